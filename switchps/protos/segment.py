"""A push's bytes through shared memory, when a worker and its PS run on one host.

A round trip of a 784k-parameter model through gRPC's Python API costs about 2.3 ms of CPU more than
an empty one (``bench/ceiling.py``); through a segment it costs two copies. The worker makes the
segment, ``/dev/shm/switchps-<32 hex>`` (its own, mode 0600): ``HEADER`` bytes starting with a random
nonce, then a gradient area and a values area of ``nbytes`` each, each starting on an ``ALIGN``-byte
boundary (so the worker's TF reads the values in place). It sends the name and the nonce
over its authenticated channel (``Attach``); a PS that can open the file, finds it a regular file of
its own user of exactly that size and reads the same nonce, uses it for that worker's pushes. The
worker then removes the name: both keep their mapping, and a crash leaves nothing behind. A PS on
another host cannot see the file, and the worker stays on gRPC bytes.

The PS copies a gradient out of the segment before checking it, so a worker that writes while the PS
reads changes only what it pushes, never what the PS applies after the checks.
"""

from __future__ import annotations

import hmac
import mmap
import os
import re
import secrets
import stat
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np

from switchps.protos.codec import ALIGN
from switchps.refusals import invalid

DIR = Path("/dev/shm")
NAME = re.compile(r"switchps-[0-9a-f]{32}\Z")
HEADER = 64
NONCE_BYTES = 16
NOT_ATTACHED = "has no attached segment"
"""In the PS's refusal of a push through a segment it does not know (after a restart of the PS)."""


def file_bytes(nbytes: int) -> int:
    """The size of a segment whose areas hold ``nbytes`` each: the header, then two aligned areas."""
    return HEADER + 2 * _area(nbytes)


def _area(nbytes: int) -> int:
    return -(-nbytes // ALIGN) * ALIGN


def available() -> bool:
    """Whether this host has a shared-memory file system to make segments in."""
    return DIR.is_dir() and os.access(DIR, os.W_OK)


@dataclass
class Segment:
    """One mapped segment: ``grad`` and ``values`` are float32 views of its two areas."""

    name: str
    nonce: bytes
    nbytes: int
    _map: mmap.mmap = field(repr=False)

    def __post_init__(self) -> None:
        n = self.nbytes // 4
        self.grad = np.frombuffer(self._map, np.float32, n, HEADER)
        self.values = np.frombuffer(self._map, np.float32, n, HEADER + _area(self.nbytes))

    @classmethod
    def create(cls, nbytes: int) -> "Segment":
        """A new segment of this process's (the worker's), its nonce written; ``unlink`` it once attached.
        ``OSError`` if ``DIR`` has no room for it: the space is reserved now (a container's /dev/shm is
        often 64 MB), so that no write into the mapping can fail later (SIGBUS)."""
        name, nonce = f"switchps-{secrets.token_hex(16)}", secrets.token_bytes(NONCE_BYTES)
        fd = os.open(DIR / name, os.O_RDWR | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW, 0o600)
        try:
            os.posix_fallocate(fd, 0, file_bytes(nbytes))
            m = mmap.mmap(fd, file_bytes(nbytes))
        except OSError:
            os.unlink(DIR / name)
            raise
        finally:
            os.close(fd)
        m[:NONCE_BYTES] = nonce
        return cls(name, nonce, nbytes, m)

    @classmethod
    def open(cls, name: str, nonce: bytes, nbytes: int) -> "Segment | None":
        """The worker's segment as the PS maps it; None if it is not there (the worker is on another host).
        ``Rejected`` (INVALID_ARGUMENT) if the name, the file or the nonce is not what a worker makes."""
        if not NAME.match(name):
            raise invalid("segment", f"a segment is named switchps-<32 hex digits>, not {name[:80]!r}")
        if nbytes <= 0 or nbytes % 4:
            raise invalid("segment", f"a segment's areas hold float32 values, not {nbytes} bytes")
        try:
            fd = os.open(DIR / name, os.O_RDWR | os.O_NOFOLLOW)
        except FileNotFoundError:
            return None
        except OSError as e:
            raise invalid("segment", f"segment {name} cannot be opened: {e.strerror}") from None
        try:
            st = os.fstat(fd)
            if not stat.S_ISREG(st.st_mode) or st.st_uid != os.geteuid() or st.st_size != file_bytes(nbytes):
                raise invalid("segment", f"segment {name} is not a {file_bytes(nbytes)}-byte file of the PS's user")
            m = mmap.mmap(fd, st.st_size)
        finally:
            os.close(fd)
        if not hmac.compare_digest(m[:NONCE_BYTES], nonce):
            m.close()
            raise invalid("segment", f"segment {name} does not hold the nonce sent with it")
        return cls(name, nonce, nbytes, m)

    def unlink(self) -> None:
        """Remove the name (both mappings stay valid until their processes drop them)."""
        try:
            os.unlink(DIR / self.name)
        except FileNotFoundError:
            pass
