"""Work over the blocks of a flat vector on several threads (``runtime.ps_threads``): the PS's apply and its
sums' joins, where a host has cores to spare.

The work is elementwise (the optimizers' updates, adding gradients), so each block's result is the same
whichever thread computes it and in whatever order: the blocks are the single-threaded loop's blocks
(``start = k * block``), each handed whole to one thread, so a threaded run makes the very same calls
on the very same slices, and its results are bit-identical. NumPy's ufuncs release the GIL on arrays
this size, so the threads run at once.

Concurrency: ``Lanes.run`` runs on its caller's thread, which only waits for the blocks and yields the
finished prefix, while the ``threads`` lanes run on a pool made once; the lanes claim blocks in order
from a shared counter, so the finished prefix grows from the start (a reply streams the model in order).
The caller runs no block itself: its ``work`` is never called back on the caller's thread, whose stack
holds the caller's file (the data path enters no file twice: ``tests/test_data_path.py``); with one
thread there is no pool and the caller loops over its blocks itself (``Lanes.parallel`` is False). One
``run`` at a time (the store's one writer, see ``store``); its ``work`` for a block runs on whichever lane
claimed it, so whatever it touches outside its block must be safe to touch from several threads at once.
"""

from __future__ import annotations

import os
import threading
from collections.abc import Callable, Iterator
from concurrent.futures import ThreadPoolExecutor, wait

AUTO_MIN_CORES = 8
"""``ps_threads: auto`` threads the apply only from this many usable cores per PS process on the host."""
AUTO_MAX_THREADS = 8

Work = Callable[[int, slice], None]
"""``work(lane, block)``: one block's work, on lane ``lane`` (0 .. threads - 1; a lane's own scratch)."""


class Lanes:
    """``threads`` pooled threads over a vector's blocks (none for one thread: the caller's loop)."""

    def __init__(self, threads: int = 1) -> None:
        if threads < 1:
            raise ValueError(f"threads must be >= 1, got {threads}")
        self.threads = threads
        self._pool = ThreadPoolExecutor(threads, "switchps-lane") if threads > 1 else None

    @property
    def parallel(self) -> bool:
        """Whether blocks run on the pool (else the caller loops over them itself, with no ``run``)."""
        return self._pool is not None

    def run(self, size: int, block: int, work: Work) -> Iterator[int]:
        """``work`` every block of ``[0, size)`` on the pool's lanes, yielding increasing ends such that every
        block below the end is done (a caller may publish them meanwhile). A caller that stops iterating
        early still waits for the blocks the lanes have started."""
        if self._pool is None:
            raise RuntimeError("one thread: the caller loops over its blocks itself (Lanes.parallel)")
        r = _Round(size, block)
        futures = [self._pool.submit(r.drain, work, lane) for lane in range(self.threads)]
        try:
            yielded = 0
            while yielded < size:
                yielded = r.wait_beyond(yielded)
                yield yielded
        finally:
            r.stop()
            wait(futures)

    def close(self) -> None:
        if self._pool is not None:
            self._pool.shutdown(wait=True)


SERIAL = Lanes(1)
"""One thread, the caller's: the single-threaded loop."""


class _Round:
    """One ``Lanes.run``'s shared state: the next block to claim, the finished ones, a lane's failure."""

    def __init__(self, size: int, block: int) -> None:
        self.size, self.block_size = size, block
        self.blocks = -(-size // block)
        self._next = 0
        self._done = bytearray(self.blocks)
        self._prefix = 0  # blocks finished from the start
        self._stopped = False
        self._error: BaseException | None = None
        self._cond = threading.Condition()

    def block(self, i: int) -> slice:
        return slice(i * self.block_size, min((i + 1) * self.block_size, self.size))

    def claim(self) -> int | None:
        """The next block to work on; None once all are claimed, or the round stopped or failed."""
        with self._cond:
            if self._stopped or self._error is not None or self._next == self.blocks:
                return None
            self._next += 1
            return self._next - 1

    def finish(self, i: int) -> int:
        """Block ``i`` is done; returns the end of the finished prefix, in elements."""
        with self._cond:
            self._done[i] = 1
            while self._prefix < self.blocks and self._done[self._prefix]:
                self._prefix += 1
            self._cond.notify_all()
            return min(self._prefix * self.block_size, self.size)

    def wait_beyond(self, end: int) -> int:
        """The finished prefix's end once it passes ``end``; raises a lane's failure."""
        with self._cond:
            while self._error is None and min(self._prefix * self.block_size, self.size) <= end:
                self._cond.wait()
            if self._error is not None:
                raise self._error
            return min(self._prefix * self.block_size, self.size)

    def drain(self, work: Work, lane: int) -> None:
        """A pooled lane: claim and work blocks until none is left; a failure stops the round."""
        try:
            while (i := self.claim()) is not None:
                work(lane, self.block(i))
                self.finish(i)
        except BaseException as e:
            with self._cond:
                self._error = e
                self._cond.notify_all()

    def stop(self) -> None:
        with self._cond:
            self._stopped = True


def auto_threads(cores: int, processes: int = 1) -> int:
    """``ps_threads: auto``: 1 below ``AUTO_MIN_CORES`` usable cores per PS process on the host (a small
    host's cores serve the event loop and the workers; this keeps the 2-core path as it was), else half
    of them, at most ``AUTO_MAX_THREADS``: the other half for the event loop, the workers' host side and
    the OS, and an elementwise update is bound by memory bandwidth, which a few threads fill."""
    per_process = cores // max(processes, 1)
    return 1 if per_process < AUTO_MIN_CORES else min(AUTO_MAX_THREADS, per_process // 2)


def ps_threads(setting: int | str, shards: list[str], shard: int = 0) -> int:
    """The threads shard ``shard`` of a PS at ``shards`` (one address: unsharded) applies with: ``setting``,
    or for ``auto`` ``auto_threads`` of the cores this process may use, shared with the shards whose
    address names the same host."""
    if setting != "auto":
        return int(setting)
    host = shards[shard].rpartition(":")[0]
    here = sum(1 for a in shards if a.rpartition(":")[0] == host)
    return auto_threads(len(os.sched_getaffinity(0)), here)
