"""A push's bytes through shared memory, when a worker and its PS run on one host.

A round trip of a 784k-parameter model through gRPC's Python API costs about 2.3 ms of CPU more than
an empty one (``bench/ceiling.py``); through a segment it costs two copies. The worker makes the
segment: a memory file (``memfd_create``, no name) of ``file_bytes(nbytes)``: ``HEADER`` bytes starting
with a random nonce, then a gradient area and a values area of ``nbytes`` each, each starting on an
``ALIGN``-byte boundary (so the worker's TF reads the values in place), sealed against shrinking and
growing. It sends the nonce over its authenticated channel (``Attach``), then the file's descriptor
with its first frame on the PS's Unix socket (``protos/local_socket.py``); a PS that finds it a memory
file so sealed, of exactly that size, holding that nonce, maps it for that worker's pushes. A PS on
another host cannot reach the socket, and the worker stays on gRPC bytes; a crash leaves no file.

The seals are what let the PS map memory a worker controls: a worker that could cut its file short
would leave the PS's mapping past the file's end, and the PS's next copy would die of SIGBUS. The PS
copies a gradient out of the segment before checking it, so a worker that writes while the PS reads
changes only what it pushes, never what the PS applies after the checks.
"""

from __future__ import annotations

import fcntl
import mmap
import os
import secrets
from dataclasses import dataclass, field

import numpy as np

from switchps.protos import wire_dtype
from switchps.protos.codec import ALIGN
from switchps.refusals import invalid

HEADER = 64
NONCE_BYTES = 16
SEALS = fcntl.F_SEAL_SHRINK | fcntl.F_SEAL_GROW
"""The seals a PS requires of a segment (its maker adds ``F_SEAL_SEAL`` too: nothing can lift them)."""
NOT_ATTACHED = "has no attached segment"
"""In the PS's refusal of a push through a segment it does not know (after a restart of the PS)."""


def file_bytes(nbytes: int) -> int:
    """The size of a segment whose areas hold ``nbytes`` each: the header, then two aligned areas."""
    return HEADER + 2 * _area(nbytes)


def _area(nbytes: int) -> int:
    return -(-nbytes // ALIGN) * ALIGN


def available() -> bool:
    """Whether this host makes memory files (Linux)."""
    return hasattr(os, "memfd_create")


@dataclass
class Segment:
    """One mapped segment: ``grad`` and ``values`` are views of its two areas, of ``wire`` values
    (``protos/wire_dtype``: float32 unless ``runtime.wire_dtype`` is narrower). ``fd``: the maker's
    descriptor, until it has sent it (``close_fd``); -1 on the PS's side, which keeps only the mapping."""

    nonce: bytes
    nbytes: int
    _map: mmap.mmap = field(repr=False)
    fd: int = -1
    wire: str = "float32"

    def __post_init__(self) -> None:
        dtype = wire_dtype.STORAGE[self.wire]
        n = self.nbytes // dtype.itemsize
        self.grad = np.frombuffer(self._map, dtype, n, HEADER)
        self.values = np.frombuffer(self._map, dtype, n, HEADER + _area(self.nbytes))

    @classmethod
    def create(cls, nbytes: int, wire: str = "float32") -> "Segment":
        """A new segment of this process's (the worker's), its nonce written and its size sealed. ``OSError``
        if there is no memory for it: the pages are reserved now, so that no write into the mapping can fail
        later (SIGBUS)."""
        nonce = secrets.token_bytes(NONCE_BYTES)
        fd = os.memfd_create("switchps-segment", os.MFD_CLOEXEC | os.MFD_ALLOW_SEALING)
        try:
            os.posix_fallocate(fd, 0, file_bytes(nbytes))
            fcntl.fcntl(fd, fcntl.F_ADD_SEALS, SEALS | fcntl.F_SEAL_SEAL)
            m = mmap.mmap(fd, file_bytes(nbytes))
        except OSError:
            os.close(fd)
            raise
        m[:NONCE_BYTES] = nonce
        return cls(nonce, nbytes, m, fd, wire)

    @classmethod
    def adopt(cls, fd: int, nonce: bytes, nbytes: int, wire: str = "float32") -> "Segment":
        """The segment a worker sent the PS ``fd`` of, mapped (``fd`` stays the caller's to close), once
        ``nonce`` has been read from it (``sealed_nonce``); ``Rejected`` (INVALID_ARGUMENT) unless it is
        ``file_bytes(nbytes)`` long."""
        size = os.fstat(fd).st_size
        if size != file_bytes(nbytes):
            raise invalid("segment", f"a segment of {nbytes}-byte areas is a {file_bytes(nbytes)}-byte file, "
                                     f"not {size}")
        try:
            return cls(nonce, nbytes, mmap.mmap(fd, size), wire=wire)
        except OSError as e:  # sealed against writes, or a descriptor opened read-only
            raise invalid("segment", f"the segment cannot be mapped to read and write: {e.strerror}") from None

    def close_fd(self) -> None:
        """Drop the maker's descriptor (the mapping stays valid)."""
        if self.fd >= 0:
            os.close(self.fd)
            self.fd = -1


def sealed_nonce(fd: int) -> bytes:
    """The nonce at the start of the segment a worker sent the PS ``fd`` of; ``Rejected`` (INVALID_ARGUMENT)
    unless it is a memory file of ordinary pages sealed against shrinking and growing. The seals are read
    first: that does no I/O, so the descriptor of a file system that hangs cannot stall the PS. A file of
    huge pages is refused: a page a worker frees in it (a punched hole) may find the pool empty when the
    PS touches it again, and that is SIGBUS too."""
    try:
        seals = fcntl.fcntl(fd, fcntl.F_GET_SEALS)
    except OSError:  # not a memory file
        seals = 0
    if seals & SEALS != SEALS:
        raise invalid("segment", "a segment is a memory file sealed against shrinking and growing")
    if os.fstat(fd).st_blksize != mmap.PAGESIZE:
        raise invalid("segment", "a segment is a memory file of ordinary pages, not huge ones")
    try:
        return os.pread(fd, NONCE_BYTES, 0)
    except OSError as e:  # a descriptor opened write-only
        raise invalid("segment", f"the segment cannot be read: {e.strerror}") from None
