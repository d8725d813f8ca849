"""Convergence on a half-precision wire (``runtime.wire_dtype``), side by side with float32.

Runs ``switchps run`` on loopback for each suite, wire type and seed, and reports the final test accuracy
(mean and 95 % t interval over the seeds), the paired difference from float32 in points (bfloat16 -
float32, seed by seed), and the payload bytes a step moves (a push and its reply: parameters x the wire
type's bytes, headers excluded) with the ratio to float32. Suites: the two quickstarts (digits: TF and
torch workers) and a CIFAR-shaped run (32x32x3 images of 10 classes, made here: each class a smooth random
template under pixel noise, learnable but not trivially; a small torch CNN, 2 workers under BSP, Adam).

    python bench/wire_dtype.py [--suites torch_quickstart quickstart cifar_shaped] [--seeds 0 1 2]
        [--dtypes float32 bfloat16 float16] [--out bench/results/issue45_wire_dtype.json]
"""

from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys
import tempfile
import time
from importlib.resources import files
from pathlib import Path
from typing import Any, Callable

import numpy as np

from switchps.jsonfile import dumps
from switchps.protos.codec import DEFAULT_CHUNK_BYTES, PayloadWriter, array_chunks
from switchps.protos.wire_dtype import NAMES, itemsize, narrowed
from switchps.ps_server.snapshot import Snapshot
from switchps.studies.stats import estimate

CONFIGS = Path(str(files("switchps.examples")))
SWITCHPS = str(Path(sys.executable).parent / "switchps")
SHAPE, CLASSES = (32, 32, 3), 10


def cifar_shaped(path: Path, train: int = 3000, test: int = 1000, signal: float = 0.12) -> Path:
    """A learnable CIFAR-shaped npz: class c's images are ``signal`` x template c (smooth: 4x4x3 normal
    values upsampled 8x) under unit Gaussian pixel noise, as uint8. The nearest-template (Bayes) classifier
    scores about 98 % at 0.08 (66 % at 0.04), so a small CNN has something to learn in a few epochs. A
    fixed seed: the runs' seeds vary the split of work, the weights and the order, not the data."""
    rng = np.random.default_rng(12345)
    coarse = rng.standard_normal((CLASSES, 4, 4, 3))
    templates = coarse.repeat(8, axis=1).repeat(8, axis=2)
    y = np.arange(train + test, dtype=np.int32) % CLASSES
    rng.shuffle(y)
    x = signal * templates[y] + rng.standard_normal((train + test, *SHAPE))
    pixels = np.clip(128 + 40 * x, 0, 255).astype(np.uint8)
    np.savez(path, x_train=pixels[:train], y_train=y[:train], x_test=pixels[train:], y_test=y[train:])
    return path


def suites(tmp: Path) -> dict[str, tuple[str, list[str]]]:
    """Each suite's config and its overrides."""
    data = cifar_shaped(tmp / "cifar-shaped.npz")
    return {
        "quickstart": (str(CONFIGS / "quickstart.yaml"), []),
        "torch_quickstart": (str(CONFIGS / "torch" / "quickstart.yaml"), []),
        "cifar_shaped": (str(CONFIGS / "torch" / "quickstart.yaml"), [
            "name=cifar-shaped", "data.name=npz", f"data.path={data}", "model.name=cnn",
            "model.kwargs={filters: [16, 32]}", "protocol.batch=32", "train.epochs=8",
            "optimizer.name=adam", "optimizer.learning_rate=0.001", "eval.every_s=2.0"]),
    }


def one_run(config: str, overrides: list[str], wire: str, seed: int, out: Path) -> dict[str, Any]:
    out.mkdir(parents=True)
    sets = [*overrides, f"runtime.wire_dtype={wire}", f"seed={seed}", f"output.dir={out}"]
    t0 = time.monotonic()
    proc = subprocess.run([SWITCHPS, "run", config, "--quiet", *[a for s in sets for a in ("--set", s)]],
                          capture_output=True, text=True, timeout=1800, cwd=out.parent)
    if proc.returncode != 0:
        raise RuntimeError(f"{config} {wire} seed {seed} failed:\n{proc.stderr[-3000:]}")
    (run_dir,) = [d for d in out.iterdir() if (d / "summary.json").exists()]
    s = json.loads((run_dir / "summary.json").read_text())
    return {"seed": seed, "final_test_accuracy": s["final_test_accuracy"], "updates": s["updates"],
            "pushes_rejected": s["pushes_rejected"], "wall_s": round(time.monotonic() - t0, 1),
            "parameters": _parameters(run_dir)}


