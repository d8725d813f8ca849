"""A study's result: every run's metrics, each arm's mean ± 95 % CI, paired comparisons, a table and a
figure (accuracy vs time per arm, the mean with its band, and the protocol timeline underneath)."""

from __future__ import annotations

import json
from pathlib import Path
from typing import TYPE_CHECKING, Any

import numpy as np
from rich.table import Table

from switchps.jsonfile import write_json
from switchps.runs.colors import PROTOCOL_COLORS, protocol_color
from switchps.runs.record import console, read_csv
from switchps.studies.metrics import Accuracy, final_accuracy, run_metrics
from switchps.studies.spec import METRICS, RATIO_METRICS, StudySpec
from switchps.studies.stats import Estimate, RatioEstimate, estimate, paired_difference, paired_ratio

if TYPE_CHECKING:
    from matplotlib.figure import Figure



def target_of(spec: StudySpec, runs: dict[tuple[str, int], Path]) -> float:
    """The absolute target, or the reference arm's mean final accuracy minus the given points."""
    if spec.target.absolute is not None:
        return spec.target.absolute
    assert spec.reference is not None and spec.target.reference_minus_points is not None
    finals = [final_accuracy(d, spec.final_evals) for (arm, _), d in runs.items() if arm == spec.reference]
    return round(float(np.mean(finals)) - spec.target.reference_minus_points / 100, 4)


def report(spec: StudySpec, runs: dict[tuple[str, int], Path], out: Path) -> dict[str, Any]:
    """Write ``study.json`` and ``study.png`` into ``out``, print the table, return the result."""
    target = target_of(spec, runs)
    per_run = {key: run_metrics(d, target, spec.smooth_evals, spec.final_evals) for key, d in sorted(runs.items())}
    repeats = range(spec.repeats)
    series = {arm: {m: [per_run[(arm, r)][m] if (arm, r) in per_run else None for r in repeats]
                    for m in METRICS} for arm in spec.arms}
    arms = {arm: {m: estimate(series[arm][m]).as_dict() for m in spec.metrics} for arm in spec.arms}
    comparisons = compare(spec, series)
    result = {"study": spec.study, "description": spec.description, "target": target, "repeats": spec.repeats,
              "runs": [{"arm": a, "repeat": r, "run_dir": str(runs[(a, r)]), **m} for (a, r), m in per_run.items()],
              "arms": arms, "comparisons": comparisons, "spec": spec.model_dump(mode="json")}
    write_json(out / "study.json", result)
    plot_study(spec, runs, target, out / "study.png")
    plot_loss_after_switch(spec, runs, out / "loss_after_switch.png")
    console().print(study_table(spec, arms, comparisons, target))
    return result


def compare(spec: StudySpec, series: dict[str, dict[str, list]]) -> dict[str, Any]:
    """Each arm against the reference and each ``compare_with`` arm, paired by seed: speedups (ratios)
    for the time metrics, on the log scale (geometric mean and its 95 % CI), and differences in points
    for the final accuracy, with whether the 95 % CI excludes no difference (1× or 0 points)."""
    out: dict[str, Any] = {}
    for ref in [r for r in [spec.reference, *spec.compare_with] if r is not None]:
        for arm in spec.arms:
            if arm == ref:
                continue
            entry: dict[str, Any] = {}
            for m in RATIO_METRICS:
                if m in spec.metrics:
                    r = paired_ratio(series[ref][m], series[arm][m])
                    entry[m + "_speedup"] = {**r.as_dict(), "significant": r.excludes(1.0)}
            if "final_accuracy" in spec.metrics:
                d = paired_difference([_points(v) for v in series[arm]["final_accuracy"]],
                                      [_points(v) for v in series[ref]["final_accuracy"]])
                entry["final_accuracy_points"] = {**d.as_dict(), "significant": d.excludes(0.0)}
            out[f"{arm} vs {ref}"] = entry
    return out


def _points(v: float | None) -> float | None:
    return None if v is None else 100 * v


RATIO_CAPTION = ("speedups: geometric mean of the ratios paired by seed, with its 95 % CI on the log scale; "
                 "*: the CI excludes 1× (significant at 5 %)")


def study_table(spec: StudySpec, arms: dict[str, dict[str, dict]], comparisons: dict[str, Any],
                target: float) -> Table:
    ref = spec.reference
    ratios = [m for m in RATIO_METRICS if m in spec.metrics] if ref else []
    t = Table(title=f"{spec.study}: mean ± 95 % CI over {spec.repeats} seeds; target {target:.4f}",
              caption=RATIO_CAPTION if ratios else None)
    t.add_column("arm", justify="right")
    for m in spec.metrics:
        t.add_column(METRICS[m], justify="right")
    for m in ratios:
        t.add_column(f"{RATIO_METRICS[m]} vs {ref}", justify="right")
    for arm, values in arms.items():
        cells = [Estimate(**values[m]).text(_format(m), missing="never" if "target" in m else "n/a")
                 for m in spec.metrics]
        for m in ratios:
            c = comparisons.get(f"{arm} vs {ref}", {}).get(m + "_speedup")
            cells.append("1×" if arm == ref else _ratio_text(c))
        t.add_row(arm, *cells)
    return t


