"""What flows into the protocol core and what comes out of it: plain data, no I/O.

A driver (the gRPC service, a test, the simulator) hands the core events such
as a ``Push`` with the time it happened, and executes the actions it gets
back, in order: ``Apply`` an update, ``Release`` a held reply, ``SetOptimizer``,
``Record`` an event or ``Count`` a push. Gradient buffers have one owner at a
time: the driver until the push reaches the core, then the core (in an
``Aggregate``), then the driver again through ``Apply`` or the core's
``recycle`` callback.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Callable, Union

import numpy as np

Recycle = Callable[[np.ndarray], None]
"""Gives a gradient buffer back to its pool once the core no longer needs it."""


@dataclass(eq=False)  # compared by identity: one push, one reply
class Push:
    """A validated push: ``grad`` is the summed gradient over ``samples``, then the worker's state."""

    id: int
    worker: int
    base_version: int
    samples: int
    grad: np.ndarray
    loss_sum: float
    arrived: float
    staleness: int = 0
    """Versions applied since ``base_version``, set by the core when the push arrives."""


@dataclass(frozen=True)
class StepReport:
    """What a worker says about the step that produced a push (its ``StepStats``)."""

    compute_s: float = 0.0
    sleep_s: float = 0.0
    send_s: float = 0.0
    wait_s: float = 0.0

    @property
    def step_s(self) -> float:
        """Compute, injected delay and communication, without the last reply's barrier wait."""
        return self.compute_s + self.sleep_s + max(0.0, self.send_s - self.wait_s)


@dataclass(eq=False)
class Aggregate:
    """Pushes summed into one buffer (the first one's): one update of ΣG/Σb."""

    started: float
    members: list[Push] = field(default_factory=list)
    grad: np.ndarray | None = None

    def add(self, push: Push, recycle: Recycle) -> None:
        """Take ``push`` in: its gradient joins the sum and its buffer, if not the sum's, is recycled."""
        if self.grad is None:
            self.grad = push.grad
        else:
            np.add(self.grad, push.grad, out=self.grad)
            recycle(push.grad)
        self.members.append(push)

    @property
    def workers(self) -> set[int]:
        return {m.worker for m in self.members}

    @property
    def samples(self) -> int:
        return sum(m.samples for m in self.members)


@dataclass(frozen=True)
class WorkOrder:
    """What a worker does next."""

    protocol: str
    version: int
    sample_budget: int
    time_budget_s: float
    micro_batch: int
    stop: bool


@dataclass(frozen=True)
class Outcome:
    """What a pusher is told about its push."""

    applied: bool
    staleness: int
    wait_s: float
    note: str = ""


@dataclass
class Apply:
    """Apply ``aggregate`` as model version ``version`` (it consumes the aggregate's buffer)."""

    version: int
    aggregate: Aggregate
    lr_factor: float
    protocol: str
    time_budget_s: float
    wait_s: float


@dataclass(frozen=True)
class Release:
    """Send push ``push_id``'s reply now."""

    push_id: int
    worker: int
    outcome: Outcome
    order: WorkOrder


@dataclass(frozen=True)
class SetOptimizer:
    """Put a learning-rate scale and momentum in force (between the updates before and after)."""

    lr_scale: float
    momentum: float | None
    state: str = "keep"
    state_scale: float = 1.0


@dataclass(frozen=True)
class Record:
    """An event for the run record."""

    event: str
    fields: dict[str, Any]


@dataclass(frozen=True)
class Count:
    """Count a push as accepted or dropped (with its reason)."""

    what: str
    reason: str | None = None


Action = Union[Apply, Release, SetOptimizer, Record, Count]


class Rejected(Exception):
    """A request that must not touch the model: the gRPC status name and the reason it is counted under."""

    def __init__(self, code: str, reason: str, message: str) -> None:
        super().__init__(message)
        self.code, self.reason = code, reason


def invalid(reason: str, message: str) -> Rejected:
    return Rejected("INVALID_ARGUMENT", reason, message)


def precondition(reason: str, message: str) -> Rejected:
    return Rejected("FAILED_PRECONDITION", reason, message)
