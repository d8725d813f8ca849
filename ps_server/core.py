"""The PS's protocol state machine: events in, actions out, with no I/O, no threads and no clock.

A driver calls ``register``, ``initialized``, ``push``, ``timer`` and ``switch`` with the time the
event happened, and executes the actions each returns, in order (see ``events``). The core keeps
membership, the protocol in force (a ``protocols`` object), versions and budgets, the learning-rate
scale, the switch records and the policy: after updates it calls ``policy.decide`` with a frozen
``ClusterView`` and applies the ``Decision`` itself. Nothing calls back into it.

Concurrency: not thread-safe, on purpose. One driver calls it from one thread: the gRPC service from
its event loop, the tests directly, a simulator from its own loop. ``next_timer`` says when the core
next wants ``timer`` called (a deadline, a window, the time limit, the start-up timeout).
"""

from __future__ import annotations

import math
from collections import deque
from collections.abc import Sequence
from typing import Any

from pydantic import ValidationError

from switchps.config import ProtocolSpec, SwitchSpec, TrainSpec
from switchps.policies.base import ClusterView, Decision, Policy
from switchps.ps_server import core_state, observer
from switchps.ps_server.events import (
    Action, Apply, Batches, Count, Effect, Membership, Outcome, Push, Record, Recycle, Release, SetOptimizer,
    StepReport, Update, WorkOrder,
)
from switchps.ps_server.overhead import SwitchRecord
from switchps.ps_server.protocols import PROTOCOLS, make_protocol
from switchps.ps_server.orders import Orders
from switchps.ps_server.receipts import Receipts
from switchps.ps_server.rescale import ramp, rescaled, restore_factor
from switchps.refusals import invalid, precondition

MAX_SHARD_SIZE = 2**40


