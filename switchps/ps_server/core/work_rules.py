"""Work rules: what a worker's order asks of its next step, and so how many samples a step holds.

A protocol is a work rule and an aggregation rule (``protocols``). The work rule sets each worker's
``Budget`` and says how many samples a worker-step holds, for the learning-rate rule; the aggregation
rule says how those steps combine. A new kind of step (a number of local steps) is one more class.
- ``Samples`` (bsp, fmb, backup, asp, ssp, kasync, timed): a sample budget, the protocol's batch or the
  one a policy set for the worker.
- ``TimeBudget`` (amb): whatever fits in T, up to ``max_batch`` samples; the batch is what was measured.
- ``LocalSteps`` (local_sgd, diloco, async_local_sgd, async_diloco, and any protocol given ``local_steps``):
  H steps of ``batch`` samples with the inner optimizer, then a push of what the model moved; over a time
  budget (amb), as many as fit in T. Its learning-rate batch is a local step's: the run's optimizer, which
  the batch rule scales, is not used while it is in force (the outer optimizer steps at its own rate).
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from typing import ClassVar

from switchps.config.optimizer import OptimizerSpec
from switchps.config.protocol import AMB, Base
from switchps.ps_server.core.events import Batches, Budget, Local


def per_worker(b: Batches, batch: int) -> list[float]:
    """Each worker's sample budget: a policy's, else the protocol's batch."""
    return [float(b.per_worker.get(w, batch)) for w in b.members or range(b.num_workers)]


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


class LocalSteps(WorkRule):
    """H local steps of ``batch`` samples with the inner optimizer, under a time budget if the protocol has one
    (``base``: the protocol's own work rule, which says whether it does)."""

    def __init__(self, s: Base, base: WorkRule, configured: OptimizerSpec) -> None:
        super().__init__(s)
        assert s.local_steps is not None
        self.time_budget_s = base.budget(-1, {}).time_budget_s
        self.inner = s.inner(configured)
        self.steps = s.local_steps

    def budget(self, worker: int, batches: dict[int, int]) -> Budget:
        batch = batches.get(worker, self.s.batch)
        return Budget(self.steps * batch, self.time_budget_s, self._micro(batch),
                      Local(self.steps, batch, self.inner, self.s.inner_state == "reset"))

    def samples(self, b: Batches) -> list[float]:
        return per_worker(b, self.s.batch)
