"""One worker's token cannot starve the others: what an identity may hold on a PS, on shard 0 and on a
follower shard is bounded per identity (``receiving.Slots``), and a follower's orphan parts cost bounded
memory that goes back to the OS."""

from __future__ import annotations

import importlib
import secrets
import threading
from collections.abc import Iterator
from pathlib import Path

import grpc
import numpy as np
import pytest

from conftest import wait_until
from switchps.protos import switchps_pb2 as pb
from switchps.protos.codec import encode
from switchps.ps_server.receiving import EACH, Slots
from switchps.refusals import Rejected
from test_sharded import grads, push, start

pytest_plugins = ["cluster"]  # cluster_factory: a PS on loopback

PS = "/switchps.ParameterServer/"
ORPHANS = 40
PART_MB = 4.0
ABOVE_IDLE_MB = 64
"""Follower RSS allowed above its idle size while one worker's orphan parts are held and after they
expired: the 2 kept parts and the pool's 3 free buffers are 20 MiB. Measured +3 to +12 MB with 40 and
with 160 parts; before the bound, +800 MB with 160 parts, and it stayed after they expired."""


def test_each_worker_holds_at_most_its_own_slots():
    slots = Slots(workers=2)
    for _ in range(EACH):
        slots.take(0)
    with pytest.raises(Rejected) as busy:
        slots.take(0)
    assert (busy.value.code, busy.value.reason) == ("RESOURCE_EXHAUSTED", "busy")
    with slots.holding(1):  # worker 0's are all held: worker 1's are its own
        assert (slots.held(0), slots.held(1)) == (EACH, 1)
    with pytest.raises(ValueError), slots.holding(1):
        raise ValueError("a refused payload")
    assert slots.held(1) == 0, "released when the body raises"
    slots.release(0)
    slots.take(0)
    for stranger in (2, -1):
        with pytest.raises(Rejected) as unknown:
            slots.take(stranger)
        assert (unknown.value.code, unknown.value.reason) == ("INVALID_ARGUMENT", "unknown_worker")


def _calls(channel: grpc.Channel, method: str, frames: list[Iterator[bytes]]) -> list:
    call = channel.stream_stream(PS + method, request_serializer=None, response_deserializer=None)
    return [call(f, timeout=120) for f in frames]


def _code(call) -> grpc.StatusCode:
    with pytest.raises(grpc.RpcError) as err:
        list(call)
    return err.value.code()


@pytest.mark.parametrize("stalled, silent", [(3, 0), (50, 50)])
def test_one_workers_stalled_pushes_never_delay_another_workers(cluster_factory, stalled, silent):
    c = cluster_factory(workers=2, size=16, protocol={"name": "asp"}, receive_timeout_s=120.0)
    let_go = threading.Event()

    def stall(header: bool) -> Iterator[bytes]:
        if header:  # a valid header, then nothing: the PS holds a slot for its payload
            yield next(encode(pb.PushHeader(worker=0, samples=4, layout_digest=c.layout.digest, nbytes=16 * 4)))
        let_go.wait(120)

    channel = grpc.insecure_channel(c.address)
    calls = _calls(channel, "Push", [stall(i < stalled) for i in range(stalled + silent)])
    try:
        held = lambda: c.server.call(lambda: c.store.slots.held(0))  # noqa: E731
        refused = lambda: [call for call in calls if call.done()]  # noqa: E731
        wait_until(lambda: held() == EACH and c.rec.rejections["push:busy"] == len(refused()) == stalled - EACH,
                   what="worker 0's stalls to hold its slots and the rest to be refused")
        assert c.workers[1].push(np.ones(16, np.float32), 4).reply.applied and c.core.version == 1
        assert held() == EACH and len(refused()) == stalled - EACH, \
            "worker 1's push was applied while worker 0's stalls were still held open"
        assert c.server.call(lambda: c.store.slots.held(1)) == 0
        assert {_code(call) for call in refused()} == {grpc.StatusCode.RESOURCE_EXHAUSTED}
    finally:
        let_go.set()
        channel.close()


def _part0(s, worker: int, attempt: int) -> bytes:
    """A valid push of ``worker`` to shard 0 alone: its header and part 0, in one frame."""
    client = s.clients[worker]
    part = np.ascontiguousarray(client.partition.split(grads(worker, 0))[0])
    header = pb.PushHeader(worker=worker, samples=4, layout_digest=client.layouts[0].digest, nbytes=part.nbytes,
                           session=7, stats=pb.StepStats(step=0), attempt=attempt)
    return next(encode(header)) + part.tobytes()


