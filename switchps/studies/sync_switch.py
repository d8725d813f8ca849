"""`switchps study sync-switch`: Sync-Switch's hybrid and online policies under transient stragglers."""

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
from switchps.ps_server.optimizers import asynchrony_momentum
from switchps.studies.base import MLP, MOMENTUM, emulated_digits, merge


@dataclass
class SyncSwitchStudy:
    """Sync-Switch's setting, shrunk: 8 emulated workers behind one emulated PS link, transient stragglers
    (2 workers 3x slower for a few seconds at a time), every arm under the same seeded episodes (they are
    a function of the run seed and wall time since training start, identical across arms).

    The emulated PS link makes communication cost what it costs in a cluster: at 5 Mbit/s a BSP round's
    8 pushes and 8 replies of the 19 kB MLP share the link for 0.5 s, twice the round's 0.25 s of compute,
    while ASP's transfers, spread in time, overlap other workers' compute. With ``ps_link_mbit_s=None``
    (loopback only) BSP pays for the stragglers alone. Every arm runs with the asynchrony momentum rule at
    switches, and the ASP arm starts with what the hybrid switches to."""

    workers: int = 8
    batch: int = 16
    samples_per_s: float = 64.0
    ps_link_mbit_s: float | None = 5.0
    lr: float = 0.2
    """BSP's learning rate at the global batch N*b: the best of 0.1, 0.2 and 0.4 in epochs to 0.95."""
    switch_lr: float = 16.0
    """``on_switch.lr`` factor: BSP -> ASP divides the learning rate by 16, the linear rule's N = 8 times 2.
    ASP at the linear rule's rate (then the momentum rule) diverged from BSP's tuned 0.2; at half of it,
    and at a quarter, it trained."""
    epochs: float = 12.0
    bsp_fraction: float = 0.125
    episode_s: float = 4.0
    every_s: float = 8.0
    factor: float = 3.0
    model: str = "mlp"
    """mlp (64 hidden units) or logreg."""
    arms_run: tuple[str, ...] = ("bsp", "asp", "hybrid", "greedy", "elastic", "anytime")
    """Which arms to run; BSP, the reference, always runs."""
    seed: int = 0
    out: str = "runs/sync-switch"

    def __post_init__(self) -> None:
        unknown = set(self.arms_run) - set(SyncSwitchStudy.arms_run)
        if unknown:
            raise ValueError(f"unknown arm(s) {sorted(unknown)}; choose from {sorted(SyncSwitchStudy.arms_run)}")

    def base(self) -> dict[str, Any]:
        return emulated_digits(
            self.seed, self.workers, self.samples_per_s, self.out, lr=self.lr, train={"epochs": self.epochs},
            model=MLP if self.model == "mlp" else {"name": self.model, "kwargs": {}},
            protocol={"name": "bsp", "batch": self.batch, "micro_batch": 4},
            network={"ps_link_mbit_s": self.ps_link_mbit_s},
            policy={"on_switch": {"lr": self.switch_lr, "momentum": "asynchrony"}},
            stragglers={"transient": {"workers": 2, "factor": self.factor, "duration_s": self.episode_s,
                                      "every_s": self.every_s}})

    def arms(self) -> dict[str, dict[str, Any]]:
        """Run name -> config overrides, for BSP and the selected ``arms_run``."""
        f = self.bsp_fraction
        detect = {"threshold": 1.5, "patience": 2}
        every = {
            "bsp": ("bsp", {}),
            "asp": ("asp", {"protocol": {"name": "asp"}, "optimizer": self.asp_optimizer()}),
            "hybrid": (f"hybrid{f:g}", {"policy": {"name": "schedule",
                                                   "kwargs": {"phases": [{"bsp": f}, {"asp": 1 - f}]}}}),
            "greedy": ("greedy", {"policy": {"name": "greedy", "kwargs": {"bsp_fraction": f, **detect}}}),
            "elastic": ("elastic", {"policy": {"name": "elastic", "kwargs": detect}}),
            "anytime": ("anytime", {"policy": {"name": "anytime", "kwargs": detect}}),
        }
        return dict(every[a] for a in every if a == "bsp" or a in self.arms_run)


    def asp_optimizer(self) -> dict[str, Any]:
        """What the hybrid switches to, from the start: the learning rate divided by ``switch_lr``, then the
        momentum rule for N asynchronous workers."""
        momentum = asynchrony_momentum(MOMENTUM, self.workers)
        return {"learning_rate": self.lr / self.switch_lr * (1 - momentum) / (1 - MOMENTUM),
                "params": {"momentum": momentum}}


