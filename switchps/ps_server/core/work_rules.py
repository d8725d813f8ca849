"""Work rules: what a worker's order asks of its next step, and so how many samples a step holds.

A protocol is a work rule and an aggregation rule (``protocols``). The work rule sets each worker's
``Budget`` and says how many samples a worker-step holds, for the learning-rate rule; the aggregation
rule says how those steps combine. A new kind of step (a number of local steps) is one more class.
- ``Samples`` (bsp, fmb, backup, asp, ssp, kasync, timed): a sample budget, the protocol's batch or the
  one a policy set for the worker.
- ``TimeBudget`` (amb): whatever fits in T, up to ``max_batch`` samples; the batch is what was measured.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from typing import ClassVar

from switchps.config.protocol import AMB, Base
from switchps.ps_server.core.events import Batches, Budget


def per_worker(b: Batches, batch: int) -> list[float]:
    """Each worker's sample budget: a policy's, else the protocol's batch."""
    return [float(b.per_worker.get(w, batch)) for w in range(b.num_workers)]


class WorkRule(ABC):
    """What a worker's order asks: ``budget``; and the samples each worker-step holds: ``samples``."""

    measures_batch: ClassVar[bool] = False
    """A step's samples are what was measured, so the learning rate follows them update by update."""

    def __init__(self, s: Base) -> None:
        self.s = s

    @abstractmethod
    def budget(self, worker: int, batches: dict[int, int]) -> Budget:
        """``worker``'s next order (-1: a reader, who computes nothing; ``batches``: a policy's budgets)."""

    @abstractmethod
    def samples(self, b: Batches) -> list[float]:
        """Each worker's samples per step, for the effective batch."""

    def _micro(self, samples: int) -> int:
        return min(self.s.micro_batch or self.s.batch, samples)


class Samples(WorkRule):
    """A sample budget: a step ends when it has its samples."""

    def budget(self, worker: int, batches: dict[int, int]) -> Budget:
        samples = batches.get(worker, self.s.batch)
        return Budget(samples, None, self._micro(samples))

    def samples(self, b: Batches) -> list[float]:
        return per_worker(b, self.s.batch)


class TimeBudget(WorkRule):
    """A time budget with a max batch: a step ends at T after its order, or at ``max_batch`` samples."""

    measures_batch: ClassVar[bool] = True
    s: AMB

    def budget(self, worker: int, batches: dict[int, int]) -> Budget:
        samples = self.s.max_batch or 4 * self.s.batch
        return Budget(samples, self.s.time_budget_s, self._micro(samples))

    def samples(self, b: Batches) -> list[float]:
        measured = b.step_samples
        return [measured] * b.num_workers if measured is not None else per_worker(b, self.s.batch)
