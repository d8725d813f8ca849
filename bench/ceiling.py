"""The most ASP steps/s a PS on gRPC's Python API could make on this machine, against TF2 ParameterServerStrategy.

A step cannot take less CPU than its three unavoidable parts, each measured alone here (no contention):
- ``gradient``: the model's gradient on a batch already in TF (``--dim``->10 logistic regression, batch 32):
  no gather, no load of new values, no copy out (in a process of its own, TF limited to one thread each);
- ``transport``: one round trip of the model's bytes each way as single unary messages through raw grpcio,
  built in advance and answered with bytes built in advance (a PS's least work on the wire), the CPU of the
  client and of the server process together;
- ``apply``: the PS's SGD update of the model (switchps's own NumPy optimizer).
With perfect packing on every core, steps/s can be no more than cores / (their sum): ``ceiling_steps_per_s``.
A worker on the PS's host moves the bytes through shared memory, and its call carries a header only:
``header_round_trip`` is that call alone (a unary round trip of ``HEADER_ONLY_BYTES`` each way, both
sides' CPU), and ``ceiling_shared_memory`` puts it in place of ``transport`` (its copies are left out).
``header_round_trip_unix_socket`` is the same round trip as length-prefixed frames over a Unix socket
(asyncio's streams serving, a blocking socket calling): what the call would cost outside gRPC.
Two workers on two cores compute at the same time, and their gradients then share the memory system:
``ceiling_two_gradients_at_once`` takes the gradient's CPU from two gradient processes run at once.
The peer, TF2 ParameterServerStrategy (``bench/tf_ps.py``), runs in the same session, and the JSON says
whether ``--target`` times its steps/s lies under the ceiling. An upper bound: every other cost (checks,
copies, Python, waiting for a core) only lowers what is reachable. Prints JSON.

    python bench/ceiling.py [--dim 78400] [--seconds 12] [--target 2.5]
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import os
import socket
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable

import grpc
import numpy as np
import psutil

from switchps.address import free_port
from switchps.jsonfile import dumps
from switchps.protos.codec import grpc_options
from switchps.protos.heap import tune_allocator
from switchps.protos.local_socket import LENGTH, frame
from tf_ps import run_peer

BATCH, CLASSES = 32, 10
HEADER_ONLY_BYTES = 128
"""About a push header's size, step stats included."""


def gradient_cpu_ms(dim: int, steps: int) -> float:
    """CPU ms of one gradient on a fixed batch already in TF (run in this process: ``--gradient``)."""
    import keras
    import tensorflow as tf

    from switchps.workload.tensorflow.setup import configure_threads

    configure_threads(1, 1)
    model = keras.Sequential([keras.Input((dim,)), keras.layers.Dense(CLASSES)])
    x = tf.constant(np.random.default_rng(0).random((BATCH, dim), np.float32))
    y = tf.constant(np.arange(BATCH, dtype=np.int32) % CLASSES)
    loss = keras.losses.SparseCategoricalCrossentropy(from_logits=True, reduction="sum")

    def grad() -> list:
        with tf.GradientTape() as tape:
            value = loss(y, model(x, training=True))
        return tape.gradient(value, model.trainable_variables)

    step = tf.function(grad).get_concrete_function()
    for _ in range(50):
        step()
    t0 = time.process_time()
    for _ in range(steps):
        step()
    return (time.process_time() - t0) / steps * 1e3


def serve_echo(port: int, nbytes: int) -> None:
    """A raw unary echo: any message in, ``nbytes`` built once out."""
    tune_allocator()
    reply = bytes(nbytes)

    async def echo(request: bytes, ctx: grpc.aio.ServicerContext) -> bytes:
        return reply

    async def main() -> None:
        server = grpc.aio.server(options=grpc_options())
        server.add_generic_rpc_handlers([grpc.method_handlers_generic_handler("raw.Echo", {
            "Echo": grpc.unary_unary_rpc_method_handler(echo, request_deserializer=None, response_serializer=None)})])
        server.add_insecure_port(f"127.0.0.1:{port}")
        await server.start()
        await server.wait_for_termination()

    asyncio.run(main())


