"""What flows into the protocol core: plain data, no behaviour, no I/O, no arrays.

A driver (the gRPC service, the test harness, the simulator) hands the core events such as a ``Push``
with the time it happened, and executes the actions it gets back (``actions``), in order. The core never
sees a gradient: the driver keeps each push's buffer by push id and each open aggregate's sum by
aggregate id (``ps_server.sums``), so a push may carry no payload at all (a time-only simulation). Here
also: the aggregates, work orders and outcomes the actions carry, and their checkpoint form.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from switchps.config.optimizer import OptimizerSpec


@dataclass(eq=False)  # compared by identity: one push, one reply
class Push:
    """A validated push of the gradient summed over ``samples`` (the driver holds its buffer by ``id``)."""

    id: int
    worker: int
    base_version: int
    samples: int
    loss_sum: float
    arrived: float
    staleness: int = 0
    """Versions applied since ``base_version``, set by the core when the push arrives."""
    step: int = 0
    session: int = 0
    """With ``worker`` and ``step``, the push's name: a retry carries the same name."""
    squares: float = 0.0
    """Its gradient's squared L2 norm, checked against ``runtime.max_grad_norm`` (on a sharded PS's shard 0,
    part 0's, to which shard 0 adds the other parts'); not saved in a checkpoint: a saved push was checked."""
    lag: int = 0
    """The staleness its worker's pipeline gives it by design, which a round tolerates (1: computed while the
    worker's previous push was in flight, under ``runtime.pipeline_sync``); set by the core when it arrives."""
    local_steps: int = 0
    """0: a gradient summed over ``samples``; else what the worker's model moved in that many local steps,
    times ``samples`` (a pseudo-gradient, which the outer optimizer applies)."""


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
    local_steps: int = 0
    """The local steps behind the push (0: it is a gradient)."""
    overlapped: bool = False
    """Computed while the worker's previous push was in flight (``runtime.pipeline_depth`` 1)."""
    local_loss_sums: tuple[float, ...] = ()
    """Each local step's loss, summed over its samples."""


@dataclass(eq=False)
class Aggregate:
    """Pushes that form one update of ΣG/Σb; ``id`` (set by the core when the first push joins) names the
    driver's sum of their gradients."""

    started: float
    members: list[Push] = field(default_factory=list)
    samples: int = 0
    id: int = -1
    workers: set[int] = field(default_factory=set, repr=False, compare=False)
    """The members' workers, kept by ``protocols.join`` (a round's checks are O(1) per push)."""

    @property
    def local_steps(self) -> int:
        """The local steps behind its pushes (0: gradients; the core never mixes the two in one aggregate)."""
        return sum(p.local_steps for p in self.members)


@dataclass(frozen=True)
class Bounds:
    """An elastic run's membership: at least ``min`` members train, at most ``max`` (worker indices are below it),
    and a member silent for ``leave_after_s`` has left for good."""

    min: int
    max: int
    leave_after_s: float


@dataclass
class Membership:
    """Registered workers (with their data partitions' sizes), the active ones, and the excluded ones.

    A worker is inactive after missing a deadline, until its next push; an excluded worker (elastic)
    still pushes, but a round does not wait for it. ``num_workers`` is N in force, which every rule that
    counts workers reads: a fixed-size run's configured count; an elastic run's (``bounds``) registered
    members once training started (before: the count it starts with), as workers join and leave.
    """

    num_workers: int
    registered: dict[int, int] = field(default_factory=dict)
    active: set[int] = field(default_factory=set)
    excluded: set[int] = field(default_factory=set)
    last_seen: dict[int, float] = field(default_factory=dict)
    """When each worker last registered, pushed or got a reply (an SSP laggard's deadline counts from it, and an
    elastic member's leaving)."""
    gradients_only: set[int] = field(default_factory=set)
    """Workers whose loop cannot take local steps (a user's own), as they said when they registered."""
    bounds: Bounds | None = None
    """Elastic membership's bounds; None: a fixed-size run."""
    sessions: dict[int, int] = field(default_factory=dict)
    """The process (its random session) holding each worker index, as it named itself when it registered."""
    lease_s: float = 10.0
    """A process holds its index while heard from within this long: a second one is refused meanwhile."""

    @property
    def capacity(self) -> int:
        """Worker indices are in ``[0, capacity)``."""
        return self.bounds.max if self.bounds else self.num_workers

    @property
    def paused(self) -> bool:
        """Fewer members than an elastic run trains with."""
        return self.bounds is not None and self.num_workers < self.bounds.min

    def epoch_samples(self) -> int:
        """The samples an epoch holds: the registered partitions together, or, in an elastic run, where each
        member draws from the whole set, the largest it registered."""
        sizes = self.registered.values()
        return (max(sizes, default=0) if self.bounds else sum(sizes)) or 1

    def in_force(self) -> range | list[int]:
        """The workers N counts: a fixed-size run's indices, an elastic run's members."""
        return sorted(self.registered) if self.bounds else range(self.num_workers)

    def remove(self, worker: int) -> None:
        """Forget a member that left for good."""
        for held in (self.registered, self.last_seen, self.sessions):
            held.pop(worker, None)
        for held_set in (self.active, self.excluded, self.gradients_only):
            held_set.discard(worker)


