"""ASP steps per second: logistic regression (784->10, or ``--dim``->10), N workers + 1 PS, real gradients of
either framework (``--framework``: TensorFlow by default, or PyTorch).

Runs the real launcher (separate PS, evaluator and worker processes on
loopback) for a fixed wall time and reads the run record. ``--vs-tf`` measures
the peer, TF2 ParameterServerStrategy (``bench/tf_ps.py``: same model, data
shape, batch, learning rate and workers), side by side in the same session, in each of its modes
(``--tf-mode``: as users run it, and tuned down to one thread per pool; both by default, the faster
by median is the peer): runs alternate, each pair's ratio is switchps / TF (> 1: switchps is faster);
their geometric mean's 95 % interval (log scale) says whether it lies above a target ratio (``--target``,
2.5), below it, or cannot tell. ``--network``: switchps's workers talk to the PS as a worker on another host
would, gRPC bytes only (no shared memory, so no Unix socket either) and no CPU binding. Prints JSON.

    python bench/steps.py [--seconds 20] [--batch 32] [--workers 2] [--dim 784]
    python bench/steps.py --shards 1 2 4 --dim 78400 [--pairs 2]      # 1, 2 and 4 PS shards side by side
                          [--checkpoint-every-s 5 | --no-checkpoint]
    python bench/steps.py --vs-tf 3      # 3 pairs: switchps as shipped (authenticated, checkpointing) vs TF2 PS
                          [--tf-mode both|user|tuned] [--network]
    python bench/steps.py --auth-ab 3    # 3 pairs of runs, authenticated (the default) vs insecure, alternating
    python bench/steps.py --shm-ab 3     # 3 pairs: pushes through shared memory (the default) vs gRPC bytes
    python bench/steps.py --network      # one run as from other hosts: gRPC bytes, no CPU binding
    python bench/steps.py --framework-ab 4 --dims 784 78400   # 4 pairs each: torch workers vs TF workers
    python bench/steps.py --pipeline-ab 3 --dim 78400   # 3 pairs: runtime.pipeline_depth 1 vs 0
    [--pipeline-depth 1] [--wire-dtype bfloat16]        # with any of the above: runtime.pipeline_depth, wire_dtype
"""

from __future__ import annotations

import argparse
import atexit
import csv
import shutil
import statistics
import tempfile
from functools import lru_cache, partial
from pathlib import Path
from typing import Any, Callable

import numpy as np

from switchps.config.run import RunConfig, parse_config
from switchps.jsonfile import dumps
from switchps.launch.launcher import launch
from switchps.studies.stats import ratio_estimate
from switchps.workload.frameworks import FRAMEWORKS
from tf_ps import MODES as TF_MODES, run_peer, train_rows

SYNTHETIC_MAX_FEATURES = 10**4
"""``data.num_features``'s limit in switchps's config; a wider input comes from an .npz of random pixels."""
CLASSES = 10
NO_BINDING = {"pin_workers": False, "worker_nice": 0}
"""``runtime.cpu`` for ``--network``: a worker on another host shares no cores with the PS, so the launcher
neither pins the workers nor runs them nicer than the PS."""


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


def run_config(args: argparse.Namespace, insecure: bool = False, shared_memory: bool = True,
               framework: str | None = None, pipeline_depth: int = 0) -> RunConfig:
    """The launcher's config for one run: switchps as shipped, but for ``insecure`` and ``shared_memory``
    False (pushes as gRPC bytes); ``args.network``: as from other hosts, gRPC bytes and ``NO_BINDING``; the
    workers' ``framework`` (default ``args.framework``), ``runtime.pipeline_depth`` and ``runtime.wire_dtype``."""
    runtime: dict[str, Any] = {"shared_memory": shared_memory and not args.network, "pipeline_depth": pipeline_depth,
                               "wire_dtype": args.wire_dtype}
    if args.network:
        runtime["cpu"] = NO_BINDING
    return parse_config({
        "name": "steps-bench",
        "cluster": {"workers": args.workers},
        "model": {"name": "logreg", "framework": framework or args.framework},
        "data": data_config(args.dim),
        "optimizer": {"name": "sgd", "learning_rate": 0.05},
        "protocol": {"name": "asp", "batch": args.batch},
        "train": {"seconds": args.seconds},
        "eval": {"every_s": 5.0},
        "output": {"dir": tempfile.mkdtemp(prefix="switchps-steps-")},
        "checkpoint": {"every_s": None if args.no_checkpoint else args.checkpoint_every_s},
        "security": {"insecure": insecure},
        "runtime": runtime,
    })


