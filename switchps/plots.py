"""Plots and comparison tables for switchps run directories.

A run directory holds ``ps.csv``, ``workers.csv``, ``eval.csv``, ``events.jsonl``,
``summary.json`` and ``config.yaml``; any CSV may be header-only, in which case the
plots that depend on it are skipped.

Figures are drawn on bare :class:`matplotlib.figure.Figure` objects (Agg canvas), so
no pyplot backend or display is needed and the caller's pyplot state is untouched.
"""

from __future__ import annotations

import csv
import json
import math
from collections import Counter
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np
import yaml
from matplotlib.axes import Axes
from matplotlib.figure import Figure
from rich.console import Console
from rich.table import Table

from switchps import resources

PLOT_FILES = (
    "accuracy_vs_time.png",
    "accuracy_vs_version.png",
    "loss_vs_step.png",
    "step_vs_time.png",
    "samples_hist.png",
    "compute_time_hist.png",
    "wait_time_hist.png",
)

_PROTOCOL_COLORS = {"bsp": "tab:blue", "asp": "tab:orange", "ssp": "tab:green", "amb": "tab:red", "fmb": "tab:purple"}
_EXTRA_COLORS = ("tab:brown", "tab:pink", "tab:olive", "tab:cyan", "tab:gray")
_DPI = 120


def read_csv(path: Path) -> dict[str, np.ndarray]:
    """Read a CSV into ``column -> array``.

    A column is float (empty fields -> NaN) if every non-empty value parses as a float,
    otherwise a str array. A header-only file gives empty float arrays; a missing or
    empty file gives ``{}``.
    """
    path = Path(path)
    if not path.is_file():
        return {}
    with path.open(newline="") as f:
        reader = csv.reader(f)
        header = next(reader, None)
        rows = [row for row in reader if row]
    if header is None:
        return {}
    return {
        name.strip(): _to_array([row[i] if i < len(row) else "" for row in rows])
        for i, name in enumerate(header)
    }


def _to_array(values: list[str]) -> np.ndarray:
    try:
        return np.array([float(v) if v.strip() else np.nan for v in values], dtype=float)
    except ValueError:
        return np.array(values, dtype=str)


def _nrows(table: dict[str, np.ndarray]) -> int:
    return len(next(iter(table.values()))) if table else 0


def _num(table: dict[str, np.ndarray], column: str) -> np.ndarray:
    """Column as floats; all-NaN when missing or non-numeric."""
    values = table.get(column)
    if values is None or values.dtype.kind != "f":
        return np.full(_nrows(table), np.nan)
    return values


def _str(table: dict[str, np.ndarray], column: str) -> np.ndarray:
    values = table.get(column)
    return np.full(_nrows(table), "", dtype=str) if values is None else values.astype(str)