@dataclass(frozen=True)
class Local:
    """Local steps a work order asks for: ``steps`` steps of ``batch`` samples (under a time budget: as many as
    fit, at most ``steps``, at least one) with the ``inner`` optimizer, its state reset each round if
    ``reset``; then a push of what the model moved."""

    steps: int
    batch: int
    inner: OptimizerSpec
    reset: bool


@dataclass(frozen=True)
class Budget:
    """A work order's budget: samples, a time limit (None: none) and the micro-batch; local steps, if any."""

    samples: int
    time_budget_s: float | None
    micro_batch: int
    local: Local | None = None


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
    members: tuple[int, ...] = ()
    """The workers N counts, when not ``range(num_workers)`` (an elastic run's members)."""


@dataclass
class Update:
    """An aggregate to apply, with the factor on its learning rate (staleness damping)."""

    aggregate: Aggregate
    lr_factor: float = 1.0


@dataclass
class Effect:
    """What a protocol answers: the aggregate the admitted push joined (or why it is dropped), updates to
    apply, held pushes to release, whether this pusher waits, workers that missed a deadline."""

    joined: Aggregate | None = None
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
    time_budget_s: float | None
    """None: no time budget (the wire says 0)."""
    micro_batch: int
    stop: bool
    pipeline: bool = False
    """The worker may compute its next step while this step's push is in flight (``runtime.pipeline_depth``)."""
    local: Local | None = None
    """Local steps, then a push of what the model moved (None: a gradient)."""


@dataclass(frozen=True)
class Outcome:
    """What a pusher is told about its push."""

    applied: bool
    staleness: int
    wait_s: float
    note: str = ""


# ---- checkpoint data: plain dicts, times relative to the moment of saving ------------------------------


def relative(t: float | None, now: float) -> float | None:
    """A time as saved: seconds from ``now`` (a resumed run's clock continues from the checkpoint)."""
    return None if t is None else t - now


def absolute(t: float | None, now: float) -> float | None:
    """A saved time (``relative``) on the clock of the process loading it at ``now``."""
    return None if t is None else now + t


def push_state(p: Push, now: float) -> dict[str, Any]:
    return {"id": p.id, "worker": p.worker, "base_version": p.base_version, "samples": p.samples,
            "loss_sum": p.loss_sum, "arrived": p.arrived - now, "staleness": p.staleness, "step": p.step,
            "session": p.session, "local_steps": p.local_steps}


def push_from(d: dict[str, Any], now: float) -> Push:
    return Push(d["id"], d["worker"], d["base_version"], d["samples"], d["loss_sum"], now + d["arrived"],
                d["staleness"], d["step"], d["session"], local_steps=d.get("local_steps", 0))


def aggregate_state(a: Aggregate | None, now: float) -> dict[str, Any] | None:
    if a is None:
        return None
    return {"id": a.id, "started": a.started - now, "members": [push_state(p, now) for p in a.members]}


def aggregate_from(d: dict[str, Any] | None, now: float) -> Aggregate | None:
    """An aggregate restored from a checkpoint (after a restart its pushes' replies are lost: workers
    resend, and a resent push takes its original's place)."""
    if d is None:
        return None
    members = [push_from(m, now) for m in d["members"]]
    return Aggregate(now + d["started"], members, sum(m.samples for m in members), d["id"],
                     {m.worker for m in members})
