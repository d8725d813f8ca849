"""What checkpoints cost a 100 MB model: the apply path held, the write, and pushes side by side.

A real PS on loopback (momentum SGD, so the checkpoint also holds a 100 MB velocity) takes ASP pushes of
a 100 MB gradient from one NumPy client, first with checkpoints off, then with a checkpoint due after
every update (the worst case: one is always being written), alternating ``--rounds`` times. Reports
the push round trip (median) of each, their ratio, and from the checkpointer: how long the applier was
held copying the model (the only stall) and how long a write took. Prints JSON.

    python bench/checkpoint_cost.py [--mb 100] [--pushes 12] [--rounds 2]
"""

from __future__ import annotations

import argparse
import statistics
import tempfile
import time
from pathlib import Path

import numpy as np

from switchps.config.run import parse_config
from switchps.jsonfile import dumps
from switchps.protos import switchps_pb2 as pb
from switchps.protos.layout import make_layout
from switchps.ps_server.rpc.main import build_ps, prepare_run_dir
from switchps.ps_server.rpc.server import Server
from switchps.worker.client import PSClient


def pushes(out: Path, size: int, n: int, every_updates: int | None) -> tuple[list[float], dict]:
    """Median-ready push round trips (s) and the checkpointer's summary for one PS."""
    cfg = parse_config({"cluster": {"workers": 1, "startup_timeout_s": 5}, "protocol": {"name": "asp"},
                        "optimizer": {"name": "momentum", "learning_rate": 0.01}, "train": {"steps": 10**6},
                        "checkpoint": {"every_updates": every_updates, "every_s": None, "keep": 1}})
    ps = build_ps(cfg, out, prepare_run_dir(cfg, out, False))
    server = Server(ps, "127.0.0.1:0")
    client = PSClient(f"127.0.0.1:{server.port}", timeout_s=600)
    layout = make_layout([("w", (size,))], [])
    params = np.zeros(size, np.float32)
    try:
        client.register(0, layout, partition_size=100)
        client.init(0, layout, params)
        version = client.pull(params, worker=0, wait_initialized=True).order.version
        grad = np.full(size, 1e-3, np.float32)
        times = []
        for step in range(n):
            header = pb.PushHeader(worker=0, base_version=version, samples=1, layout_digest=layout.digest,
                                   session=1, stats=pb.StepStats(step=step))
            t0 = time.perf_counter()
            version = client.push(header, grad, params).order.version
            times.append(time.perf_counter() - t0)
        if ps.checkpointer is not None:
            ps.checkpointer.wait(600)
        return times[2:], ps.checkpointer.stats.summary() if ps.checkpointer else {}
    finally:
        client.close()
        server.stop(grace=None)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--mb", type=float, default=100.0)
    ap.add_argument("--pushes", type=int, default=12)
    ap.add_argument("--rounds", type=int, default=2)
    args = ap.parse_args()
    size = int(args.mb * 2**20 / 4)
    off: list[float] = []
    on: list[float] = []
    stats = []
    with tempfile.TemporaryDirectory(prefix="switchps-ckpt-") as tmp:
        for r in range(args.rounds):
            off += pushes(Path(tmp) / f"off{r}", size, args.pushes, None)[0]
            times, s = pushes(Path(tmp) / f"on{r}", size, args.pushes, 1)
            on += times
            stats.append(s)
    med_off, med_on = statistics.median(off), statistics.median(on)
    print(dumps({
        "benchmark": "checkpoint_cost", "model_mb": args.mb, "optimizer": "momentum (checkpoint holds 2x the model)",
        "push_round_trip_ms": {"checkpoints_off": round(1e3 * med_off, 1), "checkpoint_every_update": round(1e3 * med_on, 1)},
        "ratio_on_vs_off": round(med_on / med_off, 3),
        "apply_path_held_ms": {"median": round(1e3 * statistics.median(s["median_held_s"] for s in stats), 1),
                               "max": round(1e3 * max(s["max_held_s"] for s in stats), 1)},
        "write_s_max": max(s["max_write_s"] for s in stats),
        "checkpoints_written": sum(s["written"] for s in stats), "deferred": sum(s["deferred"] for s in stats),
    }, indent=2))


if __name__ == "__main__":
    main()