def run_sync_switch(study: SyncSwitchStudy, quiet: bool = True) -> dict[str, Any]:
    """Run every arm, then report them (``report_sync_switch``)."""
    runs = {}
    for name, extra in study.arms().items():
        runs[name] = launch(parse_config(merge({**study.base(), "name": name}, extra)), quiet=quiet)
    return report_sync_switch(study, runs)


def report_sync_switch(study: SyncSwitchStudy, runs: dict[str, tuple[Path, dict]]) -> dict[str, Any]:
    """Write ``sync_switch.png`` and ``study.json`` for finished arms (BSP first), print the table."""
    out = Path(study.out)
    bsp_final = round(float(_smoothed_accuracy(runs["bsp"][0])[1][-1]), 4)
    target = bsp_final - 0.005
    rows = []
    for name, (run_dir, summary) in runs.items():
        overhead = summary.get("switch_overhead_s") or {}
        reached = _time_and_epochs_to(run_dir, target, summary["samples"] / study.epochs)
        rows.append({"arm": name, "run_dir": str(run_dir), "final_accuracy": round(float(_smoothed_accuracy(run_dir)[1][-1]), 4),
                     "time_to_bsp_minus_0.5_s": reached[0], "epochs_to_bsp_minus_0.5": reached[1],
                     "samples_per_s": summary["samples_per_s"],
                     "total_time_s": summary["wall_time_s"], "switches": summary["switches"],
                     "switch_overhead_median_s": overhead.get("median"), "switch_overhead_max_s": overhead.get("max"),
                     "step_time_s": _median_step_time(run_dir)})
    bsp_t = rows[0]["time_to_bsp_minus_0.5_s"]
    for r in rows:
        t = r["time_to_bsp_minus_0.5_s"]
        r["speedup_vs_bsp"] = round(bsp_t / t, 3) if bsp_t and t else None
    result = {"study": "sync-switch", "config": asdict(study), "bsp_final_accuracy": bsp_final,
              "target": target, "arms": rows}
    out.mkdir(parents=True, exist_ok=True)
    write_json(out / "study.json", result)
    plot_sync_switch(runs, target, out / "sync_switch.png")
    console().print(sync_switch_table(rows, target))
    return result


SMOOTH_EVALS = 5
"""Accuracies in the sync-switch study are means of the last 5 evaluations: one evaluation on digits'
360 test images moves by a point or more, which would decide a time-to-target comparison by chance."""


def _smoothed_accuracy(run_dir: Path) -> tuple[np.ndarray, np.ndarray]:
    """Evaluation times and the trailing mean of up to ``SMOOTH_EVALS`` evaluations' accuracy."""
    ev = read_csv(run_dir / "eval.csv")
    acc = np.cumsum(ev["test_accuracy"])
    window = np.minimum(np.arange(1, len(acc) + 1), SMOOTH_EVALS)
    acc[SMOOTH_EVALS:] -= acc[:-SMOOTH_EVALS].copy()
    return ev["time_s"], acc / window


