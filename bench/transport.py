"""Push+pull throughput: switchps's own client and PS against raw grpcio byte streaming.

For each parameter-set size, one round trip sends the payload up and gets a
payload of the same size back:
- raw: grpcio carrying pre-built bytes and answered with pre-built bytes (no
  protobuf, no copies, no work), sent as switchps sends a push of that size
  (``raw_call``): one unary message each way up to ``codec.whole_limit``, a
  stream-stream call of chunks above it. Measured three ways: as
  grpcio runs by default ("stock"), with the allocator tuning switchps
  applies to itself (``tune_allocator``), which makes raw grpcio faster too, and
  tuned on grpcio's asyncio server, the kind the PS runs
  (``tuned_grpcio_asyncio_over_threads``: its time over the thread-pool server's).
- switchps: a real ASP push (validation, ΣG/Σb apply with SGD, new snapshot)
  whose reply carries the fresh parameters, through ``PSClient``, measured three
  ways: plaintext with no authentication, plaintext with a token on every call
  (``auth``), TLS with a token (``tls``, a development CA from ``switchps.security.certs``), and with a token
  through a shared-memory segment (``shared_memory``: a worker on the PS's host; only the header is a
  gRPC message).
- a serial estimate of a PS's least work: raw tuned grpcio's round trip plus the
  passes over the payload a PS cannot skip (``PS_PASSES``), each timed alone in
  this process (``passes_ms``) and added up; ``switchps_over_estimate`` is how far
  switchps is from it. Not a bound: a streamed push overlaps the passes with the
  transfer.
Each server runs in its own process, as in a deployment; the variants
alternate in blocks so that drift on a noisy machine hits them alike. Ratios
are of medians (> 1: switchps is faster). Prints JSON.

    python bench/transport.py [--sizes-mb 1 16 100] [--reps 5]
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import time
from concurrent import futures

import grpc
import numpy as np
from threadpoolctl import threadpool_limits

from switchps.security import auth
from switchps.security.channels import ClientSecurity, ServerSecurity
from switchps.jsonfile import dumps
from switchps.config.security import TLSSpec
from switchps.protos import switchps_pb2 as pb
from switchps.protos.codec import COPIES, DEFAULT_CHUNK_BYTES, grpc_options, whole_limit
from switchps.protos.heap import tune_allocator
from switchps.protos.layout import make_layout
from switchps.worker.client import PSClient, wait_for_ps


RAW_SERVICE = "raw.Echo"
RAW_METHODS = {"unary": "Whole", "stream": "Echo"}
"""The raw echo's method for each kind of call (``raw_call``)."""


def raw_call(nbytes: int, chunk_bytes: int) -> str:
    """How switchps's client sends a push of ``nbytes`` (``PSClient.push``), and so the raw baseline too:
    ``unary``, one message each way, up to ``whole_limit``; ``stream``, chunks, above it."""
    return "unary" if nbytes <= whole_limit(chunk_bytes) else "stream"


def serve_raw(port: int, chunk_bytes: int, tuned: bool) -> None:
    """The raw echo on grpcio's thread-pool server: a unary call is answered with one message of the
    request's size, a stream with chunks of its total size."""
    if tuned:
        tune_allocator()
    cache: dict[int, list[bytes]] = {}

    def echo(frames, ctx):
        n = sum(len(f) for f in frames)
        yield from _reply(cache, n, chunk_bytes)

    def whole(request: bytes, ctx) -> bytes:
        return _whole(cache, len(request))

    server = grpc.server(futures.ThreadPoolExecutor(4), options=grpc_options())
    server.add_generic_rpc_handlers([_echo_handler(echo, whole)])
    server.add_insecure_port(f"127.0.0.1:{port}")
    server.start()
    server.wait_for_termination()


def serve_raw_aio(port: int, chunk_bytes: int) -> None:
    """``serve_raw`` (tuned) on grpcio's asyncio server, the kind the PS runs."""
    import asyncio

    tune_allocator()
    cache: dict[int, list[bytes]] = {}

    async def echo(frames, ctx):
        n = 0
        async for f in frames:
            n += len(f)
        for chunk in _reply(cache, n, chunk_bytes):
            yield chunk

    async def whole(request: bytes, ctx) -> bytes:
        return _whole(cache, len(request))

    async def serve() -> None:
        server = grpc.aio.server(options=grpc_options())
        server.add_generic_rpc_handlers([_echo_handler(echo, whole)])
        server.add_insecure_port(f"127.0.0.1:{port}")
        await server.start()
        await server.wait_for_termination()

    asyncio.run(serve())


