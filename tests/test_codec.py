"""Frame codec round trips around chunk boundaries, and models far beyond gRPC's 4 MiB default."""

from __future__ import annotations

import numpy as np
import pytest

from switchps.protos import switchps_pb2 as pb
from switchps.protos.codec import (
    COPIES, INLINE_BYTES, WHOLE_BYTES, FrameError, decode_header, encode_array, receive_into,
)
from switchps.ps_server.rpc.service import ParameterServer

pytest_plugins = ["cluster"]  # cluster_factory: a PS on loopback

CHUNK = 4096  # bytes
WHOLE_FLOATS = WHOLE_BYTES // 4


@pytest.mark.parametrize("floats", [0, 1, CHUNK // 4 - 1, CHUNK // 4, CHUNK // 4 + 1, 3 * CHUNK // 4,
                                    INLINE_BYTES // 4, INLINE_BYTES // 4 + 1, 10 * CHUNK // 4 + 7])
def test_round_trip_around_chunk_boundaries(floats):
    values = np.random.default_rng(floats).standard_normal(floats).astype(np.float32)
    header = pb.PushHeader(worker=3, samples=7, nbytes=values.nbytes)
    frames = list(encode_array(header, values, CHUNK))
    one_message = values.nbytes <= INLINE_BYTES  # inlined in frame 0 (or empty)
    assert len(frames) == (1 if one_message else 1 + -(-values.nbytes // CHUNK))
    assert all(len(f) <= CHUNK + 64 for f in frames[1:])
    got_header, first = decode_header(frames[0], pb.PushHeader)
    assert got_header == header
    out = np.empty(floats, np.float32)
    receive_into(first, iter(frames[1:]), out)
    np.testing.assert_array_equal(out, values)


def test_receive_rejects_short_and_long_payloads():
    n = INLINE_BYTES // 4 + 100  # streamed, not inlined
    values = np.ones(n, np.float32)
    frames = list(encode_array(pb.PushHeader(), values, CHUNK))
    _, first = decode_header(frames[0], pb.PushHeader)
    with pytest.raises(FrameError, match="expected"):
        receive_into(first, iter(frames[1:-1]), np.empty(n, np.float32))
    with pytest.raises(FrameError, match="exceeds"):
        receive_into(first, iter(frames[1:]), np.empty(n - 1, np.float32))


def test_decode_rejects_bad_frame0():
    with pytest.raises(FrameError):
        decode_header(b"\x00", pb.PushHeader)
    with pytest.raises(FrameError):
        decode_header(b"\xff\x00\x00\x00abc", pb.PushHeader)


def test_100mb_push_and_pull(cluster_factory):
    """25M float32 parameters (100 MB) cross the wire both ways without a 'larger than max' error."""
    size = 25_000_000
    c = cluster_factory(workers=1, size=size, protocol={"name": "asp"})
    w = c.workers[0]
    grad = np.full(size, 2.0, np.float32)
    grad[-1] = 4.0
    r = w.push(grad, 2)
    assert r.reply.applied and r.fresh and r.order.version == 1
    assert w.params[0] == -1.0 and w.params[-1] == -2.0 and w.params[size // 2] == -1.0
    fresh = np.zeros(size, np.float32)
    pulled = w.client.pull(fresh)
    assert pulled.fresh and pulled.order.version == 1
    np.testing.assert_array_equal(fresh, w.params)


@pytest.mark.parametrize("size, chunk_bytes, rpc", [(WHOLE_FLOATS, None, "PushSmall"), (WHOLE_FLOATS + 1, None, "Push"),
                                                    (2 * WHOLE_FLOATS, 2 * WHOLE_BYTES, "PushSmall")])
def test_a_push_of_at_most_whole_bytes_or_a_chunk_is_one_message_and_a_larger_one_a_stream(
        cluster_factory, monkeypatch, size, chunk_bytes, rpc):
    """The client picks the RPC by the chunk size it shares with the PS; either way the update is applied
    whole and the reply brings the new values."""
    called: list[str] = []
    small, stream = ParameterServer.push_small, ParameterServer.push

    async def push_small(self, frame, ctx):
        called.append("PushSmall")
        return await small(self, frame, ctx)

    async def push(self, requests, ctx):
        called.append("Push")
        async for frame in stream(self, requests, ctx):
            yield frame

    monkeypatch.setattr(ParameterServer, "push_small", push_small)
    monkeypatch.setattr(ParameterServer, "push", push)
    c = cluster_factory(workers=1, size=size, protocol={"name": "asp"}, chunk_bytes=chunk_bytes)
    w = c.workers[0]
    grad = np.arange(size, dtype=np.float32)
    r = w.push(grad, 1)
    assert called == [rpc]
    assert r.reply.applied and r.fresh and r.order.version == 1
    np.testing.assert_array_equal(w.params, -grad)
    np.testing.assert_array_equal(c.params, -grad)


@pytest.mark.parametrize("size", [1000, 100_000])  # 4 KB: inside frame 0 of any reply; 400 KB: past it
def test_a_push_small_reply_is_made_from_the_values_in_one_copy_and_a_pull_still_reads_the_version(
        cluster_factory, size):
    """Per push, the payload is copied four times: into the client's frame, into the PS's receive buffer,
    into the reply (straight from the values: the version's snapshot makes no chunks) and out of it. A pull
    of that version has the snapshot's chunks made then, and gets its values."""
    c = cluster_factory(workers=1, size=size, protocol={"name": "asp"})
    w = c.workers[0]
    before = COPIES.bytes_copied
    assert w.push(np.ones(size, np.float32), 1).reply.applied
    assert COPIES.bytes_copied - before == 4 * 4 * size
    fresh = np.zeros(size, np.float32)
    assert w.client.pull(fresh).order.version == 1
    np.testing.assert_array_equal(fresh, -np.ones(size))


def test_all_finite_is_exact_even_when_the_fast_sum_overflows():
    from switchps.protos.codec import all_finite

    huge = np.full(1000, 3e38, np.float32)  # finite values whose float32 sum overflows
    assert all_finite(huge)
    assert all_finite(np.full(1000, 2e19, np.float32))  # finite values whose squares overflow
    for bad in (np.nan, np.inf, -np.inf):
        x = huge.copy()
        x[500] = bad
        assert not all_finite(x)
    x = np.ones(10, np.float32)
    x[[1, 2]] = [np.inf, -np.inf]  # inf + -inf = nan: still caught
    assert not all_finite(x)


def test_receive_checks_finiteness_frame_by_frame():
    values = np.ones(INLINE_BYTES // 4 + 3000, np.float32)
    values[-1] = np.nan  # in the last frame
    frames = list(encode_array(pb.PushHeader(), values, 4096))
    _, first = decode_header(frames[0], pb.PushHeader)
    out = np.empty(values.size, np.float32)
    assert receive_into(first, iter(frames[1:]), out, check_finite=True) is False
    values[-1] = 1.0
    frames = list(encode_array(pb.PushHeader(), values, 4096))
    _, first = decode_header(frames[0], pb.PushHeader)
    assert receive_into(first, iter(frames[1:]), out, check_finite=True) is True