def _time_and_epochs_to(run_dir: Path, target: float, samples_per_epoch: float) -> tuple[float | None, float | None]:
    """When the smoothed accuracy first reached ``target``, and how many epochs the model had seen by then."""
    times, acc = _smoothed_accuracy(run_dir)
    t = time_to_target(times, acc, target)
    if t is None:
        return None, None
    ev, ps = read_csv(run_dir / "eval.csv"), read_csv(run_dir / "ps.csv")
    version = int(ev["version"][ev["time_s"] == t][0])
    return t, round(float(ps["samples"][ps["version"] <= version].sum()) / samples_per_epoch, 2)


def _median_step_time(run_dir: Path) -> float:
    """A worker's median step: compute, injected delay and communication, without barrier waits."""
    ws = read_csv(run_dir / "workers.csv")
    step = ws["compute_s"] + ws["sleep_s"] + np.maximum(0.0, ws["send_s"] - ws["wait_s"])
    return round(float(np.median(step)), 4) if len(step) else 0.0


def sync_switch_table(rows: list[dict[str, Any]], target: float) -> Table:
    t = Table(title=f"Sync-Switch study: time to BSP's final accuracy - 0.5 points ({target:.4f})")
    for col in ("arm", "final", "to target (s)", "vs BSP", "epochs to target", "samples/s", "total (s)", "switches",
                "overhead (ms)", "step (s)"):
        t.add_column(col, justify="right")
    fmt = lambda v, f, k=1: "—" if v is None else format(v * k, f)  # noqa: E731
    for r in rows:
        t.add_row(r["arm"], fmt(r["final_accuracy"], ".4f"), fmt(r["time_to_bsp_minus_0.5_s"], ".1f"),
                  fmt(r["speedup_vs_bsp"], ".2f"), fmt(r["epochs_to_bsp_minus_0.5"], ".1f"),
                  fmt(r["samples_per_s"], ".0f"), fmt(r["total_time_s"], ".1f"), str(r["switches"]),
                  f"{fmt(r['switch_overhead_median_s'], '.0f', 1e3)}/{fmt(r['switch_overhead_max_s'], '.0f', 1e3)}",
                  fmt(r["step_time_s"], ".3f"))
    return t


PROTOCOL_COLORS = {"bsp": "tab:blue", "asp": "tab:orange", "ssp": "tab:green", "amb": "tab:red", "fmb": "tab:purple"}


def plot_sync_switch(runs: dict[str, tuple[Path, dict]], target: float, path: Path) -> None:
    """Accuracy vs time per arm, each with its protocol timeline as a strip underneath."""
    from matplotlib.figure import Figure

    fig = Figure(figsize=(11, 7), layout="constrained")
    parts = fig.subfigures(2, 1, height_ratios=[2.2, 1])
    assert isinstance(parts, np.ndarray)  # two subfigures, not one
    acc, strips = parts
    ax = acc.subplots()
    lanes = strips.subplots(len(runs), 1, sharex=True)
    for lane, (name, (run_dir, _)) in zip(lanes, runs.items()):
        ax.plot(*_smoothed_accuracy(run_dir), label=name)
        ps = read_csv(run_dir / "ps.csv")
        times, protos = ps["time_s"], ps["protocol"]
        start = 0.0
        for i in range(len(protos)):
            if i + 1 == len(protos) or protos[i + 1] != protos[i]:
                end = times[i]
                lane.axvspan(start, end, color=PROTOCOL_COLORS.get(protos[i], "grey"), alpha=0.6, lw=0)
                start = end
        lane.set_yticks([])
        lane.set_ylabel(name, rotation=0, ha="right", va="center")
    ax.axhline(target, ls="--", c="grey", lw=0.8)
    ax.set(xlabel="time (s)", ylabel=f"test accuracy (mean of last {SMOOTH_EVALS} evals)", ylim=(0.5, 1.0),
           title="Sync-Switch study: accuracy vs time; dashed: BSP's final accuracy - 0.5 points")
    ax.legend(ncol=3)
    lanes[-1].set_xlabel("time (s); protocol in force: " + ", ".join(f"{p}={c.split(':')[1]}"
                                                                      for p, c in PROTOCOL_COLORS.items()))
    fig.savefig(path, dpi=110)