def _reply(cache: dict[int, list[bytes]], n: int, chunk_bytes: int) -> list[bytes]:
    """Pre-built chunks of ``n`` bytes in all (built once per size; a size goes one way only, ``raw_call``)."""
    if n not in cache:
        cache[n] = [bytes(min(chunk_bytes, n - i)) for i in range(0, n, chunk_bytes)]
    return cache[n]


def _whole(cache: dict[int, list[bytes]], n: int) -> bytes:
    """Pre-built ``n`` bytes as one message (built once per size)."""
    if n not in cache:
        cache[n] = [bytes(n)]
    return cache[n][0]


def _echo_handler(echo, whole) -> grpc.GenericRpcHandler:
    return grpc.method_handlers_generic_handler(RAW_SERVICE, {
        RAW_METHODS["stream"]: grpc.stream_stream_rpc_method_handler(echo),
        RAW_METHODS["unary"]: grpc.unary_unary_rpc_method_handler(whole)})


PS_CONFIG = {"cluster": {"workers": 1}, "protocol": {"name": "asp"},
             "optimizer": {"name": "sgd", "learning_rate": 1e-6}, "train": {"steps": 10**9}}
SECRET_ENV = "SWITCHPS_BENCH_SECRET"  # the secret reaches the PS processes by environment, never argv


def serve_ps(port: int, tls_dir: str | None) -> None:
    import tempfile
    import threading
    from pathlib import Path

    from switchps.config.run import parse_config
    from switchps.ps_server.rpc.main import build_ps
    from switchps.ps_server.rpc.server import Server

    cfg = parse_config(PS_CONFIG)
    secret = os.environ.get(SECRET_ENV, "").encode() or None
    security = ServerSecurity(secret, _tls(tls_dir) if tls_dir else None)
    server = Server(build_ps(cfg, Path(tempfile.mkdtemp(prefix="switchps-bench-"))), f"127.0.0.1:{port}", security)
    threading.Event().wait()  # serve until killed
    server.stop()


def _tls(d: str) -> TLSSpec:
    return TLSSpec(cert=f"{d}/server.pem", key=f"{d}/server.key", ca=f"{d}/ca.pem")


def _spawn(*args: str, secret: str | None = None) -> subprocess.Popen:
    env = {**os.environ, SECRET_ENV: secret} if secret else None
    return subprocess.Popen([sys.executable, __file__, *args], env=env)


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
    """Seconds per raw round trip of ``nbytes`` each way, sent as ``raw_call`` says."""
    if tuned:
        tune_allocator()
    kind = raw_call(nbytes, chunk_bytes)
    method = f"/{RAW_SERVICE}/{RAW_METHODS[kind]}"
    with grpc.insecure_channel(f"127.0.0.1:{port}", options=grpc_options()) as ch:
        grpc.channel_ready_future(ch).result(timeout=30)
        if kind == "unary":
            payload, unary = bytes(nbytes), ch.unary_unary(method, request_serializer=None, response_deserializer=None)

            def returned() -> int:
                return len(unary(payload))
        else:
            chunks = [bytes(min(chunk_bytes, nbytes - i)) for i in range(0, nbytes, chunk_bytes)]
            stream = ch.stream_stream(method, request_serializer=None, response_deserializer=None)

            def returned() -> int:
                return sum(len(f) for f in stream(iter(chunks)))

        def round_trip() -> None:
            if (got := returned()) != nbytes:
                raise RuntimeError(f"the echo returned {got} bytes of {nbytes}")

        return _timed(round_trip, reps)


def bench_switchps(address: str, nbytes: int, worker: int, reps: int, security: ClientSecurity = ClientSecurity(),
                   shared: bool = False) -> tuple[list[float], float]:
    """Seconds per push+pull, and payload bytes copied per byte moved (client side); ``shared``: through a
    shared-memory segment, as a worker on the PS's host pushes."""
    size = nbytes // 4
    client = PSClient(address, security=security)
    layout = make_layout([(f"w{size}", (size,))])
    reg = client.register(worker, layout, partition_size=1)
    if reg.send_init:
        client.init(worker, layout, np.zeros(size, np.float32))
    params = np.empty(size, np.float32)
    version = client.pull(params, worker=worker, wait_initialized=True).order.version
    if shared and not client.attach(worker, nbytes):
        raise RuntimeError("the PS did not attach this host's segment")
    grad = np.ones(size, np.float32)

    def push() -> None:  # each push is applied (ASP) and its reply carries the new version's values
        nonlocal version
        header = pb.PushHeader(worker=worker, base_version=version, samples=1, layout_digest=layout.digest)
        r = client.push(header, grad, params)
        if not (r.fresh and r.values.nbytes == nbytes and r.order.version == version + 1):
            raise RuntimeError(f"a push at version {version} got version {r.order.version}, {r.values.nbytes} bytes")
        version = r.order.version

    before = COPIES.bytes_copied
    seconds = _timed(push, reps)
    copies = (COPIES.bytes_copied - before) / ((reps + 3) * 2 * nbytes)
    client.close()
    return seconds, copies


