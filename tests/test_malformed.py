"""Bytes that are no valid request, sent to every RPC by a client written from the proto alone: each gets
INVALID_ARGUMENT, is counted, changes nothing, and the PS logs one line per kind, with no traceback."""

from __future__ import annotations

import logging

import grpc
import numpy as np
import pytest

pytest_plugins = ["cluster"]  # cluster_factory: a PS on loopback

GARBAGE = b"\xff\xff\xff\xff\x0f"  # an invalid protobuf tag; as a frame, a header length past its end
REPEATS = 30
RPCS = [  # method, its shape, the name rejections are counted under
    ("Register", "unary_unary", "register"),
    ("Status", "unary_unary", "status"),
    ("Eval", "unary_unary", "eval"),
    ("PushSmall", "unary_unary", "push"),
    ("Attach", "unary_unary", "attach"),
    ("Pull", "unary_stream", "pull"),
    ("Push", "stream_stream", "push"),
    ("Init", "stream_stream", "init"),
]


def _call(channel: grpc.Channel, method: str, shape: str) -> None:
    stub = getattr(channel, shape)(f"/switchps.ParameterServer/{method}", request_serializer=None,
                                   response_deserializer=None)
    request = iter([GARBAGE]) if shape.startswith("stream") else GARBAGE
    reply = stub(request, timeout=10)
    if shape.endswith("stream"):
        list(reply)


@pytest.mark.parametrize("method, shape, rpc", RPCS, ids=[m for m, _, _ in RPCS])
def test_garbage_is_invalid_argument_counted_and_logged_once(cluster_factory, caplog, method, shape, rpc):
    c = cluster_factory(workers=1, size=4, protocol={"name": "asp"})
    channel = grpc.insecure_channel(c.address)
    with caplog.at_level(logging.INFO):
        for _ in range(REPEATS):
            with pytest.raises(grpc.RpcError) as err:
                _call(channel, method, shape)
            assert err.value.code() == grpc.StatusCode.INVALID_ARGUMENT, err.value.details()
    assert c.rec.rejections == {f"{rpc}:malformed": REPEATS}
    assert c.store.version == 0 and not c.params.any() and c.core.members.registered == {0: 100}
    lines = [r for r in caplog.records if "rejected" in r.getMessage()]
    assert len(lines) == 1, [r.getMessage() for r in lines]
    assert all(r.exc_info is None and "Traceback" not in r.getMessage() for r in caplog.records)
    assert c.workers[0].push(np.ones(4, np.float32), 4).reply.applied, "the PS serves on"
    channel.close()
