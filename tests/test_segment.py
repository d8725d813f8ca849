"""Pushes through a shared-memory segment (``protos/segment.py``): the segment's checks and the PS's
bookkeeping without sockets, the layout the proto states, then a real PS on loopback: applied whole,
refused and counted when hostile, and attached again after the PS forgot it."""

from __future__ import annotations

import fcntl
import math
import os
import re
import tempfile
from pathlib import Path

import grpc
import numpy as np
import pytest

from switchps.protos import switchps_pb2 as pb
from switchps.protos.codec import ALIGN, COPIES
from switchps.protos.segment import HEADER, NONCE_BYTES, SEALS, Segment, available, file_bytes, sealed_nonce
from switchps.ps_server.rpc.attachments import Attachments
from switchps.refusals import Rejected

pytest_plugins = ["cluster"]  # cluster_factory: a PS on loopback
pytestmark = pytest.mark.skipif(not available(), reason="no memory files on this host")
PROTO = Path(__file__).resolve().parents[1] / "switchps" / "protos" / "switchps.proto"


@pytest.fixture
def made():
    segment = Segment.create(16)
    yield segment
    segment.close_fd()


def _adopted(segment: Segment) -> Segment:
    return Segment.adopt(segment.fd, sealed_nonce(segment.fd), segment.nbytes)


def test_the_ps_maps_the_workers_segment_and_both_see_the_same_bytes(made):
    seen = _adopted(made)
    assert seen.nonce == made.nonce
    made.grad[:] = [1, 2, 3, 4]
    seen.values[:] = [5, 6, 7, 8]
    np.testing.assert_array_equal(seen.grad, [1, 2, 3, 4])
    np.testing.assert_array_equal(made.values, [5, 6, 7, 8])
    made.close_fd()
    made.grad[0] = 9
    assert seen.grad[0] == 9, "the mappings outlive the descriptor"


def test_a_segment_cannot_be_cut_short_or_grown_by_its_maker(made):
    """What lets the PS map it: a file cut short under a mapping makes the next copy SIGBUS."""
    assert fcntl.fcntl(made.fd, fcntl.F_GET_SEALS) & (SEALS | fcntl.F_SEAL_SEAL) == SEALS | fcntl.F_SEAL_SEAL
    for size in (0, file_bytes(16) - 1, file_bytes(16) + 1):
        with pytest.raises(PermissionError):
            os.ftruncate(made.fd, size)
    with pytest.raises(PermissionError):
        fcntl.fcntl(made.fd, fcntl.F_ADD_SEALS, 0)  # F_SEAL_SEAL: no seal can be lifted or added
    assert os.fstat(made.fd).st_size == HEADER + 2 * ALIGN, "each 16-byte area padded to a cache line"


def test_each_area_starts_on_an_aligned_boundary(made):
    assert made.grad.ctypes.data % ALIGN == 0 and made.values.ctypes.data % ALIGN == 0


def _proto_layout(nbytes: int) -> dict[str, int]:
    """The segment's offsets and size for ``nbytes``, computed from the proto's words alone (its
    ``NAME = expression`` lines before ``AttachRequest``), as a client written from it would."""
    comment = PROTO.read_text().split("message AttachRequest")[0].rsplit("\n\n", 1)[1]
    lines = re.findall(r"^//\s+([A-Za-z_]+) = ([^\n]+)$", comment, re.M)
    names: dict[str, int] = {"nbytes": nbytes}
    for name, expression in lines:
        names[name] = eval(expression, {"__builtins__": {}, "ceil": math.ceil}, names)  # the proto's own text
    return names


@pytest.mark.parametrize("nbytes", [4, 16, 60, 64, 68, 4000, 3_136_040])
def test_a_segment_made_from_the_protos_words_is_the_ps_s_size_and_layout(nbytes):
    """The proto once said "a 64-byte header and two areas of nbytes": a client written from it made a
    file of the wrong size (the areas are aligned)."""
    proto = _proto_layout(nbytes)
    assert {"HEADER", "ALIGN", "NONCE", "gradient_at", "values_at", "size"} <= proto.keys(), proto
    assert (proto["HEADER"], proto["ALIGN"], proto["NONCE"]) == (HEADER, ALIGN, NONCE_BYTES)
    assert proto["size"] == file_bytes(nbytes)
    segment = Segment.create(nbytes)
    try:
        assert os.fstat(segment.fd).st_size == proto["size"]
        base = segment.grad.ctypes.data - HEADER
        assert segment.grad.ctypes.data - base == proto["gradient_at"]
        assert segment.values.ctypes.data - base == proto["values_at"]
        assert proto["values_at"] >= proto["gradient_at"] + nbytes and proto["size"] >= proto["values_at"] + nbytes
    finally:
        segment.close_fd()


