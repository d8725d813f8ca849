"""A GPU worker's copies between host and device: page-locked host memory, copies on their own stream.

A GPU step copies the payload (Σ gradient, then the state) to the host once and a reply's values to the
device once (``TorchComputer``). A copy to or from pageable memory goes through the driver's staging buffer
at a fraction of the link's bandwidth, and one into pageable memory blocks the host until it is done; the
copy engine reads and writes page-locked memory directly. So the host memory these copies touch is
page-locked: a vector this module allocates (the reply buffer, a payload with no segment to go to) comes
from torch's pinned allocator, which caches its blocks; memory it did not allocate (a shared-memory
segment, mapped by ``protos/segment``) is registered in place with ``cudaHostRegister``, the whole mapping
at once (its two areas share a page), and unregistered once no copy uses it (a new segment after the PS
restarted) or at ``close``. A registered mapping is kept referenced, so it is never unmapped while locked.

The copies run on ``Copies.stream``, ordered against the compute stream by events (``wait_stream``): an
upload waits for the compute stream (still reading the device vector it overwrites, when the caller runs
ahead) and the compute stream waits for the upload before reading it; a download waits for the compute
stream (which wrote its source) and the host waits for the download (the payload is pushed next). The
device vectors are the computer's own, allocated once, so the caching allocator never hands their memory
to another tensor under a copy (no ``record_stream``); a pinned block of torch's is kept from reuse by the
event a non-blocking copy records on it. A CPU computer has no ``Copies``: it makes no CUDA call.
"""

from __future__ import annotations

from typing import Any

import numpy as np
import torch

from switchps.workload.torch.weights import host_tensor


class Copies:
    """Host<->device copies for one device, used from the thread that computes (the compute stream is that
    thread's current stream); ``cuda`` is ``torch.cuda`` (a test gives a fake)."""

    def __init__(self, device: torch.device, cuda: Any = torch.cuda) -> None:
        self.device, self.cuda = device, cuda
        self.stream = cuda.Stream(device)
        self._registered: dict[int, tuple[int, object]] = {}
        """Start address -> (end address, the object owning the memory: kept alive while registered)."""
        self._uses: dict[str, tuple[np.ndarray, int | None]] = {}
        """What each copy direction touched last: the host vector, and the start of its registration."""

    def empty(self, size: int) -> np.ndarray:
        """A float32 vector in page-locked memory (torch's pinned allocator)."""
        return torch.empty(size, dtype=torch.float32, pin_memory=True).numpy()

    def upload(self, source: np.ndarray, target: torch.Tensor) -> torch.Tensor:
        """Copy the host vector ``source`` into the device vector ``target``, asynchronously: the compute
        stream's later work reads it after the copy; the caller leaves ``source`` unchanged until the next
        ``download`` returns (it waits for every copy before it)."""
        self._pin("upload", source)
        compute = self.cuda.current_stream(self.device)
        self.stream.wait_stream(compute)
        with self.cuda.stream(self.stream):
            target.copy_(host_tensor(source), non_blocking=True)
        compute.wait_stream(self.stream)
        return target

    def download(self, source: torch.Tensor, target: np.ndarray) -> np.ndarray:
        """Copy the device vector ``source``, once the compute stream's work so far has written it, into the
        host vector ``target``; returns when it is there. A ``target`` of a narrow wire's type (bfloat16's
        bits, float16: ``protos/wire_dtype``) gets it narrowed on the device first, so half the bytes cross
        (torch rounds to bfloat16 as ``wire_dtype.narrow`` does, bit for bit)."""
        self._pin("download", target)
        self.stream.wait_stream(self.cuda.current_stream(self.device))
        with self.cuda.stream(self.stream):
            host = host_view(target)
            host.copy_(source if host.dtype == source.dtype else source.to(host.dtype), non_blocking=True)
        self.stream.synchronize()
        return target

    def settle(self) -> None:
        """Return once every copy issued here is done (an upload's source may then be rewritten)."""
        self.stream.synchronize()

    def rows(self, rows: np.ndarray) -> torch.Tensor:
        """A micro-batch's row numbers on the device, copied on the compute stream from pinned memory, the host
        not waiting (a blocking copy waits for all the device was given: the upload, the last backward)."""
        return torch.from_numpy(rows).pin_memory().to(self.device, non_blocking=True)

    def close(self) -> None:
        """Unregister every mapping registered here (after the copies in flight)."""
        self._uses.clear()
        self._release()

    def _pin(self, use: str, array: np.ndarray) -> None:
        """Page-lock ``array``'s memory for the copy ``use`` makes, unless it is already; release what the
        previous vector of that use had registered, if no other use touches it."""
        last = self._uses.get(use)
        if last is not None and last[0] is array:
            return
        self._uses[use] = (array, self._lock(array))
        self._release()

    def _lock(self, array: np.ndarray) -> int | None:
        """The start of the registration covering ``array`` (made now if none does); None if its memory is
        page-locked already (torch's pinned allocator's)."""
        address = array.ctypes.data
        for start, (end, _) in self._registered.items():
            if start <= address and address + array.nbytes <= end:
                return start
        if torch.from_numpy(array).is_pinned():
            return None
        owner, start, nbytes = _memory(array)
        status = self.cuda.cudart().cudaHostRegister(start, nbytes, 0)  # a cudaError (an enum)
        if int(status):  # CUDA keeps it as its last error too, which a later kernel launch would raise unexplained
            raise RuntimeError(f"cudaHostRegister of {nbytes} bytes of host memory failed: "
                               f"{self.cuda.cudart().cudaGetErrorString(status)} (error {int(status)})")
        self._registered[start] = (start + nbytes, owner)
        return start

    def _release(self) -> None:
        """Unregister the registrations no use touches any more, once the copies in flight are done."""
        used = {start for _, start in self._uses.values()}
        unused = [start for start in self._registered if start not in used]
        if unused:
            self.stream.synchronize()
        for start in unused:
            del self._registered[start]
            self.cuda.cudart().cudaHostUnregister(start)


def _memory(array: np.ndarray) -> tuple[object, int, int]:
    """The object owning ``array``'s memory, and the address and length of all of it: a mapping's whole
    length for a view of a segment (``np.frombuffer`` of an ``mmap``), the first ndarray's otherwise (or the
    array's own, over memory that is no buffer, a tensor's)."""
    owner = array
    while isinstance(owner.base, np.ndarray):
        owner = owner.base
    base: Any = owner.base
    try:
        whole = np.frombuffer(base, np.uint8)
    except TypeError:  # no base (the ndarray owns its memory), or one that exports no buffer
        return owner, owner.ctypes.data, owner.nbytes
    return base, whole.ctypes.data, whole.nbytes


def host_view(array: np.ndarray) -> torch.Tensor:
    """Host vector ``array`` as a tensor of its type: float32, float16, or bfloat16 kept as its bits (uint16)."""
    if array.dtype == np.uint16:
        return torch.from_numpy(array.view(np.int16)).view(torch.bfloat16)
    return torch.from_numpy(array)
