"""The event loop on virtual time: a heap of timed callbacks, and a worker's own clock.

Events at the same time run in the order they were scheduled (a sequence number breaks every tie), so a
run is a pure function of its config: the same events, in the same order, at the same times. A cancelled
event stays in the heap but neither runs nor moves the clock. A ``background`` event (a periodic
evaluation) keeps nothing going by itself: the loop ends when only such events remain, so a run in which
nothing can happen any more (every worker gone, or waiting) ends instead of evaluating forever.
"""

from __future__ import annotations

import heapq
import itertools
from typing import Any, Callable


class Event:
    """A scheduled callback; ``cancel`` it and it never runs."""

    __slots__ = ("fn", "args", "background")

    def __init__(self, fn: Callable[..., None], args: tuple[Any, ...], background: bool = False) -> None:
        self.fn: Callable[..., None] | None = fn
        self.args = args
        self.background = background

    def cancel(self) -> None:
        self.fn = None


class Loop:
    """Timed callbacks, run in time order; ``now`` is the virtual time of the one running."""

    def __init__(self) -> None:
        self.now = 0.0
        self.events = 0  # callbacks run so far
        self._heap: list[tuple[float, int, Event]] = []
        self._seq = itertools.count()
        self._background = 0  # background events in the heap (counted apart: most events are not)

    def at(self, t: float, fn: Callable[..., None], *args: Any, background: bool = False) -> Event:
        """Run ``fn(*args)`` at virtual time ``t`` (never before now); ``background``: if nothing else
        remains, it does not run."""
        event = Event(fn, args, background)
        heapq.heappush(self._heap, (max(t, self.now), next(self._seq), event))
        if background:
            self._background += 1
        return event

    def run(self, limit: int) -> bool:
        """Run up to ``limit`` callbacks; whether any remain that keep the loop going (cancelled ones count
        until their time comes)."""
        heap, ran = self._heap, 0
        while len(heap) > self._background and ran < limit:
            t, _, event = heapq.heappop(heap)
            if event.background:
                self._background -= 1
            fn = event.fn
            if fn is None:  # cancelled
                continue
            self.now, ran = t, ran + 1
            self.events += 1
            fn(*event.args)
        return len(heap) > self._background


class WorkerClock:
    """A worker's virtual clock (``worker.steps.Clock``): sleeping moves its time on, nothing waits."""

    def __init__(self) -> None:
        self.t = 0.0

    def now(self) -> float:
        return self.t

    def sleep(self, seconds: float) -> None:
        self.t += seconds
