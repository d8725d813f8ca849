"""Transient straggler episodes: the run-wide schedule of Sync-Switch style slowdowns (k workers slowed,
or sleeping extra, for ``duration_s``, at given times or as a Poisson process).

Every worker derives the same schedule from the run's seed alone, so workers agree without talking. In
one process (the simulator's thousands of workers) they share one schedule: ``shared`` draws it once
per (spec, seed, workers), where one schedule per worker would cost O(N) draws per episode each, O(N^2)
in all. A schedule is not thread-safe; a process that shares one uses it from one thread.
"""

from __future__ import annotations

import bisect
from functools import lru_cache

import numpy as np

from switchps.step_random import Stream
from switchps.config.stragglers import TransientSpec

Episode = tuple[float, float, tuple[int, ...]]
"""(start_s, end_s, the workers it slows)."""


class Episodes:
    """The schedule, drawn as far as it has been asked about."""

    def __init__(self, spec: TransientSpec, seed: int, num_workers: int) -> None:
        self.spec, self.num_workers = spec, num_workers
        self._rng = np.random.default_rng([seed, Stream.TRANSIENT])
        self._episodes: list[Episode] = []
        self._members: list[frozenset[int]] = []
        self._starts: list[float] = []
        for start in sorted(spec.times or ()):
            self._add(start)

    def _add(self, start: float) -> None:
        k = self.spec.workers
        if isinstance(k, int):
            chosen = tuple(sorted(int(w) for w in self._rng.choice(self.num_workers, k, replace=False)))
        else:
            chosen = tuple(sorted(k))
        self._episodes.append((start, start + self.spec.duration_s, chosen))
        self._members.append(frozenset(chosen))
        self._starts.append(start)

    def _extend(self, t: float) -> None:
        """Poisson mode: draw episodes until one starts after ``t``."""
        every = self.spec.every_s
        if every is None:
            return
        while not self._starts or self._starts[-1] <= t:
            last = self._starts[-1] if self._starts else 0.0
            self._add(last + float(self._rng.exponential(every)))

    def known(self) -> list[Episode]:
        """The episodes drawn so far; the same on every worker."""
        return list(self._episodes)

    def effect(self, worker: int, t: float) -> tuple[float, float]:
        """(factor, added sleep) for ``worker`` at time ``t``: the max factor / the sum of delays over the
        episodes that cover it."""
        self._extend(t)
        factor, delay = 1.0, 0.0
        # Starts are sorted and durations equal, so ends are sorted too: walk back until one ended.
        for i in reversed(range(bisect.bisect_right(self._starts, t))):
            if self._episodes[i][1] <= t:
                break
            if worker in self._members[i]:
                if self.spec.factor is not None:
                    factor = max(factor, self.spec.factor)
                elif self.spec.delay_s is not None:
                    delay += self.spec.delay_s
        return factor, delay


def shared(spec: TransientSpec, seed: int, num_workers: int) -> Episodes:
    """The schedule of (spec, seed, workers), one per process (see the module docstring)."""
    return _shared(spec.model_dump_json(), seed, num_workers)


@lru_cache(maxsize=8)
def _shared(spec_json: str, seed: int, num_workers: int) -> Episodes:
    return Episodes(TransientSpec.model_validate_json(spec_json), seed, num_workers)