def _ratio_text(c: dict[str, Any] | None) -> str:
    if c is None:
        return "—"
    return RatioEstimate(**{k: v for k, v in c.items() if k != "significant"}).text() + \
        (" *" if c["significant"] else "")


def _format(metric: str) -> str:
    if metric == "bytes_sent":
        return ".4g"
    return ".4f" if metric in ("final_accuracy", "worker_utilization") else ".2f" if "points" in metric else ".1f"


def plot_study(spec: StudySpec, runs: dict[tuple[str, int], Path], target: float, path: Path) -> "Figure":
    """Accuracy vs time per arm (mean over seeds with its 95 % band) over a protocol timeline per arm;
    returns the figure saved."""
    from matplotlib.figure import Figure

    fig = Figure(figsize=(11, 7), layout="constrained")
    parts = fig.subfigures(2, 1, height_ratios=[2.2, 1])
    assert isinstance(parts, np.ndarray)
    ax = parts[0].subplots()
    lanes = np.atleast_1d(parts[1].subplots(len(spec.arms), 1, sharex=True))
    shown: set[str] = set()
    for lane, arm in zip(lanes, spec.arms):
        dirs = [d for (a, _), d in sorted(runs.items()) if a == arm]
        if not dirs:
            continue
        curves = [Accuracy.of(d, spec.smooth_evals) for d in dirs]
        grid = np.linspace(0, min(c.time_s[-1] for c in curves), 200)
        ys = np.array([np.interp(grid, c.time_s, c.smoothed) for c in curves])
        mean = ys.mean(axis=0)
        ax.plot(grid, mean, label=arm)
        if len(ys) > 1:
            half = np.array([estimate(list(col)).ci95 or 0.0 for col in ys.T])
            ax.fill_between(grid, mean - half, mean + half, alpha=0.2)
        shown |= _timeline(lane, read_csv(dirs[0] / "ps.csv"))
        lane.set_yticks([])
        lane.set_ylabel(arm, rotation=0, ha="right", va="center")
    ax.axhline(target, ls="--", c="grey", lw=0.8)
    ax.set(xlabel="time (s)", ylabel=f"test accuracy (mean of last {spec.smooth_evals} evals)",
           title=f"{spec.study}: mean over {spec.repeats} seeds with 95 % band; dashed: the target")
    ax.legend(ncol=3)
    lanes[-1].set_xlabel("time (s); protocol in force (first seed): " + ", ".join(
        f"{p}={c.removeprefix('tab:')}" for p, c in PROTOCOL_COLORS.items() if p in shown))
    fig.savefig(path, dpi=110)
    return fig


LOSS_UPDATES = 500


def plot_loss_after_switch(spec: StudySpec, runs: dict[tuple[str, int], Path], path: Path) -> None:
    """The training loss of every update for the first ``LOSS_UPDATES`` after the first protocol switch,
    mean over seeds per arm (arms without a switch are left out; nothing is drawn if none switched)."""
    from matplotlib.figure import Figure

    curves = {}
    for arm in spec.arms:
        losses = [loss for (a, _), d in sorted(runs.items()) if a == arm
                  if (loss := loss_after_switch(d)) is not None and len(loss)]
        if losses:
            n = min(len(x) for x in losses)
            curves[arm] = np.mean([x[:n] for x in losses], axis=0)
    if not curves:
        return
    fig = Figure(figsize=(9, 4.5), layout="constrained")
    ax = fig.subplots()
    for arm, loss in curves.items():
        ax.plot(np.arange(1, len(loss) + 1), loss, label=arm, lw=1)
    ax.set(xlabel="updates after the switch", ylabel="training loss (mean over seeds)", yscale="log",
           title=f"{spec.study}: training loss for the first {LOSS_UPDATES} updates after the switch")
    ax.legend(ncol=3)
    fig.savefig(path, dpi=110)


def loss_after_switch(run_dir: Path) -> np.ndarray | None:
    """ps.csv's training loss for the first ``LOSS_UPDATES`` updates after the run's first switch."""
    for line in (run_dir / "events.jsonl").read_text().splitlines():
        event = json.loads(line)
        if event["event"] == "switch":
            ps = read_csv(run_dir / "ps.csv")
            after = ps["version"] > event["version"]
            return np.asarray(ps["train_loss"][after][:LOSS_UPDATES], float)
    return None


def _timeline(lane: Any, ps: dict[str, np.ndarray]) -> set[str]:
    """Shade ``lane`` by the protocol in force over time; the protocols shown."""
    times, protos = ps["time_s"], ps["protocol"]
    start = 0.0
    for i in range(len(protos)):
        if i + 1 == len(protos) or protos[i + 1] != protos[i]:
            lane.axvspan(start, times[i], color=protocol_color(str(protos[i])), alpha=0.6, lw=0)
            start = times[i]
    return {str(p) for p in protos}
