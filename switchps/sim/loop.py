"""The event loop on virtual time: a heap of timed callbacks, and a worker's own clock.

Events at the same time run in the order they were scheduled (a sequence number breaks every tie), so a
run is a pure function of its config: the same events, in the same order, at the same times.
"""

from __future__ import annotations

import heapq
import itertools
from typing import Any, Callable


class Loop:
    """Timed callbacks, run in time order; ``now`` is the virtual time of the one running."""

    def __init__(self) -> None:
        self.now = 0.0
        self.events = 0  # callbacks run so far
        self._heap: list[tuple[float, int, Callable[..., None], tuple[Any, ...]]] = []
        self._seq = itertools.count()

    def at(self, t: float, fn: Callable[..., None], *args: Any) -> None:
        """Run ``fn(*args)`` at virtual time ``t`` (never before now)."""
        heapq.heappush(self._heap, (max(t, self.now), next(self._seq), fn, args))

    def run(self, limit: int) -> bool:
        """Run up to ``limit`` callbacks; whether any remain."""
        heap = self._heap
        for _ in range(limit):
            if not heap:
                return False
            self.now, _, fn, args = heapq.heappop(heap)
            self.events += 1
            fn(*args)
        return bool(heap)


class WorkerClock:
    """A worker's virtual clock (``worker.steps.Clock``): sleeping moves its time on, nothing waits."""

    def __init__(self) -> None:
        self.t = 0.0

    def now(self) -> float:
        return self.t

    def sleep(self, seconds: float) -> None:
        self.t += seconds
