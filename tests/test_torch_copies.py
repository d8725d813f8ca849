"""A GPU worker's copies (``workload/torch/copies.py``) on a fake ``torch.cuda``: what is page-locked and
released, and how the copies are ordered against the compute stream. CPU tensors stand in for the device
vectors (a copy between two CPU tensors is a real copy), so the bytes that arrive are checked too."""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager

import numpy as np
import pytest
import torch

from switchps.protos.codec import aligned_empty
from switchps.protos.segment import HEADER, Segment, available, file_bytes
from switchps.workload.torch.copies import Copies

torch.set_num_threads(1)


class FakeStream:
    def __init__(self, name: str, log: list[tuple]) -> None:
        self.name, self.log = name, log

    def wait_stream(self, other: FakeStream) -> None:
        self.log.append(("wait", self.name, other.name))

    def synchronize(self) -> None:
        self.log.append(("sync", self.name))


class FakeCudart:
    def __init__(self, log: list[tuple], error: int = 0) -> None:
        self.log, self.error = log, error

    def cudaHostRegister(self, address: int, nbytes: int, flags: int) -> int:
        self.log.append(("register", address, nbytes, flags))
        return self.error

    def cudaHostUnregister(self, address: int) -> int:
        self.log.append(("unregister", address))
        return 0

    def cudaGetErrorString(self, error: int) -> str:
        return "part or all of the requested memory range is already mapped"


class FakeCuda:
    """``torch.cuda`` as ``Copies`` uses it, every call logged in order."""

    def __init__(self, error: int = 0) -> None:
        self.log: list[tuple] = []
        self.compute = FakeStream("compute", self.log)
        self._cudart = FakeCudart(self.log, error)

    def Stream(self, device: torch.device) -> FakeStream:
        return FakeStream("copy", self.log)

    def current_stream(self, device: torch.device) -> FakeStream:
        return self.compute

    @contextmanager
    def stream(self, s: FakeStream) -> Iterator[None]:
        self.log.append(("on", s.name))
        yield
        self.log.append(("off", s.name))

    def cudart(self) -> FakeCudart:
        return self._cudart


def calls(log: list[tuple], kind: str) -> list[tuple]:
    return [entry for entry in log if entry[0] == kind]


needs_segments = pytest.mark.skipif(not available(), reason="no memory files on this host")


@needs_segments
def test_a_segment_is_page_locked_once_for_both_areas_and_released_at_close() -> None:
    """Its two areas share a page: one registration of the whole mapping covers both, made at the first
    copy and never again while the same areas come back; ``close`` unregisters it after the copies."""
    n = 1000
    cuda, segment = FakeCuda(), Segment.create(4 * n)
    copies = Copies(torch.device("cpu"), cuda)
    device_values, device_acc = torch.zeros(n), torch.arange(n, dtype=torch.float32)
    for step in range(3):
        segment.values[:] = step + 0.5
        copies.upload(segment.values, device_values)
        device_acc += 1
        copies.download(device_acc, segment.grad)
        assert torch.equal(device_values, torch.full((n,), step + 0.5)), "the reply's values reached the device"
        assert np.array_equal(segment.grad, device_acc.numpy()), "the payload reached the segment"
    mapping = segment.grad.ctypes.data - HEADER
    assert calls(cuda.log, "register") == [("register", mapping, file_bytes(4 * n), 0)]
    cuda.log.clear()
    copies.close()
    assert cuda.log == [("sync", "copy"), ("unregister", mapping)]


def test_each_copy_is_ordered_against_the_compute_stream() -> None:
    """An upload runs on the copy stream after the compute stream's work so far (which may still read the
    vector it overwrites), and the compute stream waits for it; a download waits for the compute stream
    (which wrote its source), and the host for the download."""
    cuda = FakeCuda()
    copies = Copies(torch.device("cpu"), cuda)
    host, device = aligned_empty(8), torch.ones(8)
    host[:] = 3.0
    copies.upload(host, device)
    assert [e for e in cuda.log if e[0] != "register"] == [
        ("wait", "copy", "compute"), ("on", "copy"), ("off", "copy"), ("wait", "compute", "copy")]
    cuda.log.clear()
    out = aligned_empty(8)
    assert copies.download(device, out) is out and np.array_equal(out, np.full(8, 3.0, np.float32))
    assert [e for e in cuda.log if e[0] != "register"] == [
        ("wait", "copy", "compute"), ("on", "copy"), ("off", "copy"), ("sync", "copy")]


