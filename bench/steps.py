"""ASP steps per second: logistic regression (784->10, or ``--dim``->10), N workers + 1 PS, real TF gradients.

Runs the real launcher (separate PS, evaluator and worker processes on
loopback) for a fixed wall time and reads the run record. ``--vs-tf`` measures
the peer, TF2 ParameterServerStrategy (``bench/tf_ps.py``: same model, data
shape, batch, learning rate and workers), side by side in the same session:
runs alternate, each pair's ratio is switchps / TF (> 1: switchps is faster); their geometric mean's 95 % interval
says whether it lies above a target ratio (``--target``, 2.5), below it, or cannot tell.
Prints JSON.

    python bench/steps.py [--seconds 20] [--batch 32] [--workers 2] [--dim 784]
    python bench/steps.py --shards 1 2 4 --dim 78400 [--pairs 2]      # 1, 2 and 4 PS shards side by side
                          [--checkpoint-every-s 5 | --no-checkpoint]
    python bench/steps.py --vs-tf 3      # 3 pairs: switchps as shipped (authenticated, checkpointing) vs TF2 PS
    python bench/steps.py --auth-ab 3    # 3 pairs of runs, authenticated (the default) vs insecure, alternating
    python bench/steps.py --shm-ab 3     # 3 pairs: pushes through shared memory (the default) vs gRPC bytes
                          [--no-shared-memory]                # pushes as gRPC bytes, as from another host
"""

from __future__ import annotations

import argparse
import atexit
import csv
import shutil
import statistics
import tempfile
from functools import lru_cache
from pathlib import Path
from typing import Any

import numpy as np

from switchps.config import parse_config
from switchps.jsonfile import dumps
from switchps.launcher import launch
from switchps.studies.stats import ratio_estimate
from tf_ps import run_peer, train_rows

SYNTHETIC_MAX_FEATURES = 10**4
"""``data.num_features``'s limit in switchps's config; a wider input comes from an .npz of random pixels."""
CLASSES = 10


def data_config(dim: int) -> dict[str, Any]:
    """The run's data: ``train_rows(dim)`` training rows (a fifth more in all, for the test set) of ``dim``
    features; synthetic up to ``SYNTHETIC_MAX_FEATURES``, else random uint8 pixels in an .npz."""
    rows = train_rows(dim) * 5 // 4
    if dim <= SYNTHETIC_MAX_FEATURES:
        return {"name": "synthetic", "num_samples": rows, "num_features": dim, "num_classes": CLASSES}
    return {"name": "npz", "path": str(_pixels_npz(rows, dim))}


@lru_cache(maxsize=None)
def _pixels_npz(rows: int, dim: int) -> Path:
    """An .npz of ``rows`` random uint8 rows of ``dim`` pixels and random labels; deleted at exit."""
    tmp = Path(tempfile.mkdtemp(prefix="switchps-steps-data-"))
    atexit.register(shutil.rmtree, tmp, ignore_errors=True)
    rng = np.random.default_rng(0)
    path = tmp / f"pixels-{dim}.npz"
    np.savez(path, x_train=rng.integers(0, 256, (rows, dim), np.uint8),
             y_train=np.arange(rows, dtype=np.int32) % CLASSES)
    return path


def model_name(dim: int) -> str:
    return f"logreg {dim}->{CLASSES} ({dim * CLASSES + CLASSES:,} parameters)"


