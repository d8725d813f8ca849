"""What gradient clipping costs the PS's update, side by side in one process: ms per update (``apply_update``,
the store's rule: a sum over 32 samples made a mean) of a ``--params`` vector with ``--optimizer``, without
clipping, with ``global_clip_norm`` (one read pass for the norm, the factor folded into the mean's scale) and
with ``clip_norm`` over ``--variables`` equal variables (the same read pass, plus a multiply over the variables
above the limit: the limit here binds on every one, the worst case). BLAS on one thread, as in the PS. The
arms alternate within each block (rotated by one each block); each block's median of ``--reps`` updates, and
each arm's time over no clipping's paired by block (geometric mean and 95 % t interval).

    python bench/optim_clip.py [--params 10000000] [--optimizer momentum] [--threads 1] [--blocks 6] [--reps 5]

Prints JSON.
"""

from __future__ import annotations

import argparse
import statistics
import time
from collections.abc import Callable

import numpy as np
from threadpoolctl import threadpool_limits

from switchps.jsonfile import dumps
from switchps.optim.clipping import Clip
from switchps.optim.lanes import Lanes
from switchps.optim.optimizers import apply_update, make_optimizer
from switchps.studies.stats import estimate, ratio_estimate


def updater(clip: Clip, name: str, size: int, variables: int, lanes: Lanes) -> Callable[[], float]:
    """One timed update (ms), a fresh copy of the same summed gradient each time (copied in untimed)."""
    rng = np.random.default_rng(0)
    values = rng.standard_normal(size).astype(np.float32)
    pristine = rng.standard_normal(size).astype(np.float32)  # a mean norm of ~100 over 32 samples: both limits bind
    grad = np.empty_like(pristine)
    opt = make_optimizer(name, size, 1e-6)
    opt.clip = clip
    opt.set_variables([size // variables] * (variables - 1) + [size - size // variables * (variables - 1)])

    def update() -> float:
        np.copyto(grad, pristine)
        t0 = time.perf_counter()
        for _ in apply_update(opt, values, size, grad, 32, 1, lanes=lanes):
            pass
        return (time.perf_counter() - t0) * 1e3
    return update


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--params", type=int, default=10_000_000)
    ap.add_argument("--optimizer", default="momentum")
    ap.add_argument("--variables", type=int, default=64, help="for clip_norm: equal variables")
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--blocks", type=int, default=6)
    ap.add_argument("--reps", type=int, default=5, help="updates per block (its median)")
    args = ap.parse_args()
    threadpool_limits(1, user_api="blas")  # as the PS (rpc/server.py)
    lanes = Lanes(args.threads)
    arms = {"none": Clip(), "global_clip_norm": Clip(global_norm=1.0), "clip_norm": Clip(norm=0.01)}
    run = {arm: updater(clip, args.optimizer, args.params, args.variables, lanes) for arm, clip in arms.items()}
    for each in run.values():
        each()  # warm: pages, scratch, pool threads
    names = list(arms)
    medians: dict[str, list[float]] = {arm: [] for arm in names}
    for b in range(args.blocks):
        for arm in names[b % len(names):] + names[:b % len(names)]:
            medians[arm].append(statistics.median(run[arm]() for _ in range(args.reps)))
    lanes.close()
    base = medians["none"]
    print(dumps({"params": args.params, "optimizer": args.optimizer, "variables": args.variables,
                 "threads": args.threads, "blocks": args.blocks, "reps": args.reps,
                 "arms": {arm: {"ms": estimate(ms).as_dict(),
                                "over_none": ratio_estimate([m / b for b, m in zip(base, ms)]).as_dict()}
                          for arm, ms in medians.items()}}))


if __name__ == "__main__":
    main()
