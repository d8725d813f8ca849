"""Resident memory of a PS under rounds of refused oversize pushes.

The PS runs in a spawned process of its own (so the client's memory does not mix in: ``Child``) with a
model of ``--model-mb``; a raw grpc client written from the frame format sends, each round:
- ``oversize_frame``: a valid header, then one frame of ``--frame-mb`` (over gRPC's receive limit);
- ``huge_header_length``: frame 0 declaring a 4 GiB header;
- ``huge_nbytes``: a header declaring a 1 TiB payload;
- ``payload_too_long``: the model's bytes, then one chunk more;
- ``concurrent_too_long`` / ``concurrent_oversize``: ``--concurrent`` of those at once, every one
  holding its stream open until all have sent the model's bytes.
Every push must be refused. The PS's RSS (psutil) is read a second after it has counted a round's
refusals (``rss_mb``: idle, then after each round), and sampled every 20 ms during each (``peak_rss_mb``).
Prints JSON.

    python bench/hostile_memory.py [--rounds 4] [--concurrent 8] [--model-mb 16] [--frame-mb 65]
"""

from __future__ import annotations

import argparse
import json
import multiprocessing as mp
import struct
import sys
import tempfile
import threading
import time
from collections import Counter
from collections.abc import Callable, Iterator
from concurrent.futures import ThreadPoolExecutor
from multiprocessing.connection import Connection
from pathlib import Path

import grpc
import numpy as np
import psutil

from switchps.protos import switchps_pb2 as pb
from switchps.protos.codec import DEFAULT_CHUNK_BYTES, encode
from switchps.protos.layout import make_layout

PUSH = "/switchps.ParameterServer/Push"
MB = 2**20
SETTLE_S = 1.0  # RSS is read this long after a round's refusals are counted: their streams have ended too
COUNTED_WAIT_S = 30.0  # the most a state request waits for the refusals it names to be counted
PEAK_EVERY_S = 0.02


def serve(conn: Connection, chunk_mb: float, workers: int = 1, receive_timeout_s: float = 30.0) -> None:
    """The PS (spawned child): serves on loopback and answers ``state`` requests until ``stop``. A request
    names the pushes refused so far: the answer waits until the PS has counted that many refusals."""
    from switchps.config.run import parse_config
    from switchps.ps_server.rpc.main import build_ps
    from switchps.ps_server.rpc.server import Server

    cfg = parse_config({"cluster": {"workers": workers}, "protocol": {"name": "asp"},
                        "runtime": {"chunk_mb": chunk_mb, "receive_timeout_s": receive_timeout_s},
                        "optimizer": {"name": "sgd", "learning_rate": 0.1}, "train": {"steps": 10**9}})
    ps = build_ps(cfg, Path(tempfile.mkdtemp(prefix="switchps-hostile-")))
    server = Server(ps, "127.0.0.1:0")

    def state() -> dict:
        ps.store.wait_idle(10)
        return {"version": ps.store.version, "checksum": float(np.sum(ps.store.values, dtype=np.float64)),
                "rejections": dict(ps.rec.rejections)}

    answer(conn, server.port, lambda: sum(ps.rec.rejections.values()), state)
    server.stop(grace=None)


def answer(conn: Connection, port: int, counted: Callable[[], int], state: Callable[[], dict]) -> None:
    """A spawned server's side of ``Child``: send ``port``, then answer each request (a count) once
    ``counted()`` has reached it and ``SETTLE_S`` has passed, with the process's RSS, its peak since the
    last answer, and ``state()``; until ``stop``."""
    peak = Peak()
    conn.send(port)
    while (count := conn.recv()) != "stop":
        deadline = time.monotonic() + COUNTED_WAIT_S
        while counted() < count and time.monotonic() < deadline:
            time.sleep(0.05)
        time.sleep(SETTLE_S)
        conn.send({**state(), "rss_mb": rss_mb(), "peak_mb": peak.take()})


def rss_mb() -> float:
    return psutil.Process().memory_info().rss / MB


