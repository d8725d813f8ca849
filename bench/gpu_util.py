"""How busy switchps keeps a training device: the device's own compute time ÷ the step period, at ResNet-18's
size (11.2M float32 parameters, 42.7 MB a push).

Each case is one real run (``bench/gpu.py``'s: ``launch``, a PS, an evaluator and ``--workers`` torch workers,
ASP, pushes through shared memory; ``--shards`` PS shards on this host), ``--steps`` steps a worker:
- on the CPU (the default), an emulated device (``device.samples_per_s``: ``--batch`` samples in
  ``--step-ms``, ResNet-18's step on an H200) and ``resnet18_sized``: ResNet-18's parameter count, but the
  computation of a linear layer, so that the emulated time is the device's own compute time (the rest of a
  step's real work, the payload's 42.7 MB written into shared memory, takes 5-15 ms here, inside it);
- ``--device cuda``: the real ResNet-18 on the GPU; the device's own compute time is ``gpu.local``'s step
  (the module and ``torch.optim.SGD`` alone), measured first, with ``gpu.computer``'s (the same steps with
  switchps's gradient computer and its host copies, no PS).

utilization = steps a second on one device × the device's own compute time a step (steps: the samples the PS
applied ÷ the batch, so that under local steps each of a round's H steps counts): each worker's on the
emulated device (each worker emulates one), all workers' together on a GPU (they share it). Per case, in
ms: ``compute`` (the median step on a worker, its host copies included: ``workers.csv``), ``copy``
(``compute`` beyond the device's own time: on a GPU the payload's and the values' copies, and with several
workers on it their waiting for one another; on the CPU the payload's write), ``round_trip``
(the median push and its reply), ``wait`` (the step period beyond ``compute``: the device waiting for the
PS), ``period``, and of the PS: ``apply`` (shard 0's mean apply, where its ``summary.json`` says it as
``mean_apply_ms``; today's does not: null), ``followers_apply`` (each follower shard's mean apply, from its
``shard-K.json``) and ``ps_cpu`` (the PS's CPU time an update, its shards' together: each one's mean CPU %
over its life, from ``summary.json``'s resources, times training's wall time ÷ updates; the apply with
the receiving and the reply, and the start-up: an upper bound of the work an update costs the PS, not of
its latency). The top-level ``utilization`` is the first case's.

``--set KEY=VALUE`` (repeatable; VALUE read as YAML) sets any config field, e.g. ``runtime.shared_memory=false``;
nothing else is set, so the same command measures a checkout that lacks a field its options do not name.
Imports no TensorFlow. Prints JSON.

    python bench/gpu_util.py                              # emulated, 1 worker, 1 PS: under 5 minutes on 2 cores
    python bench/gpu_util.py --device cuda --workers 1 4 --shards 1 4 [--set runtime.pipeline_depth=1]
"""

from __future__ import annotations

import argparse
import os
import shutil
import tempfile
import time
from pathlib import Path
from typing import Any

import numpy as np
import torch
import yaml
from torch import nn

from gpu import CLASSES, SHAPE, computer, config, images, launched, local, median_ms, rows_needed  # bench/gpu.py
from switchps.config.run import parse_config
from switchps.jsonfile import dumps
from switchps.workload.torch.models import build_model
from switchps.workload.torch.setup import configure_threads
from switchps.workload.torch.weights import FlatParams

RESNET18_PARAMETERS = 11_173_962
"""The zoo's ``resnet18`` with the CIFAR stem and 10 classes."""
SIZED = "gpu_util:resnet18_sized"
"""``model.name`` of the emulated case's model (this file; its directory is put on the workers' path)."""


class _Constant(torch.autograd.Function):
    """A zero that depends on a tensor without reading it: its gradient is the zero's, expanded (no memory)."""

    @staticmethod
    def forward(ctx: Any, t: torch.Tensor) -> torch.Tensor:
        ctx.shape = t.shape
        return t.new_zeros(())

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> torch.Tensor:
        return grad.expand(ctx.shape)


class Sized(nn.Module):
    """A linear layer on the flattened input, and ``rest``, a parameter that shifts every logit by a zero
    (cross-entropy ignores a shift): the gradient is dense, its cost is nothing but its size."""

    def __init__(self, features: int, classes: int, parameters: int) -> None:
        super().__init__()
        self.linear = nn.Linear(features, classes)
        self.rest = nn.Parameter(torch.zeros(parameters - features * classes - classes))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        out: torch.Tensor = self.linear(x.flatten(1)) + _Constant.apply(self.rest)
        return out


def resnet18_sized(input_shape: tuple[int, ...], num_classes: int,
                   parameters: int = RESNET18_PARAMETERS) -> nn.Module:
    """A model of ``parameters`` float32 parameters (ResNet-18's) that computes a linear layer (``Sized``)."""
    return Sized(int(np.prod(input_shape)), num_classes, parameters)


def overrides(pairs: list[str]) -> dict[str, Any]:
    """``["a.b=1", ...]`` as ``{"a.b": 1, ...}``, each value read as YAML."""
    out: dict[str, Any] = {}
    for pair in pairs:
        key, sep, value = pair.partition("=")
        if not (sep and key):
            raise SystemExit(f"--set {pair!r}: expected KEY=VALUE, e.g. runtime.shared_memory=false")
        out[key] = yaml.safe_load(value)
    return out


