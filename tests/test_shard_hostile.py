"""A client written from the .proto alone against a sharded PS: shard 0's ``Follow`` stream and a follower's
``PushPart``, ``InitPart`` and ``PullPart``. Each bad request gets its status, is counted once under its
RPC's name (the guard's and the handler's alike), changes nothing, and leaves no traceback in a log."""

from __future__ import annotations

import logging
import threading
from collections.abc import Iterable
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import grpc
import numpy as np
import pytest

from switchps.security import auth
from switchps.security.channels import ClientSecurity
from switchps.errors import ShardLost
from switchps.protos import switchps_pb2 as pb
from switchps.ps_server.rpc.main import build_ps, prepare_run_dir
from switchps.ps_server.rpc.server import Server
from switchps.worker.client import PSClient
from test_sharded import SECRET, Sharded, config, grads, make, push  # noqa: F401 (make: a fixture)

FOLLOW = "/switchps.ParameterServer/Follow"
GARBAGE = b"\xff\xff\xff\xff\x0f"  # an invalid protobuf tag
StatusCode = grpc.StatusCode


def hello(shard: int) -> bytes:
    return pb.FollowerMessage(hello=shard).SerializeToString()


def follow(address: str, messages: Iterable[bytes], role: str | None = "shard", index: int = 1) -> grpc.RpcError:
    """A Follow call sending ``messages`` (an iterable of bytes) with ``role``'s token; the error it ends with."""
    channel = grpc.insecure_channel(address)
    call = channel.stream_stream(FOLLOW, request_serializer=None, response_deserializer=None)
    md = auth.metadata(auth.token(SECRET, role, index)) if role else None
    try:
        with pytest.raises(grpc.RpcError) as e:
            list(call(iter(messages), metadata=md, timeout=30))
        return e.value
    finally:
        channel.close()


def no_traceback(caplog: pytest.LogCaptureFixture) -> None:
    assert all(r.exc_info is None and "Traceback" not in r.getMessage() for r in caplog.records), \
        [r.getMessage() for r in caplog.records if r.exc_info or "Traceback" in r.getMessage()]


def still_serves(s: Sharded) -> None:
    """The followers are attached and a push is applied on every shard."""
    assert s.ps.admission.leader.lost is None and s.ps.admission.leader.attached  # type: ignore[attr-defined]
    version = s.ps.core.version
    assert push(s.clients[0], 0, 0, grads(0, 0), version).applied
    assert [f.store.version for f in s.followers] == [version + 1]


def test_garbage_on_follow_is_invalid_argument_counted_without_a_traceback(make, caplog):
    s = make(2, tokens=True, protocol={"name": "asp"})
    with caplog.at_level(logging.INFO):
        for _ in range(3):
            err = follow(s.clients[0].address, [GARBAGE])
            assert err.code() == StatusCode.INVALID_ARGUMENT, err.details()
            assert "not a valid FollowerMessage" in err.details()
        still_serves(s)
    assert s.ps.rec.rejections == {"follow:malformed": 3}
    no_traceback(caplog)


