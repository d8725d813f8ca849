"""What one worker's token can hold on a PS and on a follower shard (``receiving.Slots``).

``stalls``: a PS of 2 workers (``runtime.receive_timeout_s``: ``--receive-timeout-s``) in a process of its
own; ``--streams`` streams open at once, half sending worker 0's valid push header and then nothing, half
sending nothing. A second later worker 1 pushes: its outcome and seconds. Then every stream is let go,
and each stream's status and the PS's refusals are reported.

``orphans``: a PS of 2 shards, the follower in a process of its own; worker 0 sends the follower
``--parts`` valid parts of ``--part-mb`` at once, naming pushes it never sends shard 0. The follower's
RSS idle (``rss_idle_mb``), once every part is kept or refused (``rss_held_mb``, and the peak), and a
second after every call has ended (the kept parts expire after twice the receive timeout:
``rss_after_mb``); every part's status and the follower's refusals. Prints JSON.

    python bench/hostile_slots.py stalls [--streams 100] [--receive-timeout-s 10]
    python bench/hostile_slots.py orphans [--parts 160] [--part-mb 4] [--receive-timeout-s 5]
"""

from __future__ import annotations

import argparse
import json
import secrets
import sys
import tempfile
import threading
import time
from collections import Counter
from collections.abc import Iterator
from multiprocessing.connection import Connection
from pathlib import Path

import grpc
import numpy as np

from hostile_memory import MB, SETTLE_S, Child, HostilePS, answer
from switchps.config.run import RunConfig, parse_config
from switchps.protos import switchps_pb2 as pb
from switchps.protos.codec import encode
from switchps.protos.layout import make_layout

PART_PUSH = "/switchps.ParameterServer/PushPart"


def _codes(calls: list[grpc.Future]) -> dict[str, int]:
    """Each call's status, once it has ended."""
    out: Counter[str] = Counter()
    for call in calls:
        try:
            list(call)
            out["OK"] += 1
        except grpc.RpcError as e:
            out[e.code().name] += 1
    return dict(out)


def stalls(streams: int, receive_timeout_s: float, model_mb: float = 1.0) -> dict:
    """Worker 1's push while worker 0's streams stall (see the module docstring)."""
    ps = HostilePS(model_mb, workers=2, receive_timeout_s=receive_timeout_s)
    let_go = threading.Event()

    def stalled(header: bool) -> Iterator[bytes]:
        if header:
            yield ps.frame0()
        let_go.wait(4 * receive_timeout_s)

    try:
        calls = [ps.call(stalled(i % 2 == 0), timeout=4 * receive_timeout_s) for i in range(streams)]
        time.sleep(SETTLE_S)  # every stream is open on the PS
        header = pb.PushHeader(worker=1, samples=4, layout_digest=ps.layout.digest, nbytes=ps.size * 4)
        t0 = time.perf_counter()
        try:
            reply = ps.clients[1].push(header, np.ones(ps.size, np.float32), np.empty(ps.size, np.float32)).reply
            outcome = "applied" if reply.applied else f"dropped ({reply.note})"
        except grpc.RpcError as e:
            outcome = e.code().name
        seconds = time.perf_counter() - t0
        let_go.set()
        codes = _codes(calls)
        state = ps.state()
    finally:
        let_go.set()
        ps.close()
    return {"benchmark": "hostile_slots stalls", "streams": streams, "with_header": (streams + 1) // 2,
            "receive_timeout_s": receive_timeout_s, "worker_1_push": outcome, "worker_1_push_s": round(seconds, 2),
            "stream_codes": codes, "rejections": state["rejections"]}


def _config(part_mb: float, receive_timeout_s: float) -> RunConfig:
    return parse_config({"cluster": {"ps": ["127.0.0.1:0", "127.0.0.1:0"], "workers": 2},
                         "protocol": {"name": "asp"}, "optimizer": {"name": "sgd", "learning_rate": 0.1},
                         "train": {"steps": 10**9}, "checkpoint": {"every_s": None},
                         "runtime": {"shard_max_mb": part_mb, "receive_timeout_s": receive_timeout_s}})


