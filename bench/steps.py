"""ASP steps per second: 784->10 logistic regression, 2 workers + 1 PS, real TF gradients.

Runs the real launcher (separate PS, evaluator and worker processes on
loopback) for a fixed wall time and reads the run record. For reference, TF2
ParameterServerStrategy did 328 steps/s for the same model on this kind of
machine (see REFERENCE.md). Prints JSON.

    python bench/steps.py [--seconds 20] [--batch 32] [--checkpoint-every-s 5 | --no-checkpoint]
"""

from __future__ import annotations

import argparse
import csv
import tempfile

from switchps.config import parse_config
from switchps.jsonfile import dumps
from switchps.launcher import launch

TF2_PS_STRATEGY_STEPS_PER_S = 328


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--seconds", type=float, default=20.0)
    ap.add_argument("--batch", type=int, default=32)
    ap.add_argument("--workers", type=int, default=2)
    ap.add_argument("--checkpoint-every-s", type=float, default=30.0, help="the PS's checkpoint interval")
    ap.add_argument("--no-checkpoint", action="store_true", help="no checkpoints at all")
    args = ap.parse_args()
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
    })
    run_dir, summary = launch(cfg, quiet=True)
    with (run_dir / "workers.csv").open() as f:
        steps = list(csv.DictReader(f))
    mean = lambda key: sum(float(r[key]) for r in steps) / len(steps)  # noqa: E731
    steps_per_s = summary["updates"] / summary["wall_time_s"]
    print(dumps({
        "benchmark": "asp_steps", "model": "logreg 784->10 (7,850 parameters)", "workers": args.workers,
        "batch": args.batch, "wall_time_s": summary["wall_time_s"], "updates": summary["updates"],
        "steps_per_s": round(steps_per_s, 1),
        "vs_tf2_parameter_server_strategy": round(steps_per_s / TF2_PS_STRATEGY_STEPS_PER_S, 2),
        "worker_compute_ms": round(1e3 * mean("compute_s"), 3), "worker_round_trip_ms": round(1e3 * mean("send_s"), 3),
        "final_test_accuracy": summary["final_test_accuracy"], "checkpoints": summary["checkpoints"],
        "run_dir": str(run_dir),
    }, indent=2))


if __name__ == "__main__":
    main()
