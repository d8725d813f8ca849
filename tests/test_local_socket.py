"""Pushes through the PS's Unix socket (``ps_server/rpc/local_pushes.py``), from a worker attached through a
shared-memory segment whose descriptor came with its first frame: applied whole through a real loopback
PS, and hostile frames and segments refused, counted and ending the connection where they break the
format, changing nothing."""

from __future__ import annotations

import asyncio
import os
import secrets
import socket
import threading

import grpc
import numpy as np
import pytest

from switchps.security import auth
from switchps.security.channels import ServerSecurity
from switchps.protos import switchps_pb2 as pb
from switchps.protos.codec import encode
from switchps.protos.local_socket import LENGTH, MAX_FRAME, answer, frame, status
from switchps.protos.segment import Segment, available
from switchps.ps_server.rpc import local_pushes
from switchps.worker.client import PSClient
from switchps.worker.local_line import LocalRpcError

pytest_plugins = ["cluster"]  # cluster_factory: a PS on loopback
pytestmark = pytest.mark.skipif(not available(), reason="no memory files on this host")
SECRET = b"s" * 32


def _connected(c) -> socket.socket:
    s = socket.socket(socket.AF_UNIX)
    s.settimeout(10)
    s.connect("\0" + c.ps.segments.socket[1:])
    return s


def _raw(c, token: str = "", worker: int = 0, fd: int | None = None) -> tuple[socket.socket, Segment]:
    """A connection to the PS's socket whose first frame (``token``) brought a new segment that worker
    ``worker`` attached (its ``Attach`` through the worker's own client), or the descriptor ``fd``."""
    segment, client = Segment.create(4000), c.workers[worker].client
    request = pb.AttachRequest(worker=worker, nonce=segment.nonce, nbytes=4000)
    assert client._attach(request, timeout=10, metadata=client._md).attached
    s = _connected(c)
    socket.send_fds(s, [frame(token.encode())], [segment.fd if fd is None else fd])
    segment.close_fd()
    return s, segment


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
        _connected(c)


def test_a_refused_push_is_answered_with_its_status_and_the_connection_stays(cluster_factory):
    c = cluster_factory(workers=2, size=1000, protocol={"name": "asp"})
    s, segment = _raw(c)
    assert _answer(s) == (grpc.StatusCode.OK, b""), "the segment is mapped"
    for body, code, reason in ((b"\x07garbage", grpc.StatusCode.INVALID_ARGUMENT, "push:malformed"),
                               (_header(c, worker=1), grpc.StatusCode.FAILED_PRECONDITION, "push:not_attached")):
        s.sendall(frame(body))
        got, details = _answer(s)
        assert got == code, details
        assert c.rec.rejections[reason] == 1, c.rec.rejections
    segment.grad[:] = 1
    s.sendall(frame(_header(c)))
    code, reply = _answer(s)
    assert code == grpc.StatusCode.OK and pb.PushReply.FromString(reply[4:4 + LENGTH.unpack(reply[:4])[0]]).applied
    assert c.store.version == 1
    np.testing.assert_array_equal(segment.values, -np.ones(1000))  # the reply's values, in the segment


@pytest.mark.parametrize("send, code, reason", [
    (LENGTH.pack(MAX_FRAME + 1), grpc.StatusCode.INVALID_ARGUMENT, "push:size"),  # from the length prefix
    (LENGTH.pack(100) + b"x" * 10, grpc.StatusCode.CANCELLED, "push:broken_stream"),  # cut short
])
@pytest.mark.parametrize("first", [True, False], ids=["first frame", "later frame"])
def test_a_frame_that_breaks_the_format_ends_the_connection_counted_changing_nothing(cluster_factory, send, code,
                                                                                      reason, first):
    c = cluster_factory(workers=1, size=1000, protocol={"name": "asp"})
    if first:
        s = _connected(c)
    else:
        s, _ = _raw(c)
        assert _answer(s)[0] == grpc.StatusCode.OK
    s.sendall(send)
    s.shutdown(socket.SHUT_WR)
    assert _answer(s)[0] == code and _closed(s)
    assert c.rec.rejections == {reason: 1} and c.store.version == 0


def test_a_connection_without_a_first_frame_in_time_is_ended_and_counted(cluster_factory):
    c = cluster_factory(workers=1, size=1000, protocol={"name": "asp"}, receive_timeout_s=0.2)
    s = _connected(c)
    assert _answer(s)[0] == grpc.StatusCode.DEADLINE_EXCEEDED and _closed(s)
    assert c.rec.rejections == {"push:idle": 1}


def test_a_first_frame_whose_body_does_not_follow_its_length_is_ended_in_time_and_counted(cluster_factory):
    """Its length prefix in, its body never: the PS once waited for that body forever."""
    c = cluster_factory(workers=1, size=1000, protocol={"name": "asp"}, receive_timeout_s=0.5)
    s = _connected(c)
    s.sendall(LENGTH.pack(10) + b"tok")
    assert _answer(s)[0] == grpc.StatusCode.DEADLINE_EXCEEDED and _closed(s)
    assert c.rec.rejections == {"push:idle": 1}