def _pairs(x: np.ndarray, y: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """Points where both coordinates are finite, sorted by x."""
    keep = np.isfinite(x) & np.isfinite(y)
    order = np.argsort(x[keep], kind="stable")
    return x[keep][order], y[keep][order]


def _opt_float(value: Any) -> float | None:
    try:
        value = float(value)
    except (TypeError, ValueError):
        return None
    return value if math.isfinite(value) else None


@dataclass
class _Run:
    """Everything read from one run directory."""

    run_dir: Path
    name: str
    protocol: str
    summary: dict[str, Any]
    ps: dict[str, np.ndarray] = field(repr=False)
    workers: dict[str, np.ndarray] = field(repr=False)
    eval: dict[str, np.ndarray] = field(repr=False)

    @classmethod
    def load(cls, run_dir: Path) -> _Run:
        run_dir = Path(run_dir)
        summary_path, config_path = run_dir / "summary.json", run_dir / "config.yaml"
        summary = json.loads(summary_path.read_text()) if summary_path.is_file() else {}
        config = yaml.safe_load(config_path.read_text()) if config_path.is_file() else None
        config_name = config.get("name") if isinstance(config, dict) else None
        ps = read_csv(run_dir / "ps.csv")
        phases = list(dict.fromkeys(p for p in _str(ps, "protocol") if p))
        return cls(
            run_dir=run_dir,
            name=str(summary.get("name") or config_name or run_dir.name),
            protocol="→".join(phases) if len(phases) > 1 else str(summary.get("protocol") or "".join(phases) or "?"),
            summary=summary,
            ps=ps,
            workers=read_csv(run_dir / "workers.csv"),
            eval=read_csv(run_dir / "eval.csv"),
        )

    def title(self, what: str) -> str:
        return f"{self.name} ({self.protocol}): {what}"


# --------------------------------------------------------------------------- single run


def _protocol_color(protocol: str, extras: dict[str, str]) -> str:
    if protocol in _PROTOCOL_COLORS:
        return _PROTOCOL_COLORS[protocol]
    return extras.setdefault(protocol, _EXTRA_COLORS[len(extras) % len(_EXTRA_COLORS)])


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
    extras: dict[str, str] = {}
    for k, i in enumerate(starts):
        proto = str(protocols[i])
        ax.axvspan(
            edges[k], edges[k + 1], color=_protocol_color(proto, extras), alpha=0.13, lw=0,
            label=None if proto in labelled else f"{proto} phase",
        )
        labelled.add(proto)


def _line_plot(run: _Run, x_col: str, xlabel: str, what: str) -> Figure | None:
    """Test accuracy vs ``x_col`` (time_s or version) over shaded protocol phases."""
    x, acc = _pairs(_num(run.eval, x_col), _num(run.eval, "test_accuracy"))
    if not len(x):
        return None
    fig = Figure(figsize=(8, 4.5), layout="constrained")
    ax = fig.add_subplot()
    _shade_protocols(ax, _num(run.ps, x_col), _str(run.ps, "protocol"), float(x[-1]))
    ax.plot(x, acc, color="0.15", marker="o", ms=3, lw=1.5, label="test accuracy")
    ax.set(xlabel=xlabel, ylabel="test accuracy", title=run.title(what))
    ax.grid(alpha=0.3)
    ax.legend(loc="lower right")
    return fig


def _loss_plot(run: _Run) -> Figure | None:
    train = _pairs(_num(run.ps, "version"), _num(run.ps, "train_loss"))
    test = _pairs(_num(run.eval, "version"), _num(run.eval, "test_loss"))
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


def _step_plot(run: _Run) -> Figure | None:
    t, version = _pairs(_num(run.ps, "time_s"), _num(run.ps, "version"))
    if not len(t):
        return None
    fig = Figure(figsize=(8, 4.5), layout="constrained")
    ax = fig.add_subplot()
    _shade_protocols(ax, _num(run.ps, "time_s"), _str(run.ps, "protocol"), float(t[-1]))
    ax.plot(t, version, color="0.15", lw=1.5, label="model version")
    ax.set(xlabel="time (s)", ylabel="model version", title=run.title("model version vs time"))
    ax.grid(alpha=0.3)
    ax.legend(loc="upper left")
    return fig


def _hist_plot(run: _Run, values: np.ndarray, xlabel: str, what: str, integer: bool = False) -> Figure | None:
    values = values[np.isfinite(values)]
    if not len(values):
        return None
    lo, hi = float(values.min()), float(values.max())
    if integer and hi - lo <= 100:
        bins: Any = np.arange(math.floor(lo) - 0.5, math.ceil(hi) + 1.5)
    else:
        bins = int(np.clip(np.sqrt(len(values)), 5, 50))
    fig = Figure(figsize=(7, 4.5), layout="constrained")
    ax = fig.add_subplot()
    ax.hist(values, bins=bins, color="tab:blue", alpha=0.8, edgecolor="white")
    mean, median = float(np.mean(values)), float(np.median(values))
    ax.axvline(mean, color="tab:red", ls="--", label=f"mean {mean:.4g}")
    ax.axvline(median, color="tab:green", ls=":", label=f"median {median:.4g}")
    ax.set(xlabel=xlabel, ylabel="count", title=run.title(f"{what} (n={len(values)})"))
    ax.grid(alpha=0.3, axis="y")
    ax.legend()
    return fig


def plot_run(run_dir: Path, out_dir: Path | None = None) -> list[Path]:
    """Write the per-run PNGs (see ``PLOT_FILES``) into ``out_dir`` (default ``run_dir/plots``).

    Plots whose data is empty are skipped. Returns the paths written.
    """
    run = _Run.load(run_dir)
    out_dir = Path(out_dir) if out_dir is not None else run.run_dir / "plots"
    figures = {
        "accuracy_vs_time.png": _line_plot(run, "time_s", "time (s)", "test accuracy vs time"),
        "accuracy_vs_version.png": _line_plot(run, "version", "model version", "test accuracy vs model version"),
        "loss_vs_step.png": _loss_plot(run),
        "step_vs_time.png": _step_plot(run),
        "samples_hist.png": _hist_plot(
            run, _num(run.workers, "samples"), "samples per worker step", "samples per worker step", integer=True
        ),
        "compute_time_hist.png": _hist_plot(
            run, _num(run.workers, "compute_s"), "compute time per worker step (s)", "worker compute time"
        ),
        "wait_time_hist.png": _hist_plot(
            run, _num(run.ps, "wait_s"), "wait from first push to update (s)", "update wait time"
        ),
    }
    out_dir.mkdir(parents=True, exist_ok=True)
    written = [p for p in [resources.plot(run.run_dir / "resources.csv", out_dir / "resources.png")] if p]
    for filename, fig in figures.items():
        if fig is None:
            continue
        path = out_dir / filename
        fig.savefig(path, dpi=_DPI)
        written.append(path)
    return written


# --------------------------------------------------------------------------- comparison


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


def time_to_target(eval_time_s: np.ndarray, accuracy: np.ndarray, target: float) -> float | None:
    """First eval time (in time order) at which ``accuracy >= target``; None if never."""
    t, acc = _pairs(np.asarray(eval_time_s, dtype=float), np.asarray(accuracy, dtype=float))
    hits = np.flatnonzero(acc >= target)
    return float(t[hits[0]]) if hits.size else None


def _result(run: _Run, target: float) -> RunResult:
    """Summary values, falling back to the CSVs where summary.json lacks them."""
    t, acc = _pairs(_num(run.eval, "time_s"), _num(run.eval, "test_accuracy"))
    final = _opt_float(run.summary.get("final_test_accuracy"))
    best = _opt_float(run.summary.get("best_test_accuracy"))
    wall = _opt_float(run.summary.get("wall_time_s"))
    updates = _opt_float(run.summary.get("updates"))
    if wall is None:
        times = np.concatenate([_num(tbl, "time_s") for tbl in (run.ps, run.workers, run.eval)])
        wall = float(np.nanmax(times)) if np.isfinite(times).any() else None
    if updates is None and _nrows(run.ps):
        updates = _nrows(run.ps)
    return RunResult(
        name=run.name,
        run_dir=run.run_dir,
        protocol=run.protocol,
        final_accuracy=final if final is not None or not len(acc) else float(acc[-1]),
        best_accuracy=best if best is not None or not len(acc) else float(acc.max()),
        wall_time_s=wall,
        updates=None if updates is None else int(updates),
        time_to_target_s=time_to_target(t, acc, target),
    )


def load_result(run_dir: Path, target: float) -> RunResult:
    """Headline numbers of the run in ``run_dir``, with time to reach ``target`` accuracy."""
    return _result(_Run.load(run_dir), target)


def run_labels(results: list[RunResult]) -> list[str]:
    """Display labels: the run name, plus the directory name when names collide."""
    counts = Counter(r.name for r in results)
    return [f"{r.name} ({r.run_dir.name})" if counts[r.name] > 1 else r.name for r in results]


def compare_runs(run_dirs: list[Path], target: float, out: Path) -> list[RunResult]:
    """Overlay test accuracy vs time and vs model version for all runs; save to ``out`` (PNG)."""
    runs = [_Run.load(d) for d in run_dirs]
    results = [_result(run, target) for run in runs]
    fig = Figure(figsize=(13, 5), layout="constrained")
    ax_time, ax_version = fig.subplots(1, 2, sharey=True)
    for run, result, label in zip(runs, results, run_labels(results)):
        t, acc_t = _pairs(_num(run.eval, "time_s"), _num(run.eval, "test_accuracy"))
        (line,) = ax_time.plot(t, acc_t, marker="o", ms=3, lw=1.5, label=f"{label} [{run.protocol}]")
        if result.time_to_target_s is not None:
            ax_time.plot(result.time_to_target_s, target, marker="*", ms=12, color=line.get_color())
        ax_version.plot(
            *_pairs(_num(run.eval, "version"), _num(run.eval, "test_accuracy")),
            marker="o", ms=3, lw=1.5, color=line.get_color(),
        )
    for ax, xlabel in ((ax_time, "time (s)"), (ax_version, "model version")):
        ax.axhline(target, color="0.4", ls="--", lw=1, label=f"target {target:g}" if ax is ax_time else None)
        ax.set(xlabel=xlabel, title=f"test accuracy vs {xlabel.split(' (')[0]}")
        ax.grid(alpha=0.3)
    ax_time.set_ylabel("test accuracy")
    ax_time.legend(loc="lower right", fontsize="small")
    fig.suptitle(f"Run comparison (★ = first reached {target:g})")
    out = Path(out)
    out.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(out, dpi=_DPI)
    return results


def console() -> Console:
    """Where tables are printed: the terminal, or 160 columns when output goes to a file or pipe."""
    out = Console()
    if not out.is_terminal:
        out.width = 160
    return out


def results_table(results: list[RunResult], target: float) -> Table:
    """Rich table of headline numbers, one row per run ("—" for missing / never reached)."""

    def fmt(value: float | int | None, spec: str) -> str:
        return "—" if value is None else format(value, spec)

    table = Table(title=f"Runs (target accuracy {target:g})")
    table.add_column("run", style="bold")
    table.add_column("protocol")
    for header in ("final acc", "best acc", "wall time (s)", "updates", f"time to {target:g} (s)"):
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
        )
    return table
