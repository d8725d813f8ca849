"""A sharded PS side by side with one PS: push+pull round trips and ASP steps/s over 1, 2, 4 shards.

- ``transport``: one worker's push round trip (the reply carries the new values) of a model of
  ``--sizes-mb`` (one variable, cut into ``shard_max_mb`` row blocks and spread over the shards)
  through ``ShardedClient`` (``PSClient`` for one shard), every shard a process of its own (shard 0
  with the core, the others following it), authenticated, by each of ``--paths``: ``shared`` (every
  shard's part through a shared-memory segment of its own, as a worker on the shards' host pushes),
  ``followers_bytes`` (shard 0's part through shared memory, the followers' as gRPC bytes: the path
  before issue 45; the same as ``shared`` for one shard, so not run there) and ``bytes`` (every part as
  gRPC bytes: a worker on another host). Shard counts and paths alternate in blocks; each case's median
  is also given as a ratio to one PS through shared memory. Besides the medians it reports each role's CPU
  seconds per round trip (the client, shard 0, every follower), from ``psutil``: on a 2-core machine
  the client and all shards share the cores, so the time alone cannot show the scaling.
- ``steps``: ASP steps/s of ``switchps run`` (2 workers, logreg ``--dim``->10, real TF gradients) with
  each shard count, alternated ``--pairs`` times.

    python bench/shards.py transport [--shards 1 4] [--sizes-mb 42.7] [--paths shared followers_bytes bytes]
                                     [--reps 5] [--blocks 3]
    python bench/shards.py steps [--shards 1 2 4] [--dim 78400] [--seconds 15] [--pairs 2]

The same runs are ``python bench/transport.py --shards 1 2 4`` and ``python bench/steps.py --shards 1 2 4``.
"""

from __future__ import annotations

import argparse
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import grpc
import numpy as np
import psutil

from switchps.security import auth
from switchps.address import free_port
from switchps.security.channels import ClientSecurity
from switchps.jsonfile import dumps
from switchps.protos import switchps_pb2 as pb
from switchps.protos.layout import make_layout
from switchps.worker.client import wait_for_ps
from switchps.worker.sharded import ShardedClient, connect

SECRET_ENV = "SWITCHPS_BENCH_SECRET"  # the secret reaches the shards by environment, never argv
SHARD_MAX_MB = 4.0


def _config(addresses: list[str], secret_env: str, max_mb: float) -> Any:
    from switchps.config.run import parse_config

    return parse_config({"cluster": {"workers": 1, "ps": addresses if len(addresses) > 1 else addresses[0]},
                         "protocol": {"name": "asp"}, "optimizer": {"name": "sgd", "learning_rate": 1e-6},
                         "train": {"steps": 10**9}, "checkpoint": {"every_s": None},
                         "runtime": {"shard_max_mb": max_mb}, "security": {"secret_env": secret_env}})


def max_mb(size_mb: float, shards: list[int]) -> float:
    """``runtime.shard_max_mb`` for a model of ``size_mb``: BytePS's 4 MB, or less, so that the model is
    cut into at least as many blocks as the most shards compared."""
    return min(SHARD_MAX_MB, size_mb / max(shards))


def serve(addresses: list[str], shard: int, max_mb: float) -> None:
    """One shard of the PS at ``addresses`` (serves until killed)."""
    import threading

    from switchps.security.channels import server_security
    from switchps.ps_server.rpc.main import build_ps
    from switchps.ps_server.rpc.server import Server

    cfg, run_dir = _config(addresses, SECRET_ENV, max_mb), Path(tempfile.mkdtemp(prefix="switchps-bench-shards-"))
    if shard == 0:
        server = Server(build_ps(cfg, run_dir), addresses[0], server_security(cfg.security))
        threading.Event().wait()  # serve until killed
        server.stop()
    from switchps.ps_server.shard.follower_main import run_follower

    run_follower(cfg, run_dir, shard, addresses[0])


def start(shards: int, secret: str, max_mb: float) -> tuple[list[str], list[subprocess.Popen]]:
    addresses = [f"127.0.0.1:{free_port()}" for _ in range(shards)]
    env = {**os.environ, SECRET_ENV: secret}
    procs = [subprocess.Popen([sys.executable, __file__, "--serve", str(k), "--addresses", ",".join(addresses),
                               "--max-mb", str(max_mb)], env=env)
             for k in range(shards)]
    return addresses, procs


def cpu_s(pids: list[int]) -> list[float]:
    """User + system CPU seconds of each process so far."""
    return [sum(psutil.Process(pid).cpu_times()[:2]) for pid in pids]


PATHS = ("shared", "followers_bytes", "bytes")


