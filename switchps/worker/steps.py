"""One worker step: injected delays, then micro-batches until the work order's budget ends.

Time comes from a ``Clock``, so the budget logic (AMB's T, emulated device
speed, slowdowns) is tested on a fake clock, exactly, without sleeping.
"""

from __future__ import annotations

import math
import time
from dataclasses import dataclass
from typing import Protocol

import numpy as np

from switchps.protos.orders import from_wire
from switchps.straggler_trace import StepDelays


class Clock(Protocol):
    def now(self) -> float: ...

    def sleep(self, seconds: float) -> None: ...


class RealClock:
    """``time.perf_counter`` and ``time.sleep``."""

    def now(self) -> float:
        return time.perf_counter()

    def sleep(self, seconds: float) -> None:
        time.sleep(seconds)


class Order(Protocol):
    """What a step needs of its work order (the worker's protobuf one, whose time budget is read through
    ``orders.from_wire``, or a simulator's ``WorkOrder``)."""

    @property
    def sample_budget(self) -> int: ...

    @property
    def time_budget_s(self) -> float | None: ...

    @property
    def micro_batch(self) -> int: ...


class Computer(Protocol):
    """What a step needs of ``GradientComputer``: it names its samples by row."""

    def compute(self, rows: np.ndarray, micro_batch: int) -> tuple[np.ndarray, float]: ...

    def accumulate(self, rows: np.ndarray) -> None: ...

    def finish(self) -> tuple[np.ndarray, float]: ...


class Takes(Protocol):
    """Where a step's sample indices come from."""

    def take(self, count: int) -> np.ndarray: ...


class Sampler:
    """Draws sample indices from a data partition in seeded, reshuffled epochs."""

    def __init__(self, n: int, seed: int) -> None:
        self.n = n
        self.rng = np.random.default_rng(seed)
        self.order = self.rng.permutation(n)
        self.pos = 0

    def take(self, count: int) -> np.ndarray:
        out = []
        while count > 0:
            if self.pos == self.n:
                self.order, self.pos = self.rng.permutation(self.n), 0
            k = min(count, self.n - self.pos)
            out.append(self.order[self.pos : self.pos + k])
            self.pos += k
            count -= k
        return np.concatenate(out)


class Draws:
    """Draws sample indices from ``n`` with replacement, seeded."""

    def __init__(self, n: int, seed: int) -> None:
        self.n = n
        self.rng = np.random.default_rng(seed)

    def take(self, count: int) -> np.ndarray:
        return self.rng.integers(0, self.n, count)


def make_sampler(sampling: str, n: int, seed: int, worker: int) -> Sampler | Draws:
    """Worker ``worker``'s sampler over its ``n`` samples (``data.sampling``), seeded by the run and the worker."""
    seed = seed * 1000 + worker
    return Draws(n, seed) if sampling == "replacement" else Sampler(n, seed)


@dataclass
class Budget:
    """When a step's micro-batches end: at the work order's sample budget, and under AMB at its time
    budget T, counted from when the order arrived, after at least one micro-batch (a step never pushes
    zeros). ``StepRunner`` and a user's own loop (``session.Batches``) both obey it."""

    samples: int
    micro_batch: int
    end: float
    """When T ends (``math.inf``: no time budget)."""
    done: int = 0

    @classmethod
    def of(cls, order: Order, received_at: float) -> Budget:
        budget_s = from_wire(order.time_budget_s)
        return cls(order.sample_budget, order.micro_batch, math.inf if budget_s is None else received_at + budget_s)

    def next(self, now: float) -> int:
        """The next micro-batch's size at time ``now``; 0 once the step is over."""
        if self.done >= self.samples or (self.done and now >= self.end):
            return 0
        return min(self.micro_batch, self.samples - self.done)

    def exhausted(self, now: float) -> bool:
        """Whether the sample budget (AMB's max_batch) ran out before T did."""
        return self.done >= self.samples and now < self.end < math.inf


@dataclass
class Step:
    """What one worker step produced."""

    grad: np.ndarray
    samples: int
    loss_sum: float
    compute_s: float
    sleep_s: float
    exhausted: bool = False


class StepRunner:
    """Runs one step under a work order: injected delays, then micro-batches until a budget ends.

    The sample budget ends a BSP/ASP/SSP/FMB step; AMB adds a time budget T
    counted from the moment the work order arrived, with any straggler sleep
    inside it, and always finishes at least one micro-batch. With an emulated
    device each micro-batch takes ``micro_batch / samples_per_s`` seconds (never
    less than the real compute).
    """

    def __init__(self, gc: Computer, sampler: Takes, samples_per_s: float | None, clock: Clock | None = None) -> None:
        self.gc, self.sampler = gc, sampler
        self.samples_per_s = samples_per_s
        self.clock = clock or RealClock()

    def sleep(self, seconds: float) -> float:
        """Sleep ``seconds`` on the clock (none if not positive); the seconds slept."""
        if seconds > 0:
            self.clock.sleep(seconds)
        return max(seconds, 0.0)

    def run(self, order: Order, received_at: float, delays: StepDelays) -> Step:
        """The step, with its straggler sleep first (inside T) and its communication delay last."""
        step = self._compute(order, received_at, delays, self.sleep(delays.sleep_s))
        step.sleep_s += self.sleep(delays.comm_s)
        return step

    def _compute(self, order: Order, received_at: float, delays: StepDelays, slept: float) -> Step:
        budget = Budget.of(order, received_at)
        if budget.end == math.inf and self.samples_per_s is None and delays.factor == 1.0:
            t0 = self.clock.now()
            rows = self.sampler.take(order.sample_budget)
            grad, loss = self.gc.compute(rows, order.micro_batch)
            return Step(grad, len(rows), loss, self.clock.now() - t0, slept)
        compute = 0.0
        while size := budget.next(self.clock.now()):
            rows = self.sampler.take(size)
            t0 = self.clock.now()
            self.gc.accumulate(rows)
            took = self.clock.now() - t0
            if self.samples_per_s is not None:
                took += self.sleep(len(rows) / self.samples_per_s - took)
            slept += self.sleep((delays.factor - 1.0) * took)
            compute += took
            budget.done += len(rows)
        exhausted = budget.exhausted(self.clock.now())
        grad, loss = self.gc.finish()
        return Step(grad, budget.done, loss, compute, slept, exhausted)