def passes(nbytes: int, chunk_bytes: int, reps: int) -> dict[str, float]:
    """Median ms of each pass a push+pull makes over the payload outside gRPC, timed alone in this process,
    with the project's own code: the client's copy into frames, the PS's copy into its receive buffer, its
    finiteness check, the optimizer's step (SGD, as the PS here runs it), the new version's copy into
    frames, and the client's copy out of the reply into its parameters."""
    from switchps.config.run import parse_config
    from switchps.protos.codec import all_finite, array_chunks, receive_into, whole_frame
    from switchps.ps_server.snapshot import Snapshot
    from switchps.optim.optimizers import apply_update, optimizer_factory

    tune_allocator()  # as the client and the PS run
    size = nbytes // 4
    grad, buf, values, out = (np.ones(size, np.float32) for _ in range(4))
    optimizer = optimizer_factory(parse_config(PS_CONFIG).optimizer)(size)
    frames = list(array_chunks(values, chunk_bytes))
    encode = (lambda: whole_frame(pb.PushHeader(), grad)) if raw_call(nbytes, chunk_bytes) == "unary" else \
        (lambda: list(array_chunks(grad, chunk_bytes)))
    steps = {
        "client_encode": encode,
        "ps_copy_in": lambda: np.copyto(buf, grad),
        "ps_finite_check": lambda: all_finite(buf),
        "ps_apply": lambda: list(apply_update(optimizer, values, size, buf, 1, 1)),
        "ps_snapshot": lambda: Snapshot.of(1, values, chunk_bytes),
        "client_copy_out": lambda: receive_into(memoryview(b""), frames, out),
    }
    with threadpool_limits(1, user_api="blas"):  # as the PS runs its BLAS passes (``ps_server.server``)
        return {k: round(statistics.median(_timed(fn, reps)) * 1e3, 3) for k, fn in steps.items()}


PS_PASSES = ("client_encode", "ps_finite_check", "ps_apply", "ps_snapshot", "client_copy_out")
"""The passes no PS can skip: gRPC's Python API sends ``bytes`` (one copy of the gradient), a push is checked
before it is applied (one read), the optimizer reads the gradient and rewrites the values, a reply needs the
version's values frozen while the next update runs (one copy), and the worker needs them in its own array.
The copy into a receive buffer (``ps_copy_in``) is the one switchps makes beyond them."""


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--sizes-mb", type=float, nargs="+", default=[1, 16, 100])
    ap.add_argument("--reps", type=int, default=5, help="timed round trips per block")
    ap.add_argument("--blocks", type=int, default=3, help="alternating blocks of raw / switchps runs")
    ap.add_argument("--chunk-mb", type=float, default=DEFAULT_CHUNK_BYTES / 2**20)
    ap.add_argument("--shards", type=int, nargs="+", metavar="S",
                    help="instead: round trips through S PS shards each, side by side (bench/shards.py)")
    ap.add_argument("--serve", choices=["raw", "raw-tuned", "raw-aio", "ps"], help=argparse.SUPPRESS)
    ap.add_argument("--client-raw", action="store_true", help=argparse.SUPPRESS)
    ap.add_argument("--tuned", action="store_true", help=argparse.SUPPRESS)
    ap.add_argument("--port", type=int, help=argparse.SUPPRESS)
    ap.add_argument("--bytes", type=int, help=argparse.SUPPRESS)
    ap.add_argument("--tls-dir", help=argparse.SUPPRESS)
    args = ap.parse_args()
    chunk = int(args.chunk_mb * 2**20)
    if args.client_raw:
        return print(dumps(raw_client(args.port, args.bytes, chunk, args.reps, args.tuned)))
    if args.serve in ("raw", "raw-tuned"):
        return serve_raw(args.port, chunk, tuned=args.serve == "raw-tuned")
    if args.serve == "raw-aio":
        return serve_raw_aio(args.port, chunk)
    if args.serve == "ps":
        return serve_ps(args.port, args.tls_dir)
    if args.shards:
        from shards import transport as by_shards  # the sibling benchmark (bench/ is on sys.path)

        return print(dumps(by_shards(args), indent=2))
    results = [bench_size(mb, chunk, args) for mb in args.sizes_mb]
    print(dumps({"benchmark": "transport", "chunk_mb": args.chunk_mb, "round_trips_per_variant":
                      args.reps * args.blocks, "results": results}, indent=2))