def run_once(args: argparse.Namespace, insecure: bool = False, shared_memory: bool = True,
             framework: str | None = None, pipeline_depth: int | None = None) -> dict:
    """One launcher run of ``run_config`` for ``args.seconds``; its steps/s and the figures behind it
    (``worker_round_trip_ms``: the mean send_s, with overlap the wait for a reply beyond the compute)."""
    depth = args.pipeline_depth if pipeline_depth is None else pipeline_depth
    cfg = run_config(args, insecure, shared_memory, framework, depth)
    run_dir, summary = launch(cfg, quiet=True)
    with (run_dir / "workers.csv").open() as f:
        steps = list(csv.DictReader(f))
    mean = lambda key: sum(float(r[key]) for r in steps) / len(steps)  # noqa: E731
    steps_per_s = summary["updates"] / summary["wall_time_s"]
    return {
        "benchmark": "asp_steps", "model": model_name(args.dim), "framework": cfg.model.framework,
        "workers": args.workers,
        "batch": args.batch, "authenticated": not insecure, "shared_memory": cfg.runtime.shared_memory,
        "pipeline_depth": cfg.runtime.pipeline_depth, "wire_dtype": cfg.runtime.wire_dtype,
        "cpu_binding": cfg.runtime.cpu.model_dump(), "wall_time_s": summary["wall_time_s"],
        "updates": summary["updates"], "steps_per_s": round(steps_per_s, 1),
        "worker_compute_ms": round(1e3 * mean("compute_s"), 3), "worker_round_trip_ms": round(1e3 * mean("send_s"), 3),
        "final_test_accuracy": summary["final_test_accuracy"], "checkpoints": summary["checkpoints"],
        "rejections": summary["rejections"], "run_dir": str(run_dir),
    }


def interleave(pairs: int, arms: dict[str, Callable[[], dict]]) -> list[tuple[int, str, dict]]:
    """Each arm run once per pair, in the arms' order in even pairs and reversed in odd ones (ABBA; ABC CBA
    for three), so drift on a shared machine hits every arm alike; (pair, arm, its run) in run order."""
    runs = []
    for pair in range(pairs):
        for name in list(arms) if pair % 2 == 0 else list(arms)[::-1]:
            runs.append((pair, name, arms[name]()))
    return runs


def series(runs: list[tuple[int, str, dict]]) -> dict[str, list[float]]:
    """Each arm's steps/s, pair by pair."""
    out: dict[str, list[float]] = {}
    for _, name, run in runs:
        out.setdefault(name, []).append(run["steps_per_s"])
    return out


def alternate(args: argparse.Namespace, pairs: int, arms: dict[str, dict[str, Any]]) -> dict:
    """Two arms (``run_once`` keyword arguments) in alternating pairs (``interleave``); each pair's ratio
    (first arm over second), their spread and geometric mean, whether it differs from 1 beyond its 95 %
    interval (log scale), and the ratio of medians."""
    done = interleave(pairs, {name: partial(run_once, args, **kw) for name, kw in arms.items()})
    runs = series(done)
    first, second = runs.values()
    med = {k: statistics.median(v) for k, v in runs.items()}
    return {"model": model_name(args.dim), "workers": args.workers, "seconds_per_run": args.seconds,
            "steps_per_s": runs, "median_steps_per_s": med,
            "pair_ratios": [round(a / b, 3) for a, b in zip(first, second)],
            "ratio": ratio_summary([a / b for a, b in zip(first, second)], target=1.0),
            "ratio_of_medians": round(statistics.median(first) / statistics.median(second), 3), "runs": kept(done)}