def case_config(args: argparse.Namespace, workers: int, shards: int, data: Path, out: Path) -> dict[str, Any]:
    """``gpu.config``'s run with ``shards`` PS shards, the emulated device and model off a GPU, and
    ``--set``'s fields."""
    d = config(args, workers, data, out)
    d["name"] = "gpu-util"
    if shards > 1:
        d["cluster"]["ps"] = ["127.0.0.1:0"] * shards
    if args.device == "cpu":
        d["model"]["name"] = SIZED
        d["device"] = {"samples_per_s": args.batch / (args.step_ms / 1e3)}
    for key, value in overrides(args.set).items():
        *path, last = key.split(".")
        node = d
        for part in path:
            node = node.setdefault(part, {})
        node[last] = value
    return d


def case(args: argparse.Namespace, workers: int, shards: int, data: Path, out: Path, device_ms: float) -> dict[str, Any]:
    """One real run and what its records say (module docstring)."""
    run = launched(parse_config(case_config(args, workers, shards, data, out)))
    summary, steps = run.summary, run.steps
    wall, updates = summary["wall_time_s"], summary["updates"]
    computed = summary["samples"] / args.batch  # steps computed: an update each, or (local steps) H each
    per_worker = computed / wall / workers
    per_device = per_worker if args.device == "cpu" else per_worker * workers
    compute, period = median_ms(steps, "compute_s"), 1e3 / per_worker
    ps_cpu = sum(r["cpu_percent_mean"] for role, r in (summary.get("resources") or {}).items()
                 if role.startswith("ps"))
    return {"workers": workers, "shards": shards, "utilization": round(per_device * device_ms / 1e3, 4),
            "steps_per_s_per_worker": round(per_worker, 3), "period_ms": round(period, 3), "compute_ms": compute,
            "copy_ms": round(compute - device_ms, 3), "apply_ms": summary.get("mean_apply_ms"),
            "followers_apply_ms": [r["mean_apply_ms"] for r in run.shards],
            "ps_cpu_ms": round(1e3 * ps_cpu / 100 * wall / updates, 3),
            "wait_ms": round(period - compute, 3), "round_trip_ms": median_ms(steps, "send_s"),
            "updates": updates, "steps_per_update": round(computed / updates, 3), "wall_time_s": wall,
            "pushes_rejected": summary["pushes_rejected"]}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--device", default="cpu", help="cpu (the emulated device), cuda or cuda:K")
    ap.add_argument("--steps", type=int, default=200, help="steps a worker in each case")
    ap.add_argument("--batch", type=int, default=128)
    ap.add_argument("--step-ms", type=float, default=11.0, help="the emulated device's step (ResNet-18 on an H200)")
    ap.add_argument("--workers", type=int, nargs="+", default=[1], help="worker counts, a case each")
    ap.add_argument("--shards", type=int, nargs="+", default=[1], help="PS shard counts, a case each")
    ap.add_argument("--set", action="append", default=[], metavar="KEY=VALUE", help="a config field, e.g. "
                    "runtime.shared_memory=false (repeatable)")
    args = ap.parse_args()
    overrides(args.set)  # refused now rather than after the first case
    os.environ["PYTHONPATH"] = os.pathsep.join([str(Path(__file__).resolve().parent),
                                                *filter(None, [os.environ.get("PYTHONPATH")])])  # the workers' model
    t0, load = time.perf_counter(), os.getloadavg()[0]
    device = torch.device(args.device)
    tmp = Path(tempfile.mkdtemp(prefix="switchps-gpu-util-"))
    result: dict[str, Any] = {"benchmark": "gpu_util", "device": "emulated" if device.type == "cpu" else str(device),
                              "device_name": torch.cuda.get_device_name(device) if device.type == "cuda" else "cpu",
                              "torch": torch.__version__, "batch": args.batch, "steps": args.steps,
                              "overrides": overrides(args.set)}
    try:
        data = tmp / "cifar-shaped.npz"
        x, y = images(rows_needed(args) + 16)
        np.savez(data, x_train=x[:-16], y_train=y[:-16], x_test=x[-16:], y_test=y[-16:])
        if device.type == "cpu":
            device_ms = args.step_ms
        else:
            runtime = parse_config(config(args, 1, data, tmp)).runtime
            configure_threads(runtime.intra_op_threads, runtime.inter_op_threads)  # as many as a worker's
            result["local"], result["computer"] = local(args, device), computer(args, device)
            device_ms = result["local"]["step_ms"]
        cases = [case(args, w, s, data, tmp / f"runs-{w}-{s}", device_ms) for w in args.workers for s in args.shards]
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    model = resnet18_sized(SHAPE, CLASSES) if device.type == "cpu" else build_model("resnet18", SHAPE, CLASSES)
    params = sum(p.numel() for p in model.parameters())
    print(dumps({**result, "model": "resnet18" if device.type != "cpu" else SIZED, "parameters": params,
                 "push_mib": round(4 * FlatParams(model).size / 2**20, 2), "device_ms": device_ms, "utilization": cases[0]["utilization"],
                 "cases": cases, "wall_s": round(time.perf_counter() - t0, 1),
                 "load_avg_1min": {"start": load, "end": os.getloadavg()[0]}}, indent=2))


if __name__ == "__main__":
    main()
