"""What the protocol core asks its driver to do, and the one place an action is told apart (``execute``).

The core answers every event with a list of actions; a driver carries them out in that order: ``Join`` a
push's gradient into an open aggregate's sum, ``Free`` a push's buffer, ``Apply`` an aggregate as the
next version, ``Release`` a held reply, ``SetOptimizer``, ``Record`` an event or ``Count`` a push. Each
driver (the gRPC service, shard 0's forwarding to its followers, a follower, the simulator, the test
harness) is an ``Executor``: one method per action. ``execute`` is the only ``match`` over the actions, and
it ends in ``assert_never``: an action added to ``Action`` and not handled there fails mypy, and so does an
executor that lacks its method, wherever it is passed to ``execute``.
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass
from typing import Any, Protocol, Union, assert_never

from switchps.config.optimizer import OptimizerSpec
from switchps.ps_server.core.events import Aggregate, Outcome, WorkOrder


@dataclass(frozen=True)
class Join:
    """Add push ``push_id``'s gradient into aggregate ``aggregate_id``'s sum (the first push's buffer
    becomes the sum; a later one's is added, in arrival order, and freed)."""

    push_id: int
    aggregate_id: int


@dataclass(frozen=True)
class Free:
    """Push ``push_id``'s buffer is not needed (a dropped push, a resent one): back to the pool."""

    push_id: int


@dataclass
class Apply:
    """Apply aggregate ``aggregate``'s sum as model version ``version`` (consuming the sum): a gradient with the
    run's optimizer, or, if ``outer`` names one, pushed movements (``Aggregate.local_steps``) with that
    outer optimizer, whose state is its own."""

    version: int
    aggregate: Aggregate
    lr_factor: float
    protocol: str
    time_budget_s: float | None
    wait_s: float
    outer: OptimizerSpec | None = None
    members: int = 0
    """N in force when it applied (``Membership.num_workers``)."""


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


Action = Union[Join, Free, Apply, Release, SetOptimizer, Record, Count]


class Executor(Protocol):
    """Carries out each kind of action. ``execute`` calls its methods on the thread that called it: the
    driver's one thread that also drives the core (a gRPC driver's event loop), so an executor needs no
    lock of its own; anything it hands another thread (the model store's applier) goes through that
    thread's queue, in the order called."""

    def join(self, a: Join) -> None: ...

    def free(self, a: Free) -> None: ...

    def apply(self, a: Apply) -> None: ...

    def release(self, a: Release) -> None: ...

    def set_optimizer(self, a: SetOptimizer) -> None: ...

    def record(self, a: Record) -> None: ...

    def count(self, a: Count) -> None: ...


def execute(actions: Iterable[Action], executor: Executor) -> None:
    """Carry out ``actions`` in order, each by its method of ``executor``."""
    for a in actions:
        match a:
            case Join():
                executor.join(a)
            case Free():
                executor.free(a)
            case Apply():
                executor.apply(a)
            case Release():
                executor.release(a)
            case SetOptimizer():
                executor.set_optimizer(a)
            case Record():
                executor.record(a)
            case Count():
                executor.count(a)
            case _:
                assert_never(a)