def framework_ab(args: argparse.Namespace) -> dict:
    """Torch workers against TensorFlow workers, same model, data, batch and protocol, at each of
    ``args.dims`` input features: ``alternate``'s pairs, each ratio torch / TF (> 1: torch is faster)."""
    arms = {"torch": {"framework": "torch"}, "tensorflow": {"framework": "tensorflow"}}
    return {"benchmark": "asp_steps_torch_over_tensorflow", "batch": args.batch,
            "models": [alternate(argparse.Namespace(**{**vars(args), "dim": dim}), args.framework_ab, arms)
                       for dim in args.dims]}


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
    """switchps as shipped (or ``--network``) against TF2 ParameterServerStrategy in each of
    ``args.tf_mode``'s modes, interleaved pair by pair; each mode's pair ratios (switchps / TF) and their
    summary. The peer is the mode with the higher median steps/s: its ratios are the headline, tested
    against ``args.target``."""
    modes = TF_MODES if args.tf_mode == "both" else (args.tf_mode,)
    arms: dict[str, Callable[[], dict]] = {"switchps": partial(run_once, args)}
    for mode in modes:
        arms[f"tf_{mode}"] = partial(run_peer, args.workers, args.seconds, args.tf_warmup_s, args.dim, args.batch,
                                     lr=0.05, mode=mode)
    runs = interleave(args.vs_tf, arms)
    steps = series(runs)
    ratios = {mode: [round(s / t, 3) for s, t in zip(steps["switchps"], steps[f"tf_{mode}"])] for mode in modes}
    peer = max(modes, key=lambda mode: statistics.median(steps[f"tf_{mode}"]))
    out = {"benchmark": "asp_steps_vs_tf2_ps_strategy", "model": model_name(args.dim), "workers": args.workers,
           "batch": args.batch, "seconds_per_run": args.seconds, "tf_warmup_s": args.tf_warmup_s,
           "switchps": {"authenticated": True, "checkpoint_every_s": None if args.no_checkpoint
                        else args.checkpoint_every_s, "path": "network" if args.network else "same host",
                        "shared_memory": not args.network, "cpu_binding": not args.network},
           "steps_per_s": steps, "median_steps_per_s": {k: statistics.median(v) for k, v in steps.items()},
           "tf_modes": {mode: {"ratio_switchps_over_tf": ratios[mode],
                               "ratio": ratio_summary(ratios[mode], args.target)} for mode in modes},
           "peer": f"tf_{peer}", "ratio_switchps_over_tf": ratios[peer], "ratio": ratio_summary(ratios[peer],
                                                                                                args.target)}
    if len(modes) == 2:
        user, tuned = steps["tf_user"], steps["tf_tuned"]
        out["tf_user_over_tuned"] = {"pair_ratios": [round(u / t, 3) for u, t in zip(user, tuned)],
                                     "ratio": ratio_summary([u / t for u, t in zip(user, tuned)], target=1.0)}
    out["runs"] = kept(runs)
    return out


def kept(runs: list[tuple[int, str, dict]]) -> list[dict]:
    """Each run, in run order, with its pair, its arm and the figures worth keeping (``_KEPT``)."""
    return [{"pair": pair, "who": name, **{k: run[k] for k in _KEPT if k in run}} for pair, name, run in runs]


