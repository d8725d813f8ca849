"""ASP steps per second: 784->10 logistic regression, 2 workers + 1 PS, real TF gradients.

Runs the real launcher (separate PS, evaluator and worker processes on
loopback) for a fixed wall time and reads the run record. For reference, TF2
ParameterServerStrategy did 328 steps/s for the same model on this kind of
machine (see REFERENCE.md). Prints JSON.

    python bench/steps.py [--seconds 20] [--batch 32] [--checkpoint-every-s 5 | --no-checkpoint]
    python bench/steps.py --auth-ab 3    # 3 pairs of runs, authenticated (the default) vs insecure, alternating
"""

from __future__ import annotations

import argparse
import csv
import statistics
import tempfile

from switchps.config import parse_config
from switchps.jsonfile import dumps
from switchps.launcher import launch

TF2_PS_STRATEGY_STEPS_PER_S = 328


def run_once(args: argparse.Namespace, insecure: bool = False) -> dict:
    """One launcher run for ``args.seconds``; its steps/s and the figures behind it."""
    out = tempfile.mkdtemp(prefix="switchps-steps-")
    cfg = parse_config({
        "name": "steps-bench",
        "cluster": {"workers": args.workers},
        "model": {"name": "logreg"},
        "data": {"name": "synthetic", "num_samples": 20000, "num_features": 784, "num_classes": 10},
        "optimizer": {"name": "sgd", "learning_rate": 0.05},
        "protocol": {"name": "asp", "batch": args.batch},
        "train": {"seconds": args.seconds},
        "eval": {"every_s": 5.0},
        "output": {"dir": out},
        "checkpoint": {"every_s": None if args.no_checkpoint else args.checkpoint_every_s},
        "security": {"insecure": insecure},
    })
    run_dir, summary = launch(cfg, quiet=True)
    with (run_dir / "workers.csv").open() as f:
        steps = list(csv.DictReader(f))
    mean = lambda key: sum(float(r[key]) for r in steps) / len(steps)  # noqa: E731
    steps_per_s = summary["updates"] / summary["wall_time_s"]
    return {
        "benchmark": "asp_steps", "model": "logreg 784->10 (7,850 parameters)", "workers": args.workers,
        "batch": args.batch, "authenticated": not insecure, "wall_time_s": summary["wall_time_s"],
        "updates": summary["updates"], "steps_per_s": round(steps_per_s, 1),
        "vs_tf2_parameter_server_strategy": round(steps_per_s / TF2_PS_STRATEGY_STEPS_PER_S, 2),
        "worker_compute_ms": round(1e3 * mean("compute_s"), 3), "worker_round_trip_ms": round(1e3 * mean("send_s"), 3),
        "final_test_accuracy": summary["final_test_accuracy"], "checkpoints": summary["checkpoints"],
        "rejections": summary["rejections"], "run_dir": str(run_dir),
    }


def auth_ab(args: argparse.Namespace) -> dict:
    """Authenticated and insecure runs alternating, so drift hits both alike; the ratio of medians."""
    runs: dict[str, list[float]] = {"authenticated": [], "insecure": []}
    for _ in range(args.auth_ab):
        for name in runs:
            runs[name].append(run_once(args, insecure=name == "insecure")["steps_per_s"])
    med = {k: statistics.median(v) for k, v in runs.items()}
    return {"benchmark": "asp_steps_auth", "seconds_per_run": args.seconds, "steps_per_s": runs,
            "median_steps_per_s": med, "authenticated_vs_insecure": round(med["authenticated"] / med["insecure"], 3)}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--seconds", type=float, default=20.0)
    ap.add_argument("--batch", type=int, default=32)
    ap.add_argument("--workers", type=int, default=2)
    ap.add_argument("--checkpoint-every-s", type=float, default=30.0, help="the PS's checkpoint interval")
    ap.add_argument("--no-checkpoint", action="store_true", help="no checkpoints at all")
    ap.add_argument("--auth-ab", type=int, metavar="PAIRS", help="compare authenticated and insecure runs")
    ap.add_argument("--insecure", action="store_true", help="one run without authentication")
    args = ap.parse_args()
    print(dumps(auth_ab(args) if args.auth_ab else run_once(args, args.insecure), indent=2))


if __name__ == "__main__":
    main()