def test_pushes_that_wait_on_shard_zero_for_their_parts_hold_only_their_workers_slots(tmp_path: Path):
    s = start(tmp_path, 3, protocol={"name": "asp"})
    channel = grpc.insecure_channel(f"127.0.0.1:{s.servers[0].port}")
    try:
        calls = _calls(channel, "Push", [iter([_part0(s, 0, attempt)]) for attempt in range(3)])
        held = lambda w: s.servers[0].call(lambda: s.ps.store.slots.held(w))  # noqa: E731
        wait_until(lambda: held(0) == EACH and s.ps.rec.rejections["push:busy"] == 1,
                   what="two pushes waiting for the followers' verdicts, the third refused")
        assert push(s.clients[1], 1, 0, grads(1, 0), 0).applied, "worker 1 is not held off"
        assert held(0) == EACH and held(1) == 0
        codes = sorted(_code(call).name for call in calls)
        assert codes == ["RESOURCE_EXHAUSTED", "UNAVAILABLE", "UNAVAILABLE"], "the parts never came"
        assert held(0) == 0 and s.ps.core.version == 1
    finally:
        _close(s, channel)


def _close(s, channel: grpc.Channel) -> None:
    """Stop what a sharded test started: the hand-made channel, every server and every client."""
    channel.close()
    for server in s.servers:
        server.stop(grace=None)
    for client in s.clients:
        client.close()


def _orphan(s, worker: int, step: int) -> Iterator[bytes]:
    """A valid part for follower 1 of a push that shard 0 never sees."""
    client = s.clients[worker]
    part = np.ascontiguousarray(client.partition.split(grads(worker, step))[1])
    key = pb.PartKey(worker=worker, session=7, step=step, attempt=secrets.randbits(62))
    yield next(encode(pb.PartHeader(key=key, layout_digest=client.layouts[1].digest, nbytes=part.nbytes)))
    yield part.tobytes()


def test_a_workers_orphan_parts_on_a_follower_hold_only_its_slots(tmp_path: Path):
    s = start(tmp_path, 2, protocol={"name": "asp"})
    follower, server = s.followers[0], s.servers[1]
    channel = grpc.insecure_channel(f"127.0.0.1:{server.port}")
    try:
        calls = _calls(channel, "PushPart", [_orphan(s, 0, step) for step in range(EACH + 3)])
        held = lambda w: server.call(lambda: follower.store.slots.held(w))  # noqa: E731
        refused = lambda: [call for call in calls if call.done()]  # noqa: E731
        wait_until(lambda: held(0) == EACH and follower.rejections["push_part:busy"] == len(refused()) == 3,
                   what="two orphan parts kept, the rest refused")
        assert server.call(follower.summary)["parts_waiting"] == EACH
        assert push(s.clients[1], 1, 0, grads(1, 0), 0).applied, "worker 1's parts are not held off"
        assert held(1) == 0, "a part applied frees its slot"
        assert held(0) == EACH and {_code(call) for call in refused()} == {grpc.StatusCode.RESOURCE_EXHAUSTED}
        assert s.ps.rec.rejections["push:busy"] == 0, "shard 0 never saw these pushes"
    finally:
        _close(s, channel)


def _bench(monkeypatch: pytest.MonkeyPatch):
    """The bench, importable by name while the test runs, as the follower process it spawns imports it."""
    monkeypatch.syspath_prepend(str(Path(__file__).resolve().parents[1] / "bench"))
    return importlib.import_module("hostile_slots")


@pytest.mark.integration
def test_a_followers_memory_under_one_workers_orphan_parts_is_bounded_and_returns(monkeypatch):
    r = _bench(monkeypatch).orphans(parts=ORPHANS, part_mb=PART_MB, receive_timeout_s=2.0)
    assert r["part_codes"] == {"ABORTED": EACH, "RESOURCE_EXHAUSTED": ORPHANS - EACH}, r
    assert r["parts_kept"] == EACH and r["parts_waiting_after"] == 0
    assert r["rejections"]["push_part:busy"] == ORPHANS - EACH
    assert r["rss_held_mb"] - r["rss_idle_mb"] < ABOVE_IDLE_MB, r
    assert r["rss_after_mb"] - r["rss_idle_mb"] < ABOVE_IDLE_MB, r


@pytest.mark.integration
def test_the_stall_bench_measures_worker_1s_push_applied_among_worker_0s_stalls(monkeypatch):
    r = _bench(monkeypatch).stalls(streams=10, receive_timeout_s=30.0)
    assert r["worker_1_push"] == "applied" and r["with_header"] == 5, r
    assert r["rejections"]["push:busy"] == r["stream_codes"]["RESOURCE_EXHAUSTED"] == 5 - EACH, r