def test_every_refused_follow_is_counted_once_and_the_run_goes_on(make, caplog):
    s = make(2, tokens=True, protocol={"name": "asp"})
    s.ps.admission.leader.wait_s = 0.5  # how long shard 0 waits for a hello (and for a verdict: set back below)
    verdict = pb.FollowerMessage(verdict=pb.Verdict(key=pb.PartKey(worker=0))).SerializeToString()
    held = threading.Event()

    def silent():  # a stream that sends nothing until the test is done with it
        held.wait(30)
        yield from ()

    cases = [  # messages, the token's role and index, the status, what it is counted as
        ([hello(1)], None, 0, StatusCode.UNAUTHENTICATED, "no_token"),
        ([hello(1)], "worker", 0, StatusCode.PERMISSION_DENIED, "role"),
        ([], "shard", 1, StatusCode.INVALID_ARGUMENT, "empty"),
        (silent(), "shard", 1, StatusCode.DEADLINE_EXCEEDED, "idle"),
        ([verdict, hello(1)], "shard", 1, StatusCode.INVALID_ARGUMENT, "hello"),
        ([hello(5)], "shard", 5, StatusCode.INVALID_ARGUMENT, "shard"),
        ([hello(1)], "shard", 2, StatusCode.PERMISSION_DENIED, "identity"),
        ([hello(1)], "shard", 1, StatusCode.FAILED_PRECONDITION, "attached"),  # shard 1 is attached
    ]
    with caplog.at_level(logging.INFO):
        try:
            for messages, role, index, code, reason in cases:
                err = follow(s.clients[0].address, messages, role, index)
                assert err.code() == code, (reason, err.details())
        finally:
            held.set()
        s.ps.admission.leader.wait_s = 5.0
        still_serves(s)
    assert s.ps.rec.rejections == {f"follow:{reason}": 1 for *_, reason in cases}
    assert s.followers[0].rejections == {}
    no_traceback(caplog)


def test_a_malformed_message_from_an_attached_follower_ends_its_stream_counted(tmp_path: Path, caplog):
    """Shard 0 alone; this test attaches as shard 1, then sends bytes that are no message."""
    cfg = config(2, 1, {"name": "asp"})
    ps = build_ps(cfg, tmp_path, prepare_run_dir(cfg, tmp_path, False))
    server = Server(ps, "127.0.0.1:0")
    try:
        with caplog.at_level(logging.INFO):
            err = follow(f"127.0.0.1:{server.port}", [hello(1), GARBAGE], role=None)
        assert err.code() == StatusCode.INVALID_ARGUMENT, err.details()
        assert ps.rec.rejections == {"follow:malformed": 1}
        failed = ps.failed
        assert isinstance(failed, ShardLost), "shard 0 stops, as when a follower leaves"
        no_traceback(caplog)
    finally:
        server.stop(grace=None)


def part_client(s: Sharded, role: str, index: int) -> PSClient:
    """A client of follower 1 with ``role`` ``index``'s token."""
    return PSClient(s.clients[0].clients[1].address, security=ClientSecurity(auth.token(SECRET, role, index)))


def part_header(s: Sharded, worker: int, step: int) -> pb.PartHeader:
    return pb.PartHeader(key=pb.PartKey(worker=worker, session=7, step=step, attempt=step),
                         layout_digest=s.clients[0].layouts[1].digest)


def test_three_orphan_parts_are_refused_and_counted_three_times(make):
    s = make(2, tokens=True, protocol={"name": "asp"}, follower_timeout_s=0.5)
    n = s.clients[0].partition.sizes()[1]

    def orphan(worker: int, step: int) -> grpc.StatusCode:  # a part sent to follower 1 only: shard 0 never names it
        client = part_client(s, "worker", worker)
        try:
            with pytest.raises(grpc.RpcError) as e:
                client.part("PushPart", part_header(s, worker, step), np.ones(n, np.float32), np.empty(n, np.float32))
            return e.value.code()
        finally:
            client.close()

    with ThreadPoolExecutor(3) as pool:  # two of worker 0's (all it may hold at once) and one of worker 1's
        assert list(pool.map(orphan, [0, 0, 1], [100, 101, 102])) == [StatusCode.ABORTED] * 3
    summary = s.followers[0].summary()
    assert summary["rejections"] == {"push_part:orphan": 3} and summary["parts_waiting"] == 0
    assert s.ps.rec.rejections == {} and s.followers[0].store.version == s.ps.core.version == 0


