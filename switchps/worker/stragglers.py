"""Straggler injection: decides, per worker step, how long to sleep and how much to slow down.

Everything here is pure and seeded; the worker loop does the sleeping. Five kinds compose:

* ``mixture``: an i.i.d. sleep per worker per step drawn from an AMB-style Gaussian mixture,
  slept inside the step's time budget (so under AMB a straggler contributes fewer samples).
* ``shifted_exponential``: an i.i.d. sleep of c + Exp(mu) per worker per step (the AMB paper's
  compute-time model), slept like the mixture's and added to it; with a device of negligible
  compute a step takes c + Exp(mu), the model of ``switchps.closed_forms``.
* ``slowdown``: a persistent per-worker compute slowdown (heterogeneous hardware).
* ``transient``: Sync-Switch style episodes during which k workers are slowed (or sleep extra).
  The episode list depends on the run seed only, so all workers agree without talking.
* ``comm_delay``: a delay before each push (tc-netem style network latency).

A run can instead replay an earlier run's ``stragglers.csv`` exactly (``trace``); the specs are in
``switchps.straggler_config``, the trace format in ``switchps.straggler_trace``.

Randomness: every kind has its own stream, and a step's draws are a pure function of (seed, worker,
stream, step) (``switchps.step_random``), so enabling one kind never changes another's draws.
"""

from __future__ import annotations

import bisect

import numpy as np

from switchps.step_random import StepRandom, Stream
from switchps.straggler_trace import StepDelays, load_trace
from switchps.straggler_config import StragglerSpec, TransientSpec


class StragglerInjector:
    """Decides one worker's delays, step by step. Build one per worker with the run's seed."""

    def __init__(self, spec: StragglerSpec, *, seed: int, worker: int, num_workers: int) -> None:
        if not 0 <= worker < num_workers:
            raise ValueError(f"worker {worker} is not in range({num_workers})")
        self.spec = spec
        self.seed = seed
        self.worker = worker
        self.num_workers = num_workers
        self.beyond_trace = 0
        """How many plan() calls asked for a step after the end of the replayed trace."""
        self._random = StepRandom(seed)
        self._check_workers()

        self._trace: dict[int, StepDelays] | None = None
        if spec.trace is not None:
            self._trace = {s: d for (w, s), d in load_trace(spec.trace).items() if w == worker}
            self._trace_end = max(self._trace, default=-1)

        m = spec.mixture
        self._mixture = m if m is not None and (m.workers is None or worker in m.workers) else None
        if self._mixture is not None:
            self._means, self._stds, probs = self._mixture.components()
            self._cum = np.cumsum(probs)
            self._cum[-1] = 1.0
            self._clip = self._mixture.clip_s
        e = spec.shifted_exponential
        self._shifted_exp = e if e is not None and (e.workers is None or worker in e.workers) else None
        self._slowdown = spec.slowdown.factors.get(worker, 1.0) if spec.slowdown is not None else 1.0

        self._episodes: list[tuple[float, float, tuple[int, ...]]] = []
        self._starts: list[float] = []
        if spec.transient is not None:
            self._episode_rng = np.random.default_rng([seed, Stream.TRANSIENT])
            if spec.transient.times is not None:
                for start in sorted(spec.transient.times):
                    self._add_episode(spec.transient, start)

    def _check_workers(self) -> None:
        n, s = self.num_workers, self.spec
        named = [*(s.mixture.workers or ())] if s.mixture else []
        named += [*(s.shifted_exponential.workers or ())] if s.shifted_exponential else []
        named += list(s.slowdown.factors) if s.slowdown else []
        if s.transient is not None:
            k = s.transient.workers
            if isinstance(k, int):
                if k > n:
                    raise ValueError(f"transient.workers={k} but the run has {n} workers")
            else:
                named += k
        bad = sorted({w for w in named if w >= n})
        if bad:
            raise ValueError(f"stragglers name worker(s) {bad} but the run has {n} workers")

    def _add_episode(self, tr: TransientSpec, start: float) -> None:
        if isinstance(tr.workers, int):
            chosen = tuple(sorted(int(w) for w in self._episode_rng.choice(self.num_workers, tr.workers, replace=False)))
        else:
            chosen = tuple(sorted(tr.workers))
        self._episodes.append((start, start + tr.duration_s, chosen))
        self._starts.append(start)

    def _extend_episodes(self, tr: TransientSpec, every_s: float, t: float) -> None:
        """Poisson mode: generate episodes until one starts after ``t``."""
        while not self._starts or self._starts[-1] <= t:
            last = self._starts[-1] if self._starts else 0.0
            self._add_episode(tr, last + float(self._episode_rng.exponential(every_s)))

    def episodes(self) -> list[tuple[float, float, tuple[int, ...]]]:
        """Episodes known so far as (start_s, end_s, workers); the same on every worker."""
        return list(self._episodes)

    def _transient(self, t: float) -> tuple[float, float]:
        """(factor, added sleep) at time ``t``: the max factor / sum of delays over overlapping episodes."""
        tr = self.spec.transient
        if tr is None:
            return 1.0, 0.0
        if tr.every_s is not None:
            self._extend_episodes(tr, tr.every_s, t)
        factor, delay = 1.0, 0.0
        # Starts are sorted and durations equal, so ends are sorted too: walk back until one ended.
        for start, end, chosen in reversed(self._episodes[: bisect.bisect_right(self._starts, t)]):
            if end <= t:
                break
            if self.worker in chosen:
                if tr.factor is not None:
                    factor = max(factor, tr.factor)
                elif tr.delay_s is not None:
                    delay += tr.delay_s
        return factor, delay

    def _rng(self, stream: Stream, step: int) -> np.random.Generator:
        return self._random.at(self.worker, stream, step)

    def _mixture_sleep(self, step: int) -> float:
        if self._mixture is None:
            return 0.0
        g = self._rng(Stream.MIXTURE, step)
        i = int(np.searchsorted(self._cum, g.random(), side="right"))
        return float(min(abs(self._means[i] + self._stds[i] * g.standard_normal()), self._clip))

    def _shifted_exp_sleep(self, step: int) -> float:
        e = self._shifted_exp
        if e is None:
            return 0.0
        return float(e.shift_s + self._rng(Stream.SHIFTED_EXP, step).exponential(1.0 / e.rate_per_s))

    def _comm(self, step: int) -> float:
        c = self.spec.comm_delay
        if c is None:
            return 0.0
        if c.fixed_s is not None:
            return float(c.fixed_s)
        return float(abs((c.sigma_s or 0.0) * self._rng(Stream.COMM, step).standard_normal()))

    def plan(self, step: int, t: float) -> StepDelays:
        """Delays for ``step``, which starts ``t`` seconds after training started.

        When replaying, a step after the last recorded one counts in ``beyond_trace`` and gets no
        delay; a gap inside the recording (a row the writer skipped) also gets no delay.
        """
        if self._trace is not None:
            if step > self._trace_end:
                self.beyond_trace += 1
                return StepDelays()
            return self._trace.get(step, StepDelays())
        factor, delay = self._transient(t)
        return StepDelays(sleep_s=self._mixture_sleep(step) + self._shifted_exp_sleep(step) + delay,
                          factor=self._slowdown * factor,
                          comm_s=self._comm(step))
