"""`switchps plot`: the per-run PNGs of a run directory.

Figures are drawn on bare :class:`matplotlib.figure.Figure` objects (Agg canvas), so no pyplot backend
or display is needed. Plots whose data is empty are skipped. Per-worker histograms leave out each
worker's first ``WARMUP_STEPS`` steps, as the AMB code's plots do.
"""

from __future__ import annotations

import math
from pathlib import Path
from typing import Any

import numpy as np
from matplotlib.axes import Axes
from matplotlib.figure import Figure

from switchps import resources
from switchps.runs.colors import protocol_color
from switchps.runs.record import Run, num, pairs, text

PLOT_FILES = (  # and resources.png when the run sampled resources
    "accuracy_vs_time.png",
    "accuracy_vs_version.png",
    "loss_vs_step.png",
    "loss_vs_time.png",
    "lr_vs_step.png",
    "step_vs_time.png",
    "samples_hist.png",
    "compute_time_hist.png",
    "wait_time_hist.png",
    "staleness_hist.png",
)
WARMUP_STEPS = 1

DPI = 120


def _shade_protocols(ax: Axes, x: np.ndarray, protocols: np.ndarray, x_end: float) -> None:
    """Shade one light band per contiguous protocol segment of ``(x, protocols)``.

    Bands start at 0 (run start), switch at the first update of each new segment and
    end at ``x_end``; each protocol gets one legend entry.
    """
    keep = np.isfinite(x) & (protocols != "")
    order = np.argsort(x[keep], kind="stable")
    x, protocols = x[keep][order], protocols[keep][order]
    if not len(x):
        return
    starts = [0] + [i for i in range(1, len(x)) if protocols[i] != protocols[i - 1]]
    edges = [min(0.0, float(x[0]))] + [float(x[i]) for i in starts[1:]] + [max(x_end, float(x[-1]))]
    labelled: set[str] = set()
    for k, i in enumerate(starts):
        proto = str(protocols[i])
        ax.axvspan(
            edges[k], edges[k + 1], color=protocol_color(proto), alpha=0.13, lw=0,
            label=None if proto in labelled else f"{proto} phase",
        )
        labelled.add(proto)


def _line_plot(run: Run, x_col: str, xlabel: str, what: str) -> Figure | None:
    """Test accuracy vs ``x_col`` (time_s or version) over shaded protocol phases."""
    x, acc = pairs(num(run.eval, x_col), num(run.eval, "test_accuracy"))
    if not len(x):
        return None
    fig = Figure(figsize=(8, 4.5), layout="constrained")
    ax = fig.add_subplot()
    _shade_protocols(ax, num(run.ps, x_col), text(run.ps, "protocol"), float(x[-1]))
    ax.plot(x, acc, color="0.15", marker="o", ms=3, lw=1.5, label="test accuracy")
    ax.set(xlabel=xlabel, ylabel="test accuracy", title=run.title(what))
    ax.grid(alpha=0.3)
    ax.legend(loc="lower right")
    return fig


def _loss_plot(run: Run) -> Figure | None:
    train = pairs(num(run.ps, "version"), num(run.ps, "train_loss"))
    test = pairs(num(run.eval, "version"), num(run.eval, "test_loss"))
    if not len(train[0]) and not len(test[0]):
        return None
    fig = Figure(figsize=(8, 4.5), layout="constrained")
    ax = fig.add_subplot()
    if len(train[0]):
        ax.plot(*train, lw=0.8, alpha=0.7, color="tab:blue", label="train loss (ps updates)")
    if len(test[0]):
        ax.plot(*test, marker="o", ms=3, lw=1.5, color="tab:red", label="test loss (eval)")
    ax.set(xlabel="model version", ylabel="loss", title=run.title("loss vs model version"))
    ax.grid(alpha=0.3)
    ax.legend()
    return fig


def _step_plot(run: Run) -> Figure | None:
    t, version = pairs(num(run.ps, "time_s"), num(run.ps, "version"))
    if not len(t):
        return None
    fig = Figure(figsize=(8, 4.5), layout="constrained")
    ax = fig.add_subplot()
    _shade_protocols(ax, num(run.ps, "time_s"), text(run.ps, "protocol"), float(t[-1]))
    ax.plot(t, version, color="0.15", lw=1.5, label="model version")
    ax.set(xlabel="time (s)", ylabel="model version", title=run.title("model version vs time"))
    ax.grid(alpha=0.3)
    ax.legend(loc="upper left")
    return fig


def _bins(values: np.ndarray, integer: bool) -> Any:
    lo, hi = float(values.min()), float(values.max())
    if integer and hi - lo <= 100:
        return np.arange(math.floor(lo) - 0.5, math.ceil(hi) + 1.5)
    return int(np.clip(np.sqrt(len(values)), 5, 50))