def test_an_orphan_part_through_a_segment_is_refused_counted_and_its_worker_attaches_with_its_token(make):
    """Through the follower's socket too: the token is checked, and a part shard 0 never names expires."""
    s = make(2, tokens=True, protocol={"name": "asp"}, follower_timeout_s=0.5)
    n = s.clients[0].partition.sizes()[1]
    stranger, client = part_client(s, "worker", 1), part_client(s, "worker", 0)
    try:
        with pytest.raises(grpc.RpcError) as e:
            stranger.attach(0, n * 4)  # worker 1's token, attaching as worker 0
        assert e.value.code() == StatusCode.PERMISSION_DENIED
        assert client.attach(0, n * 4) and client.socket_path
        with pytest.raises(grpc.RpcError) as e:
            client.part("PushPart", part_header(s, 0, 100), np.ones(n, np.float32), np.empty(n, np.float32))
        assert e.value.code() == StatusCode.ABORTED
    finally:
        stranger.close()
        client.close()
    summary = s.followers[0].summary()
    assert summary["rejections"] == {"attach:identity": 1, "push_part:orphan": 1}
    assert summary["parts_waiting"] == 0 and summary["bytes_in_shared"] == n * 4
    assert s.ps.rec.rejections == {} and s.followers[0].store.version == s.ps.core.version == 0


def test_a_follower_refuses_a_token_for_a_worker_that_does_not_exist_or_another_worker(make):
    s = make(2, tokens=True, protocol={"name": "asp"})
    n = s.clients[0].partition.sizes()[1]
    before = s.followers[0].store.values.copy()
    stranger, evaluator = part_client(s, "worker", 7), part_client(s, "evaluator", 0)
    out = np.empty(n, np.float32)
    with pytest.raises(grpc.RpcError) as e:
        stranger.pull_part(out, 7, 0)  # worker 7 of a run of 2
    assert e.value.code() == StatusCode.INVALID_ARGUMENT and "unknown worker id 7" in e.value.details()
    with pytest.raises(grpc.RpcError) as e:
        stranger.pull_part(out, 0, 0)
    assert e.value.code() == StatusCode.PERMISSION_DENIED
    with pytest.raises(grpc.RpcError) as e:
        stranger.part("PushPart", part_header(s, 7, 0), np.ones(n, np.float32), out)
    assert e.value.code() == StatusCode.INVALID_ARGUMENT
    assert evaluator.pull_part(out, -1, 0).version == 0, "the evaluator pulls as -1"
    stranger.close()
    evaluator.close()
    assert s.followers[0].rejections == {"pull_part:unknown_worker": 1, "pull_part:identity": 1,
                                         "push_part:unknown_worker": 1}
    assert s.followers[0].summary()["parts_waiting"] == 0
    assert np.array_equal(s.followers[0].store.values, before) and s.ps.rec.rejections == {}


def test_a_refused_init_part_is_worded_and_counted_as_init_part(make):
    s = make(2, tokens=True, protocol={"name": "asp"})
    n = s.clients[0].partition.sizes()[1]
    other, anonymous = part_client(s, "worker", 1), PSClient(s.clients[0].clients[1].address)
    values, out = np.ones(n, np.float32), np.empty(n, np.float32)
    with pytest.raises(grpc.RpcError) as e:
        other.part("InitPart", part_header(s, 0, -1), values, out)  # worker 1's token, as worker 0
    assert e.value.code() == StatusCode.PERMISSION_DENIED and "InitPart as worker 0" in e.value.details()
    with pytest.raises(grpc.RpcError) as e:
        other.part("InitPart", part_header(s, 1, -1), values[:-1], out)  # one value short
    assert e.value.code() == StatusCode.INVALID_ARGUMENT
    for rpc in ("InitPart", "PushPart"):
        with pytest.raises(grpc.RpcError) as e:
            anonymous.part(rpc, part_header(s, 0, -1), values, out)
        assert e.value.code() == StatusCode.UNAUTHENTICATED
    other.close()
    anonymous.close()
    assert s.followers[0].rejections == {"init_part:identity": 1, "init_part:size": 1, "init_part:no_token": 1,
                                         "push_part:no_token": 1}
    assert s.followers[0].summary()["parts_waiting"] == 0 and s.ps.rec.rejections == {}