def bench_size(mb: float, chunk: int, args: argparse.Namespace) -> dict:
    """Every variant at one size, alternating in blocks; ratios of medians."""
    import tempfile
    from pathlib import Path

    from switchps.security.certs import write_dir
    from switchps.address import free_port

    nbytes = int(mb * 2**20) // 4 * 4
    secret, tls_dir = auth.new_secret(), tempfile.mkdtemp(prefix="switchps-bench-tls-")
    write_dir(Path(tls_dir), [])
    ports = {k: free_port() for k in ("raw", "raw-tuned", "raw-aio", "ps", "auth", "tls")}
    procs = [_spawn("--serve", k, "--port", str(ports[k]), "--chunk-mb", str(args.chunk_mb))
             for k in ("raw", "raw-tuned", "raw-aio")]
    procs += [_spawn("--serve", "ps", "--port", str(ports["ps"])),
              _spawn("--serve", "ps", "--port", str(ports["auth"]), secret=secret),
              _spawn("--serve", "ps", "--port", str(ports["tls"]), "--tls-dir", tls_dir, secret=secret)]
    token = auth.token(secret.encode(), "worker", 0)
    clients = {"switchps": (f"127.0.0.1:{ports['ps']}", ClientSecurity()),
               "switchps_auth": (f"127.0.0.1:{ports['auth']}", ClientSecurity(token)),
               "switchps_tls": (f"localhost:{ports['tls']}", ClientSecurity(token, _tls(tls_dir))),
               "switchps_shared_memory": (f"127.0.0.1:{ports['auth']}", ClientSecurity(token))}
    try:
        for address, security in clients.values():
            wait_for_ps(address, 60, security)
        times: dict[str, list[float]] = {k: [] for k in ("raw_default", "raw_tuned", "raw_aio_tuned", *clients)}
        copies: dict[str, float] = {}
        for _ in range(args.blocks):  # alternate, so drift on a noisy machine hits every variant alike
            times["raw_default"] += bench_raw(ports["raw"], nbytes, chunk, args.reps, tuned=False)
            times["raw_tuned"] += bench_raw(ports["raw-tuned"], nbytes, chunk, args.reps, tuned=True)
            times["raw_aio_tuned"] += bench_raw(ports["raw-aio"], nbytes, chunk, args.reps, tuned=True)
            for name, (address, security) in clients.items():
                ours, copies[name] = bench_switchps(address, nbytes, 0, args.reps, security,
                                                    shared=name == "switchps_shared_memory")
                times[name] += ours
    finally:
        for p in procs:
            p.kill()
            p.wait()
    med = {k: statistics.median(v) for k, v in times.items()}
    gbps = lambda s: round(2 * nbytes / s / 1e9, 3)  # noqa: E731 - up + down per round trip
    ms = passes(nbytes, chunk, max(3, args.reps))
    estimate = med["raw_tuned"] * 1e3 + sum(ms[k] for k in PS_PASSES)
    return {
        "size_mb": mb,
        "raw_call": raw_call(nbytes, chunk),
        **{f"{k}_gb_s": gbps(v) for k, v in med.items()},
        **{f"{k}_median_ms": round(v * 1e3, 2) for k, v in med.items()},
        "ratio_vs_stock_grpcio": round(med["raw_default"] / med["switchps"], 3),
        "ratio_vs_tuned_grpcio": round(med["raw_tuned"] / med["switchps"], 3),
        "tuned_grpcio_asyncio_over_threads": round(med["raw_aio_tuned"] / med["raw_tuned"], 3),
        "auth_time_ratio": round(med["switchps_auth"] / med["switchps"], 3),
        "tls_time_ratio": round(med["switchps_tls"] / med["switchps"], 3),
        "shared_memory_ratio_vs_tuned_grpcio": round(med["raw_tuned"] / med["switchps_shared_memory"], 3),
        "client_copies_per_byte": round(copies["switchps"], 3),
        "passes_ms": ms,
        "serial_estimate_ms": round(estimate, 2),
        "switchps_over_estimate": round(med["switchps"] * 1e3 / estimate, 3),
    }


if __name__ == "__main__":
    main()
