"""Churn on virtual time: when a simulated elastic run's workers depart and arrive (the ``churn`` section).

A trace's changes are scheduled as they are written. A Poisson process of preemptions gives each running
worker an exponential lifetime of mean ``3600 / preempt_per_hour`` seconds, drawn when it starts running
from a generator of its own keyed by (seed, worker), so one worker's draws never depend on another's;
a preempted worker comes back ``rejoin_after_s`` later (then draws its next lifetime), or never. Nothing is
scheduled once training has ended, so the loop drains.
"""

from __future__ import annotations

from typing import Protocol

import numpy as np

from switchps.config.churn import ChurnSpec, read_trace
from switchps.config.run import RunConfig
from switchps.sim.loop import Loop

KEY = 0x636875726E
"""The third word of a worker's churn generator's key ("churn"): no ``step_random.Stream`` is this large."""


class Members(Protocol):
    """What churn acts on: the simulator's workers."""

    def arrive(self, index: int) -> None: ...

    def depart(self, index: int) -> None: ...

    @property
    def done(self) -> bool:
        """Training has ended."""


class Churn:
    """Schedules ``spec``'s departures and arrivals of ``members`` on ``loop``."""

    def __init__(self, cfg: RunConfig, loop: Loop, members: Members) -> None:
        self.spec: ChurnSpec = cfg.churn
        self.cfg, self.loop, self.members = cfg, loop, members
        self.rngs: dict[int, np.random.Generator] = {}

    def start(self) -> None:
        """Schedule the trace, or each starting worker's first preemption (at time 0, as they start)."""
        spec, cluster = self.spec, self.cfg.cluster
        if spec.trace is not None:
            for c in read_trace(spec.trace, cluster.num_workers, cluster.max_workers):
                self.loop.at(c.time_s, self._change, c.worker, c.event == "join")
        elif spec.preempt_per_hour:
            for w in range(cluster.num_workers):
                self._lifetime(w)

    def _change(self, worker: int, join: bool) -> None:
        if not self.members.done:
            (self.members.arrive if join else self.members.depart)(worker)

    def _lifetime(self, worker: int) -> None:
        """Schedule ``worker``'s preemption, which has just started running."""
        rng = self.rngs.get(worker)
        if rng is None:
            rng = self.rngs[worker] = np.random.default_rng([self.cfg.seed, worker, KEY])
        self.loop.at(self.loop.now + rng.exponential(3600.0 / self.spec.preempt_per_hour), self._preempt, worker)

    def _preempt(self, worker: int) -> None:
        if self.members.done:
            return
        self.members.depart(worker)
        if self.spec.rejoin_after_s is not None:
            self.loop.at(self.loop.now + self.spec.rejoin_after_s, self._rejoin, worker)

    def _rejoin(self, worker: int) -> None:
        if self.members.done:
            return
        self.members.arrive(worker)
        self._lifetime(worker)