def test_a_first_frame_without_the_segment_or_with_a_descriptor_of_anything_else_is_refused(cluster_factory):
    c = cluster_factory(workers=1, size=1000, protocol={"name": "asp"})
    s = _connected(c)
    s.sendall(frame(b""))  # no descriptor
    assert _answer(s)[0] == grpc.StatusCode.INVALID_ARGUMENT and _closed(s)
    unsealed = os.memfd_create("hostile")  # the right size, the nonce of an Attach, no seals
    segment = Segment.create(4000)
    os.ftruncate(unsealed, os.fstat(segment.fd).st_size)
    os.pwrite(unsealed, segment.nonce, 0)
    client = c.workers[0].client
    assert client._attach(pb.AttachRequest(worker=0, nonce=segment.nonce, nbytes=4000), timeout=10).attached
    for fds in ([unsealed], [segment.fd, segment.fd]):
        s = _connected(c)
        socket.send_fds(s, [frame(b"")], fds)
        code, details = _answer(s)
        assert code == grpc.StatusCode.INVALID_ARGUMENT and _closed(s), details
    os.close(unsealed)
    segment.close_fd()
    assert c.rec.rejections == {"attach:segment": 3}
    assert not c.workers[0].push(np.ones(1000, np.float32), 1).reply.shared, "nothing was attached"


def test_a_first_frame_keeps_at_most_two_of_the_descriptors_that_come_with_it():
    """Two with each of its bytes: two show "more than one", and the rest are closed as they come, as each
    held descriptor counts against the PS's limit of open files."""
    r, w = os.pipe()
    ours, theirs = socket.socketpair(socket.AF_UNIX, socket.SOCK_STREAM)
    before = _descriptors_of(r)
    try:
        data = frame(b"token")
        for i in range(len(data)):  # a stream socket keeps each message's descriptors with its bytes
            socket.send_fds(ours, [data[i:i + 1]], [r, r])
        theirs.setblocking(False)
        fds: list[int] = []
        assert asyncio.run(local_pushes._first_frame(theirs, 10, fds)) == b"token"
        assert len(fds) == 2 and _descriptors_of(r) == before + 2, "the two the PS keeps, and no more"
        for fd in fds:
            os.close(fd)
    finally:
        for fd in (r, w):
            os.close(fd)
        ours.close()
        theirs.close()


def _descriptors_of(fd: int) -> int:
    """How many of this process's descriptors name what ``fd`` names."""
    target = os.readlink(f"/proc/self/fd/{fd}")
    count = 0
    for name in os.listdir("/proc/self/fd"):
        try:
            count += os.readlink(f"/proc/self/fd/{name}") == target
        except OSError:  # closed meanwhile
            pass
    return count


def test_a_bad_token_ends_the_connection_and_another_workers_token_cannot_attach_or_push_as_it(cluster_factory):
    c = cluster_factory(workers=2, size=1000, protocol={"name": "asp"}, security=ServerSecurity(SECRET))
    assert c.workers[0].client.attach(0, 4000) and c.workers[0].client.socket_path
    s, _ = _raw(c, "Bearer forged")
    assert _answer(s)[0] == grpc.StatusCode.UNAUTHENTICATED and _closed(s)
    other = dict(auth.metadata(auth.token(SECRET, "worker", 1)))[auth.METADATA_KEY]
    s, _ = _raw(c, other, worker=0)  # worker 0's segment, with worker 1's token
    assert _answer(s)[0] == grpc.StatusCode.PERMISSION_DENIED and _closed(s)
    s, _ = _raw(c, other, worker=1)
    assert _answer(s)[0] == grpc.StatusCode.OK
    s.sendall(frame(_header(c, worker=0)))
    assert _answer(s)[0] == grpc.StatusCode.PERMISSION_DENIED
    assert c.rec.rejections == {"push:bad_token": 1, "attach:identity": 1, "push:identity": 1}
    assert c.store.version == 0
    c.workers[0].client.segment.grad[:] = 1
    assert c.workers[0].push(np.ones(1000, np.float32), 1).reply.shared, "the worker's own segment and token"


def test_a_process_of_another_user_is_refused(cluster_factory):
    c = cluster_factory(workers=1, size=1000, protocol={"name": "asp"})
    c.ps.segments._local.uid += 1  # the PS's user, as the kernel reports peers, is now someone else
    s = _connected(c)  # refused before its first frame is read
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
    segment = Segment.create(16)
    try:
        client._open_line("@" + name, segment)
        with pytest.raises(LocalRpcError) as refused:
            client._send_shared(b"push")
        assert refused.value.code() == grpc.StatusCode.UNAVAILABLE and "no part" in refused.value.details()
        assert client.socket_path == "@" + name, "the line stays open"
        with pytest.raises(grpc.RpcError) as resent:
            client._send_shared(b"push")  # the PS hangs up: the push goes through gRPC
        assert "connect" in (resent.value.details() or "") and client.socket_path == ""
    finally:
        segment.close_fd()
        client.close()
        server.close()
        served.join(timeout=10)


def _answer_once_then_hang_up(server: socket.socket) -> None:
    conn, _ = server.accept()
    with conn:
        for reply in (answer(grpc.StatusCode.OK, b""), answer(grpc.StatusCode.UNAVAILABLE,
                                                               b"PS shard 1 got no part of this push"), None):
            (n,) = LENGTH.unpack(conn.recv(LENGTH.size, socket.MSG_WAITALL))
            conn.recv(n, socket.MSG_WAITALL)  # the token with the segment, then each push
            if reply is not None:
                conn.sendall(reply)
