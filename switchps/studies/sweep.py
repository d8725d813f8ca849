"""A sweep's result: each arm's metrics against the swept value (e.g. the number of workers), from the
study reports of every value, as ``sweep.json``, one table per metric and one figure (``sweep.png``:
a panel per metric, a line per arm, the mean with its 95 % CI at every value)."""

from __future__ import annotations

from pathlib import Path
from typing import TYPE_CHECKING, Any

from rich.table import Table

from switchps.jsonfile import write_json
from switchps.runs.record import console
from switchps.studies.spec import METRICS, StudySpec
from switchps.studies.stats import Estimate

if TYPE_CHECKING:
    from matplotlib.figure import Figure

PLOTTED = ("time_to_target_s", "final_accuracy")
"""The metrics the figure shows (those the study reports), in this order."""


def sweep_report(spec: StudySpec, results: dict[str, dict[str, Any]], out: Path) -> dict[str, Any]:
    """Write ``sweep.json`` and ``sweep.png`` into ``out``, print a table per metric, return the result.
    ``results``: ``KEY=VALUE`` -> that value's study result (``studies.report.report``)."""
    assert spec.sweep is not None
    key, values = next(iter(spec.sweep.items()))
    points = [{"value": v, "point": p, "target": r["target"], "arms": r["arms"], "comparisons": r["comparisons"]}
              for v, (p, r) in zip(values, results.items())]
    result = {"study": spec.study, "description": spec.description, "mode": spec.mode, "repeats": spec.repeats,
              "key": key, "values": values, "sweep": spec.sweep, "points": points}
    write_json(out / "sweep.json", result)
    for m in spec.metrics:
        console().print(sweep_table(spec, key, points, m))
    plot_sweep(spec, key, points, out / "sweep.png")
    return result


def sweep_table(spec: StudySpec, key: str, points: list[dict[str, Any]], metric: str) -> Table:
    t = Table(title=f"{spec.study}: {METRICS[metric]} against {key}, mean ± 95 % CI over {spec.repeats} seeds")
    t.add_column("arm", justify="right")
    for p in points:
        t.add_column(str(p["value"]), justify="right")
    fmt = ".4f" if metric in ("final_accuracy", "worker_utilization") else ".1f"
    for arm in spec.arms:
        t.add_row(arm, *[Estimate(**p["arms"][arm][metric]).text(fmt, missing="never" if "target" in metric
                                                                  else "n/a") for p in points])
    return t


def plot_sweep(spec: StudySpec, key: str, points: list[dict[str, Any]], path: Path) -> "Figure":
    """A panel per plotted metric: each arm's mean and 95 % CI against the swept value (a value where no
    run of an arm reached the target has no point; the legend counts such runs); returns the figure saved."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    metrics = [m for m in PLOTTED if m in spec.metrics] or spec.metrics[:1]
    values = [p["value"] for p in points]
    numeric = all(isinstance(v, (int, float)) for v in values)
    x = values if numeric else list(range(len(values)))
    fig, axes = plt.subplots(1, len(metrics), figsize=(6.5 * len(metrics), 4.8), squeeze=False)
    for ax, m in zip(axes[0], metrics):
        for arm in spec.arms:
            est = [Estimate(**p["arms"][arm][m]) for p in points]
            xs = [xi for xi, e in zip(x, est) if e.mean is not None]
            missed = sum(e.missing for e in est)
            label = arm + (f" ({missed} runs never)" if missed and "target" in m else "")
            ax.errorbar(xs, [e.mean for e in est if e.mean is not None],
                        yerr=[e.ci95 or 0.0 for e in est if e.mean is not None], marker="o", capsize=3, label=label)
        if numeric and min(values) > 0 and max(values) / min(values) >= 8:
            ax.set_xscale("log", base=2)
        ax.set_xticks(x, [str(v) for v in values])
        ax.set_xlabel(key)
        ax.set_ylabel(METRICS[m])
        ax.grid(alpha=0.3)
    axes[0][-1].legend(fontsize=7, ncol=2)
    fig.suptitle(f"{spec.study} ({spec.mode}): mean ± 95 % CI over {spec.repeats} seeds")
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return fig
