"""ResNet-18 (CIFAR stem) steps/s of PyTorch workers through switchps, beside the same steps with no PS.

Three ways to take the same SGD steps (batch ``--batch`` of 32x32x3 images, the zoo's ``resnet18``, on
``--device``), in one process each, one after the other:
- ``local``: the module and ``torch.optim.SGD``, nothing else: the device's own rate;
- ``computer``: switchps's ``TorchComputer`` with the update done locally on the flat vector: the same
  steps plus what a worker adds without a PS (the payload's and the values' host copies on a GPU);
- ``switchps``: a real run (``launch``: a PS, an evaluator and ``--workers`` worker processes, ASP, pushes
  through shared memory), its steps/s per worker and together, each step's compute and round trip (push
  and reply) in milliseconds from ``workers.csv``.
The first two run with a worker's threads (``runtime``'s defaults). Imports no TensorFlow: a GPU machine
has none. Prints JSON.

    python bench/gpu.py --device cuda [--steps 200] [--batch 128] [--workers 1 4]
    python bench/gpu.py --device cpu --steps 3 --batch 8      # tiny, on any machine (the test runs this)
"""

from __future__ import annotations

import argparse
import csv
import json
import shutil
import statistics
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable

import numpy as np
import torch
import torch.nn.functional as F

from switchps.config.run import RunConfig, parse_config
from switchps.jsonfile import dumps
from switchps.launch.launcher import launch
from switchps.workload.torch.gradients import TorchComputer
from switchps.workload.torch.models import build_model
from switchps.workload.torch.setup import configure_threads

SHAPE = (32, 32, 3)
CLASSES = 10
LR = 0.01
WARM_UP_STEPS = 2
"""Steps before each timed loop (kernels chosen, memory allocated); a switchps worker warms up before it
registers."""


def images(rows: int, seed: int = 0) -> tuple[np.ndarray, np.ndarray]:
    """``rows`` random uint8 CIFAR-shaped images and labels (the data does not change a step's cost)."""
    rng = np.random.default_rng(seed)
    return rng.integers(0, 256, (rows, *SHAPE), np.uint8), np.arange(rows, dtype=np.int32) % CLASSES


def rows_needed(args: argparse.Namespace) -> int:
    return max(4 * args.batch, 64)


def timed(step: Callable[[int], None], steps: int, device: torch.device) -> float:
    """Seconds per step of ``steps`` calls of ``step(i)``, after ``WARM_UP_STEPS``, the device synchronized."""
    for i in range(WARM_UP_STEPS):
        step(i)
    sync = torch.cuda.synchronize if device.type == "cuda" else (lambda: None)
    sync()
    t0 = time.perf_counter()
    for i in range(steps):
        step(i)
    sync()
    return (time.perf_counter() - t0) / steps


def local(args: argparse.Namespace, device: torch.device) -> dict[str, Any]:
    """The device's own rate: forward, summed cross-entropy, backward and ``SGD.step`` on the module."""
    x, y = images(rows_needed(args))
    model = build_model("resnet18", SHAPE, CLASSES).to(device).train()
    xs = torch.tensor(x, device=device).float().div_(255)
    ys = torch.tensor(y, dtype=torch.int64, device=device)
    opt = torch.optim.SGD(model.parameters(), lr=LR)

    def step(i: int) -> None:
        rows = torch.arange(i * args.batch, (i + 1) * args.batch, device=device) % len(xs)
        opt.zero_grad(set_to_none=True)
        F.cross_entropy(model(xs[rows]), ys[rows], reduction="sum").backward()
        opt.step()

    s = timed(step, args.steps, device)
    return {"steps_per_s": round(1 / s, 3), "step_ms": round(1e3 * s, 3)}


def computer(args: argparse.Namespace, device: torch.device) -> dict[str, Any]:
    """switchps's gradient computer, its update local: compute the payload at the staged values, step them."""
    x, y = images(rows_needed(args))
    gc = TorchComputer(build_model("resnet18", SHAPE, CLASSES), x.astype(np.float32) / 255, y, device)
    values = gc.buffer()
    values[:] = gc.read()
    n = gc.weights.trainable_size
    gc.warm_up(args.batch, args.batch)

    def step(i: int) -> None:
        rows = np.arange(i * args.batch, (i + 1) * args.batch) % gc.samples
        payload, _ = gc.compute(rows, args.batch)
        values[:n] -= np.float32(LR) * payload[:n]
        values[n:] = payload[n:]
        gc.stage(values)

    s = timed(step, args.steps, device)
    return {"steps_per_s": round(1 / s, 3), "step_ms": round(1e3 * s, 3)}