def _parameters(run_dir: Path) -> int:
    """The model's values (parameters and state), from the PS's record of the run."""
    for line in (run_dir / "events.jsonl").read_text().splitlines():
        e = json.loads(line)
        if e["event"] == "model_initialized":
            return int(e["parameters"])
    raise RuntimeError(f"{run_dir}: no model size recorded")


def conversion_ms(size: int, repeat: int = 5) -> dict[str, dict[str, float]]:
    """Median milliseconds, per wire type, of what a narrow wire adds or changes on one core, for ``size``
    values: the worker's narrowing of a payload on the host, the PS's copy-in of a push's frames (widened)
    with its finiteness check, and the PS's chunks of a reply (narrowed)."""
    x = np.random.default_rng(0).standard_normal(size).astype(np.float32)
    out = np.empty(size, np.float32)
    result: dict[str, dict[str, float]] = {}
    for wire in NAMES:
        frames = list(array_chunks(narrowed(x, wire)))

        def receive() -> None:
            writer = PayloadWriter(out, True, wire)
            for f in frames:
                writer.add(f)
            writer.finish()

        steps = {"worker_narrow": lambda: narrowed(x, wire), "ps_receive_and_check": receive,
                 "ps_reply_chunks": lambda: Snapshot.of(1, x, DEFAULT_CHUNK_BYTES, wire)}
        result[wire] = {name: round(1e3 * _median_s(step, repeat), 2) for name, step in steps.items()}
    return result


def _median_s(step: Callable[[], object], repeat: int) -> float:
    step()
    times = []
    for _ in range(repeat):
        t0 = time.perf_counter()
        step()
        times.append(time.perf_counter() - t0)
    return statistics.median(times)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--suites", nargs="+", default=["torch_quickstart", "quickstart", "cifar_shaped"])
    ap.add_argument("--dtypes", nargs="+", default=list(NAMES), choices=NAMES)
    ap.add_argument("--seeds", nargs="+", type=int, default=[0, 1, 2])
    ap.add_argument("--out", type=Path, help="also write the JSON here (keeping the suites it has that are not run)")
    ap.add_argument("--conversion-size", type=int, default=11_200_000, help="values (default: ResNet-18's)")
    args = ap.parse_args()
    report: dict[str, Any] = {"benchmark": "wire_dtype", "conversion_ms": conversion_ms(args.conversion_size),
                              "suites": {}}
    if args.out and args.out.exists():  # a suite run again replaces its entry; the others are kept
        report["suites"] = json.loads(args.out.read_text())["suites"]
    with tempfile.TemporaryDirectory(prefix="switchps-wire-") as d:
        tmp = Path(d)
        table = suites(tmp)
        for name in args.suites:
            config, overrides = table[name]
            runs = {w: [one_run(config, overrides, w, s, tmp / f"{name}-{w}-{s}" / "runs") for s in args.seeds]
                    for w in args.dtypes}
            acc = {w: [r["final_test_accuracy"] for r in rs] for w, rs in runs.items()}
            size = runs[args.dtypes[0]][0]["parameters"]
            report["suites"][name] = {
                "config": Path(config).name, "overrides": overrides, "parameters": size, "seeds": args.seeds,
                "runs": runs,
                "accuracy": {w: estimate(a).as_dict() for w, a in acc.items()},
                "accuracy_minus_float32_points": {
                    w: estimate([100 * (x - r) for x, r in zip(a, acc["float32"])]).as_dict()
                    for w, a in acc.items() if w != "float32" and "float32" in acc},
                "bytes_per_step": {w: 2 * size * itemsize(w) for w in args.dtypes},
                "fewer_bytes_than_float32": {w: 4 / itemsize(w) for w in args.dtypes},
            }
            if args.out:  # after each suite: a long benchmark leaves what it finished
                args.out.write_text(dumps(report, indent=2) + "\n")
    print(dumps(report, indent=2))


if __name__ == "__main__":
    main()
