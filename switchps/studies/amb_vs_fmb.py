"""`switchps study amb-vs-fmb`: Anytime vs fixed mini-batch on the same straggler trace.

Eight emulated workers train digits under the `niagara` straggler mixture
(scaled down in time so the study is short; scaling keeps the ratios). FMB
runs first and records its straggler trace; AMB then replays exactly that
trace. AMB's time budget T is chosen so its mean batch matches FMB's batch, as
in the AMB paper: T = C + E[sleep], where C = batch / samples_per_s is FMB's
compute time per step.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

import numpy as np
from rich.table import Table

from switchps.config import parse_config
from switchps.jsonfile import write_json
from switchps.launcher import launch
from switchps.plots import console, read_csv, time_to_target
from switchps.straggler_config import MixtureSpec, expected_mixture_mean
from switchps.studies.base import emulated_digits


@dataclass
class AmbStudy:
    """Defaults: C = batch / samples_per_s = 1 s of emulated compute per FMB step, with niagara's
    times scaled by 1/4. That is the paper's regime of C = 4 s against unscaled niagara, where the
    per-step gain is largest: a sleep longer than T still delays an AMB round, because a worker
    always finishes at least one micro-batch."""

    workers: int = 8
    batch: int = 16
    micro_batch: int = 1
    samples_per_s: float = 16.0
    scale: float = 0.25
    steps: int = 100
    target: float = 0.9
    seed: int = 0
    out: str = "runs/amb-vs-fmb"

    def base(self) -> dict[str, Any]:
        return emulated_digits(self.seed, self.workers, self.samples_per_s, self.out, lr=0.05,
                               train={"steps": self.steps}, eval={"target_accuracy": self.target})

    @property
    def mixture(self) -> dict[str, Any]:
        return {"preset": "niagara", "scale": self.scale}

    def time_budget_s(self) -> float:
        return self.batch / self.samples_per_s + expected_mixture_mean(MixtureSpec(**self.mixture))


@dataclass
class Arm:
    name: str
    run_dir: Path
    time_to_target_s: float | None
    final_accuracy: float
    best_accuracy: float
    seconds_per_step: float
    samples_per_step: float
    worker_utilization: float


def _arm(name: str, run_dir: Path, summary: dict, target: float) -> Arm:
    ev, ps = read_csv(run_dir / "eval.csv"), read_csv(run_dir / "ps.csv")
    return Arm(name, run_dir, time_to_target(ev["time_s"], ev["test_accuracy"], target),
               summary["final_test_accuracy"], summary["best_test_accuracy"],
               summary["wall_time_s"] / summary["updates"], float(np.mean(ps["b_mean"])),
               summary["worker_utilization"])


def run_amb_vs_fmb(study: AmbStudy, quiet: bool = True) -> dict[str, Any]:
    """Run both arms and write the table, ``amb_vs_fmb.png`` and ``study.json`` into ``study.out``."""
    out = Path(study.out)
    base = study.base()
    fmb_cfg = parse_config({**base, "name": "fmb", "stragglers": {"mixture": study.mixture},
                            "protocol": {"name": "fmb", "batch": study.batch, "micro_batch": study.micro_batch}})
    fmb_dir, fmb = launch(fmb_cfg, quiet=quiet)
    budget = study.time_budget_s()
    amb_cfg = parse_config({**base, "name": "amb", "stragglers": {"trace": str(fmb_dir / "stragglers.csv")},
                            "protocol": {"name": "amb", "batch": study.batch, "micro_batch": study.micro_batch,
                                         "time_budget_s": budget, "max_batch": 4 * study.batch}})
    amb_dir, amb = launch(amb_cfg, quiet=quiet)
    arms = [_arm("fmb", fmb_dir, fmb, study.target), _arm("amb", amb_dir, amb, study.target)]
    f, a = arms
    result = {
        "study": "amb-vs-fmb", "config": asdict(study), "amb_time_budget_s": round(budget, 4),
        "arms": [{**asdict(x), "run_dir": str(x.run_dir)} for x in arms],
        "speedup_time_to_target": round(f.time_to_target_s / a.time_to_target_s, 3)
        if f.time_to_target_s and a.time_to_target_s else None,
        "speedup_seconds_per_step": round(f.seconds_per_step / a.seconds_per_step, 3),
    }
    out.mkdir(parents=True, exist_ok=True)
    write_json(out / "study.json", result)
    plot_amb_vs_fmb(arms, study.target, out / "amb_vs_fmb.png")
    console().print(study_table(arms, study.target, result))
    return result


def study_table(arms: list[Arm], target: float, result: dict[str, Any]) -> Table:
    t = Table(title=f"AMB vs FMB, {result['config']['workers']} emulated workers, niagara stragglers "
                    f"(x{result['config']['scale']}), same trace; speedup to {target}: "
                    f"{result['speedup_time_to_target']}x")
    for col in ("arm", f"time to {target} (s)", "final acc", "best acc", "s / step", "samples / worker-step",
                "worker utilization"):
        t.add_column(col, justify="right")
    for x in arms:
        ttt = "—" if x.time_to_target_s is None else f"{x.time_to_target_s:.1f}"
        t.add_row(x.name, ttt, f"{x.final_accuracy:.4f}", f"{x.best_accuracy:.4f}", f"{x.seconds_per_step:.3f}",
                  f"{x.samples_per_step:.1f}", f"{x.worker_utilization:.1%}")
    return t


def plot_amb_vs_fmb(arms: list[Arm], target: float, path: Path) -> None:
    from matplotlib.figure import Figure

    fig = Figure(figsize=(15, 4.2), layout="constrained")
    acc, loss, hist = fig.subplots(1, 3)
    for x in arms:
        ev, ps, ws = (read_csv(x.run_dir / f) for f in ("eval.csv", "ps.csv", "workers.csv"))
        acc.plot(ev["time_s"], ev["test_accuracy"], label=x.name.upper())
        loss.plot(ps["version"], ps["train_loss"], label=x.name.upper(), alpha=0.8)
        hist.hist(ws["samples"], bins=np.arange(0, ws["samples"].max() + 2) - 0.5, alpha=0.55, label=x.name.upper())
    acc.axhline(target, ls="--", c="grey", lw=0.8)
    acc.set(xlabel="time (s)", ylabel="test accuracy", title="accuracy vs time", ylim=(0, 1))
    loss.set(xlabel="step (model version)", ylabel="training loss", title="loss vs step", yscale="log")
    hist.set(xlabel="samples per worker-step", ylabel="count", title="batch sizes")
    for ax in (acc, loss, hist):
        ax.legend()
    fig.savefig(path, dpi=110)