def config(args: argparse.Namespace, workers: int, data: Path, out: Path) -> dict[str, Any]:
    """A PS and ``workers`` torch workers on ``args.device``, ASP, ``args.steps`` steps each (a config's
    fields, for ``parse_config``)."""
    return {
        "name": "gpu-bench", "cluster": {"workers": workers},
        "model": {"name": "resnet18", "framework": "torch"}, "data": {"name": "npz", "path": str(data)},
        "optimizer": {"name": "sgd", "learning_rate": LR}, "protocol": {"name": "asp", "batch": args.batch},
        "train": {"steps": args.steps * workers}, "eval": {"every_s": 3600.0},
        "checkpoint": {"every_s": None}, "runtime": {"device": args.device}, "output": {"dir": str(out)},
    }


def run_config(args: argparse.Namespace, workers: int, data: Path, out: Path) -> RunConfig:
    return parse_config(config(args, workers, data, out))


@dataclass
class Run:
    """What a real run's records say."""

    summary: dict[str, Any]
    steps: list[dict[str, str]]
    """``workers.csv``'s rows: a worker step each."""
    shards: list[dict[str, Any]]
    """``shard-K.json`` of each follower shard (none with one PS)."""


def launched(cfg: RunConfig) -> Run:
    """One real run of ``cfg`` and its records (its run directory, the only one in ``output.dir``, removed)."""
    _, summary = launch(cfg, quiet=True)
    run_dir = next(Path(cfg.output.dir).iterdir())
    with (run_dir / "workers.csv").open() as f:
        steps = list(csv.DictReader(f))
    shards = [json.loads(p.read_text()) for p in sorted(run_dir.glob("shard-*.json"))]
    shutil.rmtree(run_dir)
    return Run(summary, steps, shards)


def median_ms(steps: list[dict[str, str]], key: str) -> float:
    """The median over workers.csv's rows of the seconds in column ``key``, in milliseconds."""
    return round(1e3 * statistics.median(float(r[key]) for r in steps), 3)


def through_switchps(args: argparse.Namespace, workers: int, data: Path, out: Path) -> dict[str, Any]:
    """One real run: steps/s (updates over training's wall time, each update one worker's step) and the
    median step's compute and round trip."""
    run = launched(run_config(args, workers, data, out))
    summary, steps = run.summary, run.steps
    together = summary["updates"] / summary["wall_time_s"]
    return {"workers": workers, "steps_per_s": round(together, 3), "steps_per_s_per_worker": round(together / workers, 3),
            "compute_ms": median_ms(steps, "compute_s"), "round_trip_ms": median_ms(steps, "send_s"),
            "updates": summary["updates"], "wall_time_s": summary["wall_time_s"],
            "pushes_rejected": summary["pushes_rejected"]}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--device", default="cuda", help="cuda, cuda:K or cpu")
    ap.add_argument("--steps", type=int, default=200, help="timed steps (per worker through switchps)")
    ap.add_argument("--batch", type=int, default=128)
    ap.add_argument("--workers", type=int, nargs="+", default=[1, 4], help="worker counts through switchps")
    args = ap.parse_args()
    device = torch.device(args.device)
    tmp = Path(tempfile.mkdtemp(prefix="switchps-gpu-bench-"))
    try:
        data = tmp / "cifar-shaped.npz"
        x, y = images(rows_needed(args) + 16)
        np.savez(data, x_train=x[:-16], y_train=y[:-16], x_test=x[-16:], y_test=y[-16:])
        runtime = run_config(args, 1, data, tmp).runtime
        configure_threads(runtime.intra_op_threads, runtime.inter_op_threads)  # as many as a worker's
        base, comp = local(args, device), computer(args, device)
        runs = [through_switchps(args, w, data, tmp / f"runs-{w}") for w in args.workers]
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    model = build_model("resnet18", SHAPE, CLASSES)
    for run in runs:
        run["per_worker_over_local"] = round(run["steps_per_s_per_worker"] / base["steps_per_s"], 3)
    print(dumps({
        "benchmark": "gpu_resnet18", "device": str(device),
        "device_name": torch.cuda.get_device_name(device) if device.type == "cuda" else "cpu",
        "torch": torch.__version__, "parameters": sum(p.numel() for p in model.parameters()),
        "batch": args.batch, "steps": args.steps, "local": base, "computer": comp,
        "switchps": runs,
    }, indent=2))


if __name__ == "__main__":
    main()