def run_once(args: argparse.Namespace, insecure: bool = False, shared_memory: bool = True) -> dict:
    """One launcher run for ``args.seconds``; its steps/s and the figures behind it. ``shared_memory``
    False: pushes go as gRPC bytes, as from another host."""
    out = tempfile.mkdtemp(prefix="switchps-steps-")
    cfg = parse_config({
        "name": "steps-bench",
        "cluster": {"workers": args.workers},
        "model": {"name": "logreg"},
        "data": data_config(args.dim),
        "optimizer": {"name": "sgd", "learning_rate": 0.05},
        "protocol": {"name": "asp", "batch": args.batch},
        "train": {"seconds": args.seconds},
        "eval": {"every_s": 5.0},
        "output": {"dir": out},
        "checkpoint": {"every_s": None if args.no_checkpoint else args.checkpoint_every_s},
        "security": {"insecure": insecure},
        "runtime": {"shared_memory": shared_memory and not args.no_shared_memory},
    })
    run_dir, summary = launch(cfg, quiet=True)
    with (run_dir / "workers.csv").open() as f:
        steps = list(csv.DictReader(f))
    mean = lambda key: sum(float(r[key]) for r in steps) / len(steps)  # noqa: E731
    steps_per_s = summary["updates"] / summary["wall_time_s"]
    return {
        "benchmark": "asp_steps", "model": model_name(args.dim), "workers": args.workers,
        "batch": args.batch, "authenticated": not insecure, "shared_memory": cfg.runtime.shared_memory,
        "wall_time_s": summary["wall_time_s"],
        "updates": summary["updates"], "steps_per_s": round(steps_per_s, 1),
        "worker_compute_ms": round(1e3 * mean("compute_s"), 3), "worker_round_trip_ms": round(1e3 * mean("send_s"), 3),
        "final_test_accuracy": summary["final_test_accuracy"], "checkpoints": summary["checkpoints"],
        "rejections": summary["rejections"], "run_dir": str(run_dir),
    }


def alternate(args: argparse.Namespace, pairs: int, arms: dict[str, dict[str, bool]]) -> dict:
    """Two arms (``run_once`` keyword arguments) in alternating pairs, ABBA, so drift hits both alike; each
    pair's ratio (first arm over second), their spread and geometric mean, whether it differs from 1 beyond
    its 95 % interval, and the ratio of medians."""
    runs: dict[str, list[float]] = {name: [] for name in arms}
    for pair in range(pairs):
        for name in list(arms) if pair % 2 == 0 else list(arms)[::-1]:
            runs[name].append(run_once(args, **arms[name])["steps_per_s"])
    first, second = runs.values()
    med = {k: statistics.median(v) for k, v in runs.items()}
    return {"model": model_name(args.dim), "workers": args.workers, "seconds_per_run": args.seconds,
            "steps_per_s": runs, "median_steps_per_s": med,
            "pair_ratios": [round(a / b, 3) for a, b in zip(first, second)],
            "ratio": ratio_summary([a / b for a, b in zip(first, second)], target=1.0),
            "ratio_of_medians": round(statistics.median(first) / statistics.median(second), 3)}


def ratio_summary(ratios: list[float], target: float | None = None) -> dict[str, Any]:
    """min, median and max of the pairs' ratios, their geometric mean with its 95 % interval ``low``–``high``
    (the t interval of the logarithms, taken back; None for one pair) and, given a ``target``, whether the
    interval lies above it, below it or across it ("not significant either way": the pairs cannot tell
    apart)."""
    if not ratios:
        raise ValueError("no ratios")
    est = ratio_estimate(ratios)
    if est.missing:
        raise ValueError(f"every ratio must be > 0: {ratios}")
    assert est.geomean is not None
    low, high = (None if v is None else float(f"{v:.4g}") for v in (est.low, est.high))  # never rounded to 0
    out: dict[str, Any] = {"min": round(min(ratios), 3), "median": round(statistics.median(ratios), 3),
                           "max": round(max(ratios), 3), "geomean": round(est.geomean, 3), "low": low, "high": high}
    if target is not None:
        verdict = ("not significant either way" if not est.excludes(target)
                   else "above" if est.geomean > target else "below")
        out["target"] = {"ratio": target, "verdict": verdict}
    return out


