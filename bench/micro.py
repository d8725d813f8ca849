"""Per-step costs measured alone, in one process, for before/after comparisons of one change.

- ``tensorboard``: the PS's CPU time per update for its TensorBoard events, fed rows as the recorder's
  flusher hands them over (700 updates/s flushed every 0.5 s), counting every thread of the process.
- ``worker-step``: a worker's wall time per step for loading a reply's values into the model and
  computing the next gradient (logreg ``--dim``->10, batch 32, its samples named by row).
- ``segment-copies``: the PS's two copies of a push through a shared-memory segment (the gradient out,
  the reply's values in) of ``--dim``*10+10 parameters, three ways side by side, alternating in blocks
  of ``--steps`` / 40: mapped from a /dev/shm file (the segments until they were sealed), mapped from a
  sealed memory file (``protos/segment.py``), and ``os.preadv``/``os.pwritev`` on its descriptor (no
  mapping: what a PS that may not map it would pay). Each is a block's median; the ratios are paired
  by block, against the /dev/shm file's.

Run the same command with ``PYTHONPATH`` at each worktree, alternating. Prints JSON.

    python bench/micro.py tensorboard [--updates 20000]
    python bench/micro.py worker-step [--dim 784] [--steps 3000]
    python bench/micro.py segment-copies [--dim 78400] [--steps 4000]
"""

from __future__ import annotations

import argparse
import mmap
import os
import statistics
import tempfile
import time
from collections.abc import Callable
from pathlib import Path

import numpy as np

from switchps.jsonfile import dumps

FLUSH_ROWS = 350


def tensorboard(updates: int) -> dict:
    from switchps.ps_server.records import PS_COLUMNS, WORKER_COLUMNS
    from switchps.ps_server.tensorboard import TensorBoard

    ps = [dict(zip(PS_COLUMNS, (f"{i / 700:.6g}", str(i), "asp", "0", "32", "0", "0", "0.5", "0.05", "2.3", "32", "32",
                                "32", "0", "", f"0:1:{i}"))) for i in range(1, updates + 1)]
    steps = [(f"{i / 700:.6g}", str(i % 2), str(i // 2), str(i), "32", "0.0005", "0.0015", "0", "0", "2.3", "0", "")
             for i in range(updates)]
    tb = TensorBoard(Path(tempfile.mkdtemp(prefix="switchps-micro-")))
    cpu, wall = time.process_time(), time.perf_counter()
    for i in range(0, updates, FLUSH_ROWS):
        tb.updates(ps[i:i + FLUSH_ROWS])
        tb.steps(steps[i:i + FLUSH_ROWS], WORKER_COLUMNS)
        getattr(tb, "flush", lambda: None)()
    tb.close()
    return {"benchmark": "tensorboard_per_update", "updates": updates,
            "cpu_us_per_update": round((time.process_time() - cpu) / updates * 1e6, 1),
            "wall_us_per_update": round((time.perf_counter() - wall) / updates * 1e6, 1)}


def worker_step(dim: int, steps: int) -> dict:
    import keras

    from switchps.protos.heap import tune_allocator
    from switchps.workload.tensorflow.gradients import GradientComputer
    from switchps.workload.tensorflow.setup import configure_threads

    configure_threads(1, 1)  # as a worker runs
    tune_allocator()  # as a worker's client does
    x = np.random.default_rng(0).random((256, dim), np.float32)
    y = (np.arange(256) % 10).astype(np.int32)
    gc = GradientComputer(keras.Sequential([keras.Input((dim,)), keras.layers.Dense(10)]), x, y)
    gc.warm_up(32, 32)
    values = gc.buffer()  # as the worker's reply buffer (or its segment): TF reads it in place
    values[:] = gc.weights.read()
    gc.payload_to = gc.buffer()  # as the worker's segment's gradient area

    def step(i: int) -> None:
        gc.stage(values)
        gc.compute(np.arange(i % 8 * 32, (i % 8 + 1) * 32), 32)

    for i in range(50):
        step(i)
    t0 = time.perf_counter()
    for i in range(steps):
        step(i)
    return {"benchmark": "worker_load_and_gradient", "dim": dim,
            "ms_per_step": round((time.perf_counter() - t0) / steps * 1e3, 4)}


def segment_copies(dim: int, steps: int, blocks: int = 40) -> dict:
    from switchps.protos.segment import HEADER, Segment, _area, file_bytes, sealed_nonce
    from switchps.studies.stats import estimate, paired_ratio

    n = dim * 10 + 10
    nbytes = 4 * n
    fd, path = tempfile.mkstemp(dir="/dev/shm")
    os.unlink(path)
    os.posix_fallocate(fd, 0, file_bytes(nbytes))
    named = Segment(b"", nbytes, mmap.mmap(fd, file_bytes(nbytes)))
    made = Segment.create(nbytes)
    sealed = Segment.adopt(made.fd, sealed_nonce(made.fd), nbytes)
    grad, values = np.empty(n, np.float32), np.random.default_rng(0).random(n, np.float32)
    into, out_of = grad.data.cast("B"), values.data.cast("B")

    def mapped(segment: Segment) -> Callable[[], None]:
        def copies() -> None:
            np.copyto(grad, segment.grad)
            np.copyto(segment.values, values)
        return copies

    def positioned() -> None:
        assert os.preadv(made.fd, [into], HEADER) == nbytes
        assert os.pwritev(made.fd, [out_of], HEADER + _area(nbytes)) == nbytes

    ways: dict[str, Callable[[], None]] = {"dev_shm_mapped": mapped(named), "memfd_sealed_mapped": mapped(sealed),
                                           "memfd_preadv_pwritev": positioned}
    medians: dict[str, list[float]] = {way: [] for way in ways}
    for block in range(blocks + 1):
        for way, copy in ways.items():
            times = []
            for _ in range(max(steps // blocks, 1)):
                t0 = time.perf_counter()
                copy()
                times.append(time.perf_counter() - t0)
            if block:  # the first block warms up
                medians[way].append(statistics.median(times) * 1e6)
    os.close(fd)
    made.close_fd()
    base = medians["dev_shm_mapped"]
    return {"benchmark": "segment_copies", "parameters": n, "blocks": blocks,
            "us_per_push": {way: estimate(m).text(".1f") for way, m in medians.items()},
            "time_x_dev_shm_mapped": {way: paired_ratio(m, base).text(4) for way, m in medians.items()
                                      if m is not base}}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("what", choices=["tensorboard", "worker-step", "segment-copies"])
    ap.add_argument("--updates", type=int, default=20000)
    ap.add_argument("--dim", type=int, default=784)
    ap.add_argument("--steps", type=int, default=3000)
    args = ap.parse_args()
    out = (tensorboard(args.updates) if args.what == "tensorboard" else worker_step(args.dim, args.steps)
           if args.what == "worker-step" else segment_copies(args.dim, args.steps))
    print(dumps(out))


if __name__ == "__main__":
    main()
