"""Push+pull throughput: switchps's own client and PS against raw grpcio byte streaming.

For each parameter-set size, one round trip sends the payload up and gets a
payload of the same size back:
- raw: a grpcio stream-stream call of pre-built bytes chunks, answered with
  pre-built chunks (no protobuf, no copies, no work), measured twice: as
  grpcio runs by default ("stock"), and with the allocator tuning switchps
  applies to itself (``tune_allocator``), which makes raw grpcio faster too.
- switchps: a real ASP push (validation, ΣG/Σb apply with SGD, new snapshot)
  whose reply carries the fresh parameters, through ``PSClient``.
Each server runs in its own process, as in a deployment; the three variants
alternate in blocks so that drift on a noisy machine hits them alike. Ratios
are of medians (> 1: switchps is faster). Prints JSON.

    python bench/transport.py [--sizes-mb 1 16 100] [--reps 7]
"""

from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys
import time
from concurrent import futures

import grpc
import numpy as np

from switchps.jsonfile import dumps
from switchps.protos import switchps_pb2 as pb
from switchps.protos.codec import COPIES, DEFAULT_CHUNK_BYTES, grpc_options, tune_allocator
from switchps.protos.layout import make_layout
from switchps.worker.client import PSClient, wait_for_ps


def serve_raw(port: int, chunk_bytes: int, tuned: bool) -> None:
    if tuned:
        tune_allocator()
    cache: dict[int, list[bytes]] = {}

    def echo(frames, ctx):
        n = sum(len(f) for f in frames)
        if n not in cache:
            cache[n] = [bytes(min(chunk_bytes, n - i)) for i in range(0, n, chunk_bytes)]
        yield from cache[n]

    server = grpc.server(futures.ThreadPoolExecutor(4), options=grpc_options())
    server.add_generic_rpc_handlers([grpc.method_handlers_generic_handler(
        "raw.Echo", {"Echo": grpc.stream_stream_rpc_method_handler(echo)})])
    server.add_insecure_port(f"127.0.0.1:{port}")
    server.start()
    server.wait_for_termination()


def serve_ps(port: int) -> None:
    import tempfile
    import threading
    from pathlib import Path

    from switchps.config import parse_config
    from switchps.ps_server.main import build_ps
    from switchps.ps_server.server import Server

    cfg = parse_config({"cluster": {"workers": 1}, "protocol": {"name": "asp"},
                        "optimizer": {"name": "sgd", "learning_rate": 1e-6}, "train": {"steps": 10**9}})
    server = Server(build_ps(cfg, Path(tempfile.mkdtemp(prefix="switchps-bench-"))), f"127.0.0.1:{port}")
    threading.Event().wait()  # serve until killed
    server.stop()


def _spawn(*args: str) -> subprocess.Popen:
    return subprocess.Popen([sys.executable, __file__, *args])


def _timed(fn, reps: int, warmup: int = 3) -> list[float]:
    for _ in range(warmup):  # lets HTTP/2 flow-control windows grow on both paths alike
        fn()
    times = []
    for _ in range(reps):
        t0 = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t0)
    return times


def bench_raw(port: int, nbytes: int, chunk_bytes: int, reps: int, tuned: bool) -> list[float]:
    """Raw grpcio from a fresh client process, so allocator settings are exactly as asked."""
    out = subprocess.run([sys.executable, __file__, "--client-raw", "--port", str(port), "--bytes", str(nbytes),
                          "--chunk-mb", str(chunk_bytes / 2**20), "--reps", str(reps)] + (["--tuned"] if tuned else []),
                         capture_output=True, text=True, check=True)
    return json.loads(out.stdout.strip().splitlines()[-1])


def raw_client(port: int, nbytes: int, chunk_bytes: int, reps: int, tuned: bool) -> list[float]:
    if tuned:
        tune_allocator()
    chunks = [bytes(min(chunk_bytes, nbytes - i)) for i in range(0, nbytes, chunk_bytes)]
    with grpc.insecure_channel(f"127.0.0.1:{port}", options=grpc_options()) as ch:
        call = ch.stream_stream("/raw.Echo/Echo", request_serializer=None, response_deserializer=None)
        grpc.channel_ready_future(ch).result(timeout=30)
        return _timed(lambda: sum(len(f) for f in call(iter(chunks))), reps)


