"""The PS's apply on 1 and more threads (``runtime.ps_threads``), side by side: ms per update of a
ResNet-18-sized model (11.2M float32 parameters, 42.7 MB) as the store's applier runs it, the new
version's chunks copied out as the blocks finish (``Snapshot.ready``), with BLAS on one thread as in the
PS (``--no-publish``: the update alone); and ``join``, adding one push into a sum (BSP's joins). The
thread counts alternate in blocks (ABBA: each block runs them in order, the next in reverse); each
block's median of ``--reps`` updates, and one thread's time over n threads' paired by block (the
speedup: its geometric mean and 95 % t interval).

    python bench/apply.py [--work sgd momentum adam join] [--threads 1 2] [--params 11173962]
                          [--blocks 8] [--reps 5] [--no-publish]

Prints JSON.
"""

from __future__ import annotations

import argparse
import os
import statistics
import time
from collections.abc import Callable

import numpy as np
from threadpoolctl import threadpool_limits

from switchps.jsonfile import dumps
from switchps.protos.codec import DEFAULT_CHUNK_BYTES
from switchps.optim.lanes import Lanes
from switchps.optim.optimizers import apply_update, make_optimizer
from switchps.ps_server.snapshot import Snapshot
from switchps.ps_server.sums import Sums
from switchps.studies.stats import estimate, ratio_estimate

RESNET18_PARAMS = 11_173_962
"""ResNet-18 with a CIFAR stem: 42.7 MiB of float32 (issue 45's model)."""


def updater(work: str, size: int, lanes: Lanes, publish: bool = True) -> Callable[[], float]:
    """One timed update (ms) of ``work`` on ``lanes``: a fresh gradient each time (copied in untimed); with
    ``publish``, the new version's chunks copied out as the store's applier does."""
    rng = np.random.default_rng(0)
    values = rng.standard_normal(size).astype(np.float32)
    pristine = (rng.standard_normal(size) * 1e-3).astype(np.float32)
    grad = np.empty_like(pristine)
    if work == "join":
        sums = Sums()

        def join() -> float:
            sums.open[0] = values  # the sum the push joins
            np.copyto(grad, pristine)
            t0 = time.perf_counter()
            sums.join(0, grad, lanes)
            return (time.perf_counter() - t0) * 1e3
        return join
    opt = make_optimizer(work, size, 1e-3)

    def update() -> float:
        np.copyto(grad, pristine)
        snap = Snapshot(1, values.nbytes, DEFAULT_CHUNK_BYTES)
        t0 = time.perf_counter()
        for _ in apply_update(opt, values, size, grad, 32, 1, lanes=lanes,
                              done=(lambda lo, hi: snap.ready(values, lo, hi)) if publish else None):
            pass
        return (time.perf_counter() - t0) * 1e3
    return update


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--work", nargs="+", default=["sgd", "momentum", "adam", "join"])
    ap.add_argument("--threads", type=int, nargs="+", default=[1, 2])
    ap.add_argument("--params", type=int, default=RESNET18_PARAMS)
    ap.add_argument("--blocks", type=int, default=8, help="per thread count (even: ABBA pairs)")
    ap.add_argument("--reps", type=int, default=5, help="updates per block (its median)")
    ap.add_argument("--no-publish", dest="publish", action="store_false", help="time the update alone")
    args = ap.parse_args()
    threadpool_limits(1, user_api="blas")  # as the PS (rpc/server.py)
    lanes = {n: Lanes(n) for n in args.threads}
    out: dict[str, object] = {"params": args.params, "mb": args.params * 4 / 1e6,
                              "cores": len(os.sched_getaffinity(0)), "threads": args.threads, "blocks": args.blocks,
                              "reps": args.reps, "publish": args.publish, "work": {}}
    for work in args.work:
        run = {n: updater(work, args.params, lanes[n], args.publish) for n in args.threads}
        for n in args.threads:
            run[n]()  # warm: pages, scratch, pool threads
        medians: dict[int, list[float]] = {n: [] for n in args.threads}
        for b in range(args.blocks):
            for n in args.threads if b % 2 == 0 else args.threads[::-1]:
                medians[n].append(statistics.median(run[n]() for _ in range(args.reps)))
        base = medians[args.threads[0]]
        out["work"][work] = {  # type: ignore[index]
            str(n): {"ms": estimate(ms).as_dict(),
                     "speedup": ratio_estimate([b / m for b, m in zip(base, ms)]).as_dict()}
            for n, ms in medians.items()}
    for each in lanes.values():
        each.close()
    print(dumps(out))


if __name__ == "__main__":
    main()
