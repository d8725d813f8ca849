"""Receiving payloads: model-sized buffers reused and bounded (``BufferPool``), and how many payloads each
worker may hold at once on a PS or a follower shard (``Slots``), so that no worker can starve another and
receive memory stays within ``EACH`` × workers × the model's bytes."""

from __future__ import annotations

import contextlib
import threading
from collections import Counter
from typing import AsyncIterator, Iterator

import numpy as np

from switchps.protos.heap import TrimSoon
from switchps.refusals import Rejected, invalid

TRIM_DELAY_S = 0.5
"""How soon after a payload is discarded the heap's free pages go back to the OS."""


class BufferPool:
    """Model-sized receive buffers, reused so pushes don't page-fault fresh memory each time, and bounded.

    At most ``limit`` free buffers are kept (with a fresh buffer per concurrent push, rounds of refused
    pushes grew the PS's resident memory without bound), and a discarded payload's pages go back to the OS
    soon after. How many payloads are held at once is bounded per worker (``Slots``).
    """

    def __init__(self, size: int, limit: int = 8) -> None:
        self.size, self.limit = size, limit
        self._free: list[np.ndarray] = []
        self._lock = threading.Lock()  # ``put`` also runs on the applier thread
        self._trim_soon = TrimSoon(TRIM_DELAY_S)

    def get(self) -> np.ndarray:
        with self._lock:
            if self._free:
                return self._free.pop()
        return np.empty(self.size, np.float32)

    def put(self, buf: np.ndarray) -> None:
        with self._lock:
            if buf.size == self.size and len(self._free) < self.limit:
                self._free.append(buf)

    def discard(self, buf: np.ndarray | None = None) -> None:
        """A refused or expired payload: ``put`` its buffer (if it had one), and give the heap's free pages
        back to the OS soon (on the event loop only), so that neither what was not kept nor what gRPC
        buffered for the call stays resident."""
        if buf is not None:
            self.put(buf)
        self._trim_soon()

    @contextlib.asynccontextmanager
    async def receiving(self, size: int | None = None) -> AsyncIterator[np.ndarray]:
        """A buffer to receive one payload into (a fresh one of ``size`` elements if given), on the event
        loop. The buffer is the caller's if the body succeeds, and is discarded if it raises."""
        buf = self.get() if size is None else np.empty(size, np.float32)
        try:
            yield buf
        except BaseException:
            self.discard(buf)
            raise


EACH = 2
"""Payloads one worker may hold at once: a push and its resend after a lost reply."""


class Slots:
    """How many payloads each worker holds on a PS or a follower shard at once, so that none can starve
    another: at most ``EACH`` for each of ``workers`` identities (0 .. workers - 1).

    A worker has one push in flight, two around a lost reply (its resend arrives while the PS still holds
    the first). An identity is a worker's index (its token's: the handlers check the header's against it
    before they take a slot); one more payload than ``EACH`` is refused at once with RESOURCE_EXHAUSTED
    (``busy``): it never waits, and no other identity waits behind it (with one pool of slots for all,
    three stalled streams of one worker held every other worker's pushes off). An index outside the
    run's holds nothing (INVALID_ARGUMENT, ``unknown_worker``), so receive buffers take at most ``EACH`` ×
    workers × the model's (a follower: its part's) bytes, plus the ``BufferPool``'s free ones.

    Held: on the PS (and shard 0), from a push's header passing its checks until the push reaches the
    core (read whole and, on shard 0, accepted by every follower) or is refused; on a follower, from a
    part's header until shard 0 names its push (join, free, drop), the part expires, or it is refused.

    Concurrency: the server's event loop's alone (the handlers take and release), so no lock.
    """

    def __init__(self, workers: int) -> None:
        self.workers = workers
        self._held: Counter[int] = Counter()

    def take(self, worker: int) -> None:
        """Hold a slot of ``worker``'s, or raise ``Rejected`` if it has none free (or is no worker)."""
        if not 0 <= worker < self.workers:
            raise invalid("unknown_worker", f"worker index {worker} outside [0, {self.workers})")
        if self._held[worker] >= EACH:
            raise Rejected("RESOURCE_EXHAUSTED", "busy", f"worker {worker} already has {EACH} payloads being "
                                                         f"received or awaiting the other shards (at most {EACH})")
        self._held[worker] += 1

    def release(self, worker: int) -> None:
        assert self._held[worker] > 0, f"worker {worker} holds no slot"
        self._held[worker] -= 1

    @contextlib.contextmanager
    def holding(self, worker: int) -> Iterator[None]:
        """A slot of ``worker``'s for the body (``take``'s refusal if none is free)."""
        self.take(worker)
        try:
            yield
        finally:
            self.release(worker)

    def held(self, worker: int) -> int:
        """How many payloads ``worker`` holds now."""
        return self._held[worker]
