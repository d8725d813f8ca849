"""glibc heap tuning for processes that move multi-MB frames: what the allocator keeps for the next frames
(``tune_allocator``), one arena for every thread (``one_arena``), and free pages given back to the OS
(``trim_heap``, ``TrimSoon``). Where the C library is not glibc each does nothing (and the tuning says
False).
"""

from __future__ import annotations

import asyncio
import ctypes
import ctypes.util
import functools

TRIM_THRESHOLD = 128 * 1024 * 1024
"""Free memory glibc keeps at the top of its heap, for the next frames (see ``tune_allocator``)."""


@functools.cache
def _libc() -> ctypes.CDLL | None:
    try:
        libc = ctypes.CDLL(ctypes.util.find_library("c"))
        return libc if hasattr(libc, "mallopt") and hasattr(libc, "malloc_trim") else None
    except (OSError, TypeError):
        return None


def trim_heap() -> None:
    """Return the free pages of glibc's heap to the OS.

    Freed frames stay in the heap, and the frames of many streams, freed in any order, fragment it:
    after rounds of refused concurrent pushes, 850 MB of a 1.1 GB heap was free yet resident.
    ``malloc_trim`` releases free pages anywhere in the heap (2-30 ms there).
    """
    libc = _libc()
    if libc is not None:
        libc.malloc_trim(0)


class TrimSoon:
    """``trim_heap`` a little after it is asked for (on the running event loop), at most once per ``delay_s``
    however often it is asked."""

    def __init__(self, delay_s: float) -> None:
        self.delay_s, self._due = delay_s, False

    def __call__(self) -> None:
        if not self._due:
            self._due = True
            asyncio.get_running_loop().call_later(self.delay_s, self._trim)

    def _trim(self) -> None:
        self._due = False
        trim_heap()


@functools.cache
def one_arena() -> bool:
    """Serve every thread that first allocates after this call from glibc's main arena.

    glibc gives threads arenas of their own (up to 8 per core), and what is freed at the top of one stays
    resident: ``malloc_trim`` shrinks only the main arena's top, and a per-thread heap (64 MiB at most)
    never reaches ``TRIM_THRESHOLD``, past which it would shrink itself. With the PS's dozen arenas, its
    resident memory after rounds of refused pushes was the sum of their high-water marks (340-415 MB
    for a 16 MB model; 160-180 MB with one arena). Returns False where the C library is not glibc.
    """
    libc = _libc()
    m_arena_max = -8
    return libc is not None and libc.mallopt(m_arena_max, 1) == 1


@functools.cache
def tune_allocator() -> bool:
    """Keep freed memory in glibc's heap so multi-MB frames don't page-fault fresh memory.

    Every frame is a new ``bytes`` object; by default glibc serves multi-MB blocks
    with mmap and returns them on free, so each frame costs page faults: cutting a
    100 MB model into frames ran at 1.6 GB/s, and at 12 GB/s with this tuning.
    At most ``TRIM_THRESHOLD`` of free memory stays at the heap's top (it was 1 GiB).
    Returns False where the C library is not glibc.
    """
    libc = _libc()
    if libc is None:
        return False
    m_trim_threshold, m_top_pad, m_mmap_threshold = -1, -2, -3
    return all(libc.mallopt(opt, value) == 1 for opt, value in (
        (m_mmap_threshold, 32 * 2**20), (m_trim_threshold, TRIM_THRESHOLD), (m_top_pad, 64 * 2**20)))
