"""The simulator at scale: the issue's three targets, and the cost of a simulated worker step as N grows.

Every case simulates the same problem (``switchps.sim.run.simulate``): an MLP (one hidden layer of 64) on
digits with ``data.sampling: replacement``, SGD at 0.05, batch 16, a device of 1,000 samples/s and the
niagara straggler mixture at scale 0.25, for ``train.steps`` updates. ``eval.every_s`` is 1e9 virtual
seconds, so the model is evaluated only at the start and at the end: evaluation is not what is measured.
No checkpoints, no link model. Each case runs in its own process (this script, re-invoked with ``--case``),
so its wall time includes nothing else and its peak RSS (``ru_maxrss``) is its own.

- targets: 1,024 workers x 500 BSP rounds with real gradients (< 300 s); 1,024 workers x 20,000 ASP
  updates with real gradients (< 300 s); 10,000 workers x 100 BSP rounds, time only (< 120 s); peak
  memory < 4 GB at 1,024 workers; and issue 46's 1,024 workers x 50 rounds of local SGD (H = 8 local
  steps, the protocol's default), time only (< 120 s). Exit 1 when one fails.
- growth: BSP at each of ``--sizes`` for about ``GROWTH_STEPS`` worker steps each (rounds = steps / N),
  time only and with real gradients.

Per case: ``wall_s`` (the whole child: interpreter, imports, TensorFlow, data, the simulation, writing
the run directory), ``sim_wall_s`` (the simulation alone, from ``summary.json``), worker steps (applied
pushes: samples / batch; under local SGD, local steps), microseconds per worker step on either clock, and
peak RSS. Prints JSON.

    python bench/sim_scale.py [--only targets|growth] [--sizes 8,64,1024,10000] [--quick]
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import shutil
import subprocess
import sys
import tempfile
import time
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

from switchps.jsonfile import dumps

BATCH = 16
SAMPLES_PER_S = 1000.0
STRAGGLERS = {"mixture": {"preset": "niagara", "scale": 0.25}}
EVAL_EVERY_S = 1e9
"""Virtual seconds between evaluations: far beyond any case's length, so only the first and last run."""
GROWTH_STEPS = 100_000
"""Worker steps per growth case (rounds = this / N, at least 1)."""
SIZES = (8, 64, 1024, 10_000)
MEMORY_LIMIT_MB = 4096.0
TIMEOUT_S = 1800.0
"""A case still running after this long is stopped and fails."""


@dataclass
class Case:
    """One simulation: its size, protocol and length, and for a target its limits."""

    name: str
    group: str
    workers: int
    protocol: str
    updates: int
    time_only: bool
    limit_s: float | None = None
    memory_limit_mb: float | None = None


def targets(quick: bool) -> list[Case]:
    """The issue's three targets. With ``quick``, at toy sizes and without their time limits: a toy case's
    wall time says nothing about its target's, only how loaded the machine is, so the quick run (the test's)
    judges what must hold at any size: every update done and the peak memory under its limit."""
    n, big = (16, 64) if quick else (1024, 10_000)
    rounds, updates, rounds_big, rounds_local = (5, 50, 5, 5) if quick else (500, 20_000, 100, 50)
    limit_s, limit_big_s = (None, None) if quick else (300.0, 120.0)
    return [Case(f"bsp_real_{n}x{rounds}", "targets", n, "bsp", rounds, False, limit_s, MEMORY_LIMIT_MB),
            Case(f"asp_real_{n}x{updates}", "targets", n, "asp", updates, False, limit_s, MEMORY_LIMIT_MB),
            Case(f"bsp_time_only_{big}x{rounds_big}", "targets", big, "bsp", rounds_big, True, limit_big_s),
            Case(f"local_sgd_time_only_{n}x{rounds_local}", "targets", n, "local_sgd", rounds_local, True,
                 limit_big_s)]


def growth(sizes: list[int], steps: int) -> list[Case]:
    """BSP at each size for about ``steps`` worker steps, time only and with real gradients."""
    cases = []
    for time_only in (True, False):
        for n in sizes:
            rounds = max(1, round(steps / n))
            kind = "time_only" if time_only else "real"
            cases.append(Case(f"bsp_{kind}_{n}x{rounds}", "growth", n, "bsp", rounds, time_only))
    return cases


def config(case: Case, out: Path) -> dict[str, Any]:
    """The raw run config of ``case`` (validated with ``parse_config(..., role="simulate")``)."""
    return {
        "name": case.name,
        "seed": 0,
        "cluster": {"workers": case.workers},
        "model": {"name": "mlp", "kwargs": {"hidden": [64]}},
        "data": {"name": "digits", "sampling": "replacement"},
        "optimizer": {"name": "sgd", "learning_rate": 0.05},
        "protocol": {"name": case.protocol, "batch": BATCH},
        "device": {"samples_per_s": SAMPLES_PER_S},
        "stragglers": STRAGGLERS,
        "train": {"steps": case.updates},
        "eval": {"every_s": EVAL_EVERY_S},
        "checkpoint": {"every_s": None},
        "output": {"dir": str(out)},
    }