def round_trips(addresses: list[str], nbytes: int, reps: int, secret: str, max_bytes: int,
                shard_pids: list[int], path: str = "bytes") -> tuple[list[float], list[float]]:
    """Seconds per push round trip of one worker by ``path`` (``PATHS``); CPU seconds per timed round trip
    of this client, then of every shard (warm-up round trips, registration and the first pull not counted)."""
    size = nbytes // 4
    layout = make_layout([("w", (size // 1024, 1024))])
    security = ClientSecurity(auth.token(secret.encode(), "worker", 0))
    client = connect(addresses, layout, max_bytes, 2**21, security)
    deadline = time.monotonic() + 60
    while True:  # the followers attach after shard 0 serves: it answers UNAVAILABLE until then
        try:
            if client.register(0, layout, 1).send_init:
                client.init(0, layout, np.zeros(size, np.float32))
            break
        except grpc.RpcError as e:
            if e.code() != grpc.StatusCode.UNAVAILABLE or time.monotonic() > deadline:
                raise
            time.sleep(0.1)
    if path == "shared":
        assert client.attach(0, nbytes), "every shard is on this host"
    elif path == "followers_bytes":  # what a worker did before followers took segments
        zero = client.clients[0] if isinstance(client, ShardedClient) else client
        assert zero.attach(0, client.parts[0].nbytes if isinstance(client, ShardedClient) else nbytes)
    params, grad = np.empty(size, np.float32), np.ones(size, np.float32)
    version = client.pull(params, worker=0, wait_initialized=True).order.version
    times, pids = [], [os.getpid(), *shard_pids]
    for step in range(reps + 2):  # two warm-up round trips
        if step == 2:
            cpu0 = cpu_s(pids)
        header = pb.PushHeader(worker=0, base_version=version, samples=1, layout_digest=layout.digest,
                               session=7, stats=pb.StepStats(step=step))
        t0 = time.perf_counter()
        version = client.push(header, grad, params).order.version
        times.append(time.perf_counter() - t0)
    cpu = [(b - a) / reps for a, b in zip(cpu0, cpu_s(pids))]
    client.close()
    return times[2:], cpu


def transport(args: argparse.Namespace) -> dict:
    """Round trips at each size by every shard count and path, alternating in blocks (``--sizes-mb``,
    ``--shards``, ``--paths``, ``--reps``, ``--blocks``)."""
    results = []
    paths = getattr(args, "paths", ["bytes"])  # ``bench/transport.py --shards``: every part as bytes
    cases = [(s, p) for s in args.shards for p in paths if not (s == 1 and p == "followers_bytes")]
    for mb in args.sizes_mb:
        nbytes = int(mb * 2**20) // 4096 * 4096
        times: dict[tuple[int, str], list[list[float]]] = {c: [] for c in cases}  # per block
        cpu: dict[tuple[int, str], list[list[float]]] = {c: [] for c in cases}
        for _ in range(args.blocks):  # alternate, so drift on a noisy machine hits every case alike
            for s, path in cases:
                secret = auth.new_secret()
                addresses, procs = start(s, secret, max_mb(mb, args.shards))
                try:
                    for a in addresses[:1]:
                        wait_for_ps(a, 60, ClientSecurity(auth.token(secret.encode(), "status")))
                    t, c = round_trips(addresses, nbytes, args.reps, secret, int(max_mb(mb, args.shards) * 2**20),
                                       [p.pid for p in procs], path)
                finally:
                    for p in procs:
                        p.kill()
                        p.wait()
                times[(s, path)].append(t)
                cpu[(s, path)].append(c)
        results.append(_summary(mb, nbytes, times, cpu))
    return {"benchmark": "transport_by_shards", "shard_max_mb": {mb: max_mb(mb, args.shards) for mb in args.sizes_mb},
            "cpus": os.cpu_count(), "round_trips_per_case": args.reps * args.blocks, "results": results}


def _summary(mb: float, nbytes: int, times: dict[tuple[int, str], list[list[float]]],
             cpu: dict[tuple[int, str], list[list[float]]]) -> dict:
    """Per case (``"SHARDS PATH"``): the median, its speedup over the baseline (the fewest shards through
    shared memory, or the first case) block by block (each block's medians a pair: geometric mean and
    95 % interval, ``steps.ratio_summary``), and each role's CPU seconds per round trip."""
    sys.path.insert(0, str(Path(__file__).parent))
    from steps import ratio_summary  # noqa: E402 - a sibling benchmark's helper

    med = {c: statistics.median(t for block in v for t in block) for c, v in times.items()}
    base = min(med, key=lambda c: (c[0], c[1] != "shared"))

    def speedup(case: tuple[int, str], over: tuple[int, str]) -> dict:
        return ratio_summary([statistics.median(b) / statistics.median(a) for a, b in zip(times[case], times[over])])

    return {"size_mb": mb, "parameters": nbytes // 4, "baseline": f"{base[0]} {base[1]}", "cases": {
        f"{s} {path}": {"shards": s, "path": path, "median_ms": round(1e3 * m, 2),
                        "gb_s": round(2 * nbytes / m / 1e9, 3), "time_vs_baseline": round(m / med[base], 3),
                        "speedup_vs_baseline": speedup((s, path), base),
                        **({"speedup_vs_followers_bytes": speedup((s, path), (s, "followers_bytes"))}
                           if path == "shared" and (s, "followers_bytes") in times else {}),
                        "cpu_s_per_round_trip": dict(zip(["client", "shard0", *(f"shard{k}" for k in range(1, s))],
                                                         (round(statistics.mean(c), 4) for c in zip(*cpu[(s, path)]))))}
        for (s, path), m in med.items()}}


def steps(args: argparse.Namespace) -> dict:
    """ASP steps/s of `switchps run` with each shard count, alternated (``--shards``, ``--dim``,
    ``--seconds``, ``--pairs``, ``--shard-max-mb``)."""
    sys.path.insert(0, str(Path(__file__).parent))
    from steps import data_config, model_name  # noqa: E402 - a sibling benchmark's helpers

    from switchps.config.run import parse_config
    from switchps.launch.launcher import launch

    rates: dict[int, list[float]] = {s: [] for s in args.shards}
    for _ in range(args.pairs):
        for s in args.shards:
            cfg = parse_config({
                "name": "shards-bench", "cluster": {"workers": 2, "ps": ["127.0.0.1:0"] * s if s > 1 else "127.0.0.1:0"},
                "model": {"name": "logreg"}, "data": data_config(args.dim),
                "optimizer": {"name": "sgd", "learning_rate": 0.05}, "protocol": {"name": "asp", "batch": 32},
                "train": {"seconds": args.seconds}, "eval": {"every_s": 5.0},
                "output": {"dir": tempfile.mkdtemp(prefix="switchps-shards-")},
                "checkpoint": {"every_s": 30.0}, "runtime": {"shard_max_mb": args.shard_max_mb}})
            _, summary = launch(cfg, quiet=True)
            rates[s].append(summary["updates"] / summary["wall_time_s"])
    return {"benchmark": "asp_steps_by_shards", "model": model_name(args.dim), "workers": 2,
            "shard_max_mb": args.shard_max_mb, "seconds": args.seconds,
            "steps_per_s": {str(s): [round(r, 1) for r in v] for s, v in rates.items()},
            "median_steps_per_s": {str(s): round(statistics.median(v), 1) for s, v in rates.items()}}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--serve", type=int, help=argparse.SUPPRESS)
    ap.add_argument("--addresses", help=argparse.SUPPRESS)
    ap.add_argument("--max-mb", type=float, help=argparse.SUPPRESS)
    sub = ap.add_subparsers(dest="what")
    t = sub.add_parser("transport", help="push+pull round trips through 1..N shards")
    t.add_argument("--shards", type=int, nargs="+", default=[1, 2, 4])
    t.add_argument("--sizes-mb", type=float, nargs="+", default=[16, 100], help="42.7: ResNet-18's 11.2M")
    t.add_argument("--paths", nargs="+", choices=PATHS, default=["shared", "followers_bytes"],
                   help="how the parts travel (see the module docstring)")
    t.add_argument("--reps", type=int, default=5, help="timed round trips per block")
    t.add_argument("--blocks", type=int, default=3, help="alternating blocks of every shard count")
    s = sub.add_parser("steps", help="ASP steps/s of switchps run with 1..N shards")
    s.add_argument("--shards", type=int, nargs="+", default=[1, 2, 4])
    s.add_argument("--dim", type=int, default=78400, help="input features (78400: 784,010 parameters)")
    s.add_argument("--seconds", type=float, default=15.0)
    s.add_argument("--pairs", type=int, default=2)
    s.add_argument("--shard-max-mb", type=float, default=1.0, help="1: the 3 MB kernel in 4 row blocks")
    args = ap.parse_args()
    if args.serve is not None:
        return serve(args.addresses.split(","), args.serve, args.max_mb)
    if args.what == "transport":
        return print(dumps(transport(args), indent=2))
    if args.what == "steps":
        return print(dumps(steps(args), indent=2))
    ap.print_help()


if __name__ == "__main__":
    main()
