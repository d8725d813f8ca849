"""The core's event loop: events in, actions out, with no I/O, no threads, no clock and no arrays.

A driver calls ``register``, ``initialized_at``, ``push``, ``timer``, ``switch`` and ``decide`` with the
time the event happened, and executes the actions each returns, in order (see ``events``). ``Core``
owns the model's version and sample count and runs the protocol's effects; its parts own the rest:
``lifecycle`` (membership, start, end), ``switching`` (the protocol in force, a pending switch, the
learning-rate scale), ``consulting`` (the policy and what it sees), ``orders`` (what each worker's work
orders allow) and ``receipts`` (which pushes arrived). Its checkpoint is their states together.

Concurrency: not thread-safe, on purpose. One driver calls it from one thread: the gRPC service from
its event loop, the test harness directly, a simulator from its own loop. ``next_timer`` says when the
core next wants ``timer`` called (a deadline, a window, the time limit, the start-up timeout).
"""

from __future__ import annotations

from typing import Any

from pydantic import ValidationError

from switchps.config import ProtocolSpec, SwitchSpec, TrainSpec
from switchps.policies.base import ClusterView, Decision, Policy
from switchps.ps_server import observer
from switchps.ps_server.core.consulting import Consulting
from switchps.ps_server.core.lifecycle import Lifecycle
from switchps.ps_server.core.orders import Orders
from switchps.ps_server.core.receipts import Receipts
from switchps.ps_server.core.switching import Switching
from switchps.ps_server.events import (
    Action, Apply, Count, Effect, Free, Join, Membership, Outcome, Push, Record, Release, StepReport,
    Update, WorkOrder,
)
from switchps.refusals import invalid, precondition

