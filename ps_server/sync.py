"""Synchronization protocols: when a pushed gradient is applied and when its pusher is released.

One ``SyncEngine`` serves every push. Under the engine's condition lock it
keeps membership (registered / active workers), the BSP round in flight and
the SSP clocks; the model store's own lock covers only the apply itself.

- **BSP** (and **AMB**, **FMB**, which differ from it only in the budgets of
  their work orders): pushes for the current version join a round; the round completes
  when every active worker (minus ``backup_workers``) has pushed, is applied as
  one update of ΣG/Σb, and releases everyone. A round older than
  ``deadline_s`` completes without its missing workers, who become inactive
  until they push again. Pushes for an older version are dropped and counted.
- **ASP**: every push is applied on arrival (optionally with lr/(1+τ)).
- **SSP(s)**: applied on arrival; the pusher's reply is held while its clock
  is more than ``s`` ahead of the slowest active worker's.

``switch`` changes the protocol and its parameters live. Leaving a round-based
protocol, the round in flight completes first; entering one, gradients still
in flight from asynchronous work orders join the first round with their
staleness recorded. Nothing is lost or applied twice.
"""

from __future__ import annotations

import threading
import time
from collections import deque
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

import numpy as np

from switchps.config import ProtocolSpec, SwitchSpec, TrainSpec
from switchps.protos import switchps_pb2 as pb
from switchps.ps_server.model import ModelStore, Snapshot
from switchps.ps_server.records import RunRecorder
from switchps.ps_server.overhead import SwitchRecord, switch_overheads
from switchps.ps_server.rescale import Batches, adjust_optimizer, lr_scale, momentum_in_force

if TYPE_CHECKING:
    from switchps.ps_server.controller import Controller


@dataclass
class Push:
    """A validated push: ``grad`` is the SUM of per-sample gradients over ``samples``."""

    worker: int
    base_version: int
    samples: int
    grad: np.ndarray
    loss_sum: float = 0.0
    arrived: float = field(default_factory=time.monotonic)


@dataclass
class Outcome:
    applied: bool
    note: str = ""
    staleness: int = 0
    wait_s: float = 0.0
    snapshot: Snapshot | None = None  # the version the pusher should receive


@dataclass
class _Round:
    version: int
    started: float
    acc: np.ndarray | None = None
    members: list[Push] = field(default_factory=list)
    staleness: list[int] = field(default_factory=list)


