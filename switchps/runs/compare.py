"""`switchps compare`: several runs overlaid (accuracy, training loss, throughput) with a table of their
headline numbers, time to a target accuracy and what each ran on."""

from __future__ import annotations

from collections import Counter
from dataclasses import dataclass
from pathlib import Path

import numpy as np
from matplotlib.figure import Figure
from rich.table import Table

from switchps.runs.record import Run, nrows, num, opt_float, pairs

DPI = 120


@dataclass
class RunResult:
    """Headline numbers of one run."""

    name: str
    run_dir: Path
    protocol: str
    final_accuracy: float | None
    best_accuracy: float | None
    wall_time_s: float | None
    updates: int | None
    time_to_target_s: float | None
    framework: str | None = None
    device: str | None = None
    """``summary.json``'s ``device``, with the emulated or simulated device's speed ("emulated, 800 samples/s")."""
    ps_shards: int | None = None
    hosts: int | None = None
    """Distinct hosts the run's roles ran on (None for a simulation, or a run from before it was recorded)."""


def time_to_target(eval_time_s: np.ndarray, accuracy: np.ndarray, target: float) -> float | None:
    """First eval time (in time order) at which ``accuracy >= target``; None if never."""
    t, acc = pairs(np.asarray(eval_time_s, dtype=float), np.asarray(accuracy, dtype=float))
    hits = np.flatnonzero(acc >= target)
    return float(t[hits[0]]) if hits.size else None


def _result(run: Run, target: float) -> RunResult:
    """Summary values, falling back to the CSVs where summary.json lacks them."""
    t, acc = pairs(num(run.eval, "time_s"), num(run.eval, "test_accuracy"))
    final = opt_float(run.summary.get("final_test_accuracy"))
    best = opt_float(run.summary.get("best_test_accuracy"))
    wall = opt_float(run.summary.get("wall_time_s"))
    updates = opt_float(run.summary.get("updates"))
    if wall is None:
        times = np.concatenate([num(tbl, "time_s") for tbl in (run.ps, run.workers, run.eval)])
        wall = float(np.nanmax(times)) if np.isfinite(times).any() else None
    if updates is None and nrows(run.ps):
        updates = nrows(run.ps)
    return RunResult(
        name=run.name,
        run_dir=run.run_dir,
        protocol=run.protocol,
        final_accuracy=final if final is not None or not len(acc) else float(acc[-1]),
        best_accuracy=best if best is not None or not len(acc) else float(acc.max()),
        wall_time_s=wall,
        updates=None if updates is None else int(updates),
        time_to_target_s=time_to_target(t, acc, target),
        framework=run.summary.get("framework"),
        device=_device(run.summary),
        ps_shards=run.summary.get("ps_shards"),
        hosts=run.summary.get("hosts"),
    )


def _device(summary: dict) -> str | None:
    device, speed = summary.get("device"), (summary.get("emulated_device") or {}).get("samples_per_s")
    return f"{device}, {speed:g} samples/s" if device and speed else device


def load_result(run_dir: Path, target: float) -> RunResult:
    """Headline numbers of the run in ``run_dir``, with time to reach ``target`` accuracy."""
    return _result(Run.load(run_dir), target)


def run_labels(results: list[RunResult]) -> list[str]:
    """Display labels: the run name, plus the directory name when names collide."""
    counts = Counter(r.name for r in results)
    return [f"{r.name} ({r.run_dir.name})" if counts[r.name] > 1 else r.name for r in results]


def compare_runs(run_dirs: list[Path], target: float, out: Path) -> list[RunResult]:
    """``comparison`` of the runs, its figure saved to ``out`` (PNG)."""
    results, fig = comparison(run_dirs, target)
    out = Path(out)
    out.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(out, dpi=DPI)
    return results


def comparison(run_dirs: list[Path], target: float) -> tuple[list[RunResult], Figure]:
    """Each run's headline numbers, and a figure overlaying test accuracy (vs time and vs model version),
    training loss and throughput (samples/s over time) for all runs."""
    runs = [Run.load(d) for d in run_dirs]
    results = [_result(run, target) for run in runs]
    fig = Figure(figsize=(13, 9), layout="constrained")
    (ax_time, ax_version), (ax_loss, ax_rate) = fig.subplots(2, 2)
    for run, result, label in zip(runs, results, run_labels(results)):
        t, acc_t = pairs(num(run.eval, "time_s"), num(run.eval, "test_accuracy"))
        (line,) = ax_time.plot(t, acc_t, marker="o", ms=3, lw=1.5, label=f"{label} [{run.protocol}]")
        color = line.get_color()
        if result.time_to_target_s is not None:
            ax_time.plot(result.time_to_target_s, target, marker="*", ms=12, color=color)
        ax_version.plot(*pairs(num(run.eval, "version"), num(run.eval, "test_accuracy")), marker="o", ms=3,
                        lw=1.5, color=color)
        ax_loss.plot(*pairs(num(run.ps, "time_s"), num(run.ps, "train_loss")), lw=0.8, color=color)
        ax_rate.plot(*_throughput(run), lw=1.2, color=color)
    for ax, xlabel in ((ax_time, "time (s)"), (ax_version, "model version")):
        ax.axhline(target, color="0.4", ls="--", lw=1, label=f"target {target:g}" if ax is ax_time else None)
        ax.set(xlabel=xlabel, ylabel="test accuracy", title=f"test accuracy vs {xlabel.split(' (')[0]}")
    ax_loss.set(xlabel="time (s)", ylabel="training loss", yscale="log", title="training loss vs time")
    ax_rate.set(xlabel="time (s)", ylabel="samples/s", title="throughput (samples applied per second, 2 s bins)")
    for ax in (ax_time, ax_version, ax_loss, ax_rate):
        ax.grid(alpha=0.3)
    ax_time.legend(loc="lower right", fontsize="small")
    fig.suptitle(f"Run comparison (★ = first reached {target:g})")
    return results, fig


def _throughput(run: Run, bin_s: float = 2.0) -> tuple[np.ndarray, np.ndarray]:
    t, samples = pairs(num(run.ps, "time_s"), num(run.ps, "samples"))
    if not len(t):
        return t, samples
    edges = np.arange(0.0, float(t[-1]) + bin_s, bin_s)
    sums, _ = np.histogram(t, bins=edges, weights=samples)
    return edges[1:], sums / bin_s


def results_table(results: list[RunResult], target: float) -> Table:
    """Rich table of headline numbers, one row per run ("—" for missing / never reached)."""

    def fmt(value: float | int | None, spec: str) -> str:
        return "—" if value is None else format(value, spec)

    table = Table(title=f"Runs (target accuracy {target:g})")
    table.add_column("run", style="bold")
    table.add_column("protocol")
    for header in ("final acc", "best acc", "wall time (s)", "updates", f"time to {target:g} (s)"):
        table.add_column(header, justify="right")
    table.add_column("framework")
    table.add_column("device")
    for header in ("PS shards", "hosts"):
        table.add_column(header, justify="right")
    for result, label in zip(results, run_labels(results)):
        table.add_row(
            label,
            result.protocol,
            fmt(result.final_accuracy, ".4f"),
            fmt(result.best_accuracy, ".4f"),
            fmt(result.wall_time_s, ".1f"),
            fmt(result.updates, "d"),
            fmt(result.time_to_target_s, ".1f"),
            result.framework or "—",
            result.device or "—",
            fmt(result.ps_shards, "d"),
            fmt(result.hosts, "d"),
        )
    return table