@needs_segments
def test_a_new_segment_is_locked_and_the_old_released_once_neither_copy_uses_it() -> None:
    """After the PS restarted the worker attaches a new segment: the download moves to it first, the
    upload at the next reply; the old mapping stays locked until then, then is unregistered, the copies in
    flight done first."""
    n = 256
    cuda, old, new = FakeCuda(), Segment.create(4 * n), Segment.create(4 * n)
    copies = Copies(torch.device("cpu"), cuda)
    device = torch.zeros(n)
    copies.upload(old.values, device)
    copies.download(device, old.grad)
    copies.download(device, new.grad)
    old_map, new_map = old.grad.ctypes.data - HEADER, new.grad.ctypes.data - HEADER
    assert [e[1] for e in calls(cuda.log, "register")] == [old_map, new_map]
    assert calls(cuda.log, "unregister") == [], "the upload still reads the old segment's values"
    cuda.log.clear()
    copies.upload(new.values, device)
    assert calls(cuda.log, "register") == []
    assert cuda.log[:2] == [("sync", "copy"), ("unregister", old_map)]
    copies.close()
    assert calls(cuda.log, "unregister") == [("unregister", old_map), ("unregister", new_map)]


def test_a_plain_vector_is_locked_whole_through_the_array_owning_its_memory() -> None:
    """An aligned vector is a view of a larger byte array: that array is what is registered, once, however
    many views of it are copied."""
    cuda = FakeCuda()
    copies = Copies(torch.device("cpu"), cuda)
    flat = aligned_empty(100)
    owner = flat.base
    assert isinstance(owner, np.ndarray)
    copies.upload(flat, torch.zeros(100))
    copies.upload(flat[:100], torch.zeros(100))  # another view of the same memory: covered already
    assert calls(cuda.log, "register") == [("register", owner.ctypes.data, owner.nbytes, 0)]


def test_a_failed_registration_is_raised_with_cuda_s_reason() -> None:
    copies = Copies(torch.device("cpu"), FakeCuda(error=712))
    with pytest.raises(RuntimeError, match="already mapped"):
        copies.download(torch.zeros(4), aligned_empty(4))


def test_a_vector_over_a_tensor_s_memory_is_locked_as_the_whole_array_over_it() -> None:
    """A tensor exports no buffer: the ndarray over all of it (``Tensor.numpy``) is what is registered."""
    cuda = FakeCuda()
    whole = torch.zeros(16).numpy()
    Copies(torch.device("cpu"), cuda).download(torch.ones(12), whole[4:])
    assert calls(cuda.log, "register") == [("register", whole.ctypes.data, 64, 0)] and whole.sum() == 12


@pytest.mark.skipif(not torch.cuda.is_available() or not available(), reason="no GPU here (CI): run on a GPU host")
def test_on_a_gpu_the_payload_and_values_cross_through_page_locked_memory(monkeypatch: pytest.MonkeyPatch) -> None:
    """On a real GPU: a step at a segment's staged values pushes the CPU's payload (within 1 %, TF32 off: with
    cuDNN's TF32 convolutions, torch's default, it was 6 % off on an H200) from the segment's gradient area,
    both areas page-locked until ``close``; the reply buffer and a payload with no segment are pinned memory."""
    monkeypatch.setattr(torch.backends.cudnn, "allow_tf32", False)
    monkeypatch.setattr(torch.backends.cuda.matmul, "allow_tf32", False)
    from switchps.workload.torch.gradients import TorchComputer
    from switchps.workload.torch.models import build_model

    rng = np.random.default_rng(0)
    x, y = rng.random((64, 8, 8, 3), dtype=np.float32), np.arange(64) % 10
    cpu, gpu = (TorchComputer(build_model("resnet20", (8, 8, 3), 10, seed=1), x, y, d) for d in ("cpu", "cuda"))
    segment = Segment.create(4 * gpu.size)
    gpu.payload_to, cpu.payload_to = segment.grad, aligned_empty(cpu.size)
    reply, rows = cpu.buffer(), np.arange(0, 64, 2)
    for scale in (1.0, 0.5):  # the second step's values must reach the device too
        reply[:] = segment.values[:] = cpu.weights.read() * np.float32(scale)
        cpu.stage(reply)
        gpu.stage(segment.values)
        (want, want_loss), (got, got_loss) = cpu.compute(rows, 16), gpu.compute(rows, 16)
        assert np.shares_memory(got, segment.grad)
        assert np.linalg.norm(got - want) <= 1e-2 * np.linalg.norm(want) and got_loss == pytest.approx(want_loss, 1e-2)
    assert torch.from_numpy(segment.grad).is_pinned() and torch.from_numpy(segment.values).is_pinned()
    assert torch.from_numpy(gpu.buffer()).is_pinned()
    gpu.payload_to = None
    alone, _ = gpu.compute(rows, 16)  # the same gradient (its state, the running statistics, has moved on)
    n = gpu.weights.trainable_size
    assert torch.from_numpy(alone).is_pinned() and np.linalg.norm(alone[:n] - want[:n]) <= 1e-2 * np.linalg.norm(want)
    gpu.close()
    assert not torch.from_numpy(segment.grad).is_pinned()
