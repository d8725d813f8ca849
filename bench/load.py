"""Many clients: N ASP workers pushing the small model (784->10, 7,850 parameters) as fast as they can.

One PS process as shipped (authenticated, checkpointing every 30 s) and ``--procs`` client processes of
``--clients / --procs`` threads each. Every thread is a worker with its own channel and token: it pushes a
gradient, takes the reply's values and pushes again at once (no compute between, so the PS is the only
limit). Every push's round trip is timed; after ``--warmup-s`` of pushing, the window of ``--seconds``
that every client spans gives pushes/s and round-trip percentiles (ms). Prints JSON.

    python bench/load.py [--clients 64] [--procs 4] [--seconds 40] [--warmup-s 5]
"""

from __future__ import annotations

import argparse
import json
import os
import secrets
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

import numpy as np

from switchps.security import auth
from switchps.address import free_port
from switchps.security.channels import ClientSecurity, ServerSecurity
from switchps.jsonfile import dumps
from switchps.protos import switchps_pb2 as pb
from switchps.protos.layout import make_layout
from switchps.worker.client import PSClient, wait_for_ps

SECRET_ENV = "SWITCHPS_BENCH_SECRET"  # the secret reaches the other processes by environment, never argv
LAYOUT = make_layout([("logits/kernel", (784, 10)), ("logits/bias", (10,))])
SIZE = 7850
BATCH = 32


def serve_ps(port: int, workers: int) -> None:
    """A PS for ``workers`` ASP workers, as ``switchps run`` builds it; serves until killed."""
    from switchps.config.run import parse_config
    from switchps.ps_server.rpc.main import build_ps
    from switchps.ps_server.rpc.server import Server

    run_dir = Path(tempfile.mkdtemp(prefix="switchps-load-"))
    cfg = parse_config({"cluster": {"workers": workers}, "protocol": {"name": "asp", "batch": BATCH},
                        "optimizer": {"name": "sgd", "learning_rate": 1e-3}, "train": {"steps": 10**9},
                        "checkpoint": {"every_s": 30.0}, "output": {"dir": str(run_dir)}})
    server = Server(build_ps(cfg, run_dir), f"127.0.0.1:{port}", ServerSecurity(os.environ[SECRET_ENV].encode()))
    threading.Event().wait()  # serve until killed (an unreferenced server would be collected, and stop)
    server.stop()


def push_loop(address: str, worker: int, seconds: float, out: list[tuple[float, float]]) -> None:
    """Worker ``worker``: register (the first one in sends the initial values), wait for the start, then
    push for ``seconds``; appends (monotonic end time, round trip s) per push to ``out``."""
    token = auth.token(os.environ[SECRET_ENV].encode(), "worker", worker)
    client = PSClient(address, security=ClientSecurity(token))
    if client.register(worker, LAYOUT, partition_size=1000).send_init:
        client.init(worker, LAYOUT, np.zeros(SIZE, np.float32))
    params = np.empty(SIZE, np.float32)
    order = client.pull(params, worker=worker, wait_initialized=True).order
    grad = np.random.default_rng(worker).normal(0, 1e-3, SIZE).astype(np.float32)
    session, step, end = secrets.randbits(31), 0, time.monotonic() + seconds
    while not order.stop and time.monotonic() < end:
        header = pb.PushHeader(worker=worker, base_version=order.version, samples=BATCH, session=session,
                               layout_digest=LAYOUT.digest, stats=pb.StepStats(step=step))
        t0 = time.monotonic()
        order = client.push(header, grad, params).order
        t1 = time.monotonic()
        out.append((t1, t1 - t0))
        step += 1
    client.close()


def run_clients(address: str, first: int, count: int, seconds: float) -> None:
    """``count`` workers from ``first`` on threads of this process; prints their pushes as JSON."""
    pushes: list[list[tuple[float, float]]] = [[] for _ in range(count)]
    threads = [threading.Thread(target=push_loop, args=(address, first + i, seconds, pushes[i]))
               for i in range(count)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    print(json.dumps(pushes))


def summarize(per_worker: list[list[tuple[float, float]]], warmup_s: float, seconds: float) -> dict:
    """Pushes/s and round-trip percentiles over the window every worker spans, after the warm-up."""
    start = max(p[0][0] for p in per_worker) + warmup_s
    end = min(min(p[-1][0] for p in per_worker), start + seconds)
    if end <= start:
        raise RuntimeError("no window that every client spans: raise --seconds or lower --warmup-s")
    rtt = np.array([r for p in per_worker for t, r in p if start <= t < end]) * 1e3
    p50, p99 = np.percentile(rtt, [50, 99])
    per_client = [sum(start <= t < end for t, _ in p) / (end - start) for p in per_worker]
    return {"window_s": round(end - start, 2), "pushes": int(rtt.size),
            "pushes_per_s": round(rtt.size / (end - start), 1),
            "round_trip_ms": {"p50": round(float(p50), 2), "p90": round(float(np.percentile(rtt, 90)), 2),
                              "p99": round(float(p99), 2), "max": round(float(rtt.max()), 2)},
            "p99_over_p50": round(float(p99 / p50), 2),
            "pushes_per_s_per_client": {"min": round(min(per_client), 1), "max": round(max(per_client), 1)}}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--clients", type=int, default=64)
    ap.add_argument("--procs", type=int, default=4, help="client processes (the clients are their threads)")
    ap.add_argument("--seconds", type=float, default=40.0, help="the measured window")
    ap.add_argument("--warmup-s", type=float, default=5.0)
    ap.add_argument("--serve", type=int, metavar="PORT", help=argparse.SUPPRESS)
    ap.add_argument("--client", nargs=4, metavar=("ADDRESS", "FIRST", "COUNT", "SECONDS"), help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.serve is not None:
        return serve_ps(args.serve, args.clients)
    if args.client:
        address, first, count, seconds = args.client
        return run_clients(address, int(first), int(count), float(seconds))
    print(dumps(measure(args), indent=2))


def measure(args: argparse.Namespace) -> dict:
    """Start the PS and the client processes, wait for the clients, kill the PS."""
    env = {**os.environ, SECRET_ENV: auth.new_secret()}
    port = free_port()
    address = f"127.0.0.1:{port}"
    me = [sys.executable, __file__]
    serve = [*me, "--serve", str(port), "--clients", str(args.clients)]
    procs: list[subprocess.Popen] = [subprocess.Popen(serve, env=env)]
    try:
        wait_for_ps(address, 60)
        spans = [(args.clients * i // args.procs, args.clients * (i + 1) // args.procs) for i in range(args.procs)]
        total = args.warmup_s + args.seconds + 3
        clients = [subprocess.Popen([*me, "--client", address, str(lo), str(hi - lo), str(total)], env=env,
                                    stdout=subprocess.PIPE, text=True) for lo, hi in spans]
        procs += clients
        per_worker = [p for c in clients for p in json.loads(c.communicate(timeout=total + 120)[0])]
    finally:
        for p in procs:
            p.kill()
            p.wait()
    return {"benchmark": "load", "model": "logreg 784->10 (7,850 parameters)", "clients": args.clients,
            "client_processes": args.procs, "protocol": "asp", "authenticated": True, "checkpoint_every_s": 30.0,
            **summarize(per_worker, args.warmup_s, args.seconds)}


if __name__ == "__main__":
    main()
