"""Pushes through the PS's Unix socket (``ps_server/local_pushes.py``), from a worker attached through a
shared-memory segment: applied whole through a real loopback PS, and hostile frames refused, counted and
ending the connection where they break the format, changing nothing."""

from __future__ import annotations

import secrets
import socket
import threading

import grpc
import numpy as np
import pytest

from switchps import auth
from switchps.channels import ServerSecurity
from switchps.protos import switchps_pb2 as pb
from switchps.protos.codec import encode
from switchps.protos.local_socket import LENGTH, MAX_FRAME, answer, frame, status
from switchps.protos.segment import available
from switchps.worker.client import PSClient
from switchps.worker.local_line import LocalRpcError

pytest_plugins = ["cluster"]  # cluster_factory: a PS on loopback
pytestmark = pytest.mark.skipif(not available(), reason="no /dev/shm on this host")
SECRET = b"s" * 32


def _raw(c, token: str = "") -> socket.socket:
    """A connection to the PS's socket that has sent its first frame (``token``)."""
    s = socket.socket(socket.AF_UNIX)
    s.settimeout(10)
    s.connect(_address(c))
    s.sendall(frame(token.encode()))
    return s


def _address(c) -> str:
    return "\0" + c.ps.segments.socket[1:]


def _answer(s: socket.socket) -> tuple[grpc.StatusCode, bytes]:
    (n,) = LENGTH.unpack(s.recv(LENGTH.size, socket.MSG_WAITALL))
    data = s.recv(n, socket.MSG_WAITALL)
    return status(data[0]), data[1:]


def _closed(s: socket.socket) -> bool:
    return s.recv(1) == b""


def _header(c, worker: int = 0) -> bytes:
    return next(encode(pb.PushHeader(worker=worker, samples=1, layout_digest=c.workers[0].layout.digest,
                                     nbytes=4000, shared=True)))


def test_an_attached_workers_pushes_go_through_the_socket_and_are_applied_whole(cluster_factory):
    c = cluster_factory(workers=1, size=1000, protocol={"name": "asp"})
    w = c.workers[0]
    assert w.client.attach(0, 4000) and w.client.socket_path == c.ps.segments.socket
    assert c.ps.segments.socket.startswith("@switchps-ps-"), "in the abstract namespace: no file to leave behind"
    for step in range(3):
        r = w.push(np.ones(1000, np.float32), 1, step=step)
        assert r.reply.applied and r.reply.shared and r.order.version == step + 1
    np.testing.assert_array_equal(c.params, -3 * np.ones(1000))
    np.testing.assert_array_equal(w.params, c.params)
    assert c.rec.rejections == {}
    c.server.stop(grace=None)
    with pytest.raises(ConnectionRefusedError):
        _raw(c)


def test_a_refused_push_is_answered_with_its_status_and_the_connection_stays(cluster_factory):
    c = cluster_factory(workers=2, size=1000, protocol={"name": "asp"})
    assert c.workers[0].client.attach(0, 4000)
    s = _raw(c)
    for body, code, reason in ((b"\x07garbage", grpc.StatusCode.INVALID_ARGUMENT, "push:malformed"),
                               (_header(c, worker=1), grpc.StatusCode.FAILED_PRECONDITION, "push:not_attached")):
        s.sendall(frame(body))
        got, details = _answer(s)
        assert got == code, details
        assert c.rec.rejections[reason] == 1, c.rec.rejections
    c.workers[0].client.segment.grad[:] = 1
    s.sendall(frame(_header(c)))
    code, reply = _answer(s)
    assert code == grpc.StatusCode.OK and pb.PushReply.FromString(reply[4:4 + LENGTH.unpack(reply[:4])[0]]).applied
    assert c.store.version == 1


@pytest.mark.parametrize("send, code, reason", [
    (LENGTH.pack(MAX_FRAME + 1), grpc.StatusCode.INVALID_ARGUMENT, "push:size"),  # from the length prefix
    (LENGTH.pack(100) + b"x" * 10, grpc.StatusCode.CANCELLED, "push:broken_stream"),  # cut short
])
def test_a_frame_that_breaks_the_format_ends_the_connection_counted_changing_nothing(cluster_factory, send, code,
                                                                                      reason):
    c = cluster_factory(workers=1, size=1000, protocol={"name": "asp"})
    assert c.workers[0].client.attach(0, 4000)
    s = _raw(c)
    s.sendall(send)
    s.shutdown(socket.SHUT_WR)
    assert _answer(s)[0] == code and _closed(s)
    assert c.rec.rejections == {reason: 1} and c.store.version == 0