class Core:
    """The protocol state machine; see the module docstring."""

    def __init__(self, protocol: ProtocolSpec, train: TrainSpec, num_workers: int, *,
                 startup_timeout_s: float = 120.0, on_switch: SwitchSpec | None = None, momentum: float = 0.0,
                 policy: Policy | None = None, every_k: int = 10, window: int = 5) -> None:
        self.lifecycle = Lifecycle(train, Membership(num_workers), startup_timeout_s)
        self.switching = Switching(protocol, on_switch or SwitchSpec(), momentum)
        self.consulting = Consulting(policy, every_k, window, num_workers)
        self.orders = Orders()
        self.receipts = Receipts()
        self.version = self.samples = 0
        self.aggregates = 0  # aggregates named so far: the next one's id
        self.resumed = False  # restarted from a checkpoint: pushes may name versions lost in the crash
        self._out: list[Action] = []
        self._replies: list[tuple[Push, Outcome]] = []  # released this event; their orders come last

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
        b = self.switching.protocol.budget(worker, self.consulting.batches)
        return WorkOrder(self.spec.name, self.version, b.samples, b.time_s, b.micro_batch, self.done)

    def issue(self, worker: int, now: float, step: bool = False) -> WorkOrder:
        """``work_order``, given to ``worker`` at ``now``: it bounds the worker's next push (``orders``).
        ``step``: a new step's order (a push's reply), not the same step's again (a registration, a pull)."""
        order = self.work_order(worker)
        if worker >= 0:
            self.orders.issue(worker, order.sample_budget, now, step)
        return order

    def view(self, now: float) -> ClusterView:
        """What the policy sees: a frozen view of the cluster now."""
        return self.consulting.view(self.switching.protocol, self.members, self.version, self.samples,
                                    now - (self.started_at or now), self.progress(now))

    def next_timer(self) -> float | None:
        """When ``timer`` should next be called, if ever."""
        if self.started_at is None:
            return self.lifecycle.start_deadline()
        if self.done:
            return None
        times = [self.switching.protocol.next_timer(self.members), self.lifecycle.end_deadline()]
        return min((t for t in times if t is not None), default=None)

    # ---- checks (before a request's payload is read) ---------------------------------------------

    def check_register(self, worker: int, partition_size: int) -> None:
        """Raise ``Rejected`` unless a worker index and partition size are plausible."""
        self.lifecycle.check_register(worker, partition_size)

    def check_push(self, worker: int, samples: int, base_version: int, report: StepReport, now: float,
                   session: int = 0) -> None:
        """Raise ``Rejected`` unless a push with this header may enter (checked before its payload is read).

        The step's statistics feed the record and the policies: each must be finite, not negative, and
        within what the worker's work order allows (``orders``); its step follows the worker's last one
        (``receipts``)."""
        if worker not in self.members.registered:
            raise invalid("unknown_worker", f"unknown worker id {worker}")
        if self.started_at is None:
            raise precondition("not_started", "training has not started")
        self.orders.check(worker, samples, report, now, now - (self.lifecycle.first_register or now))
        self.receipts.check(worker, session, report.step)
        if base_version < 0 or (base_version > self.version and not self.resumed):
            raise invalid("version", f"base version {base_version} is not in [0, {self.version}]")

    # ---- events -----------------------------------------------------------------------------

    def register(self, worker: int, partition_size: int, now: float) -> list[Action]:
        """A worker registers (again, after a restart: it rejoins). Raises ``Rejected`` for a bad one."""
        self.check_register(worker, partition_size)
        self._out += self.lifecycle.register(worker, partition_size, now, self.version)
        self._maybe_start(now)
        return self._flush(now)

    def initialized_at(self, now: float) -> list[Action]:
        """The model has its initial values."""
        self.lifecycle.initialized = True
        self._maybe_start(now)
        return self._flush(now)

    def push(self, p: Push, report: StepReport, now: float) -> list[Action]:
        """A validated push arrived (the driver holds its buffer until a ``Join`` or ``Free`` names it)."""
        self.members.last_seen[p.worker] = now
        if self.receipts.seen(p):
            return self._retried(p, now)
        self.receipts.note(p)
        self.consulting.note_step(p, report)
        p.staleness = self.version - p.base_version
        if self.done or p.staleness < 0:  # < 0: computed on a version lost in a crash
            self._drop(p, "finished" if self.done else "lost_version")
            return self._flush(now)
        if p.worker not in self.members.active:
            self._out += self.lifecycle.activate(p.worker, "worker_rejoined", self.version)
            self._run(self.switching.protocol.on_membership(self.members, now), now)
        effect = self.switching.protocol.admit(p, self.members, now)
        if effect.drop:
            self._drop(p, effect.drop)
        else:
            self._join(p, effect)
            self._out.append(Count("accepted"))
        self._run(effect, now)
        return self._flush(now)

    def timer(self, now: float) -> list[Action]:
        """Time passed: start-up timeout, time limit, or the protocol's deadline or window."""
        if self.started_at is None:
            self._maybe_start(now)
        elif not self.done:
            self._check_finished(now)
            self._run(self.switching.protocol.on_timer(self.members, now), now)
        return self._flush(now)

    def switch(self, new: ProtocolSpec, reason: str, policy: str, now: float) -> list[Action]:
        """Change the protocol or its parameters live (a round in flight completes first)."""
        self._switch(new, reason, policy, now)
        return self._flush(now)

    def decide(self, d: Decision, policy: str, now: float) -> list[Action]:
        """Apply a decision as if a policy named ``policy`` had returned it."""
        self._apply_decision(d, policy, now)
        return self._flush(now)

    # ---- state ------------------------------------------------------------------------------------

    def state_dict(self, now: float) -> dict[str, Any]:
        """Everything the core holds, as its parts' states, with times relative to ``now``."""
        return {"version": self.version, "samples": self.samples, "aggregates": self.aggregates,
                "lifecycle": self.lifecycle.state_dict(now), "switching": self.switching.state_dict(now),
                "consulting": self.consulting.state_dict(), "orders": self.orders.state_dict(now),
                "receipts": self.receipts.state_dict()}

    def load_state_dict(self, d: dict[str, Any], now: float) -> None:
        """Continue exactly from ``state_dict``'s data at time ``now``."""
        self.version, self.samples, self.aggregates = d["version"], d["samples"], d["aggregates"]
        self.lifecycle.load_state_dict(d["lifecycle"], now)
        self.switching.load_state_dict(d["switching"], self.members, now)
        self.consulting.load_state_dict(d["consulting"])
        self.orders.load_state_dict(d["orders"], now)
        self.receipts.load_state_dict(d["receipts"])

    def restarted(self, now: float) -> None:
        """This core was loaded by a new process after a crash: relax what a crash makes uncertain (versions
        and pushes it lost, the times of orders, each worker's deadline)."""
        self.resumed = True
        self.lifecycle.restarted(now)
        self.orders.restarted()
        self.receipts.restarted()

    # ---- running effects ----------------------------------------------------------------------

    def _flush(self, now: float) -> list[Action]:
        """The event's actions; replies last, with work orders as the event left things (a switch that
        completed with a round already reaches the workers that round releases)."""
        out = self._out + [Release(p.id, p.worker, o, self.issue(p.worker, now, step=True))
                           for p, o in self._replies]
        self._out, self._replies = [], []
        return out

    def _join(self, p: Push, effect: Effect) -> None:
        a = effect.joined
        assert a is not None, "a protocol names the aggregate every push it keeps joins"
        if a.id < 0:
            a.id, self.aggregates = self.aggregates, self.aggregates + 1
        self._out.append(Join(p.id, a.id))

    def _run(self, e: Effect, now: float, settle: bool = True) -> None:
        """Carry out a protocol's effect: deadlines first, then updates, then replies; then, if ``settle``,
        a pending switch and the policy."""
        for w, reason in e.deactivate:
            self._out.append(self.lifecycle.deactivate(w, reason, self.version))
        if e.deactivate:
            self._run(self.switching.protocol.on_membership(self.members, now), now, settle)
        for u in e.apply:
            self._apply(u, now)
        if e.apply:
            self._check_finished(now)
        for p in e.release:
            self._replies.append((p, Outcome(True, p.staleness, now - p.arrived)))
        if e.apply and settle and not self.done:
            self._settle(len(e.apply), now)

    def _apply(self, u: Update, now: float) -> None:
        a = u.aggregate
        self.version += 1
        self.samples += a.samples
        self.consulting.note_update(a.samples)
        self.switching.updated(now)
        self._out.append(Apply(self.version, a, self.switching.lr_factor(self.version, u.lr_factor),
                               self.spec.name, self.switching.protocol.budget(-1, {}).time_s, now - a.started))

    def _drop(self, p: Push, reason: str) -> None:
        self._out += [Count("dropped", reason), Free(p.id),
                      Record("push_dropped", {"worker": p.worker, "base_version": p.base_version,
                                              "version": self.version, "reason": reason})]
        self._replies.append((p, Outcome(False, p.staleness, 0.0, f"dropped: {reason}")))

    def _retried(self, p: Push, now: float) -> list[Action]:
        """A push sent again: it takes the original's place if that still waits, else it is a duplicate."""
        waiting = self.switching.protocol.waiting()
        original = next((w for w in waiting if (w.worker, w.step) == (p.worker, p.step)), None)
        if original is None:
            self._drop(p, "repeated")
        else:
            original.id = p.id
            self._out += [Free(p.id), Record("push_retried", {"worker": p.worker, "step": p.step,
                                                             "version": self.version})]
        return self._flush(now)

    def _settle(self, updates: int, now: float) -> None:
        """After updates: a switch that waited for its round, a learning rate that follows measured
        batches, the policy."""
        s = self.switching
        if s.pending is not None and not s.protocol.busy():
            self._switch_now(*s.pending, now)
        if s.protocol.measures_batch:
            self._rescale()
        if self.consulting.due(updates, s.protocol.asynchronous):
            self._consult(now)

    def _consult(self, now: float) -> None:
        c = self.consulting
        assert c.policy is not None
        c.since, c.consulting = 0, True
        try:
            decision = c.policy.decide(self.view(now))
            if decision is not None:
                self._apply_decision(decision, c.policy.name, now)
        finally:
            c.consulting = False

    # ---- lifecycle ----------------------------------------------------------------------------

    def _maybe_start(self, now: float) -> None:
        records = self.lifecycle.start(now)
        if records is not None:
            self.switching.protocol.enter(None, self.members, now)
            self._out += records
            if self.consulting.policy is not None:  # e.g. a schedule's first phase is in force from step 0
                self._consult(now)

    def _check_finished(self, now: float) -> None:
        if self.done or self.started_at is None or self.progress(now) < 1.0:
            return
        self.lifecycle.finished_at = now
        self._run(self.switching.protocol.drain(self.members, now), now, settle=False)  # its pushes still count
        self._out.append(Record("training_finished", {"version": self.version, "samples": self.samples}))

    # ---- decisions and switches ---------------------------------------------------------------

    def _apply_decision(self, d: Decision, policy: str, now: float) -> None:
        self._out += self.lifecycle.regroup(d, policy, self.version)
        if d.exclude or d.readmit:
            self._run(self.switching.protocol.on_membership(self.members, now), now)
        self._out += self.consulting.set_batches(d, policy, self.version)
        update = {**d.params, **({"name": d.protocol} if d.protocol else {}),
                  **({"time_budget_s": d.time_budget_s} if d.time_budget_s is not None else {})}
        if update:
            try:
                new = ProtocolSpec.model_validate({**self.spec.model_dump(), **update})
            except ValidationError as err:
                self._out.append(Record("decision_rejected", {"policy": policy, "reason": d.reason,
                                                              "error": str(err.errors()[0]["msg"])}))
                return
            self._switch(new, d.reason, policy, now)

    def _switch(self, new: ProtocolSpec, reason: str, policy: str, now: float) -> None:
        if new == self.spec:
            return
        if self.switching.protocol.busy():
            self.switching.pending = (new, reason, policy, now)
            return
        self._switch_now(new, reason, policy, now, now)

    def _switch_now(self, new: ProtocolSpec, reason: str, policy: str, decided_at: float, now: float) -> None:
        s, old = self.switching, self.spec
        self._run(s.begin(new, self.members, now), now, settle=False)
        s.complete(new, self.members, now)
        self._rescale(s.on_switch.optimizer_state if old.name != new.name else "keep")
        self._out.append(s.note(old, reason, policy, decided_at, observer.normal_step_s(self.consulting.recent),
                                self.version))

    def _rescale(self, state: str = "keep") -> None:
        """Set the learning-rate scale and momentum for the protocol in force, absolutely (``rescale``)."""
        change = self.switching.rescaled(self.consulting.measured(self.members.num_workers), state)
        if change is not None:
            self._out.append(change)