_KEPT = ("steps_per_s", "wall_time_s", "window_s", "updates", "steps", "worker_compute_ms", "worker_round_trip_ms",
         "checkpoints", "shared_memory", "cpu_binding", "mode", "threads", "per_step_fetch", "ports_freed",
         "framework", "run_dir")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--seconds", type=float, default=20.0)
    ap.add_argument("--batch", type=int, default=32)
    ap.add_argument("--workers", type=int, default=2)
    ap.add_argument("--dim", type=int, default=784, help="input features (78400: 784,010 parameters)")
    ap.add_argument("--framework", choices=FRAMEWORKS, default="tensorflow", help="the workers' framework")
    ap.add_argument("--framework-ab", type=int, metavar="PAIRS",
                    help="alternate PAIRS runs of torch workers and of TF workers at each of --dims")
    ap.add_argument("--dims", type=int, nargs="+", default=[784, 78400], help="with --framework-ab: input features")
    ap.add_argument("--checkpoint-every-s", type=float, default=30.0, help="the PS's checkpoint interval")
    ap.add_argument("--no-checkpoint", action="store_true", help="no checkpoints at all")
    ap.add_argument("--auth-ab", type=int, metavar="PAIRS", help="compare authenticated and insecure runs")
    ap.add_argument("--insecure", action="store_true", help="one run without authentication")
    ap.add_argument("--network", action="store_true",
                    help="workers as on other hosts: pushes as gRPC bytes (no shared memory), no CPU binding")
    ap.add_argument("--shm-ab", type=int, metavar="PAIRS",
                    help="compare pushes through shared memory with pushes as gRPC bytes")
    ap.add_argument("--vs-tf", type=int, nargs="?", const=3, metavar="PAIRS",
                    help="alternate PAIRS runs of switchps and of TF2 ParameterServerStrategy (default 3)")
    ap.add_argument("--target", type=float, default=2.5,
                    help="with --vs-tf: the ratio the pairs' geometric mean is tested against (95 %% CI, log scale)")
    ap.add_argument("--tf-warmup-s", type=float, default=3.0, help="TF's steps before its measured window")
    ap.add_argument("--tf-mode", choices=("both", *TF_MODES), default="both",
                    help="with --vs-tf: TF as users run it (user), tuned to 1 thread per pool with every step "
                         "fetched (tuned), or both side by side, the faster as the peer (default)")
    ap.add_argument("--shards", type=int, nargs="+", metavar="S", help="instead: S PS shards each, alternated "
                                                                       "--pairs times (bench/shards.py)")
    ap.add_argument("--pairs", type=int, default=2, help="with --shards: rounds of every shard count")
    ap.add_argument("--pipeline-depth", type=int, choices=(0, 1), default=0, help="runtime.pipeline_depth")
    ap.add_argument("--wire-dtype", choices=("float32", "bfloat16", "float16"), default="float32",
                    help="runtime.wire_dtype")
    ap.add_argument("--pipeline-ab", type=int, metavar="PAIRS",
                    help="compare runtime.pipeline_depth 1 (a push in flight while the next step computes) with 0")
    ap.add_argument("--shard-max-mb", type=float, default=1.0, help="with --shards: runtime.shard_max_mb")
    args = ap.parse_args()
    if args.shards:
        from shards import steps as by_shards  # the sibling benchmark (bench/ is on sys.path)

        return print(dumps(by_shards(args), indent=2))
    if args.vs_tf is not None and args.vs_tf < 1:
        ap.error("--vs-tf needs at least 1 pair")
    if args.network and args.shm_ab:
        ap.error("--shm-ab compares shared memory with gRPC bytes: not with --network (gRPC bytes only)")
    if args.vs_tf:
        out = vs_tf(args)
    elif args.framework_ab:
        out = framework_ab(args)
    elif args.auth_ab:
        out = {"benchmark": "asp_steps_authenticated_over_insecure",
               **alternate(args, args.auth_ab, {"authenticated": {}, "insecure": {"insecure": True}})}
    elif args.shm_ab:
        out = {"benchmark": "asp_steps_shared_memory_over_grpc_bytes",
               **alternate(args, args.shm_ab, {"shared_memory": {}, "grpc_bytes": {"shared_memory": False}})}
    elif args.pipeline_ab:
        out = {"benchmark": "asp_steps_pipelined_over_not",
               **alternate(args, args.pipeline_ab, {"depth_1": {"pipeline_depth": 1},
                                                    "depth_0": {"pipeline_depth": 0}})}
    else:
        out = run_once(args, args.insecure)
    print(dumps(out, indent=2))


if __name__ == "__main__":
    main()
