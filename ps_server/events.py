"""What flows into the protocol core and what comes out of it: plain data, no behaviour, no I/O.

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
    step: int = 0
    session: int = 0
    """With ``worker`` and ``step``, the push's name: a retry carries the same name."""


@dataclass(frozen=True)
class StepReport:
    """What a worker says about the step that produced a push (its ``StepStats``, as plain data)."""

    compute_s: float = 0.0
    sleep_s: float = 0.0
    send_s: float = 0.0
    wait_s: float = 0.0
    step: int = 0
    loss_sum: float = 0.0
    delay_sleep_s: float = 0.0
    delay_factor: float = 0.0
    delay_comm_s: float = 0.0
    batch_exhausted: bool = False


@dataclass(eq=False)
class Aggregate:
    """Pushes summed into one buffer (the first one's): one update of ΣG/Σb."""

    started: float
    members: list[Push] = field(default_factory=list)
    grad: np.ndarray | None = None
    samples: int = 0


@dataclass
class Membership:
    """Registered workers (with their shard sizes), the active ones, and the excluded ones.

    A worker is inactive after missing a deadline, until its next push; an excluded worker (elastic)
    still pushes, but a round does not wait for it.
    """

    num_workers: int
    registered: dict[int, int] = field(default_factory=dict)
    active: set[int] = field(default_factory=set)
    excluded: set[int] = field(default_factory=set)
    last_seen: dict[int, float] = field(default_factory=dict)
    """When each worker last registered or pushed (an SSP laggard's deadline counts from it)."""


@dataclass(frozen=True)
class Budget:
    """A work order's budget: samples, a time limit (0: none) and the micro-batch."""

    samples: int
    time_s: float
    micro_batch: int


@dataclass(frozen=True)
class Batches:
    """What an effective batch depends on besides the protocol."""

    num_workers: int
    per_worker: dict[int, int]
    """Per-worker sample budgets a policy set (dynamic batching); others use the protocol's batch."""
    step_samples: float | None = None
    """Measured mean samples per worker-step, if any (AMB does whatever fits in T)."""
    update_samples: float | None = None
    """Measured mean samples per update, if any (a window holds whatever arrived)."""


@dataclass
class Update:
    """An aggregate to apply, with the factor on its learning rate (staleness damping)."""

    aggregate: Aggregate
    lr_factor: float = 1.0


@dataclass
class Effect:
    apply: list[Update] = field(default_factory=list)
    release: list[Push] = field(default_factory=list)
    hold: bool = False
    drop: str = ""
    deactivate: list[tuple[int, str]] = field(default_factory=list)


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


# ---- checkpoint data: plain dicts of the state above (times as given) ---------------------------------


def membership_state(m: Membership) -> dict[str, Any]:
    return {"registered": {str(w): n for w, n in m.registered.items()}, "active": sorted(m.active),
            "excluded": sorted(m.excluded)}


def load_membership(m: Membership, d: dict[str, Any], now: float) -> None:
    m.registered = {int(w): int(n) for w, n in d["registered"].items()}
    m.active, m.excluded = set(d["active"]), set(d["excluded"])
    m.last_seen = dict.fromkeys(m.registered, now)


def aggregate_state(a: Aggregate | None) -> dict[str, Any] | None:
    if a is None:
        return None
    return {"started": a.started, "grad": a.grad,
            "members": [{"worker": p.worker, "base_version": p.base_version, "samples": p.samples,
                         "loss_sum": p.loss_sum, "staleness": p.staleness, "step": p.step, "session": p.session}
                        for p in a.members]}


def aggregate_from(d: dict[str, Any] | None) -> Aggregate | None:
    """An aggregate restored from a checkpoint: its pushes' replies were lost with the process (id -1)."""
    if d is None:
        return None
    members = [Push(-1, m["worker"], m["base_version"], m["samples"], d["grad"], m["loss_sum"], d["started"],
                    m["staleness"], m["step"], m["session"]) for m in d["members"]]
    return Aggregate(started=d["started"], members=members, grad=d["grad"], samples=sum(m.samples for m in members))
