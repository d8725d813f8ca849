"""A worker's step with each framework's gradient computer, side by side: µs per ``stage`` + ``compute`` on
the same MLP and the same digits batches (rows named as a worker names them, the payload written into a
segment-like buffer, one thread each), TensorFlow's ``GradientComputer`` and PyTorch's ``TorchComputer``
alternating in blocks (ABBA); each block's median, and the ratios paired by block (their geometric mean
and its 95 % t interval).

    python bench/torch_step.py [--hidden 128] [--batch 32] [--steps 300] [--blocks 20]

Prints JSON.
"""

from __future__ import annotations

import argparse
import statistics
import time

import numpy as np
import torch

from switchps.jsonfile import dumps
from switchps.studies.stats import ratio_estimate
from switchps.workload.tensorflow.gradients import GradientComputer
from switchps.workload.tensorflow.models import build_model as keras_model
from switchps.workload.tensorflow.setup import configure_threads
from switchps.workload.torch.gradients import TorchComputer
from switchps.workload.torch.models import build_model as torch_model
from switchps.workload.data import load_dataset


def computers(hidden: list[int], batch: int) -> dict[str, GradientComputer | TorchComputer]:
    """Both frameworks' computers over digits' training set, warmed up, their payload going to a buffer."""
    configure_threads(1, 1)
    torch.set_num_threads(1)
    data = load_dataset("digits")
    shape, classes = data.input_shape, data.num_classes
    found: dict[str, GradientComputer | TorchComputer] = {
        "tensorflow": GradientComputer(keras_model("mlp", shape, classes, hidden=hidden), data.x_train, data.y_train),
        "torch": TorchComputer(torch_model("mlp", shape, classes, hidden=hidden), data.x_train, data.y_train, "cpu"),
    }
    for gc in found.values():
        gc.warm_up(batch, batch)
        gc.payload_to = gc.buffer()
    return found


def block(gc: GradientComputer | TorchComputer, values: np.ndarray, batch: int, steps: int) -> float:
    """The median µs of ``steps`` steps, each staging the reply's values and computing a batch's payload."""
    times = []
    batches = max(1, gc.samples // batch)
    for i in range(steps):
        rows = np.arange(i % batches * batch, (i % batches + 1) * batch)
        t0 = time.perf_counter()
        gc.stage(values)
        gc.compute(rows, batch)
        times.append(time.perf_counter() - t0)
    return statistics.median(times) * 1e6


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--hidden", type=int, nargs="*", default=[128])
    ap.add_argument("--batch", type=int, default=32)
    ap.add_argument("--steps", type=int, default=300)
    ap.add_argument("--blocks", type=int, default=20, help="per framework (even: ABBA pairs)")
    args = ap.parse_args()
    found = computers(args.hidden, args.batch)
    values = {}
    for name, gc in found.items():
        values[name] = gc.buffer()
        values[name][:] = gc.read()
        block(gc, values[name], args.batch, 50)  # past the first steps' allocations
    medians: dict[str, list[float]] = {name: [] for name in found}
    for b in range(args.blocks):
        order = ["tensorflow", "torch"] if b % 2 == 0 else ["torch", "tensorflow"]
        for name in order:
            medians[name].append(block(found[name], values[name], args.batch, args.steps))
    ratio = ratio_estimate([p / t for p, t in zip(medians["torch"], medians["tensorflow"])])  # paired by block
    print(dumps({
        "benchmark": "torch_vs_tf_step", "model": f"mlp{args.hidden}", "params": found["torch"].weights.trainable_size,
        "batch": args.batch, "steps_per_block": args.steps, "blocks": args.blocks,
        "us_per_step_median": {n: round(statistics.median(m), 1) for n, m in medians.items()},
        "torch_over_tf": {k: v if v is None else round(v, 3) for k, v in ratio.as_dict().items()},
    }))


if __name__ == "__main__":
    main()