def child(case: Case) -> dict[str, Any]:
    """Run ``case`` in this process (the child's side): what the parent cannot see from outside."""
    from switchps.config.run import parse_config
    from switchps.sim.run import simulate

    out = Path(tempfile.mkdtemp(prefix="switchps-simscale-"))
    try:
        cfg = parse_config(config(case, out), role="simulate")
        s = simulate(cfg, out / case.name, time_only=case.time_only, quiet=True)
    finally:
        shutil.rmtree(out, ignore_errors=True)
    return {"sim_wall_s": s["sim_wall_s"], "sim_events": s["sim_events"], "updates": s["updates"],
            "samples": s["samples"], "virtual_time_s": s["virtual_time_s"],
            "final_test_accuracy": s["final_test_accuracy"],
            "peak_rss_mb": round(resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024, 1)}


def run_case(case: Case, timeout_s: float) -> dict[str, Any]:
    """Run ``case`` in a child process and measure it; a crash or a timeout is a result too (failed)."""
    load = os.getloadavg()[0]
    cmd = [sys.executable, str(Path(__file__).resolve()), "--case", json.dumps(asdict(case))]
    t0 = time.perf_counter()
    try:
        proc = subprocess.run(cmd, capture_output=True, text=True, timeout=timeout_s)
    except subprocess.TimeoutExpired:
        return {**asdict(case), "load_1m_before": load, "error": f"timed out after {timeout_s:.0f} s",
                "pass": False}
    wall = time.perf_counter() - t0
    if proc.returncode != 0:
        return {**asdict(case), "load_1m_before": load, "wall_s": round(wall, 2),
                "error": f"exit {proc.returncode}: {proc.stderr.strip()[-2000:]}", "pass": False}
    got = json.loads(proc.stdout.strip().splitlines()[-1])
    return measured(case, got, wall, load)


def measured(case: Case, got: dict[str, Any], wall: float, load: float) -> dict[str, Any]:
    """The child's figures with the per-step costs and, for a target, its verdict."""
    steps = got["samples"] // BATCH  # every (local) step is exactly BATCH samples (BSP, ASP, local SGD; no AMB)
    result = {**asdict(case), "load_1m_before": round(load, 2), "wall_s": round(wall, 2), **got,
              "worker_steps": steps,
              "us_per_step_sim": round(got["sim_wall_s"] / steps * 1e6, 1) if steps else None,
              "us_per_step_wall": round(wall / steps * 1e6, 1) if steps else None}
    ok = got["updates"] == case.updates
    if case.limit_s is not None:
        ok = ok and wall < case.limit_s
    if case.memory_limit_mb is not None:
        ok = ok and got["peak_rss_mb"] < case.memory_limit_mb
    result["pass"] = ok
    return result


def table(results: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """Growth: per mode, each size's cost per step and its ratio to the smallest size's."""
    rows = []
    for time_only in (True, False):
        mode = [r for r in results if r["time_only"] == time_only and r.get("us_per_step_sim")]
        first = mode[0]["us_per_step_sim"] if mode else None
        for r in mode:
            rows.append({"mode": "time_only" if time_only else "real", "workers": r["workers"],
                         "rounds": r["updates"], "worker_steps": r["worker_steps"],
                         "us_per_step_sim": r["us_per_step_sim"], "us_per_step_wall": r["us_per_step_wall"],
                         "vs_smallest": round(r["us_per_step_sim"] / first, 2) if first else None,
                         "peak_rss_mb": r["peak_rss_mb"]})
    return rows


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--only", choices=("targets", "growth"), help="run one group (default: both)")
    ap.add_argument("--sizes", default=",".join(map(str, SIZES)), help="growth: worker counts, comma-separated")
    ap.add_argument("--steps", type=int, default=GROWTH_STEPS, help="growth: worker steps per case")
    ap.add_argument("--quick", action="store_true", help="toy sizes (for the test): targets at 16 and 64 "
                    "workers without time limits, growth at 4 and 16 for 200 steps")
    ap.add_argument("--timeout", type=float, default=TIMEOUT_S, help="seconds before a case is stopped (fails)")
    ap.add_argument("--case", help=argparse.SUPPRESS)  # the child: one case, as JSON
    args = ap.parse_args()
    if args.case:
        print(json.dumps(child(Case(**json.loads(args.case)))))
        return
    sizes, steps = ([4, 16], 200) if args.quick else ([int(n) for n in args.sizes.split(",")], args.steps)
    t0 = time.perf_counter()
    out: dict[str, Any] = {"benchmark": "sim_scale", "quick": args.quick, "cpus": os.cpu_count(),
                           "problem": {k: v for k, v in config(Case("", "", 0, "bsp", 0, True), Path()).items()
                                       if k in ("model", "data", "optimizer", "device", "stragglers", "eval")}}
    passed = True
    if args.only in (None, "targets"):
        out["targets"] = [run_case(c, args.timeout) for c in targets(args.quick)]
        passed = all(r["pass"] for r in out["targets"])
    if args.only in (None, "growth"):
        cases = [run_case(c, args.timeout) for c in growth(sizes, steps)]
        out["growth"] = {"steps_per_case": steps, "table": table(cases), "cases": cases}
        passed = passed and all(r["pass"] for r in cases)  # a growth case fails only if it did not finish
    out["all_pass"] = passed
    out["wall_s"] = round(time.perf_counter() - t0, 1)
    print(dumps(out, indent=2))
    sys.exit(0 if passed else 1)


if __name__ == "__main__":
    main()
