"""The simulator against closed forms: seconds per update, staleness and batch at 8, 64 and 1,024 workers.

Every step takes c + Exp(mu): the ``shifted_exponential`` straggler on a device of negligible compute
(one sample at 1e9 samples/s; AMB's micro-batches take T/20 each), no communication time. Each case is
simulated in time-only mode (``switchps.sim.run.simulate``) for enough updates that the standard error
of the measured mean is ``--se`` of the formula (0.5 %, a quarter of the 2 % tolerance), planned from
each formula's own variance. From ps.csv, after a warm-up: the mean seconds per update (time_s
differences), the mean staleness and the mean samples per update, each with a batch-means standard
error (20 batches), against ``switchps.closed_forms``:

- bsp: c + H_N/mu (FMB is the same rule: BSP's row covers it);
- backup (N/4 backup workers, c = 0): switchps's rule, whose late workers finish their step and lose
  it, by a Markov chain (the paper's K-sync value, where they start afresh, is printed beside it);
- kasync (K = N/4, c = 0): K/(N mu); asp: mean staleness N - 1;
- amb (T = BSP's mean round): E[max over workers of each one's push time], and the mean batch;
- local_sgdH (H = 1, 4, 16 local steps a round, each c + Exp(mu)): H c + E[max of N Gamma(H, mu)].
Prints JSON; exits 1 when a case fails. ``--plan`` prints the plan without simulating.

    python bench/sim_validation.py [--sizes 8,64,1024] [--cases bsp,backup,kasync,asp,amb,local_sgd4] [--se 0.005]
"""

from __future__ import annotations

import argparse
import csv
import math
import shutil
import sys
import tempfile
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

import numpy as np

from switchps import closed_forms as cf
from switchps.config.protocol import MEMBERS
from switchps.config.run import RunConfig, parse_config
from switchps.jsonfile import dumps
from switchps.sim.run import simulate

MU = 1.0
"""The exponential part's rate, per second."""
SHIFT_S = 0.5
"""c where the formula allows it; backup and kasync use c = 0."""
FAST = 1e9
"""samples/s of the device outside AMB: a one-sample step computes for 1e-9 s (added to c)."""
AMB_MICRO_PER_T = 20
"""AMB: micro-batches (of one sample) per budget T."""
TOLERANCE = 0.02
BATCHES = 20
"""Batch means: the standard error of a correlated series from the spread of 20 consecutive means."""
MIN_UPDATES = 200
CASES = ("bsp", "backup", "kasync", "asp", "amb", "local_sgd1", "local_sgd4", "local_sgd16")


@dataclass
class Case:
    """One simulation: its config's protocol part, what it measures, and how long it runs."""

    name: str
    workers: int
    protocol: dict[str, Any]
    shift_s: float
    samples_per_s: float
    expected: dict[str, float]
    """metric -> the formula's value."""
    warmup: int
    updates: int
    """Updates measured after the warm-up."""
    pushes_per_update: int
    """To size the run: worker steps = pushes_per_update x (warmup + updates) (local steps: each one counts)."""
    reference: dict[str, float] = field(default_factory=dict)
    """Figures printed beside the comparison (parameters, the paper's value)."""


def updates_for(cv: float, se: float, least: int = MIN_UPDATES) -> int:
    """Updates whose mean has relative standard error ``se`` when one update's is ``cv`` (``least`` at least)."""
    return max(least, math.ceil((cv / se) ** 2))