def vs_tf(args: argparse.Namespace) -> dict:
    """switchps as shipped and TF2 ParameterServerStrategy in alternating pairs (ABBA: which runs first
    alternates too), so drift on a shared machine hits both alike; each pair's ratio, and their spread."""
    series: dict[str, list[float]] = {"switchps": [], "tf2_ps_strategy": []}
    runs: list[dict] = []
    for pair in range(args.vs_tf):
        for name in (["switchps", "tf2_ps_strategy"] if pair % 2 == 0 else ["tf2_ps_strategy", "switchps"]):
            if name == "switchps":
                run = run_once(args)
            else:
                run = run_peer(args.workers, args.seconds, args.tf_warmup_s, args.dim, args.batch, lr=0.05)
            series[name].append(run["steps_per_s"])
            runs.append({"pair": pair, "who": name, **{k: run.get(k) for k in _KEPT}})
    ratios = [round(s / t, 3) for s, t in zip(series["switchps"], series["tf2_ps_strategy"])]
    return {"benchmark": "asp_steps_vs_tf2_ps_strategy", "model": model_name(args.dim), "workers": args.workers,
            "batch": args.batch, "seconds_per_run": args.seconds, "tf_warmup_s": args.tf_warmup_s,
            "switchps": {"authenticated": True, "checkpoint_every_s": None if args.no_checkpoint
                         else args.checkpoint_every_s},
            "steps_per_s": series, "ratio_switchps_over_tf": ratios, "ratio": ratio_summary(ratios, args.target),
            "runs": runs}


_KEPT = ("steps_per_s", "wall_time_s", "window_s", "updates", "steps", "worker_compute_ms", "worker_round_trip_ms",
         "checkpoints", "ports_freed", "run_dir")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--seconds", type=float, default=20.0)
    ap.add_argument("--batch", type=int, default=32)
    ap.add_argument("--workers", type=int, default=2)
    ap.add_argument("--dim", type=int, default=784, help="input features (78400: 784,010 parameters)")
    ap.add_argument("--checkpoint-every-s", type=float, default=30.0, help="the PS's checkpoint interval")
    ap.add_argument("--no-checkpoint", action="store_true", help="no checkpoints at all")
    ap.add_argument("--auth-ab", type=int, metavar="PAIRS", help="compare authenticated and insecure runs")
    ap.add_argument("--insecure", action="store_true", help="one run without authentication")
    ap.add_argument("--no-shared-memory", action="store_true", help="pushes as gRPC bytes, as from another host")
    ap.add_argument("--shm-ab", type=int, metavar="PAIRS",
                    help="compare pushes through shared memory with pushes as gRPC bytes")
    ap.add_argument("--vs-tf", type=int, nargs="?", const=3, metavar="PAIRS",
                    help="alternate PAIRS runs of switchps and of TF2 ParameterServerStrategy (default 3)")
    ap.add_argument("--target", type=float, default=2.5,
                    help="with --vs-tf: the ratio the pairs' geometric mean is tested against (95 %% CI, log scale)")
    ap.add_argument("--tf-warmup-s", type=float, default=3.0, help="TF's steps before its measured window")
    ap.add_argument("--shards", type=int, nargs="+", metavar="S", help="instead: S PS shards each, alternated "
                                                                       "--pairs times (bench/shards.py)")
    ap.add_argument("--pairs", type=int, default=2, help="with --shards: rounds of every shard count")
    ap.add_argument("--shard-max-mb", type=float, default=1.0, help="with --shards: runtime.shard_max_mb")
    args = ap.parse_args()
    if args.shards:
        from shards import steps as by_shards  # the sibling benchmark (bench/ is on sys.path)

        return print(dumps(by_shards(args), indent=2))
    if args.vs_tf is not None and args.vs_tf < 1:
        ap.error("--vs-tf needs at least 1 pair")
    if args.vs_tf:
        out = vs_tf(args)
    elif args.auth_ab:
        out = {"benchmark": "asp_steps_authenticated_over_insecure",
               **alternate(args, args.auth_ab, {"authenticated": {}, "insecure": {"insecure": True}})}
    elif args.shm_ab:
        out = {"benchmark": "asp_steps_shared_memory_over_grpc_bytes",
               **alternate(args, args.shm_ab, {"shared_memory": {}, "grpc_bytes": {"shared_memory": False}})}
    else:
        out = run_once(args, args.insecure)
    print(dumps(out, indent=2))


if __name__ == "__main__":
    main()