def _memory_file(seals: int, size: int = file_bytes(16), nonce: bytes = b"n" * NONCE_BYTES) -> int:
    fd = os.memfd_create("hostile", os.MFD_CLOEXEC | (os.MFD_ALLOW_SEALING if seals else 0))
    os.ftruncate(fd, size)
    os.pwrite(fd, nonce, 0)
    if seals:
        fcntl.fcntl(fd, fcntl.F_ADD_SEALS, seals)
    return fd


def _shm_file() -> int:
    """A file in /dev/shm, as segments were before they were sealed: the right size, the nonce in place."""
    fd, path = tempfile.mkstemp(dir="/dev/shm")
    os.unlink(path)
    os.ftruncate(fd, file_bytes(16))
    os.pwrite(fd, b"n" * NONCE_BYTES, 0)
    return fd


@pytest.mark.parametrize("make, what", [
    (lambda: _memory_file(0), "sealed"),  # a memory file that cannot be sealed
    (lambda: _memory_file(fcntl.F_SEAL_GROW), "sealed"),  # it can still shrink
    (lambda: _memory_file(fcntl.F_SEAL_SEAL), "sealed"),
    (_shm_file, "sealed"),
    (lambda: os.pipe()[0], "sealed"),
    (lambda: os.open("/dev/zero", os.O_RDONLY), "sealed"),
])
def test_a_descriptor_of_anything_but_a_sealed_memory_file_is_refused(make, what):
    fd = make()
    try:
        with pytest.raises(Rejected) as err:
            sealed_nonce(fd)
        assert err.value.code == "INVALID_ARGUMENT" and err.value.reason == "segment" and what in str(err.value)
    finally:
        os.close(fd)


@pytest.mark.parametrize("flags, seals, what", [
    (os.O_RDWR, fcntl.F_SEAL_WRITE, "cannot be mapped"),  # sealed against the worker's own gradients
    (os.O_RDONLY, 0, "cannot be mapped"),
    (os.O_WRONLY, 0, "cannot be read"),
])
def test_a_sealed_segment_the_ps_cannot_read_and_write_is_refused(flags, seals, what):
    """The same memory file opened again through /proc, or sealed against writes: refused, not an OSError."""
    fd = _memory_file(SEALS | seals)
    again = os.open(f"/proc/self/fd/{fd}", flags)
    try:
        with pytest.raises(Rejected, match=what) as err:
            Segment.adopt(again, sealed_nonce(again), 16)
        assert err.value.code == "INVALID_ARGUMENT"
    finally:
        os.close(again)
        os.close(fd)


@pytest.mark.parametrize("size", [HEADER + 2 * 16, file_bytes(16) - ALIGN, file_bytes(16) + ALIGN])
def test_a_sealed_segment_of_another_size_is_refused(size):
    """The first: what the proto used to describe (a header and two areas of ``nbytes``, unaligned)."""
    fd = _memory_file(SEALS, size=size)
    try:
        nonce = sealed_nonce(fd)
        with pytest.raises(Rejected, match=f"{file_bytes(16)}-byte file, not {size}"):
            Segment.adopt(fd, nonce, 16)
    finally:
        os.close(fd)


def _request(segment: Segment, worker: int = 0, **kw) -> pb.AttachRequest:
    return pb.AttachRequest(**{"worker": worker, "nonce": segment.nonce, "nbytes": segment.nbytes, **kw})


def _listening() -> Attachments:
    a = Attachments()
    a.socket = "@switchps-ps-test"  # as ``listen`` sets it
    return a


@pytest.mark.parametrize("kw, reason, what", [
    ({"nbytes": 32}, "size", "32-byte areas for a payload of 16 bytes"),  # a segment sized for another model
    ({"nonce": bytes(NONCE_BYTES)}, "segment", "all zero"),
    ({"nonce": b"short"}, "segment", "not 5"),
    ({"name": "switchps-" + "a" * 32}, "segment", "no name"),  # how a hard link or a symbolic one was named
])
def test_an_attach_no_worker_would_send_is_refused(made, kw, reason, what):
    with pytest.raises(Rejected) as err:
        _listening().attach(_request(made, **kw), registered=True, nbytes=16)
    assert (err.value.code, err.value.reason) == ("INVALID_ARGUMENT", reason) and what in str(err.value)