class SyncEngine:
    def __init__(self, store: ModelStore, recorder: RunRecorder, protocol: ProtocolSpec,
                 train: TrainSpec, num_workers: int, startup_timeout_s: float = 120.0,
                 on_switch: SwitchSpec | None = None, momentum: float = 0.0) -> None:
        self.store = store
        self.rec = recorder
        self.protocol = self.reference = protocol
        self.train = train
        self.num_workers = num_workers
        self.startup_timeout_s = startup_timeout_s
        self.cond = threading.Condition()
        self.registered: dict[int, int] = {}  # worker -> shard size
        self.active: set[int] = set()
        self.clocks: dict[int, int] = {}
        self.last_push: dict[int, float] = {}
        self.samples_applied = 0
        self.first_register: float | None = None
        self.started_at: float | None = None
        self.finished_at: float | None = None
        self._round: _Round | None = None
        self.on_switch = on_switch or SwitchSpec()
        self.configured_momentum = self.momentum = momentum
        self.lr_scale = 1.0
        self.amb_samples: deque[int] = deque(maxlen=2 * num_workers)  # recent AMB worker-steps' samples
        self.issued: dict[int, int] = {}         # per worker: the largest sample budget it was ever given
        self.batches: dict[int, int] = {}        # per-worker sample budgets (dynamic batching)
        self.excluded: set[int] = set()          # out of the barrier (elastic)
        self._joins_stale: set[int] = set()      # next push joins the round whatever its base version
        self._pending: tuple[ProtocolSpec, str, str, float] | None = None
        self.switches: list[SwitchRecord] = []
        self.update_times: list[tuple[float, str]] = []
        self.step_times: deque[float] = deque(maxlen=256)  # recent worker steps, barrier waits excluded
        self.controller: Controller | None = None

    # ---- membership and lifecycle ---------------------------------------------------------

    @property
    def done(self) -> bool:
        return self.finished_at is not None

    def register(self, worker: int, shard_size: int) -> None:
        with self.cond:
            rejoin = worker in self.registered
            self.registered[worker] = shard_size
            self.first_register = self.first_register or time.monotonic()
            self._activate(worker, "worker_rejoined" if rejoin else "worker_joined")
            self.cond.notify_all()

    def wait_started(self, timeout: float | None = None) -> bool:
        """Block until the model is initialized and every worker registered (or startup timed out)."""
        deadline = time.monotonic() + (timeout if timeout is not None else 1e9)
        with self.cond:
            while self.started_at is None:
                now = time.monotonic()
                complete = len(self.registered) >= self.num_workers
                late = self.first_register is not None and now - self.first_register > self.startup_timeout_s
                if self.store.initialized and (complete or late):
                    if not complete:
                        self.rec.event("started_incomplete", workers=sorted(self.registered))
                    self.started_at = now
                    self.rec.start(now)
                    self.rec.event("training_started", workers=sorted(self.registered))
                    if self.controller is not None:  # e.g. a schedule's first phase is in force from step 0
                        self.controller.consult()
                    self.cond.notify_all()
                    break
                if now >= deadline:
                    return False
                self.cond.wait(min(0.5, deadline - now))
        return True

    def notify(self) -> None:
        with self.cond:
            self.cond.notify_all()

    def _activate(self, worker: int, event: str) -> None:
        if worker not in self.active:
            self.active.add(worker)
            slowest = min((self.clocks[w] for w in self.active if w in self.clocks), default=0)
            self.clocks[worker] = max(self.clocks.get(worker, 0), slowest)
            self.rec.event(event, worker=worker, version=self.store.version)

    def _deactivate(self, worker: int, reason: str) -> None:
        self.active.discard(worker)
        self.rec.event("deadline_missed", worker=worker, version=self.store.version, reason=reason)

    def elapsed(self) -> float:
        return 0.0 if self.started_at is None else time.monotonic() - self.started_at

    def progress(self) -> float:
        t = self.train
        if t.steps:
            frac = self.store.version / t.steps
        elif t.epochs:
            frac = self.samples_applied / max(1, t.epochs * sum(self.registered.values()))
        else:
            frac = self.elapsed() / t.seconds if t.seconds else 0.0
        return min(1.0, frac)

    def _check_finished(self) -> None:
        if not self.done and self.started_at is not None and self.progress() >= 1.0:
            self.finished_at = time.monotonic()
            if self._round is not None:  # a time limit can fall mid-round: its accepted pushes still count
                self._complete(self._round)
            self.rec.event("training_finished", version=self.store.version, samples=self.samples_applied)
            self.cond.notify_all()

    def tick(self) -> None:
        """Periodic check for time-based training length."""
        with self.cond:
            self._check_finished()

    def budget(self, worker: int) -> int:
        p = self.protocol
        return p.sample_budget if p.name == "amb" else self.batches.get(worker, p.batch)

    def work_order(self, worker: int = -1) -> pb.WorkOrder:
        p = self.protocol
        budget = self.budget(worker)
        if worker >= 0:
            self.issued[worker] = max(budget, self.issued.get(worker, 0))
        return pb.WorkOrder(protocol=p.name, version=self.store.version, sample_budget=budget,
                            time_budget_s=p.step_time_budget_s, micro_batch=min(p.effective_micro_batch, budget),
                            stop=self.done)

    # ---- live reconfiguration -------------------------------------------------------------

    def switch(self, new: ProtocolSpec, reason: str, policy: str) -> None:
        """Change protocol or parameters live (engine lock held by the caller)."""
        if new == self.protocol:
            return
        if self.protocol.synchronous and self._round is not None and self._round.members:
            self._pending = (new, reason, policy, time.monotonic())  # the round in flight completes first
            return
        self._switch_now(new, reason, policy, time.monotonic())

    def _switch_now(self, new: ProtocolSpec, reason: str, policy: str, decided_at: float) -> None:
        old, self._pending = self.protocol, None
        self.protocol = new
        if new.synchronous and not old.synchronous:
            self._joins_stale = set(self.active)  # their in-flight async gradients join the first round
        if new.name == "ssp" and old.name != "ssp":
            self.clocks = dict.fromkeys(self.clocks, 0)
        state = self.on_switch.optimizer_state if old.name != new.name else "keep"
        self._rescale(state)
        if old.name != new.name:
            recent = list(self.step_times)[-2 * self.num_workers:]
            self.switches.append(SwitchRecord(decided_at, new.name, float(np.median(recent)) if recent else 0.0))
        before = old.model_dump()
        self.rec.event("switch" if old.name != new.name else "reconfigure", version=self.store.version,
                       reason=reason, policy=policy, lr_scale=self.lr_scale, momentum=self.momentum,
                       **{"from": old.name, "to": new.name},
                       changed={k: v for k, v in new.model_dump().items() if before[k] != v})
        self.cond.notify_all()

    def _rescale(self, state: str = "keep") -> None:
        """Set the learning-rate scale and momentum for the protocol in force, absolutely (see ``rescale``)."""
        amb = sum(self.amb_samples) / len(self.amb_samples) if self.amb_samples else None
        b = Batches(self.num_workers, dict(self.batches), amb)
        scale = lr_scale(self.protocol, self.reference, self.on_switch, self.configured_momentum, b)
        momentum = momentum_in_force(self.protocol, self.reference, self.on_switch, self.configured_momentum,
                                     self.num_workers)
        if scale == self.lr_scale and momentum == self.momentum and state == "keep":
            return
        self.lr_scale, self.momentum = scale, momentum
        set_momentum = momentum if self.configured_momentum else None
        self.store.control(lambda opt: adjust_optimizer(opt, scale, state, self.on_switch.state_scale,
                                                          set_momentum))

    def set_batches(self, batches: dict[int, int], reason: str, policy: str) -> None:
        self.batches.update(batches)
        self.rec.event("batches", version=self.store.version, reason=reason, policy=policy,
                       batches={str(w): b for w, b in sorted(self.batches.items())})

    def exclude(self, workers: frozenset[int], reason: str, policy: str) -> None:
        for w in sorted(workers - self.excluded):
            self.excluded.add(w)
            self.rec.event("worker_excluded", worker=w, version=self.store.version, reason=reason, policy=policy)
        self._maybe_complete()

    def readmit(self, workers: frozenset[int], reason: str, policy: str) -> None:
        for w in sorted(workers & self.excluded):
            self.excluded.discard(w)
            self.rec.event("worker_readmitted", worker=w, version=self.store.version, reason=reason, policy=policy)

    def observe_step(self, worker: int, stats: pb.StepStats, samples: int) -> None:
        # compute, injected delay and communication, without waiting at a barrier (the last push's reply)
        self.step_times.append(stats.compute_s + stats.sleep_s + max(0.0, stats.send_s - stats.wait_s))
        if self.controller is not None:
            with self.cond:
                self.controller.observe(worker, stats, samples)

    # ---- pushes ---------------------------------------------------------------------------

    def push(self, p: Push) -> Outcome:
        """Apply or aggregate a validated push; blocks as the protocol requires."""
        with self.cond:
            self.last_push[p.worker] = p.arrived
            if self.done:
                outcome = self._drop(p, "finished")
            else:
                if p.worker not in self.active:
                    self._activate(p.worker, "worker_rejoined")
                if self.protocol.synchronous:
                    outcome = self._push_round(p)
                else:
                    outcome = self._apply_now(p)
                    if self.protocol.name == "ssp":
                        outcome.wait_s = self._hold_ssp(p.worker)
            outcome.snapshot = self.store.snapshot()
        return outcome

    def _drop(self, p: Push, reason: str) -> Outcome:
        self.rec.count("dropped", reason)
        self.rec.event("push_dropped", worker=p.worker, base_version=p.base_version,
                       version=self.store.version, reason=reason)
        self.store.buffers.put(p.grad)
        return Outcome(applied=False, note=f"dropped: {reason}", staleness=self.store.version - p.base_version)

    def _apply_now(self, p: Push) -> Outcome:
        """ASP/SSP: apply on arrival (queued to the applier in arrival order)."""
        staleness = self.store.version - p.base_version
        damp = 1.0 / (1 + staleness) if self.protocol.staleness_lr else 1.0
        self._submit(p.grad, [p], [staleness], p.arrived, damp)
        self.clocks[p.worker] = self.clocks.get(p.worker, 0) + 1
        self.rec.count("accepted")
        return Outcome(applied=True, staleness=staleness)

    def _submit(self, grad: np.ndarray, members: list[Push], staleness: list[int], since: float,
                lr_factor: float = 1.0) -> None:
        """Queue one update of ΣG/Σb and account for it; the record is written once it is applied."""
        samples = sum(m.samples for m in members)
        wait_s = time.monotonic() - since
        protocol, budget = self.protocol.name, self.protocol.step_time_budget_s
        version = self.store.version + 1
        self.store.submit(grad, samples, len(members), lr_factor, on_applied=lambda lr: self._record_update(
            version, lr, protocol, members, staleness, wait_s, budget))
        self.samples_applied += samples
        now = time.monotonic()
        self.update_times.append((now, protocol))
        for sw in self.switches:
            if sw.first_update_at is None and sw.to == protocol:
                sw.first_update_at = now
        self._check_finished()
        if self.controller is not None and not self.done:
            self.controller.after_update()
        self.cond.notify_all()

    def _hold_ssp(self, worker: int) -> float:
        """Hold a worker while it is more than s clocks ahead of the slowest active worker."""
        t0 = time.monotonic()
        s = self.protocol.staleness
        while not self.done and worker in self.active and self.protocol.name == "ssp":
            laggards = [w for w in self.active if self.clocks[worker] - self.clocks[w] > s]
            if not laggards:
                break
            now = time.monotonic()
            for w in laggards:
                if now - self.last_push.get(w, t0) > self.protocol.deadline_s:
                    self._deactivate(w, "ssp_deadline")
            self.cond.wait(0.25)
        return time.monotonic() - t0

    def _push_round(self, p: Push) -> Outcome:
        """BSP, AMB and FMB: join the current round and wait for it to complete."""
        staleness = self.store.version - p.base_version
        joins_stale = p.worker in self._joins_stale or (p.worker in self.excluded and self.on_switch.stale == "use")
        self._joins_stale.discard(p.worker)
        if staleness and not joins_stale:
            reason = "excluded_stale" if p.worker in self.excluded else \
                "backup" if self.protocol.backup_workers else "late"
            return self._drop(p, reason)
        r = self._round
        if r is None or r.version != self.store.version:
            r = self._round = _Round(version=self.store.version, started=p.arrived)
        if any(m.worker == p.worker for m in r.members):
            return self._drop(p, "duplicate")
        if r.acc is None:
            r.acc = p.grad  # the first push's buffer becomes the accumulator: no copy
        else:
            np.add(r.acc, p.grad, out=r.acc)
            self.store.buffers.put(p.grad)
        r.members.append(p)
        r.staleness.append(staleness)
        if self.protocol.name == "amb":
            self.amb_samples.append(p.samples)
        self.rec.count("accepted")
        self._maybe_complete()
        while self.store.version == r.version and not self.done:
            remaining = r.started + self.protocol.deadline_s - time.monotonic()
            if remaining <= 0:
                for w in self.active - self.excluded - {m.worker for m in r.members}:
                    self._deactivate(w, "bsp_deadline")
                self._complete(r)
                break
            self.cond.wait(remaining)
        return Outcome(applied=True, staleness=staleness, wait_s=time.monotonic() - p.arrived)

    def _maybe_complete(self) -> None:
        """Complete the round once every worker in the barrier (less backups) has pushed."""
        r = self._round
        if r is None or not r.members:
            return
        required = self.active - self.excluded
        pushed = {m.worker for m in r.members} & required
        if len(pushed) >= max(1, len(required) - self.protocol.backup_workers):
            self._complete(r)

    def _complete(self, r: _Round) -> None:
        self._round = None
        assert r.acc is not None, "a round exists only with a member, whose buffer is the accumulator"
        self._submit(r.acc, r.members, r.staleness, r.started)
        if self.protocol.name == "amb":
            self._rescale()  # AMB's effective batch is what its workers measurably did
        if self._pending is not None:
            self._switch_now(*self._pending)

    def _record_update(self, version: int, lr: float, protocol: str, members: list[Push], staleness: list[int],
                       wait_s: float, time_budget_s: float) -> None:
        b = [m.samples for m in members]
        self.rec.update(
            time_s=self.rec.now(), version=version, protocol=protocol,
            workers=";".join(str(m.worker) for m in members), samples=sum(b),
            staleness_max=max(staleness), staleness_mean=sum(staleness) / len(staleness), lr=lr,
            train_loss=sum(m.loss_sum for m in members) / sum(b),
            b_min=min(b), b_mean=sum(b) / len(b), b_max=max(b), wait_s=wait_s, time_budget_s=time_budget_s or None,
        )