class Core:
    def __init__(self, protocol: ProtocolSpec, train: TrainSpec, num_workers: int, *,
                 startup_timeout_s: float = 120.0, on_switch: SwitchSpec | None = None, momentum: float = 0.0,
                 policy: Policy | None = None, every_k: int = 10, window: int = 5,
                 recycle: Recycle | None = None) -> None:
        self.spec, self.train = protocol, train
        self.recycle: Recycle = recycle or (lambda buffer: None)
        self.protocol = make_protocol(protocol, self.recycle)
        self.reference = make_protocol(protocol, self.recycle)  # the configured protocol, for the learning-rate rule
        self.members = Membership(num_workers)
        self.startup_timeout_s = startup_timeout_s
        self.on_switch = on_switch or SwitchSpec()
        self.configured_momentum = self.momentum = momentum
        self.policy, self.every_k = policy, every_k
        self.recent = observer.Recent(window, 2 * num_workers)
        self.version = self.samples = 0
        self.receipts = Receipts()
        self.resumed = False  # loaded from a checkpoint: pushes may name versions lost in the crash
        self.lr_scale = 1.0
        self.switched_at: int | None = None  # the version at the last protocol switch, for ``rescale.ramp``
        self.restore = 1.0
        self.initialized = False
        self.first_register: float | None = None
        self.started_at: float | None = None
        self.finished_at: float | None = None
        self.batches: dict[int, int] = {}   # per-worker sample budgets a policy set
        self.orders = Orders()  # what each worker's latest work orders allow its next push to claim
        self.pending: tuple[ProtocolSpec, str, str, float] | None = None  # a switch waiting for the round
        self.switches: list[SwitchRecord] = []
        self.update_times: list[tuple[float, str]] = []
        self._since = 0            # updates since the policy was last consulted
        self._consulting = False
        self._out: list[Action] = []
        self._replies: list[tuple[Push, Outcome]] = []  # released this event; their orders come last

    # ---- events -----------------------------------------------------------------------------

    def check_register(self, worker: int, shard_size: int) -> None:
        """Raise ``Rejected`` unless a worker index and shard size are plausible."""
        if not 0 <= worker < self.members.num_workers:
            raise invalid("worker", f"worker index {worker} outside [0, {self.members.num_workers})")
        if not 0 < shard_size <= MAX_SHARD_SIZE:
            raise invalid("shard_size", f"shard size {shard_size} must be in [1, {MAX_SHARD_SIZE}]")

    def register(self, worker: int, shard_size: int, now: float) -> list[Action]:
        """A worker registers (again, after a restart: it rejoins). Raises ``Rejected`` for a bad one."""
        self.check_register(worker, shard_size)
        rejoin = worker in self.members.registered
        self.members.registered[worker] = shard_size
        self.members.last_seen[worker] = now
        self.first_register = self.first_register or now
        self._activate(worker, "worker_rejoined" if rejoin else "worker_joined", now)
        self._maybe_start(now)
        return self._flush(now)

    def initialized_at(self, now: float) -> list[Action]:
        """The model has its initial values."""
        self.initialized = True
        self._maybe_start(now)
        return self._flush(now)

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
        self.orders.check(worker, samples, report, now, now - (self.first_register or now))
        self.receipts.check(worker, session, report.step)
        if base_version < 0 or (base_version > self.version and not self.resumed):
            raise invalid("version", f"base version {base_version} is not in [0, {self.version}]")

    def push(self, p: Push, report: StepReport, now: float) -> list[Action]:
        """A validated push arrived (the core owns its buffer from here on)."""
        m = self.members
        m.last_seen[p.worker] = now
        if self.receipts.seen(p):
            return self._retried(p, now)
        self.receipts.note(p)
        self._note_step(p, report)
        p.staleness = self.version - p.base_version
        if self.done or p.staleness < 0:  # < 0: computed on a version lost in a crash
            self._drop(p, "finished" if self.done else "lost_version")
            return self._flush(now)
        if p.worker not in m.active:
            self._activate(p.worker, "worker_rejoined", now)
            self._run(self.protocol.on_membership(m, now), now)
        effect = self.protocol.admit(p, m, now)
        if effect.drop:
            self._drop(p, effect.drop)
        else:
            self._out.append(Count("accepted"))
        self._run(effect, now)
        return self._flush(now)

    def timer(self, now: float) -> list[Action]:
        """Time passed: start-up timeout, time limit, or the protocol's deadline or window."""
        if self.started_at is None:
            self._maybe_start(now)
        elif not self.done:
            self._check_finished(now)
            self._run(self.protocol.on_timer(self.members, now), now)
        return self._flush(now)

    def next_timer(self) -> float | None:
        """When ``timer`` should next be called, if ever."""
        if self.started_at is None:
            first = self.first_register
            return first + self.startup_timeout_s if first is not None and self.initialized else None
        if self.done:
            return None
        times = [self.protocol.next_timer(self.members)]
        if self.train.seconds:
            times.append(self.started_at + self.train.seconds)
        return min((t for t in times if t is not None), default=None)

    def switch(self, new: ProtocolSpec, reason: str, policy: str, now: float) -> list[Action]:
        """Change the protocol or its parameters live (a round in flight completes first)."""
        self._switch(new, reason, policy, now)
        return self._flush(now)

    def decide(self, d: Decision, policy: str, now: float) -> list[Action]:
        """Apply a decision as if a policy named ``policy`` had returned it."""
        self._apply_decision(d, policy, now)
        return self._flush(now)

    # ---- what drivers read --------------------------------------------------------------------

    @property
    def done(self) -> bool:
        return self.finished_at is not None

    def progress(self, now: float) -> float:
        """The fraction of the training length done: exactly 1.0 once it is reached (compared, not divided,
        as (t0 + s - t0) / s can round below 1)."""
        t, started = self.train, self.started_at
        if t.steps or t.epochs:
            done, length = (self.version, t.steps) if t.steps else \
                (self.samples, (t.epochs or 0) * sum(self.members.registered.values()))
            return 0.0 if not length else 1.0 if done >= length else done / length
        if started is None or not t.seconds:
            return 0.0
        return 1.0 if now >= started + t.seconds else (now - started) / t.seconds

    def work_order(self, worker: int = -1) -> WorkOrder:
        """The work order ``worker`` would get now (-1: a reader such as the evaluator, who computes nothing)."""
        b = self.protocol.budget(worker, self.batches)
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
        budgets = {w: self.protocol.budget(w, self.batches) for w in [-1, *sorted(self.members.active)]}
        return observer.view(self.recent, self.members, self.version, self.samples, self.spec.name, budgets,
                             now - (self.started_at or now), self.progress(now))

    def state_dict(self, now: float) -> dict[str, Any]:
        """Everything the core and its policy hold, as plain data, with times relative to ``now``."""
        return core_state.save(self, now)

    def load_state_dict(self, d: dict[str, Any], now: float) -> None:
        """Continue from ``state_dict``'s data at time ``now``."""
        core_state.load(self, d, now)


    # ---- running effects ----------------------------------------------------------------------

    def _flush(self, now: float) -> list[Action]:
        """The event's actions; replies last, with work orders as the event left things (a switch that
        completed with a round already reaches the workers that round releases)."""
        out = self._out + [Release(p.id, p.worker, o, self.issue(p.worker, now, step=True)) for p, o in self._replies]
        self._out, self._replies = [], []
        return out

    def _run(self, e: Effect, now: float, settle: bool = True) -> None:
        """Carry out a protocol's effect: deadlines first, then updates, then replies; then, if ``settle``,
        a pending switch and the policy."""
        for w, reason in e.deactivate:
            self._deactivate(w, reason)
        if e.deactivate:
            self._run(self.protocol.on_membership(self.members, now), now, settle)
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
        self.recent.update_samples.append(a.samples)
        self.update_times.append((now, self.spec.name))
        for sw in self.switches:
            if sw.first_update_at is None and sw.to == self.spec.name:
                sw.first_update_at = now
        since = None if self.switched_at is None else self.version - 1 - self.switched_at
        factor = u.lr_factor * (1.0 if since is None else ramp(self.on_switch, self.restore, since))
        self._out.append(Apply(self.version, a, factor, self.spec.name,
                               self.protocol.budget(-1, {}).time_s, now - a.started))

    def _drop(self, p: Push, reason: str) -> None:
        self._out += [Count("dropped", reason),
                      Record("push_dropped", {"worker": p.worker, "base_version": p.base_version,
                                              "version": self.version, "reason": reason})]
        self.recycle(p.grad)
        self._replies.append((p, Outcome(False, p.staleness, 0.0, f"dropped: {reason}")))

    def _retried(self, p: Push, now: float) -> list[Action]:
        """A push sent again: it takes the original's place if that still waits, else it is a duplicate."""
        original = next((w for w in self.protocol.waiting() if (w.worker, w.step) == (p.worker, p.step)), None)
        if original is None:
            self._drop(p, "repeated")
        else:
            original.id = p.id
            self.recycle(p.grad)
            self._out.append(Record("push_retried", {"worker": p.worker, "step": p.step, "version": self.version}))
        return self._flush(now)

    def _note_step(self, p: Push, report: StepReport) -> None:
        r = self.recent
        window = r.steps.get(p.worker) or r.steps.setdefault(p.worker, deque(maxlen=r.window))
        window.append((report.compute_s, report.compute_s + report.sleep_s, p.samples, p.loss_sum))
        r.step_s.append(report.compute_s + report.sleep_s + max(0.0, report.send_s - report.wait_s))
        r.step_samples.append(p.samples)

    def _settle(self, updates: int, now: float) -> None:
        """After updates: a switch that waited for its round, a learning rate that follows measured
        batches, the policy."""
        if self.pending is not None and not self.protocol.busy():
            self._switch_now(*self.pending, now)
        if self.protocol.measures_batch:
            self._rescale()
        self._since += updates
        if self.policy is not None and not self._consulting and \
                (not self.protocol.asynchronous or self._since >= self.every_k):
            self._consult(now)

    def _consult(self, now: float) -> None:
        assert self.policy is not None
        self._since, self._consulting = 0, True
        try:
            decision = self.policy.decide(self.view(now))
            if decision is not None:
                self._apply_decision(decision, self.policy.name, now)
        finally:
            self._consulting = False

    # ---- lifecycle and membership -------------------------------------------------------------

    def _maybe_start(self, now: float) -> None:
        m = self.members
        if self.started_at is not None or not self.initialized or self.first_register is None:
            return
        complete = len(m.registered) >= m.num_workers
        if not complete and now - self.first_register < self.startup_timeout_s:
            return
        if not complete:
            self._out.append(Record("started_incomplete", {"workers": sorted(m.registered)}))
        self.started_at = now
        self.protocol.enter(None, m, now)
        self._out.append(Record("training_started", {"workers": sorted(m.registered)}))
        if self.policy is not None:  # e.g. a schedule's first phase is in force from step 0
            self._consult(now)

    def _check_finished(self, now: float) -> None:
        if self.done or self.started_at is None or self.progress(now) < 1.0:
            return
        self.finished_at = now
        self._run(self.protocol.drain(self.members, now), now, settle=False)  # its pushes still count
        self._out.append(Record("training_finished", {"version": self.version, "samples": self.samples}))

    def _activate(self, worker: int, event: str, now: float) -> None:
        if worker not in self.members.active:
            self.members.active.add(worker)
            self._out.append(Record(event, {"worker": worker, "version": self.version}))

    def _deactivate(self, worker: int, reason: str) -> None:
        self.members.active.discard(worker)
        self._out.append(Record("deadline_missed", {"worker": worker, "version": self.version, "reason": reason}))

    # ---- decisions and switches ---------------------------------------------------------------

    def _apply_decision(self, d: Decision, policy: str, now: float) -> None:
        m = self.members
        for w in sorted(d.exclude - m.excluded):
            m.excluded.add(w)
            self._out.append(Record("worker_excluded", {"worker": w, "version": self.version,
                                                        "reason": d.reason, "policy": policy}))
        for w in sorted(d.readmit & m.excluded):
            m.excluded.discard(w)
            self._out.append(Record("worker_readmitted", {"worker": w, "version": self.version,
                                                          "reason": d.reason, "policy": policy}))
        if d.exclude or d.readmit:
            self._run(self.protocol.on_membership(m, now), now)
        if d.batches:
            self.batches.update(d.batches)
            self._out.append(Record("batches", {"version": self.version, "reason": d.reason, "policy": policy,
                                                "batches": {str(w): b for w, b in sorted(self.batches.items())}}))
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
        if self.protocol.busy():
            self.pending = (new, reason, policy, now)
            return
        self._switch_now(new, reason, policy, now, now)

    def _switch_now(self, new: ProtocolSpec, reason: str, policy: str, decided_at: float, now: float) -> None:
        old, self.pending = self.spec, None
        if type(self.protocol) is PROTOCOLS[new.name]:  # same rule, other parameters: keep its state
            self.spec = self.protocol.s = new
            self._run(self.protocol.on_membership(self.members, now), now, settle=False)
        else:
            self._run(self.protocol.drain(self.members, now), now, settle=False)  # nothing left behind
            previous, self.spec, self.protocol = self.protocol, new, make_protocol(new, self.recycle)
            self.protocol.enter(previous, self.members, now)
        self._rescale(self.on_switch.optimizer_state if old.name != new.name else "keep")
        if old.name != new.name:
            self.switches.append(SwitchRecord(decided_at, new.name, observer.normal_step_s(self.recent)))
            self.switched_at = self.version
            self.restore = restore_factor(self.momentum, self.configured_momentum) \
                if self.on_switch.momentum == "asynchrony" else 1.0
        before = old.model_dump()
        self._out.append(Record("switch" if old.name != new.name else "reconfigure", {
            "version": self.version, "reason": reason, "policy": policy, "lr_scale": self.lr_scale,
            "momentum": self.momentum, "from": old.name, "to": new.name,
            "changed": {k: v for k, v in new.model_dump().items() if before[k] != v}}))

    def _rescale(self, state: str = "keep") -> None:
        """Set the learning-rate scale and momentum for the protocol in force, absolutely (``rescale``)."""
        r = self.recent
        b = Batches(self.members.num_workers, dict(self.batches), observer.mean(r.step_samples),
                    observer.mean(r.update_samples))
        scale, momentum = rescaled(self.protocol, self.reference, self.on_switch, self.configured_momentum, b)
        if math.isclose(scale, self.lr_scale, rel_tol=1e-12) and momentum == self.momentum and state == "keep":
            return
        self.lr_scale, self.momentum = scale, momentum
        self._out.append(SetOptimizer(scale, momentum if self.configured_momentum else None, state,
                                      self.on_switch.state_scale))