def serve_socket_echo(path: str) -> None:
    """``serve_echo`` over a Unix socket: each frame in (``protos/local_socket``) is answered with the same."""
    async def echo(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        with contextlib.suppress(asyncio.IncompleteReadError, ConnectionError):
            while True:
                (n,) = LENGTH.unpack(await reader.readexactly(LENGTH.size))
                writer.write(frame(await reader.readexactly(n)))

    async def main() -> None:
        server = await asyncio.start_unix_server(echo, path)
        await server.serve_forever()

    asyncio.run(main())


def transport_cpu_ms(nbytes: int, reps: int) -> float:
    """Client and server CPU ms of one unary round trip of ``nbytes`` each way, median of 5 blocks."""
    tune_allocator()
    port = free_port()
    server = subprocess.Popen([sys.executable, __file__, "--serve", str(port), "--bytes", str(nbytes)])
    request = bytes(nbytes)
    try:
        with grpc.insecure_channel(f"127.0.0.1:{port}", options=grpc_options()) as channel:
            grpc.channel_ready_future(channel).result(timeout=60)
            call = channel.unary_unary("/raw.Echo/Echo", request_serializer=None, response_deserializer=None)
            return _cpu_ms(lambda: call(request), server, reps)
    finally:
        server.kill()
        server.wait()


def socket_cpu_ms(nbytes: int, reps: int) -> float:
    """``transport_cpu_ms`` over a Unix socket, as length-prefixed frames."""
    with tempfile.TemporaryDirectory() as tmp:
        path = os.path.join(tmp, "echo.sock")
        server = subprocess.Popen([sys.executable, __file__, "--serve-socket", path])
        request = frame(bytes(nbytes))
        try:
            with socket.socket(socket.AF_UNIX) as s:
                for _ in range(600):  # until the server listens
                    if s.connect_ex(path) == 0:
                        break
                    time.sleep(0.1)

                def call() -> None:
                    s.sendall(request)
                    s.recv(len(request), socket.MSG_WAITALL)
                return _cpu_ms(call, server, reps)
        finally:
            server.kill()
            server.wait()


def _cpu_ms(call: Callable[[], object], server: subprocess.Popen, reps: int) -> float:
    """Client and ``server`` CPU ms per ``call``, median of 5 blocks of ``reps``."""
    proc, blocks = psutil.Process(server.pid), []
    for _ in range(5):
        for _ in range(5):
            call()
        s0, c0 = proc.cpu_times(), time.process_time()
        for _ in range(reps):
            call()
        s1 = proc.cpu_times()
        server_s = s1.user + s1.system - s0.user - s0.system
        blocks.append((time.process_time() - c0 + server_s) / reps * 1e3)
    return statistics.median(blocks)


def apply_cpu_ms(size: int, reps: int) -> float:
    """CPU ms of the PS's SGD update of ``size`` parameters."""
    from switchps.config.run import parse_config
    from switchps.optim.optimizers import apply_update
    from switchps.optim.optimizers import optimizer_factory

    spec = parse_config({"cluster": {"workers": 1}, "optimizer": {"name": "sgd", "learning_rate": 0.05}}).optimizer
    optimizer = optimizer_factory(spec)(size)
    values, grad = np.zeros(size, np.float32), np.ones(size, np.float32)
    t0 = time.process_time()
    for _ in range(reps):
        list(apply_update(optimizer, values, size, grad, BATCH, 1))
    return (time.process_time() - t0) / reps * 1e3


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--dim", type=int, default=78400, help="input features (78400: 784,010 parameters)")
    ap.add_argument("--seconds", type=float, default=12.0, help="the peer's measured window")
    ap.add_argument("--target", type=float, default=2.5, help="the multiple of the peer's steps/s to test")
    ap.add_argument("--steps", type=int, default=400, help="gradients and updates timed")
    ap.add_argument("--gradient", action="store_true", help=argparse.SUPPRESS)
    ap.add_argument("--serve", type=int, help=argparse.SUPPRESS)
    ap.add_argument("--bytes", type=int, help=argparse.SUPPRESS)
    ap.add_argument("--serve-socket", help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.serve:
        return serve_echo(args.serve, args.bytes)
    if args.serve_socket:
        return serve_socket_echo(args.serve_socket)
    if args.gradient:
        return print(json.dumps(gradient_cpu_ms(args.dim, args.steps)))
    size = args.dim * CLASSES + CLASSES
    alone, (*two,) = gradients(args, 1), gradients(args, 2)
    ms = {"gradient": alone[0], "transport": transport_cpu_ms(4 * size, 100), "apply": apply_cpu_ms(size, args.steps)}
    header, unix = transport_cpu_ms(HEADER_ONLY_BYTES, 500), socket_cpu_ms(HEADER_ONLY_BYTES, 5000)  # /proc counts in 10 ms ticks
    cores = os.cpu_count() or 1
    ceiling = cores * 1e3 / sum(ms.values())
    shared = cores * 1e3 / (sum(ms.values()) - ms["transport"] + header)
    at_once = cores * 1e3 / (sum(ms.values()) - alone[0] + statistics.mean(two))
    peer = run_peer(2, args.seconds, 3.0, args.dim, BATCH, lr=0.05)["steps_per_s"]
    print(dumps({"benchmark": "asp_steps_ceiling", "parameters": size, "cores": cores,
                 "cpu_ms_per_step": {k: round(v, 3) for k, v in ms.items()},
                 "header_round_trip_cpu_ms": round(header, 3), "header_round_trip_unix_socket_cpu_ms": round(unix, 3),
                 "ceiling_shared_memory": round(shared, 1),
                 "gradient_cpu_ms_two_at_once": [round(v, 3) for v in two],
                 "ceiling_steps_per_s": round(ceiling, 1), "ceiling_two_gradients_at_once": round(at_once, 1),
                 "tf2_ps_strategy_steps_per_s": peer, "ceiling_over_tf": round(ceiling / peer, 3),
                 "ceiling_two_gradients_at_once_over_tf": round(at_once / peer, 3),
                 "ceiling_shared_memory_over_tf": round(shared / peer, 3), "target": args.target,
                 "target_under_ceiling": ceiling >= args.target * peer,
                 "target_under_ceiling_two_gradients_at_once": at_once >= args.target * peer}, indent=2))


def gradients(args: argparse.Namespace, n: int) -> list[float]:
    """The gradient's CPU ms per step in each of ``n`` processes run at the same time."""
    cmd = [sys.executable, __file__, "--gradient", "--dim", str(args.dim), "--steps", str(args.steps)]
    procs = [subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, text=True) for _ in range(n)]
    outs = [p.communicate()[0] for p in procs]
    if any(p.returncode for p in procs):
        raise SystemExit("ceiling: a gradient process failed")
    return [float(out.strip().splitlines()[-1]) for out in outs]


if __name__ == "__main__":
    main()