def test_the_segment_that_comes_is_mapped_for_the_worker_whose_attach_sent_its_nonce(made):
    a = _listening()
    with pytest.raises(Rejected, match="unknown worker"):
        a.attach(_request(made), registered=False, nbytes=16)
    with pytest.raises(Rejected) as err:
        a.payload(1, memoryview(b""))
    assert err.value.code == "FAILED_PRECONDITION"
    with pytest.raises(Rejected, match="no Attach sent"):
        a.adopt([made.fd], lambda worker: None)
    reply = a.attach(_request(made, worker=1), registered=True, nbytes=16)
    assert reply.attached and reply.socket == a.socket
    with pytest.raises(Rejected, match="one descriptor"):
        a.adopt([made.fd, made.fd], lambda worker: None)

    def other_token(worker: int) -> None:
        raise Rejected("PERMISSION_DENIED", "identity", f"not worker {worker}'s token")

    with pytest.raises(Rejected, match="not worker 1's token"):
        a.adopt([made.fd], other_token)
    authorized: list[int] = []
    a.adopt([made.fd], authorized.append)
    assert authorized == [1]
    with pytest.raises(Rejected, match="no Attach sent"):
        a.adopt([made.fd], authorized.append)  # an Attach's nonce brings one segment
    with pytest.raises(Rejected, match="no bytes of its own"):
        a.payload(1, memoryview(b"\0\0\0\0"))
    segment, payload = a.payload(1, memoryview(b""))
    made.grad[:] = [1, 2, 3, 4]
    assert payload.nbytes == 16 and np.frombuffer(payload, np.float32).tolist() == [1, 2, 3, 4]


def test_a_ps_without_a_socket_takes_no_segment(made):
    reply = Attachments().attach(_request(made), registered=True, nbytes=16)
    assert not reply.attached and "no Unix socket" in reply.note


# ---- a real PS on loopback -----------------------------------------------------------------------


def test_a_push_through_the_segment_is_applied_whole_and_its_reply_comes_back_through_it(cluster_factory):
    c = cluster_factory(workers=1, size=1000, protocol={"name": "asp"})
    w = c.workers[0]
    assert w.client.attach(0, 4000) and w.client.segment is not None
    assert w.client.segment.fd == -1, "the worker's descriptor is closed once sent: the PS has its own"
    grad = np.arange(1000, dtype=np.float32)
    r = w.push(grad, 1)
    assert r.reply.applied and r.reply.shared and r.fresh and r.order.version == 1
    assert r.values is w.client.segment.values, "the worker loads the values from the segment, not a copy"
    np.testing.assert_array_equal(c.params, -grad)
    np.testing.assert_array_equal(w.params, -grad)
    assert c.rec.rejections == {}


def test_a_payload_written_into_the_segment_is_pushed_without_a_copy(cluster_factory):
    c = cluster_factory(workers=1, size=1000, protocol={"name": "asp"})
    w = c.workers[0]
    assert w.client.payload_area is None, "not attached: nowhere to write a payload ahead"
    assert w.client.attach(0, 4000) and w.client.payload_area is w.client.segment.grad
    copied = []
    for grad in (np.ones(1000, np.float32), w.client.payload_area):
        grad[:] = 1
        before = COPIES.bytes_copied
        assert w.push(grad, 1).reply.applied
        copied.append(COPIES.bytes_copied - before)
    assert copied[0] - copied[1] == 4000, "the worker's copy into the segment is skipped, nothing else"
    np.testing.assert_array_equal(c.params, -2 * np.ones(1000))


def test_a_push_through_the_segment_is_copied_twice_out_of_it_and_the_new_values_into_it(cluster_factory):
    """No snapshot chunks in between: the reply's values are copied into the segment from the model's."""
    c = cluster_factory(workers=1, size=1000, protocol={"name": "asp"})
    w = c.workers[0]
    assert w.client.attach(0, 4000) and w.client.payload_area is not None
    w.client.payload_area[:] = 1
    before = COPIES.bytes_copied
    assert w.push(w.client.payload_area, 1).reply.applied
    assert COPIES.bytes_copied - before == 2 * 4000
    np.testing.assert_array_equal(w.params, -np.ones(1000))


def test_a_non_finite_gradient_in_the_segment_is_refused_counted_and_changes_nothing(cluster_factory):
    c = cluster_factory(workers=1, size=1000, protocol={"name": "asp"})
    w = c.workers[0]
    assert w.client.attach(0, 4000)
    grad = np.ones(1000, np.float32)
    grad[999] = np.nan
    with pytest.raises(grpc.RpcError) as err:
        w.push(grad, 1)
    assert err.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert c.rec.rejections == {"push:non_finite": 1}
    assert c.store.version == 0 and not c.params.any()
    assert w.push(np.ones(1000, np.float32), 1).reply.applied, "the PS serves on"


