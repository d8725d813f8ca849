"""Two per-step costs measured alone, in one process, for before/after comparisons of one change.

- ``tensorboard``: the PS's CPU time per update for its TensorBoard events, fed rows as the recorder's
  flusher hands them over (700 updates/s flushed every 0.5 s), counting every thread of the process.
- ``worker-step``: a worker's wall time per step for loading a reply's values into the model and
  computing the next gradient (logreg ``--dim``->10, batch 32, its samples named by row).

Run the same command with ``PYTHONPATH`` at each worktree, alternating. Prints JSON.

    python bench/micro.py tensorboard [--updates 20000]
    python bench/micro.py worker-step [--dim 784] [--steps 3000]
"""

from __future__ import annotations

import argparse
import tempfile
import time
from pathlib import Path

import numpy as np

from switchps.jsonfile import dumps

FLUSH_ROWS = 350


def tensorboard(updates: int) -> dict:
    from switchps.ps_server.records import PS_COLUMNS, WORKER_COLUMNS
    from switchps.ps_server.tensorboard import TensorBoard

    ps = [dict(zip(PS_COLUMNS, (f"{i / 700:.6g}", str(i), "asp", "0", "32", "0", "0.5", "0.05", "2.3", "32", "32",
                                "32", "0", "", f"0:1:{i}"))) for i in range(1, updates + 1)]
    steps = [(f"{i / 700:.6g}", str(i % 2), str(i // 2), str(i), "32", "0.0005", "0.0015", "0", "0", "2.3")
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

    from switchps.protos.codec import tune_allocator
    from switchps.worker.gradients import GradientComputer
    from switchps.worker.setup import configure_threads

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


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("what", choices=["tensorboard", "worker-step"])
    ap.add_argument("--updates", type=int, default=20000)
    ap.add_argument("--dim", type=int, default=784)
    ap.add_argument("--steps", type=int, default=3000)
    args = ap.parse_args()
    out = tensorboard(args.updates) if args.what == "tensorboard" else worker_step(args.dim, args.steps)
    print(dumps(out))


if __name__ == "__main__":
    main()
