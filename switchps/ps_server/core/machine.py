"""The core's event loop: events in, actions out, with no I/O, no threads, no clock and no arrays.

A driver calls ``register``, ``initialized_at``, ``push``, ``timer``, ``switch`` and ``decide`` with the
time the event happened, and executes the actions each returns, in order (see ``events``). ``Core``
owns the model's version and sample count and runs the protocol's effects; its parts own the rest:
``lifecycle`` (membership, start, end), ``admission`` (what each worker's work orders allow, which pushes
arrived), ``switching`` (the protocol in force, a pending switch, the learning-rate scale), ``consulting``
(the policy and what it sees) and ``outbox`` (the event's actions and replies, the aggregates' ids). The
parts return records and effects; the core runs the effects. Its checkpoint is their states together.

Concurrency: not thread-safe, on purpose. One driver calls it from one thread: the gRPC service from
its event loop, the test harness directly, a simulator from its own loop. ``next_timer`` says when the
core next wants ``timer`` called (a deadline, a window, the time limit, the start-up timeout).
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from typing import Any, Protocol

from switchps.config.optimizer import OptimizerSpec
from switchps.config.protocol import ProtocolSpec
from switchps.config.run import Pipeline, SwitchSpec, TrainSpec
from switchps.policies.base import ClusterView, Decision, Policy
from switchps.ps_server.core.consulting import Consulting
from switchps.ps_server.core.admission import Orders, Receipts
from switchps.ps_server.core.aggregation import alone
from switchps.ps_server.core.lifecycle import Lifecycle
from switchps.ps_server.core.outbox import Outbox
from switchps.ps_server.core.switching import Pending, Switching
from switchps.ps_server.core.actions import Action, Record, Release
from switchps.ps_server.core.events import Bounds, Effect, Membership, Push, StepReport, WorkOrder
from switchps.refusals import precondition


class Part(Protocol):
    """A part of the core: it saves and restores its own state, with times relative to ``now``."""

    def state_dict(self, now: float) -> dict[str, Any]: ...

    def load_state_dict(self, d: dict[str, Any], now: float) -> None: ...


class Core:
    """The protocol state machine; see the module docstring."""

    def __init__(self, protocol: ProtocolSpec, train: TrainSpec, num_workers: int, *,
                 startup_timeout_s: float = 120.0, on_switch: SwitchSpec | None = None, momentum: float = 0.0,
                 policy: Policy | None = None, every_k: int = 10, window: int = 5,
                 targets: Sequence[ProtocolSpec] = (), pipeline: Pipeline = Pipeline(),
                 optimizer: OptimizerSpec | None = None, bounds: Bounds | None = None,
                 lease_s: float = 10.0) -> None:
        """``num_workers``: the workers the run starts with; ``bounds``: an elastic run's membership;
        ``lease_s``: how long a process holds its worker index after it was last heard from."""
        self.pipeline = pipeline
        self.lifecycle = Lifecycle(train, Membership(num_workers, bounds=bounds, lease_s=lease_s), startup_timeout_s)
        self.switching = Switching(protocol, on_switch or SwitchSpec(), momentum, self.lifecycle.members, targets,
                                   optimizer)
        self.consulting = Consulting(policy, every_k, window, self.members.capacity)
        self.orders, self.receipts, self.outbox = Orders(), Receipts(), Outbox()
        self.parts: dict[str, Part] = {"lifecycle": self.lifecycle, "switching": self.switching,  # in this order
                                       "consulting": self.consulting, "orders": self.orders,
                                       "receipts": self.receipts, "outbox": self.outbox}
        self.version = self.samples = 0

    # ---- what drivers read ----------------------------------------------------------------------

    @property
    def spec(self) -> ProtocolSpec:
        return self.switching.spec

    @property
    def members(self) -> Membership:
        return self.lifecycle.members

    @property
    def train(self) -> TrainSpec:
        return self.lifecycle.train

    @property
    def started_at(self) -> float | None:
        return self.lifecycle.started_at

    @property
    def finished_at(self) -> float | None:
        return self.lifecycle.finished_at

    @property
    def done(self) -> bool:
        return self.lifecycle.done

    def progress(self, now: float) -> float:
        return self.lifecycle.progress(now, self.version, self.samples)

    def work_order(self, worker: int = -1) -> WorkOrder:
        """The work order ``worker`` would get now (-1: a reader such as the evaluator, who computes nothing)."""
        b = self.switching.protocol.work.budget(worker, self.consulting.batches)
        return WorkOrder(self.spec.name, self.version, b.samples, b.time_budget_s, b.micro_batch, self.done,
                         b.local is None and self.pipeline.overlaps(self.switching.protocol.asynchronous), b.local)

    def issue(self, worker: int, now: float, step: bool = False) -> WorkOrder:
        """``work_order``, given to ``worker`` at ``now``: it bounds the worker's next push (``orders``).
        ``step``: a new step's order (a push's reply), not the same step's again (a registration, a pull)."""
        if worker in self.members.last_seen:  # a pull or a push's reply: the worker is there
            self.members.last_seen[worker] = now
        return self.orders.issue(worker, self.work_order(worker), now, step)

    def view(self, now: float) -> ClusterView:
        """What the policy sees: a frozen view of the cluster now."""
        return self.consulting.view(self.switching.protocol, self.members, self.version, self.samples,
                                    now - _or(self.started_at, now), self.progress(now))

    def next_timer(self) -> float | None:
        """When ``timer`` should next be called, if ever."""
        return self.lifecycle.next_timer(self.switching.protocol.rule)

    def check_register(self, worker: int, partition_size: int, local_steps: bool = True, session: int = 0,
                       now: float = 0.0) -> None:
        """Raise ``Rejected`` unless a worker index and partition size are plausible, the index is free to
        process ``session`` at ``now`` (``Lifecycle.check_holder``), and the worker can take local steps if
        the protocol in force has them."""
        self.lifecycle.check_register(worker, partition_size)
        self.lifecycle.check_holder(worker, session, now, self.switching.protocol.rule)
        self._check_local(worker, local_steps)

    def _check_local(self, worker: int, local_steps: bool) -> None:
        """Raise ``Rejected`` if the worker cannot take local steps and the protocol in force has them."""
        pending = self.switching.pending  # a switch waiting for its round is as good as in force
        spec = pending.new if pending is not None and pending.new.local else self.spec
        if not local_steps and spec.local:
            raise precondition("local_steps", f"worker {worker}'s training loop cannot take local steps, which "
                                              f"the protocol {'in force' if spec is self.spec else 'switched to'} "
                                              f"({spec.name}) asks for")

    def check_push(self, worker: int, samples: int, base_version: int, report: StepReport, now: float,
                   session: int = 0) -> None:
        """Raise ``Rejected`` unless a push with this header may enter (checked before its payload is read):
        from a registered worker once training started, within what its work order allows (``orders``), its
        step following its last one (``receipts``), on a version this core has made (``lifecycle``)."""
        self.lifecycle.check_push(worker, session)
        self.orders.check(worker, samples, report, now, now - _or(self.lifecycle.first_register, now))
        self.receipts.check(worker, session, report.step)
        self.lifecycle.check_version(base_version, self.version)

    # ---- events -----------------------------------------------------------------------------

    def register(self, worker: int, partition_size: int, now: float, local_steps: bool = True,
                 session: int = 0) -> list[Action]:
        """Process ``session`` registers as ``worker`` (again, after a restart: it rejoins). Raises
        ``Rejected`` for a bad one."""
        self._check_local(worker, local_steps)  # the lifecycle checks the rest
        was, paused = self.members.num_workers, self.members.paused
        self.outbox.add(self.lifecycle.register(worker, partition_size, now, self.version,
                                                self.switching.protocol.rule, local_steps, session))
        if self.started_at is not None and self.members.num_workers != was:  # an elastic run grew
            self._membership_changed(paused, now)
        self._maybe_start(now)
        return self._flush(now)

    def initialized_at(self, now: float) -> list[Action]:
        """The model has its initial values."""
        self.lifecycle.initialized = True
        self._maybe_start(now)
        return self._flush(now)

    def is_retry(self, p: Push) -> bool:
        """Whether ``p`` repeats a push already received (its step is recorded once)."""
        return self.receipts.seen(p)

    def push(self, p: Push, report: StepReport, now: float) -> list[Action]:
        """A validated push arrived (the driver holds its buffer until a ``Join`` or ``Free`` names it)."""
        if p.worker not in self.members.registered:  # it left (an elastic run) while its push was read
            self.outbox.drop(p, "left", self.version)
            return self._flush(now)
        self.members.last_seen[p.worker] = now
        if self.receipts.seen(p):
            self.outbox.retried(p, [*self.switching.protocol.rule.waiting(), *self.lifecycle.paused], self.version)
            return self._flush(now)
        self.receipts.note(p)
        self.consulting.note_step(p, report)
        p.staleness = self.version - p.base_version
        p.lag = int(self.pipeline.sync and report.overlapped)
        p.local_steps = report.local_steps
        if self.done or p.staleness < 0:  # < 0: computed on a version lost in a crash
            self.outbox.drop(p, "finished" if self.done else "lost_version", self.version)
            return self._flush(now)
        if p.worker not in self.members.active:
            self.outbox.add(self.lifecycle.activate(p.worker, "worker_rejoined", self.version))
            if not self.members.paused:
                self._run(self.switching.protocol.rule.on_membership(self.members, now), now)
        if self.members.paused:  # it waits, unapplied, for enough members
            self.lifecycle.paused.append(p)
            return self._flush(now)
        self._admit(p, now)
        return self._flush(now)

    def _admit(self, p: Push, now: float) -> None:
        """The protocol in force takes ``p`` in."""
        protocol = self.switching.protocol
        # a push of the other kind (a gradient under local steps, or the reverse) was computed before a switch:
        # it is an update of its own, at once, never mixed into an aggregate of the kind in force
        effect = alone(p) if bool(p.local_steps) != protocol.local else protocol.rule.admit(p, self.members, now)
        self.outbox.admitted(p, effect, self.version)
        self._run(effect, now)

    def timer(self, now: float) -> list[Action]:
        """Time passed: start-up timeout, time limit, or the protocol's deadline or window."""
        if self.started_at is None:
            self._maybe_start(now)
        elif not self.done:
            self._check_finished(now)
            rule = self.switching.protocol.rule
            if left := self.lifecycle.leavers(now, self.lifecycle.waiting(rule)):
                self._leave(left, "silent", now)
            if not self.members.paused and not self.done:
                self._run(self.switching.protocol.rule.on_timer(self.members, now), now)
        return self._flush(now)

    def leave(self, worker: int, now: float, session: int = 0) -> list[Action]:
        """Worker ``worker`` (process ``session``) says it is ending: an elastic run counts it gone; a
        fixed-size one stops waiting for it until it pushes again (``worker_exited``). Raises ``Rejected`` for
        a worker not registered, or a process that no longer holds the index."""
        self.lifecycle.check_registered(worker, session)
        if self.members.bounds is not None:
            self._leave([worker], "exited", now)
        elif worker in self.members.active:
            self.members.active.discard(worker)
            self.outbox.add([Record("worker_exited", {"worker": worker, "version": self.version})])
            self._run(self.switching.protocol.rule.on_membership(self.members, now), now)
        return self._flush(now)

    def _leave(self, workers: list[int], reason: str, now: float) -> None:
        paused = self.members.paused
        self.outbox.add(self.lifecycle.leave(workers, self.version, reason))
        self.consulting.forget(workers)
        if self.started_at is not None:
            self._membership_changed(paused, now)

    def switch(self, new: ProtocolSpec, reason: str, policy: str, now: float) -> list[Action]:
        """Change the protocol or its parameters live (a round in flight completes first)."""
        self._switch(self.switching.request(Pending(new, reason, policy, now)), now)
        return self._flush(now)

    def decide(self, d: Decision, policy: str, now: float) -> list[Action]:
        """Apply a decision as if a policy named ``policy`` had returned it."""
        self._apply_decision(d, policy, now)
        return self._flush(now)

    # ---- state ------------------------------------------------------------------------------------

    def state_dict(self, now: float) -> dict[str, Any]:
        """Everything the core holds, as its parts' states, with times relative to ``now``."""
        return {"version": self.version, "samples": self.samples,
                **{name: part.state_dict(now) for name, part in self.parts.items()}}

    def load_state_dict(self, d: dict[str, Any], now: float) -> None:
        """Continue exactly from ``state_dict``'s data at time ``now``."""
        self.version, self.samples = d["version"], d["samples"]
        for name, part in self.parts.items():  # the lifecycle's membership first: the protocol enters it
            part.load_state_dict(d[name], now)

    def restarted(self, now: float) -> None:
        """This core was loaded by a new process after a crash: relax what a crash makes uncertain (versions
        and pushes it lost, the times of orders, each worker's deadline)."""
        self.lifecycle.restarted(now)
        self.orders.restarted()
        self.receipts.restarted()

    # ---- running effects ----------------------------------------------------------------------

    def _flush(self, now: float) -> list[Action]:
        """The event's actions; replies last, with work orders as the event left things (a switch that
        completed with a round already reaches the workers that round releases)."""
        out, replies = self.outbox.take()  # ``issue`` notes each: silent from its reply on, not while it waited
        return out + [Release(p.id, p.worker, o, self.issue(p.worker, now, step=True)) for p, o in replies]

    def _run(self, e: Effect, now: float, settle: bool = True) -> None:
        """Carry out a protocol's effect: deadlines, updates, replies; then, if ``settle``, after updates: a
        switch that waited for its round, a learning rate that follows measured batches, the policy."""
        self.outbox.add(self.lifecycle.deactivate(e.deactivate, self.version))
        if e.deactivate:
            self._run(self.switching.protocol.rule.on_membership(self.members, now), now, settle)
        for u in e.apply:
            self.version, self.samples = self.version + 1, self.samples + u.aggregate.samples
            self.consulting.note_update(u.aggregate.samples)
            self.outbox.add([self.switching.applied(u, self.version, now)])
        if e.apply:
            self._check_finished(now)
        self.outbox.release(e.release, now)
        if e.apply and settle and not self.done:
            self._switch(self.switching.ready(), now)
            self.outbox.add(self.switching.remeasured(self.consulting.measured(self.members)))
            if self.consulting.due(len(e.apply), self.switching.protocol.rule.asynchronous):
                self._consult(now)

    def _membership_changed(self, was_paused: bool, now: float) -> None:
        """An elastic run's N moved: the rule in force sees the members (unless paused), the learning rate and
        momentum follow N (``rescale``), and crossing ``min`` pauses training or resumes it, admitting the
        pushes that waited, in order."""
        self.outbox.add(self.lifecycle.pause_records(was_paused, self.version))
        if self.members.paused:
            return
        self._run(self.switching.protocol.rule.on_membership(self.members, now), now)
        self.outbox.add(self.switching.rescaled(self.consulting.measured(self.members)))
        waited, self.lifecycle.paused = self.lifecycle.paused, []
        for p in waited:
            if self.done:
                self.outbox.drop(p, "finished", self.version)
                continue
            p.staleness = self.version - p.base_version
            self._admit(p, now)

    def _maybe_start(self, now: float) -> None:
        if (records := self.lifecycle.start(now)) is not None:
            self.switching.protocol.rule.enter(None, self.members, now)
            self.outbox.add(records)
            self.outbox.add(self.lifecycle.pause_records(False, self.version))
            if self.consulting.policy is not None:  # e.g. a schedule's first phase is in force from step 0
                self._consult(now)

    def _check_finished(self, now: float) -> None:
        if self.lifecycle.finish(now, self.version, self.samples):
            self._run(self.switching.protocol.rule.drain(self.members, now), now, settle=False)  # its pushes count
            self.outbox.add([Record("training_finished", {"version": self.version, "samples": self.samples})])

    def _consult(self, now: float) -> None:
        with self.consulting.asking() as policy:
            if (decision := policy.decide(self.view(now))) is not None:
                self._apply_decision(decision, policy.name, now)

    def _apply_decision(self, d: Decision, policy: str, now: float) -> None:
        self.outbox.add(self.lifecycle.regroup(d, policy, self.version))
        if d.exclude or d.readmit:
            self._run(self.switching.protocol.rule.on_membership(self.members, now), now)
        self.outbox.add(self.consulting.set_batches(d, policy, self.version))
        sw, rejected = self.switching.decided(d, policy, now)
        self.outbox.add(rejected)
        self._switch(sw, now)

    def _switch(self, sw: Pending | None, now: float) -> None:
        """Make switch ``sw``, if any: the protocol in force finishes its part, then the new one takes over."""
        if sw is not None:
            old, c = self.spec, self.consulting
            self._run(self.switching.begin(sw.new, now), now, settle=False)
            self.outbox.add(self.switching.complete(sw, old, c.measured(self.members), c.step_s(), self.version, now))


def _or(t: float | None, now: float) -> float:
    """A time if there is one, else ``now`` (not ``t or now``: 0.0 is a time, where a simulator's clock starts)."""
    return now if t is None else t