def bench_switchps(port: int, nbytes: int, worker: int, reps: int) -> tuple[list[float], float]:
    """Seconds per push+pull, and payload bytes copied per byte moved (client side)."""
    size = nbytes // 4
    client = PSClient(f"127.0.0.1:{port}")
    layout = make_layout([(f"w{size}", (size,))])
    reg = client.register(worker, layout, shard_size=1)
    if reg.send_init:
        client.init(worker, layout, np.zeros(size, np.float32))
    params = np.empty(size, np.float32)
    version = client.pull(params, worker=worker, wait_initialized=True).order.version
    grad = np.ones(size, np.float32)

    def push() -> None:
        nonlocal version
        header = pb.PushHeader(worker=worker, base_version=version, samples=1, layout_digest=layout.digest)
        version = client.push(header, grad, params).order.version

    before = COPIES.bytes_copied
    seconds = _timed(push, reps)
    copies = (COPIES.bytes_copied - before) / ((reps + 3) * 2 * nbytes)
    client.close()
    return seconds, copies


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--sizes-mb", type=float, nargs="+", default=[1, 16, 100])
    ap.add_argument("--reps", type=int, default=5, help="timed round trips per block")
    ap.add_argument("--blocks", type=int, default=3, help="alternating blocks of raw / switchps runs")
    ap.add_argument("--chunk-mb", type=float, default=DEFAULT_CHUNK_BYTES / 2**20)
    ap.add_argument("--serve", choices=["raw", "raw-tuned", "ps"], help=argparse.SUPPRESS)
    ap.add_argument("--client-raw", action="store_true", help=argparse.SUPPRESS)
    ap.add_argument("--tuned", action="store_true", help=argparse.SUPPRESS)
    ap.add_argument("--port", type=int, help=argparse.SUPPRESS)
    ap.add_argument("--bytes", type=int, help=argparse.SUPPRESS)
    args = ap.parse_args()
    chunk = int(args.chunk_mb * 2**20)
    if args.client_raw:
        return print(dumps(raw_client(args.port, args.bytes, chunk, args.reps, args.tuned)))
    if args.serve in ("raw", "raw-tuned"):
        return serve_raw(args.port, chunk, tuned=args.serve == "raw-tuned")
    if args.serve == "ps":
        return serve_ps(args.port)

    from switchps.launcher import free_port

    results = []
    for mb in args.sizes_mb:
        nbytes = int(mb * 2**20) // 4 * 4
        raw_port, tuned_port, ps_port = free_port(), free_port(), free_port()
        procs = [_spawn("--serve", "raw", "--port", str(raw_port), "--chunk-mb", str(args.chunk_mb)),
                 _spawn("--serve", "raw-tuned", "--port", str(tuned_port), "--chunk-mb", str(args.chunk_mb)),
                 _spawn("--serve", "ps", "--port", str(ps_port))]
        try:
            wait_for_ps(f"127.0.0.1:{ps_port}", 60)
            times: dict[str, list[float]] = {"raw_default": [], "raw_tuned": [], "switchps": []}
            for _ in range(args.blocks):  # alternate, so drift on a noisy machine hits every variant alike
                times["raw_default"] += bench_raw(raw_port, nbytes, chunk, args.reps, tuned=False)
                times["raw_tuned"] += bench_raw(tuned_port, nbytes, chunk, args.reps, tuned=True)
                ours, copies = bench_switchps(ps_port, nbytes, 0, args.reps)
                times["switchps"] += ours
        finally:
            for p in procs:
                p.kill()
                p.wait()
        med = {k: statistics.median(v) for k, v in times.items()}
        gbps = lambda s: round(2 * nbytes / s / 1e9, 3)  # noqa: E731 - up + down per round trip
        results.append({
            "size_mb": mb,
            **{f"{k}_gb_s": gbps(v) for k, v in med.items()},
            **{f"{k}_median_ms": round(v * 1e3, 2) for k, v in med.items()},
            "ratio_vs_stock_grpcio": round(med["raw_default"] / med["switchps"], 3),
            "ratio_vs_tuned_grpcio": round(med["raw_tuned"] / med["switchps"], 3),
            "client_copies_per_byte": round(copies, 3),
        })
    print(dumps({"benchmark": "transport", "chunk_mb": args.chunk_mb, "round_trips_per_variant":
                      args.reps * args.blocks, "results": results}, indent=2))


if __name__ == "__main__":
    main()