class Peak:
    """The process's largest RSS, sampled every ``PEAK_EVERY_S`` on a thread of its own."""

    def __init__(self) -> None:
        self._peak, self._lock = rss_mb(), threading.Lock()
        threading.Thread(target=self._sample, name="peak-rss", daemon=True).start()

    def _sample(self) -> None:
        while True:
            time.sleep(PEAK_EVERY_S)
            with self._lock:
                self._peak = max(self._peak, rss_mb())

    def take(self) -> float:
        """The peak since the last ``take``."""
        with self._lock:
            peak, self._peak = self._peak, rss_mb()
        return peak


class Child:
    """A server spawned in a process of its own (so the client's memory does not mix in), running
    ``target(conn, *args)``, which ``answer``s over the pipe."""

    def __init__(self, target: Callable[..., None], *args: object) -> None:
        self._conn, child = mp.get_context("spawn").Pipe()
        self.proc = mp.get_context("spawn").Process(target=target, args=(child, *args), daemon=True)
        self.proc.start()
        self.address = f"127.0.0.1:{self._receive()}"

    def _receive(self, timeout_s: float = 60.0) -> object:
        if not self._conn.poll(timeout_s):
            self.proc.kill()
            raise RuntimeError(f"the server process did not answer within {timeout_s:g}s")
        return self._conn.recv()

    def state(self, count: int = 0) -> dict:
        """The server's state once it has counted ``count`` (or ``COUNTED_WAIT_S`` has passed)."""
        self._conn.send(count)
        return self._receive()  # type: ignore[return-value]

    def close(self) -> None:
        if self.proc.is_alive():  # a PS an attack killed hears nothing
            self._conn.send("stop")
        self.proc.join(10)
        if self.proc.is_alive():
            self.proc.kill()


class HostilePS(Child):
    """A PS in a spawned process, a registered and initialized model, and a raw client to attack it."""

    def __init__(self, model_mb: float, chunk_mb: float = DEFAULT_CHUNK_BYTES / MB, workers: int = 1,
                 receive_timeout_s: float = 30.0) -> None:
        from switchps.worker.client import PSClient

        super().__init__(serve, chunk_mb, workers, receive_timeout_s)
        self.size = int(model_mb * MB) // 4
        self.chunk = int(chunk_mb * MB) // 4 * 4
        self.layout = make_layout([("w", (self.size,))])
        self.clients = [PSClient(self.address, self.chunk, timeout_s=60) for _ in range(workers)]
        for i, client in enumerate(self.clients):
            if client.register(i, self.layout, partition_size=100).send_init:
                client.init(i, self.layout, np.zeros(self.size, np.float32))
        self.channel = grpc.insecure_channel(self.address, options=[("grpc.max_send_message_length", 2**31 - 1)])
        self.call = self.channel.stream_stream(PUSH, request_serializer=None, response_deserializer=None)

    def close(self) -> None:
        self.channel.close()
        for client in self.clients:
            client.close()
        super().close()

    def frame0(self, **kw: object) -> bytes:
        fields: dict = dict(worker=0, base_version=0, samples=4, layout_digest=self.layout.digest,
                            nbytes=self.size * 4)
        fields.update(kw)
        return next(encode(pb.PushHeader(**fields)))

    def payload(self, extra: int, barrier: threading.Barrier | None = None) -> Iterator[bytes]:
        """The model's bytes in chunks (waiting at ``barrier`` once sent), then ``extra`` bytes more."""
        chunk = bytes(self.chunk)
        for i in range(0, self.size * 4, self.chunk):
            yield chunk[: min(self.chunk, self.size * 4 - i)]
        meet(barrier)
        if extra:
            yield bytes(extra)

    def push(self, frames: Iterator[bytes]) -> str:
        """The status code of a push of ``frames`` (``OK`` if it was accepted)."""
        try:
            list(self.call(frames, timeout=60))
            return "OK"
        except grpc.RpcError as e:
            return e.code().name


