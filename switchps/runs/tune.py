"""`switchps tune-switch`: Sync-Switch's search for the smallest BSP fraction that keeps BSP's accuracy.

Run BSP alone, then the hybrid "BSP for a fraction f, then ASP" with
f = 1/2, 1/4, 1/8, ... Keep halving while the final accuracy (mean over
``repeats`` runs) stays within ``tolerance`` of BSP's; the answer is the
smallest fraction that did.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Callable

import yaml
from rich.table import Table

from switchps.checks import PREFLIGHT
from switchps.config.protocol import carried
from switchps.config.run import RunConfig, parse_config
from switchps.jsonfile import write_json
from switchps.launch.launcher import launch
from switchps.runs.record import console


@dataclass
class Trial:
    bsp_fraction: float           # 1.0 = BSP alone
    accuracies: list[float]
    wall_times_s: list[float]

    @property
    def accuracy(self) -> float:
        return sum(self.accuracies) / len(self.accuracies)


def search_fraction(run: Callable[[float], tuple[float, float]], tolerance: float = 0.005, repeats: int = 1,
                    min_fraction: float = 1 / 64) -> tuple[list[Trial], float]:
    """Halve the BSP fraction while accuracy holds; ``run(f)`` returns (final accuracy, wall time)."""

    def trial(f: float) -> Trial:
        results = [run(f) for _ in range(repeats)]
        return Trial(f, [a for a, _ in results], [t for _, t in results])

    trials = [trial(1.0)]
    chosen, f = 1.0, 0.5
    while f >= min_fraction:
        t = trial(f)
        trials.append(t)
        if t.accuracy < trials[0].accuracy - tolerance:
            break
        chosen, f = f, f / 2
    return trials, chosen


def hybrid_config(cfg: RunConfig, fraction: float, name: str) -> RunConfig:
    """``cfg`` as BSP alone (fraction 1) or as BSP for ``fraction`` of training, then ASP."""
    raw = cfg.model_dump(mode="json")
    raw["name"] = name
    raw["protocol"] = carried(raw["protocol"], "bsp")
    raw["policy"] = {**raw["policy"], "name": None, "kwargs": {}}
    if fraction < 1.0:
        raw["policy"].update(name="schedule", kwargs={"phases": [{"bsp": fraction}, {"asp": 1 - fraction}]})
    return parse_config(raw, checks=PREFLIGHT)


def schedule_snippet(fraction: float) -> str:
    policy = {"name": "schedule", "kwargs": {"phases": [{"bsp": fraction}, {"asp": round(1 - fraction, 6)}]}} \
        if fraction < 1.0 else {"name": None}
    return yaml.safe_dump({"policy": policy}, sort_keys=False)


def tune_switch(cfg: RunConfig, tolerance: float, repeats: int, min_fraction: float, quiet: bool = True) -> dict:
    out = Path(cfg.output.dir) / f"tune-switch-{cfg.name}"
    counter = iter(range(10**6))

    def run(fraction: float) -> tuple[float, float]:
        trial_cfg = hybrid_config(cfg, fraction, f"{cfg.name}-bsp{fraction:g}-{next(counter)}")
        trial_cfg.output.dir = str(out)
        _, summary = launch(trial_cfg, quiet=quiet)
        return summary["final_test_accuracy"], summary["wall_time_s"]

    trials, chosen = search_fraction(run, tolerance, repeats, min_fraction)
    out.mkdir(parents=True, exist_ok=True)
    (out / "schedule.yaml").write_text(schedule_snippet(chosen))
    result = {"bsp_accuracy": trials[0].accuracy, "tolerance": tolerance, "chosen_bsp_fraction": chosen,
              "trials": [{**asdict(t), "accuracy": t.accuracy} for t in trials]}
    write_json(out / "tune_switch.json", result)
    table_out = console()
    table_out.print(trials_table(trials, tolerance, chosen))
    table_out.print(f"schedule written to {out / 'schedule.yaml'}:\n{schedule_snippet(chosen)}")
    return result


def trials_table(trials: list[Trial], tolerance: float, chosen: float) -> Table:
    bsp = trials[0].accuracy
    t = Table(title=f"BSP-fraction search (tolerance {tolerance * 100:.2g} points of BSP's {bsp:.4f})")
    for col in ("BSP fraction", "final accuracy", "vs BSP (points)", "wall time (s)", "within tolerance"):
        t.add_column(col, justify="right")
    for trial in trials:
        gap = (trial.accuracy - bsp) * 100
        ok = trial.accuracy >= bsp - tolerance
        mark = " ← chosen" if trial.bsp_fraction == chosen else ""
        t.add_row(f"{trial.bsp_fraction:g}{mark}", f"{trial.accuracy:.4f}", f"{gap:+.2f}",
                  f"{sum(trial.wall_times_s) / len(trial.wall_times_s):.1f}", "yes" if ok else "no")
    return t
