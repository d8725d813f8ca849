"""Anytime Mini-Batch partition overhead: gradient time per sample vs micro-batch size.

A worker accumulates the Σ gradient of a fixed batch one micro-batch at a time
(``GradientComputer.compute``). For each model and micro-batch size this
times one whole batch and reports the median seconds per sample and the
ratio to the full-batch (one micro-batch) time per sample. Runs TF with one
intra-op and one inter-op thread, as workers do. Prints JSON and writes
``<out>/partitions.png``.

    python bench/partitions.py [--batch 256] [--models cnn mlp] [--out bench/out]
"""

from __future__ import annotations

import argparse
import statistics
import time
from pathlib import Path

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402
import numpy as np  # noqa: E402

from switchps.jsonfile import dumps  # noqa: E402
from switchps.workload.data import load_dataset  # noqa: E402
from switchps.workload.tensorflow.gradients import GradientComputer  # noqa: E402
from switchps.workload.tensorflow.setup import configure_threads  # noqa: E402
from switchps.workload.tensorflow.models import build_model  # noqa: E402

MICRO_BATCHES = (1, 2, 4, 8, 16, 32, 64, 128, 256)
WARMUP_CALLS = 2
MIN_REPS, MAX_REPS = 3, 30
BUDGET_S = 4.0  # timed seconds per (model, micro-batch): slow (small) micro-batches get fewer reps


def time_compute(gc: GradientComputer, micro: int) -> float:
    """Median wall seconds of ``gc.compute`` over all its samples after warm-up (tracing excluded)."""
    rows = np.arange(gc.samples)
    for _ in range(WARMUP_CALLS):
        gc.compute(rows, micro)
    times: list[float] = []
    while len(times) < MIN_REPS or (len(times) < MAX_REPS and sum(times) < BUDGET_S):
        t0 = time.perf_counter()
        gc.compute(rows, micro)
        times.append(time.perf_counter() - t0)
    return statistics.median(times)


def bench_model(name: str, x: np.ndarray, y: np.ndarray, num_classes: int) -> list[dict[str, float]]:
    """Per micro-batch size (<= batch): median s/sample and overhead vs the full batch."""
    gc = GradientComputer(build_model(name, x.shape[1:], num_classes), x, y)
    micros = [m for m in MICRO_BATCHES if m < len(x)] + [len(x)]
    per_sample = {m: time_compute(gc, m) / len(x) for m in micros}
    full = per_sample[len(x)]
    return [{"micro_batch": m, "s_per_sample": float(f"{s:.4g}"), "overhead_vs_full_batch": round(s / full, 2)}
            for m, s in per_sample.items()]


def plot(results: dict[str, list[dict[str, float]]], batch: int, path: Path) -> None:
    """Time per sample (log y) vs micro-batch size (log2 x), one line per model."""
    fig, ax = plt.subplots(figsize=(6.4, 4.4))
    for name, rows in results.items():
        ax.plot([r["micro_batch"] for r in rows], [r["s_per_sample"] for r in rows], marker="o", label=name)
    ax.set_xscale("log", base=2)
    micros = sorted({r["micro_batch"] for rows in results.values() for r in rows})
    ax.set_xticks(micros, [str(m) for m in micros])
    ax.set_yscale("log")
    ax.set_xlabel("micro-batch size (samples)")
    ax.set_ylabel("gradient time per sample (s)")
    ax.set_title(f"Partition overhead, batch {batch} (digits, 1 TF thread)")
    ax.grid(True, which="both", alpha=0.3)
    ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--batch", type=int, default=256)
    ap.add_argument("--models", nargs="+", default=["cnn", "mlp"])
    ap.add_argument("--out", type=Path, default=Path("bench/out"))
    args = ap.parse_args()
    configure_threads(1, 1)
    data = load_dataset("digits")
    if not 1 <= args.batch <= len(data.x_train):
        ap.error(f"--batch must be in [1, {len(data.x_train)}]")
    x, y = data.x_train[: args.batch], data.y_train[: args.batch]
    results = {name: bench_model(name, x, y, data.num_classes) for name in args.models}
    args.out.mkdir(parents=True, exist_ok=True)
    png = args.out / "partitions.png"
    plot(results, args.batch, png)
    print(dumps({"benchmark": "partitions", "batch": args.batch, "results": results}, indent=2))


if __name__ == "__main__":
    main()