def _hist_plot(run: Run, values: np.ndarray, xlabel: str, what: str, integer: bool = False) -> Figure | None:
    values = values[np.isfinite(values)]
    if not len(values):
        return None
    fig = Figure(figsize=(7, 4.5), layout="constrained")
    ax = fig.add_subplot()
    ax.hist(values, bins=_bins(values, integer), color="tab:blue", alpha=0.8, edgecolor="white")
    mean, median = float(np.mean(values)), float(np.median(values))
    ax.axvline(mean, color="tab:red", ls="--", label=f"mean {mean:.4g}")
    ax.axvline(median, color="tab:green", ls=":", label=f"median {median:.4g}")
    ax.set(xlabel=xlabel, ylabel="count", title=run.title(f"{what} (n={len(values)})"))
    ax.grid(alpha=0.3, axis="y")
    ax.legend()
    return fig


def _series_plot(run: Run, x_col: str, y_col: str, xlabel: str, ylabel: str, what: str,
                 log: bool = False) -> Figure | None:
    """ps.csv's ``y_col`` per update against ``x_col``, over shaded protocol phases."""
    x, y = pairs(num(run.ps, x_col), num(run.ps, y_col))
    if not len(x):
        return None
    fig = Figure(figsize=(8, 4.5), layout="constrained")
    ax = fig.add_subplot()
    _shade_protocols(ax, num(run.ps, x_col), text(run.ps, "protocol"), float(x[-1]))
    ax.plot(x, y, color="0.15", lw=0.8, label=ylabel)
    ax.set(xlabel=xlabel, ylabel=ylabel, title=run.title(what), yscale="log" if log and (y > 0).all() else "linear")
    ax.grid(alpha=0.3)
    ax.legend(loc="upper right")
    return fig


def _per_worker(run: Run, column: str) -> dict[int, np.ndarray]:
    """workers.csv's ``column`` per worker, each worker's first ``WARMUP_STEPS`` steps left out."""
    workers, steps, values = num(run.workers, "worker"), num(run.workers, "step"), num(run.workers, column)
    keep = np.isfinite(values) & (steps >= WARMUP_STEPS)
    return {int(w): values[keep & (workers == w)] for w in np.unique(workers[np.isfinite(workers)])}


def _per_worker_hist(run: Run, column: str, xlabel: str, what: str, integer: bool = False) -> Figure | None:
    parts = {w: v for w, v in _per_worker(run, column).items() if len(v)}
    if not parts:
        return None
    values = np.concatenate(list(parts.values()))
    fig = _hist_plot(run, values, xlabel, f"{what}, per worker, warm-up excluded", integer)
    assert fig is not None
    ax = fig.axes[0]
    ax.cla()
    ax.hist(list(parts.values()), bins=_bins(values, integer), stacked=True, label=[f"worker {w}" for w in parts])
    ax.set(xlabel=xlabel, ylabel="count", title=run.title(f"{what}, per worker (n={len(values)})"))
    ax.legend(fontsize="small", ncol=2)
    return fig


def run_figures(run: Run) -> dict[str, Figure | None]:
    """Each per-run plot by file name (None: its data is empty), drawn but not saved."""
    figures = {
        "accuracy_vs_time.png": _line_plot(run, "time_s", "time (s)", "test accuracy vs time"),
        "accuracy_vs_version.png": _line_plot(run, "version", "model version", "test accuracy vs model version"),
        "loss_vs_step.png": _loss_plot(run),
        "loss_vs_time.png": _series_plot(run, "time_s", "train_loss", "time (s)", "training loss",
                                         "training loss vs time", log=True),
        "lr_vs_step.png": _series_plot(run, "version", "lr", "model version", "learning rate",
                                       "learning rate vs model version"),
        "step_vs_time.png": _step_plot(run),
        "samples_hist.png": _per_worker_hist(run, "samples", "samples per worker step", "samples per step",
                                             integer=True),
        "compute_time_hist.png": _per_worker_hist(run, "compute_s", "compute time per worker step (s)",
                                                  "compute time"),
        "wait_time_hist.png": _hist_plot(
            run, num(run.ps, "wait_s"), "wait from first push to update (s)", "update wait time"
        ),
        "staleness_hist.png": _hist_plot(run, num(run.ps, "staleness_max"), "largest staleness in an update",
                                         "staleness", integer=True),
    }
    if (run.run_dir / "resources.csv").exists():
        figures["resources.png"] = resources.figure(run.run_dir / "resources.csv")
    return figures


def plot_run(run_dir: Path, out_dir: Path | None = None) -> list[Path]:
    """Write the per-run PNGs (see ``PLOT_FILES``) into ``out_dir`` (default ``run_dir/plots``).

    Plots whose data is empty are skipped. Returns the paths written.
    """
    run = Run.load(run_dir)
    out_dir = Path(out_dir) if out_dir is not None else run.run_dir / "plots"
    written = []
    for filename, fig in run_figures(run).items():
        if fig is None:
            continue
        out_dir.mkdir(parents=True, exist_ok=True)
        path = out_dir / filename
        fig.savefig(path, dpi=DPI)
        written.append(path)
    return written