def meet(barrier: threading.Barrier | None, wait_s: float = 2.0) -> None:
    """Wait until every push of a concurrent attack is this far (a PS that reads fewer at once breaks it)."""
    if barrier is not None:
        try:
            barrier.wait(wait_s)
        except threading.BrokenBarrierError:
            pass


def attacks(ps: HostilePS, frame_mb: float, concurrent: int) -> dict[str, Callable[[], list[str]]]:
    big = bytes(int(frame_mb * MB))

    def oversize(barrier: threading.Barrier | None = None) -> Iterator[bytes]:
        yield ps.frame0()
        meet(barrier)
        yield big

    def too_long(barrier: threading.Barrier | None = None) -> Iterator[bytes]:
        yield ps.frame0()
        yield from ps.payload(ps.chunk, barrier)

    def together(make: Callable[[threading.Barrier], Iterator[bytes]]) -> Callable[[], list[str]]:
        def run() -> list[str]:
            barrier = threading.Barrier(concurrent)
            with ThreadPoolExecutor(concurrent) as pool:
                return list(pool.map(lambda _: ps.push(make(barrier)), range(concurrent)))
        return run

    return {
        "oversize_frame": lambda: [ps.push(oversize())],
        "huge_header_length": lambda: [ps.push(iter([struct.pack("<I", 2**32 - 1) + b"\x08\x00" * 8]))],
        "huge_nbytes": lambda: [ps.push(iter([ps.frame0(nbytes=2**40)]))],
        "payload_too_long": lambda: [ps.push(too_long())],
        "concurrent_too_long": together(too_long),
        "concurrent_oversize": together(oversize),
    }


def refused(codes: dict[str, Counter[str]]) -> int:
    return sum(n for c in codes.values() for code, n in c.items() if code != "OK")


def run(rounds: int, concurrent: int, model_mb: float, frame_mb: float, chunk_mb: float,
        only: list[str] | None = None) -> dict:
    """Attack a fresh PS for ``rounds`` rounds; its RSS and state before and after each."""
    ps = HostilePS(model_mb, chunk_mb)
    try:
        todo = {k: v for k, v in attacks(ps, frame_mb, concurrent).items() if not only or k in only}
        before = ps.state()
        codes: dict[str, Counter[str]] = {k: Counter() for k in todo}
        rss, peak = [round(before["rss_mb"], 1)], []
        for _ in range(rounds):
            for name, attack in todo.items():
                codes[name].update(attack())
            state = ps.state(refused(codes))
            rss.append(round(state["rss_mb"], 1))
            peak.append(round(state["peak_mb"], 1))
        after = ps.state(refused(codes))
    finally:
        ps.close()
    return {"benchmark": "hostile_memory", "rounds": rounds, "concurrent": concurrent, "model_mb": model_mb,
            "frame_mb": frame_mb, "chunk_mb": chunk_mb, "pushes_per_round": sum(
                concurrent if k.startswith("concurrent") else 1 for k in todo),
            "rss_mb": rss, "peak_rss_mb": peak, "growth_after_round_1_mb": round(rss[-1] - rss[1], 1),
            "codes": {k: dict(v) for k, v in codes.items()},
            "model_unchanged": after["version"] == before["version"] and after["checksum"] == before["checksum"],
            "rejections": after["rejections"]}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--rounds", type=int, default=4)
    ap.add_argument("--concurrent", type=int, default=8, help="pushes at once in the concurrent attacks")
    ap.add_argument("--model-mb", type=float, default=16.0)
    ap.add_argument("--frame-mb", type=float, default=65.0, help="the oversize frame")
    ap.add_argument("--chunk-mb", type=float, default=DEFAULT_CHUNK_BYTES / MB, help="the PS's runtime.chunk_mb")
    ap.add_argument("--only", nargs="+", help="run only these attacks")
    args = ap.parse_args()
    json.dump(run(args.rounds, args.concurrent, args.model_mb, args.frame_mb, args.chunk_mb, args.only),
              sys.stdout, indent=2)
    print()


if __name__ == "__main__":
    main()