def follow(conn: Connection, leader: str, part_mb: float, receive_timeout_s: float) -> None:
    """Follower shard 1 (spawned child), as ``follower_main`` builds it; a state request names how many
    parts must be kept or refused (counted) before the answer."""
    from switchps.security.channels import ClientSecurity
    from switchps.protos.heap import one_arena
    from switchps.ps_server.shard.follower import Follower
    from switchps.ps_server.store import ModelStore
    from switchps.optim.optimizers import optimizer_factory
    from switchps.ps_server.rpc.server import Server

    one_arena()
    cfg = _config(part_mb, receive_timeout_s)
    store = ModelStore(optimizer_factory(cfg.optimizer), cfg.runtime.chunk_bytes, workers=cfg.cluster.num_workers)
    follower = Follower(1, 2, leader, ClientSecurity(), store, cfg.runtime.shard_max_bytes, receive_timeout_s,
                        Path(tempfile.mkdtemp(prefix="switchps-follower-")), workers=cfg.cluster.num_workers)
    server = Server(follower, "127.0.0.1:0")

    def summary() -> dict:
        return server.call(follower.summary)

    def counted() -> int:
        s = summary()
        return s["parts_waiting"] + sum(s["rejections"].values())

    answer(conn, server.port, counted, summary)
    server.stop(grace=None)


def orphans(parts: int, part_mb: float, receive_timeout_s: float) -> dict:
    """A follower's memory under one worker's orphan parts (see the module docstring)."""
    from switchps.security.channels import ClientSecurity
    from switchps.ps_server.rpc.main import build_ps
    from switchps.ps_server.rpc.server import Server
    from switchps.worker.client import Reconnect
    from switchps.worker.sharded import ShardedClient

    cfg = _config(part_mb, receive_timeout_s)
    shard0 = build_ps(cfg, Path(tempfile.mkdtemp(prefix="switchps-shard0-")))
    server = Server(shard0, "127.0.0.1:0")
    follower = Child(follow, f"127.0.0.1:{server.port}", part_mb, receive_timeout_s)
    n = int(part_mb * MB) // 4
    layout = make_layout([("a", (n,)), ("b", (n,))])
    clients = [ShardedClient([f"127.0.0.1:{server.port}", follower.address], layout, cfg.runtime.shard_max_bytes,
                             cfg.runtime.chunk_bytes, ClientSecurity()) for _ in range(2)]
    channel = grpc.insecure_channel(follower.address)
    try:
        for i, c in enumerate(clients):
            if Reconnect(c.address, 30.0)(lambda: c.register(i, layout, 100)).send_init:  # the follower attaches
                c.init(i, layout, np.zeros(2 * n, np.float32))
        idle = follower.state()
        part = clients[0].layouts[1]
        chunk = bytes(cfg.runtime.chunk_bytes)
        payload = [chunk[: min(len(chunk), n * 4 - i)] for i in range(0, n * 4, len(chunk))]

        def orphan(step: int) -> Iterator[bytes]:
            key = pb.PartKey(worker=0, session=1, step=step, attempt=secrets.randbits(62))
            yield next(encode(pb.PartHeader(key=key, layout_digest=part.digest, nbytes=n * 4)))
            yield from payload

        call = channel.stream_stream(PART_PUSH, request_serializer=None, response_deserializer=None)
        calls = [call(orphan(step), timeout=10 * receive_timeout_s) for step in range(parts)]
        held = follower.state(parts)
        codes = _codes(calls)
        after = follower.state()
    finally:
        channel.close()
        for c in clients:
            c.close()
        follower.close()
        server.stop(grace=None)
    return {"benchmark": "hostile_slots orphans", "parts": parts, "part_mb": part_mb,
            "receive_timeout_s": receive_timeout_s, "rss_idle_mb": round(idle["rss_mb"], 1),
            "rss_held_mb": round(held["rss_mb"], 1), "parts_kept": held["parts_waiting"],
            "rss_peak_mb": round(max(held["peak_mb"], after["peak_mb"]), 1), "rss_after_mb": round(after["rss_mb"], 1),
            "part_codes": codes, "rejections": after["rejections"], "parts_waiting_after": after["parts_waiting"]}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    sub = ap.add_subparsers(dest="case", required=True)
    s = sub.add_parser("stalls")
    s.add_argument("--streams", type=int, default=100)
    s.add_argument("--receive-timeout-s", type=float, default=10.0)
    o = sub.add_parser("orphans")
    o.add_argument("--parts", type=int, default=160)
    o.add_argument("--part-mb", type=float, default=4.0)
    o.add_argument("--receive-timeout-s", type=float, default=5.0)
    args = ap.parse_args()
    if args.case == "stalls":
        result = stalls(args.streams, args.receive_timeout_s)
    else:
        result = orphans(args.parts, args.part_mb, args.receive_timeout_s)
    json.dump(result, sys.stdout, indent=2)
    print()


if __name__ == "__main__":
    main()
