"""Straggler injection: decides, per worker step, how long to sleep and how much to slow down.

Everything here is pure and seeded; the worker loop does the sleeping. Five kinds compose:

* ``mixture``: an i.i.d. sleep per worker per step drawn from an AMB-style Gaussian mixture,
  slept inside the step's time budget (so under AMB a straggler contributes fewer samples).
* ``shifted_exponential``: an i.i.d. sleep of c + Exp(mu) per worker per step (the AMB paper's
  compute-time model), slept like the mixture's and added to it; with a device of negligible
  compute a step takes c + Exp(mu), the model of ``switchps.closed_forms``.
* ``slowdown``: a persistent per-worker compute slowdown (heterogeneous hardware).
* ``transient``: Sync-Switch style episodes during which k workers are slowed (or sleep extra).
  The episode list depends on the run seed only, so all workers agree without talking
  (``switchps.worker.episodes``).
* ``comm_delay``: a delay before each push (tc-netem style network latency).

A run can instead replay an earlier run's ``stragglers.csv`` exactly (``trace``); the specs are in
``switchps.config.stragglers``, the trace format in ``switchps.straggler_trace``.

Randomness: every kind has its own stream, and a step's draws are a pure function of (seed, worker,
stream, step) (``switchps.step_random``), so enabling one kind never changes another's draws.
"""

from __future__ import annotations

import numpy as np

from switchps.step_random import StepRandom, Stream
from switchps.straggler_trace import StepDelays, worker_trace
from switchps.config.stragglers import StragglerSpec
from switchps.worker.episodes import Episode, shared as shared_episodes


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
            self._trace = worker_trace(spec.trace, worker)
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

        tr = spec.transient
        self._episodes = shared_episodes(tr, seed, num_workers) if tr is not None else None

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

    def episodes(self) -> list[Episode]:
        """Transient episodes known so far as (start_s, end_s, workers); the same on every worker."""
        return self._episodes.known() if self._episodes is not None else []

    def _transient(self, t: float) -> tuple[float, float]:
        """(factor, added sleep) at time ``t`` from the transient episodes."""
        return self._episodes.effect(self.worker, t) if self._episodes is not None else (1.0, 0.0)

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