def plan(name: str, n: int, se: float, least: int = MIN_UPDATES) -> Case:
    """The case ``name`` at ``n`` workers, with the formula's values and a run long enough for ``se``
    (at least ``least`` updates measured, for the batch means; ASP plans its own length)."""
    c = SHIFT_S + 1 / FAST
    if name == "bsp":
        mean = cf.bsp_update_s(n, c, MU)
        return Case(name, n, {"name": "bsp"}, SHIFT_S, FAST, {"seconds_per_update": mean}, 20,
                    updates_for(cf.bsp_update_sd(n, MU) / mean, se, least), n)
    if name == "backup":  # c = 0 but for the 1e-9 s of compute, which the formula ignores
        b = n // 4
        mean, var = cf.backup_late_finish_moments(n, b, MU)
        return Case(name, n, {"name": "bsp", "backup_workers": b}, 0.0, FAST, {"seconds_per_update": mean}, 20,
                    updates_for(math.sqrt(var) / mean, se, least), n,
                    {"backup_workers": b, "paper_k_sync_s": cf.backup_update_s(n, b, 0.0, MU)})
    if name == "kasync":  # Poisson pushes: an update's time is Gamma(K, N mu), cv 1/sqrt(K)
        k = n // 4
        return Case(name, n, {"name": "kasync", "k": k}, 0.0, FAST,
                    {"seconds_per_update": cf.kasync_update_s(n, k, MU, c=1 / FAST)}, max(20, 10 * n // k),
                    updates_for(1 / math.sqrt(k), se, least), k, {"k": k})
    if name == "asp":  # the total staleness is conserved (see cf.asp_mean_staleness): sqrt(8N)/se pushes
        return Case(name, n, {"name": "asp"}, SHIFT_S, FAST, {"mean_staleness": cf.asp_mean_staleness(n)}, 10 * n,
                    max(20 * n, math.ceil(math.sqrt(8 * n) / se)), 1)
    if name == "amb":
        return _amb(n, se, least)
    if name.startswith("local_sgd") and name.removeprefix("local_sgd").isdigit():
        h = int(name.removeprefix("local_sgd"))  # a round: H local steps of c + Exp(mu) each, then one push
        mean = cf.local_sgd_round_s(n, h, c, MU)
        return Case(name, n, {"name": "local_sgd", "local_steps": h}, SHIFT_S, FAST, {"seconds_per_update": mean},
                    20, updates_for(cf.local_sgd_round_sd(n, h, MU) / mean, se, least), n * h, {"local_steps": h})
    raise ValueError(f"unknown case {name!r}; expected one of {', '.join(CASES)}")


def _amb(n: int, se: float, least: int) -> Case:
    """AMB with T = BSP's mean round under the same stragglers (the AMB paper's comparison)."""
    budget = cf.bsp_update_s(n, SHIFT_S, MU)
    micro = budget / AMB_MICRO_PER_T
    mean, batch = cf.amb_update_s(n, SHIFT_S, MU, budget, micro), cf.amb_mean_batch(n, SHIFT_S, MU, budget, micro)
    # a worker's micro-batch count is 1/micro-Lipschitz in its sleep (plus rounding): sd <= 1/(mu micro) + 1
    batch_cv = (1 / (MU * micro) + 1) * math.sqrt(n) / batch
    cv = max(cf.amb_update_sd(n, SHIFT_S, MU, budget, micro) / mean, batch_cv)
    protocol = {"name": "amb", "time_budget_s": budget, "micro_batch": 1, "max_batch": 2 * AMB_MICRO_PER_T + 2}
    return Case("amb", n, protocol, SHIFT_S, 1 / micro, {"seconds_per_update": mean, "mean_batch": batch}, 20,
                updates_for(cv, se, least), n, {"time_budget_s": budget, "micro_batch_s": micro})


def build_config(case: Case, seed: int, out: Path) -> RunConfig:
    """The run config of ``case``: a small synthetic problem (time-only runs compute no gradient)."""
    name = case.protocol.get("name", "bsp")  # a protocol with a deadline never hits it
    never = {"deadline_s": 1e6} if "deadline_s" in MEMBERS[name].model_fields else {}
    return parse_config({
        "name": f"simval-{case.name}-{case.workers}",
        "seed": seed,
        "cluster": {"workers": case.workers},
        "model": {"name": "logreg"},
        "data": {"name": "synthetic", "num_samples": 1000, "num_features": 4, "num_classes": 2,
                 "sampling": "replacement"},  # 1,024 workers cannot each have a partition of 800 samples
        "protocol": {"batch": 1, **never, **case.protocol},
        "train": {"steps": case.warmup + case.updates + 1},
        "device": {"samples_per_s": case.samples_per_s},
        "stragglers": {"shifted_exponential": {"shift_s": case.shift_s, "rate_per_s": MU}},
        "checkpoint": {"every_s": None},
        "output": {"dir": str(out)},
    }, role="simulate")


def read_ps(path: Path) -> dict[str, np.ndarray]:
    """ps.csv's time_s, staleness_mean and samples columns, one row per update."""
    with path.open(newline="") as f:
        rows = list(csv.DictReader(f))
    return {k: np.array([float(r[k]) for r in rows]) for k in ("time_s", "staleness_mean", "samples")}


def batch_mean(x: np.ndarray, batches: int = BATCHES) -> tuple[float, float]:
    """(mean, standard error) of a series that may be correlated: the spread of ``batches`` consecutive
    means (the oldest values that do not fill a batch are left out of the error, not of the mean)."""
    size = len(x) // batches
    if size < 2:
        raise ValueError(f"{len(x)} values are too few for {batches} batches")
    means = x[len(x) - size * batches:].reshape(batches, size).mean(axis=1)
    return float(x.mean()), float(means.std(ddof=1) / math.sqrt(batches))


def measure(ps: dict[str, np.ndarray], warmup: int) -> dict[str, tuple[float, float]]:
    """(mean, standard error) of each metric over the updates after ``warmup``."""
    return {"seconds_per_update": batch_mean(np.diff(ps["time_s"][warmup:])),
            "mean_staleness": batch_mean(ps["staleness_mean"][warmup + 1:]),
            "mean_batch": batch_mean(ps["samples"][warmup + 1:])}


def compare(expected: dict[str, float], measured: dict[str, tuple[float, float]]) -> dict[str, dict[str, Any]]:
    """Per metric: the formula, the simulated mean, the relative error and standard error, and the verdict."""
    out = {}
    for metric, formula in expected.items():
        mean, se = measured[metric]
        error = mean / formula - 1
        out[metric] = {"formula": formula, "simulated": mean, "rel_error": error, "rel_se": se / formula,
                       "pass": abs(error) <= TOLERANCE}
    return out


def run_case(case: Case, seed: int, out: Path, simulate: Callable[..., dict[str, Any]]) -> dict[str, Any]:
    """Simulate ``case`` in ``out``, read its ps.csv and compare it with the formulas."""
    cfg = build_config(case, seed, out)
    run_dir = out / cfg.name
    run_dir.mkdir(parents=True)
    t0 = time.perf_counter()
    simulate(cfg, run_dir, time_only=True, quiet=True)
    wall = time.perf_counter() - t0
    ps = read_ps(run_dir / "ps.csv")
    result = compare(case.expected, measure(ps, case.warmup))
    return {**describe(case), "rows": len(ps["time_s"]), "wall_s": round(wall, 2), "metrics": result,
            "pass": all(m["pass"] for m in result.values())}


def describe(case: Case) -> dict[str, Any]:
    """``case`` as JSON, with the worker steps it simulates."""
    d = asdict(case)
    return {"case": d.pop("name"), **d, "worker_steps": case.pushes_per_update * (case.warmup + case.updates)}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--sizes", default="8,64,1024", help="worker counts, comma-separated")
    ap.add_argument("--cases", default=",".join(CASES), help=f"comma-separated, of {', '.join(CASES)}")
    ap.add_argument("--se", type=float, default=0.005, help="target relative standard error of each mean")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--plan", action="store_true", help="print the planned cases without simulating")
    ap.add_argument("--keep", metavar="DIR", help="write the run directories here and keep them")
    args = ap.parse_args()
    cases = [plan(name, int(n), args.se) for n in args.sizes.split(",") for name in args.cases.split(",")]
    if args.plan:
        planned = [describe(c) for c in cases]
        print(dumps({"benchmark": "sim_validation_plan", "worker_steps": sum(c["worker_steps"] for c in planned),
                     "cases": planned}, indent=2))
        return
    out = Path(args.keep) if args.keep else Path(tempfile.mkdtemp(prefix="switchps-simval-"))
    t0 = time.perf_counter()
    try:
        results = [run_case(c, args.seed, out, simulate) for c in cases]
    finally:
        if not args.keep:
            shutil.rmtree(out, ignore_errors=True)
    passed = all(r["pass"] for r in results)
    print(dumps({"benchmark": "sim_validation", "mu_per_s": MU, "tolerance": TOLERANCE, "target_rel_se": args.se,
                 "all_pass": passed, "wall_s": round(time.perf_counter() - t0, 1), "cases": results}, indent=2))
    sys.exit(0 if passed else 1)


if __name__ == "__main__":
    main()
