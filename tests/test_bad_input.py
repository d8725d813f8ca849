"""Malformed and hostile pushes get an error status, leave the model untouched, and are counted."""

from __future__ import annotations

import json

import grpc
import numpy as np
import pytest

from switchps.protos import switchps_pb2 as pb
from switchps.protos.codec import encode

pytest_plugins = ["cluster"]  # cluster_factory: a PS on loopback

SIZE = 16


def _raw_push(c, frames: list[bytes]) -> grpc.RpcError:
    channel = grpc.insecure_channel(c.address)
    call = channel.stream_stream("/switchps.ParameterServer/Push", request_serializer=None,
                                 response_deserializer=None)
    with pytest.raises(grpc.RpcError) as err:
        list(call(iter(frames), timeout=10))
    channel.close()
    return err.value


def _header(c, **kw) -> pb.PushHeader:
    fields = dict(worker=0, base_version=0, samples=4, layout_digest=c.layout.digest, nbytes=SIZE * 4)
    fields.update(kw)
    return pb.PushHeader(**fields)


def _payload(values=None) -> bytes:
    return np.ones(SIZE, np.float32).tobytes() if values is None else np.asarray(values, np.float32).tobytes()


CASES = {
    "wrong_byte_count": (lambda c: [next(encode(_header(c, nbytes=SIZE * 4))) + _payload()[:-4]],
                         grpc.StatusCode.INVALID_ARGUMENT, "size"),
    "declared_size_mismatch": (lambda c: [next(encode(_header(c, nbytes=12))) + _payload()],
                               grpc.StatusCode.INVALID_ARGUMENT, "size"),
    "unknown_worker": (lambda c: [next(encode(_header(c, worker=99))) + _payload()],
                       grpc.StatusCode.INVALID_ARGUMENT, "unknown_worker"),
    "non_finite": (lambda c: [next(encode(_header(c))) + _payload([np.nan] + [1.0] * (SIZE - 1))],
                   grpc.StatusCode.INVALID_ARGUMENT, "non_finite"),
    "infinite": (lambda c: [next(encode(_header(c))) + _payload([np.inf] * SIZE)],
                 grpc.StatusCode.INVALID_ARGUMENT, "non_finite"),
    "zero_samples": (lambda c: [next(encode(_header(c, samples=0))) + _payload()],
                     grpc.StatusCode.INVALID_ARGUMENT, "samples"),
    "negative_samples": (lambda c: [next(encode(_header(c, samples=-3))) + _payload()],
                         grpc.StatusCode.INVALID_ARGUMENT, "samples"),
    "future_version": (lambda c: [next(encode(_header(c, base_version=7))) + _payload()],
                       grpc.StatusCode.INVALID_ARGUMENT, "version"),
    "unknown_layout": (lambda c: [next(encode(_header(c, layout_digest="feed"))) + _payload()],
                       grpc.StatusCode.FAILED_PRECONDITION, "layout"),
    "garbage_header": (lambda c: [b"\xff\xff\x00\x00garbage"], grpc.StatusCode.INVALID_ARGUMENT, "malformed"),
    "truncated_prefix": (lambda c: [b"\x01"], grpc.StatusCode.INVALID_ARGUMENT, "malformed"),
    "too_many_bytes": (lambda c: [next(encode(_header(c))) + _payload(), _payload()],
                       grpc.StatusCode.INVALID_ARGUMENT, "size"),
}


@pytest.mark.parametrize("case", sorted(CASES))
def test_bad_push_is_rejected_counted_and_harmless(cluster_factory, case):
    make_frames, code, reason = CASES[case]
    c = cluster_factory(workers=1, size=SIZE, protocol={"name": "asp"})
    before = c.params.copy()
    err = _raw_push(c, make_frames(c))
    assert err.code() == code, err.details()
    assert err.details(), "the status must carry a message"
    np.testing.assert_array_equal(c.params, before)
    assert c.store.version == 0
    assert c.rec.counts["rejected"] == 1 and c.rec.reasons[f"rejected:{reason}"] == 1
    assert [e["reason"] for e in c.events("push_rejected")] == [reason]
    # The server survives and a good push still works.
    r = c.workers[0].push(np.ones(SIZE, np.float32), 4)
    assert r.reply.applied and c.store.version == 1
    summary = c.rec.close({})
    assert summary["pushes_rejected"] == 1
    assert json.loads((c.run_dir / "summary.json").read_text())["pushes_rejected"] == 1


def test_register_rejects_bad_index_and_foreign_layout(cluster_factory):
    from switchps.protos.layout import make_layout

    c = cluster_factory(workers=1, size=SIZE)
    client = c.workers[0].client
    with pytest.raises(grpc.RpcError) as err:
        client.register(5, c.layout, 10)
    assert err.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    with pytest.raises(grpc.RpcError) as err:
        client.register(0, make_layout([("other", (3, 3))]), 10)
    assert err.value.code() == grpc.StatusCode.FAILED_PRECONDITION
    assert "layout" in err.value.details()