def test_a_connection_without_a_first_frame_in_time_is_ended_and_counted(cluster_factory):
    c = cluster_factory(workers=1, size=1000, protocol={"name": "asp"}, receive_timeout_s=0.2)
    assert c.workers[0].client.attach(0, 4000)
    s = socket.socket(socket.AF_UNIX)
    s.settimeout(10)
    s.connect(_address(c))
    assert _answer(s)[0] == grpc.StatusCode.DEADLINE_EXCEEDED and _closed(s)
    assert c.rec.rejections == {"push:idle": 1}


def test_a_bad_token_ends_the_connection_and_another_workers_token_cannot_push_as_it(cluster_factory):
    c = cluster_factory(workers=2, size=1000, protocol={"name": "asp"}, security=ServerSecurity(SECRET))
    assert c.workers[0].client.attach(0, 4000) and c.workers[0].client.socket_path
    s = _raw(c, "Bearer forged")
    assert _answer(s)[0] == grpc.StatusCode.UNAUTHENTICATED and _closed(s)
    other = dict(auth.metadata(auth.token(SECRET, "worker", 1)))[auth.METADATA_KEY]
    s = _raw(c, other)
    s.sendall(frame(_header(c, worker=0)))
    assert _answer(s)[0] == grpc.StatusCode.PERMISSION_DENIED
    assert sum(c.rec.rejections.values()) == 2 and c.store.version == 0
    c.workers[0].client.segment.grad[:] = 1
    assert c.workers[0].push(np.ones(1000, np.float32), 1).reply.applied, "the worker's own token pushes"


def test_a_process_of_another_user_is_refused(cluster_factory):
    c = cluster_factory(workers=1, size=1000, protocol={"name": "asp"})
    c.ps.segments._local.uid += 1  # the PS's user, as the kernel reports peers, is now someone else
    s = socket.socket(socket.AF_UNIX)
    s.settimeout(10)
    s.connect(_address(c))  # refused before its first frame is read
    assert _answer(s)[0] == grpc.StatusCode.PERMISSION_DENIED and _closed(s)
    assert c.rec.rejections == {"push:other_user": 1}


def test_a_refusal_answered_through_the_socket_is_raised_and_only_a_broken_socket_falls_back_to_grpc():
    """UNAVAILABLE from the PS itself (a shard's part missing) is its answer: raised, the push not sent again
    through gRPC (a PS shard would wait for the missing part once more). A broken socket is not an answer."""
    name = f"switchps-test-{secrets.token_hex(8)}"
    server = socket.socket(socket.AF_UNIX)
    server.bind("\0" + name)
    server.listen(1)
    served = threading.Thread(target=_answer_once_then_hang_up, args=(server,), daemon=True)
    served.start()
    client = PSClient("127.0.0.1:1", timeout_s=10)  # no gRPC server: a push sent through gRPC fails to connect
    try:
        client._open_line("@" + name)
        with pytest.raises(LocalRpcError) as refused:
            client._send_shared(b"push")
        assert refused.value.code() == grpc.StatusCode.UNAVAILABLE and "no part" in refused.value.details()
        assert client.socket_path == "@" + name, "the line stays open"
        with pytest.raises(grpc.RpcError) as resent:
            client._send_shared(b"push")  # the PS hangs up: the push goes through gRPC
        assert "connect" in (resent.value.details() or "") and client.socket_path == ""
    finally:
        client.close()
        server.close()
        served.join(timeout=10)


def _answer_once_then_hang_up(server: socket.socket) -> None:
    conn, _ = server.accept()
    with conn:
        for reply in (answer(grpc.StatusCode.UNAVAILABLE, b"PS shard 1 got no part of this push"), None):
            (n,) = LENGTH.unpack(conn.recv(LENGTH.size, socket.MSG_WAITALL))
            conn.recv(n, socket.MSG_WAITALL)  # the token, then each push
            if reply is not None:
                conn.sendall(reply)