def test_hostile_attaches_and_unattached_shared_pushes_are_refused_and_counted(cluster_factory):
    c = cluster_factory(workers=1, size=1000, protocol={"name": "asp"})
    w = c.workers[0]
    segment = Segment.create(4000)
    try:
        for request in (_request(segment, nonce=bytes(NONCE_BYTES)), _request(segment, nbytes=8000),
                        _request(segment, worker=7), _request(segment, name=f"switchps-{'a' * 32}")):
            with pytest.raises(grpc.RpcError) as err:
                w.client._attach(request, timeout=10)
            assert err.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    finally:
        segment.close_fd()
    push = w.client.channel.unary_unary("/switchps.ParameterServer/PushSmall")
    header = pb.PushHeader(worker=0, samples=1, layout_digest=w.layout.digest, nbytes=4000, shared=True)
    with pytest.raises(grpc.RpcError) as err:
        push(b"".join([len(header.SerializeToString()).to_bytes(4, "little"), header.SerializeToString()]),
             timeout=10)
    assert err.value.code() == grpc.StatusCode.FAILED_PRECONDITION
    assert c.rec.rejections == {"attach:segment": 2, "attach:size": 1, "attach:unknown_worker": 1,
                                "push:not_attached": 1}
    assert c.store.version == 0 and not c.params.any()


def test_a_worker_that_cannot_reach_the_ps_s_socket_is_on_another_host_and_pushes_bytes(cluster_factory):
    c = cluster_factory(workers=1, size=1000, protocol={"name": "asp"})
    w = c.workers[0]
    c.ps.segments.socket = "@switchps-ps-" + "0" * 32  # as another host sees the PS's socket: nowhere
    before = _segment_descriptors()
    assert not w.client.attach(0, 4000) and w.client.segment is None and w.client.socket_path == ""
    r = w.push(np.ones(1000, np.float32), 1)
    assert r.reply.applied and not r.reply.shared and r.values is w.params
    assert c.rec.rejections == {} and _segment_descriptors() <= before, "the segment went with the attempt"


def test_a_client_attaches_again_when_the_ps_has_forgotten_its_segment(cluster_factory):
    """A PS that restarted between two pushes has no segment of the worker's: the push is refused before
    it reaches the core, and the client attaches a new segment and sends it again, once."""
    c = cluster_factory(workers=1, size=1000, protocol={"name": "asp"})
    w = c.workers[0]
    assert w.client.attach(0, 4000)
    first = w.client.segment
    forgot = Attachments()  # what a restarted PS has: its socket, and no segments
    forgot.socket, forgot._local = c.ps.segments.socket, c.ps.segments._local
    c.ps.segments = forgot
    r = w.push(np.ones(1000, np.float32), 1)
    assert r.reply.applied and r.reply.shared and r.order.version == 1
    assert w.client.segment is not first
    assert c.rec.rejections == {"push:not_attached": 1}


def test_a_segment_without_memory_leaves_no_descriptor_and_the_worker_pushes_as_bytes(cluster_factory,
                                                                                      monkeypatch):
    """No memory for it (a container's limit): the pages are reserved up front, so the failure is an OSError
    at creation, not a SIGBUS at the first write; the client stays on gRPC bytes."""
    import errno

    def full(fd: int, offset: int, length: int) -> None:
        raise OSError(errno.ENOSPC, "No space left on device")

    before = _segment_descriptors()
    monkeypatch.setattr(os, "posix_fallocate", full)
    with pytest.raises(OSError):
        Segment.create(16)
    assert _segment_descriptors() <= before
    c = cluster_factory(workers=1, size=1000, protocol={"name": "asp"})
    w = c.workers[0]
    assert not w.client.attach(0, 4000) and w.client.segment is None
    r = w.push(np.ones(1000, np.float32), 1)
    assert r.reply.applied and not r.reply.shared and r.values is w.params
    assert _segment_descriptors() <= before


def _segment_descriptors() -> set[str]:
    """This process's descriptors of segments (a mapping holds one too: ``mmap`` keeps a duplicate)."""
    out = set()
    for fd in os.listdir("/proc/self/fd"):
        try:
            if "switchps-segment" in os.readlink(f"/proc/self/fd/{fd}"):
                out.add(fd)
        except OSError:  # closed meanwhile (the listing's own, another thread's)
            pass
    return out
