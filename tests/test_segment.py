"""Pushes through a shared-memory segment (``protos/segment.py``): the segment's checks without sockets,
then a real PS on loopback: applied whole, refused and counted when hostile, and attached again after the
PS forgot it."""

from __future__ import annotations

import os

import grpc
import numpy as np
import pytest

from switchps.protos import switchps_pb2 as pb
from switchps.protos.codec import ALIGN, COPIES
from switchps.protos.segment import DIR, HEADER, Segment, available
from switchps.ps_server.attachments import Attachments
from switchps.refusals import Rejected

pytest_plugins = ["cluster"]  # cluster_factory: a PS on loopback
pytestmark = pytest.mark.skipif(not available(), reason="no /dev/shm on this host")


@pytest.fixture
def made():
    segment = Segment.create(16)
    yield segment
    segment.unlink()


def test_the_ps_maps_the_workers_segment_and_both_see_the_same_bytes(made):
    seen = Segment.open(made.name, made.nonce, 16)
    assert seen is not None
    made.grad[:] = [1, 2, 3, 4]
    seen.values[:] = [5, 6, 7, 8]
    np.testing.assert_array_equal(seen.grad, [1, 2, 3, 4])
    np.testing.assert_array_equal(made.values, [5, 6, 7, 8])
    made.unlink()
    assert not (DIR / made.name).exists()
    made.grad[0] = 9
    assert seen.grad[0] == 9, "the mappings outlive the name"


def test_a_segment_is_the_workers_own_file_only(made):
    assert os.stat(DIR / made.name).st_mode & 0o777 == 0o600
    assert os.stat(DIR / made.name).st_size == HEADER + 2 * ALIGN, "each 16-byte area padded to a cache line"


def test_each_area_starts_on_an_aligned_boundary(made):
    assert made.grad.ctypes.data % ALIGN == 0 and made.values.ctypes.data % ALIGN == 0


@pytest.mark.parametrize("name, nonce, nbytes, what", [
    ("../etc/passwd", None, 16, "named"),
    ("switchps-" + "0" * 31, None, 16, "named"),
    (None, b"x" * 16, 16, "nonce"),
    (None, b"", 16, "nonce"),
    (None, None, 80, "-byte file"),
    (None, None, 6, "float32"),
])
def test_a_segment_that_is_not_what_a_worker_makes_is_refused(made, name, nonce, nbytes, what):
    with pytest.raises(Rejected) as err:
        Segment.open(name or made.name, made.nonce if nonce is None else nonce, nbytes)
    assert err.value.code == "INVALID_ARGUMENT" and err.value.reason == "segment" and what in str(err.value)


def test_a_link_in_place_of_a_segment_is_refused(made, tmp_path):
    name = "switchps-" + "a" * 32
    os.symlink(DIR / made.name, DIR / name)
    try:
        with pytest.raises(Rejected, match="cannot be opened"):
            Segment.open(name, made.nonce, 16)
    finally:
        os.unlink(DIR / name)


def test_a_segment_the_ps_cannot_see_means_another_host():
    assert Segment.open("switchps-" + "b" * 32, b"n" * 16, 16) is None


def test_attachments_refuse_strangers_and_pushes_before_attaching(made):
    a = Attachments(max_bytes=1024)
    request = pb.AttachRequest(worker=0, name=made.name, nonce=made.nonce, nbytes=16)
    with pytest.raises(Rejected, match="unknown worker"):
        a.attach(request, registered=False)
    with pytest.raises(Rejected) as err:
        a.payload(0, memoryview(b""))
    assert err.value.code == "FAILED_PRECONDITION"
    assert a.attach(request, registered=True).attached
    with pytest.raises(Rejected, match="no bytes of its own"):
        a.payload(0, memoryview(b"\0\0\0\0"))
    segment, payload = a.payload(0, memoryview(b""))
    assert payload.nbytes == 16
    with pytest.raises(Rejected, match="model limit"):
        Attachments(max_bytes=8).attach(request, registered=True)


# ---- a real PS on loopback -----------------------------------------------------------------------


def test_a_push_through_the_segment_is_applied_whole_and_its_reply_comes_back_through_it(cluster_factory):
    c = cluster_factory(workers=1, size=1000, protocol={"name": "asp"})
    w = c.workers[0]
    assert w.client.attach(0, 4000) and w.client.segment is not None
    assert not (DIR / w.client.segment.name).exists(), "the name is gone once attached"
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
    attach = w.client.channel.unary_unary("/switchps.ParameterServer/Attach", pb.AttachRequest.SerializeToString,
                                          pb.AttachReply.FromString)
    segment = Segment.create(4000)
    try:
        for request in (pb.AttachRequest(worker=0, name=segment.name, nonce=b"guess" * 4, nbytes=4000),
                        pb.AttachRequest(worker=7, name=segment.name, nonce=segment.nonce, nbytes=4000),
                        pb.AttachRequest(worker=0, name="/dev/shm/x", nonce=segment.nonce, nbytes=4000)):
            with pytest.raises(grpc.RpcError) as err:
                attach(request, timeout=10)
            assert err.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    finally:
        segment.unlink()
    push = w.client.channel.unary_unary("/switchps.ParameterServer/PushSmall")
    header = pb.PushHeader(worker=0, samples=1, layout_digest=w.layout.digest, nbytes=4000, shared=True)
    with pytest.raises(grpc.RpcError) as err:
        push(b"".join([len(header.SerializeToString()).to_bytes(4, "little"), header.SerializeToString()]),
             timeout=10)
    assert err.value.code() == grpc.StatusCode.FAILED_PRECONDITION
    assert c.rec.rejections == {"attach:segment": 2, "attach:unknown_worker": 1, "push:not_attached": 1}
    assert c.store.version == 0 and not c.params.any()


def test_a_client_attaches_again_when_the_ps_has_forgotten_its_segment(cluster_factory):
    """A PS that restarted between two pushes has no segment of the worker's: the push is refused before
    it reaches the core, and the client attaches a new segment and sends it again, once."""
    c = cluster_factory(workers=1, size=1000, protocol={"name": "asp"})
    w = c.workers[0]
    assert w.client.attach(0, 4000)
    first = w.client.segment
    c.ps.segments = Attachments(c.ps.max_model_bytes)  # what a restarted PS has
    r = w.push(np.ones(1000, np.float32), 1)
    assert r.reply.applied and r.reply.shared and r.order.version == 1
    assert w.client.segment is not first
    assert c.rec.rejections == {"push:not_attached": 1}


def test_a_segment_with_no_room_leaves_no_file_and_the_worker_pushes_as_bytes(cluster_factory, monkeypatch):
    """/dev/shm too small (a container's is often 64 MB): the space is reserved up front, so the failure is
    an OSError at creation, not a SIGBUS at the first write; the client stays on gRPC bytes."""
    import errno

    def full(fd: int, offset: int, length: int) -> None:
        raise OSError(errno.ENOSPC, "No space left on device")

    before = set(os.listdir(DIR))
    monkeypatch.setattr(os, "posix_fallocate", full)
    with pytest.raises(OSError):
        Segment.create(16)
    assert set(os.listdir(DIR)) == before
    c = cluster_factory(workers=1, size=1000, protocol={"name": "asp"})
    w = c.workers[0]
    assert not w.client.attach(0, 4000) and w.client.segment is None
    r = w.push(np.ones(1000, np.float32), 1)
    assert r.reply.applied and not r.reply.shared and r.values is w.params
