"""Membership and the run's lifecycle: who registered, who is active, when training started and ends.

Training starts once the model is initialized and every worker registered, or once ``startup_timeout_s``
has passed since the first registration with whoever is there. It ends when ``train`` says (steps,
epochs or seconds), measured by ``progress``. A run restarted from a checkpoint is ``resumed``.

An elastic run (``Membership.bounds``) starts once its starting count registered; then a worker may join
(register with a new index below ``max``) at any time and counts at once; a member silent for
``leave_after_s`` (no push, pull or reply, and no push of its waiting for a reply) leaves for
good; N follows. Below ``min`` members training pauses: pushes wait, unapplied, until enough join.

A worker index is held by the process that registered it (the random session it names; 0, naming none, is
never checked): a second process registering at a registered index is refused while the holder is heard from
(a push, pull or reply within ``Membership.lease_s``, or a push of its waiting for a reply), and takes the index
once the holder was silent that long; the holder's pushes are then refused as ``superseded``.
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from switchps.config.run import TrainSpec
from switchps.policies.base import Decision
from switchps.ps_server.core.actions import Record
from switchps.ps_server.core.aggregation import AggregationRule
from switchps.ps_server.core.events import Membership, Push, absolute, relative
from switchps.refusals import index_in_use, invalid, precondition, superseded, unknown_worker

MAX_PARTITION_SIZE = 2**40
"""The most samples a worker may say its data partition holds."""


@dataclass
class Lifecycle:
    """The membership and the start and end of training (times on the driver's clock)."""

    train: TrainSpec
    members: Membership
    startup_timeout_s: float
    initialized: bool = False
    first_register: float | None = None
    started_at: float | None = None
    finished_at: float | None = None
    resumed: bool = False  # restarted from a checkpoint: pushes may name versions lost in the crash
    paused: list[Push] = field(default_factory=list)
    """Pushes that arrived while an elastic run had fewer than ``min`` members: they wait, unapplied (their
    workers with them), and enter the protocol in order once enough join; not checkpointed (as a push in
    flight, a crash makes its worker send it again)."""

    @property
    def done(self) -> bool:
        return self.finished_at is not None

    def check_register(self, worker: int, partition_size: int) -> None:
        """Raise ``Rejected`` unless a worker index and partition size are plausible."""
        if not 0 <= worker < self.members.capacity:
            raise invalid("worker", f"worker index {worker} outside [0, {self.members.capacity})")
        if not 0 < partition_size <= MAX_PARTITION_SIZE:
            raise invalid("partition_size", f"partition size {partition_size} must be in [1, {MAX_PARTITION_SIZE}]")

    def check_holder(self, worker: int, session: int, now: float, protocol: AggregationRule) -> None:
        """Raise ``Rejected`` if process ``session`` may not take index ``worker``: another process holds it
        and was heard from within ``lease_s``, or its push waits for a reply (in ``protocol``, or paused)."""
        m = self.members
        held = m.sessions.get(worker, 0)
        if 0 in (session, held) or held == session or worker not in m.registered:
            return
        silent = now - m.last_seen.get(worker, now - m.lease_s)
        if silent < m.lease_s or worker in self.waiting(protocol):
            raise index_in_use(worker, silent, m.lease_s)

    def check_registered(self, worker: int, session: int = 0) -> None:
        """Raise ``Rejected`` unless ``worker`` is registered, by process ``session`` (0: not checked)."""
        if worker not in self.members.registered:
            raise unknown_worker(worker)
        if session != 0 and self.members.sessions.get(worker, session) != session:
            raise superseded(worker)

    def check_push(self, worker: int, session: int = 0) -> None:
        """Raise ``Rejected`` unless ``worker`` registered (by process ``session``) and training has started."""
        self.check_registered(worker, session)
        if self.started_at is None:
            raise precondition("not_started", "training has not started")

    def check_version(self, base_version: int, version: int) -> None:
        """Raise ``Rejected`` unless a push's ``base_version`` is one the core has made (``version``: the
        newest; after a restart, newer ones may have been lost in the crash)."""
        if base_version < 0 or (base_version > version and not self.resumed):
            raise invalid("version", f"base version {base_version} is not in [0, {version}]")

    def register(self, worker: int, partition_size: int, now: float, version: int,
                 protocol: AggregationRule, local_steps: bool = True, session: int = 0) -> list[Record]:
        """Process ``session`` registers as ``worker`` (again, after a restart: it rejoins), saying whether it
        can take local steps; ``Rejected`` unless it is plausible and the index is free to it (``protocol``: the
        rule in force, which holds the pushes waiting for a reply)."""
        self.check_register(worker, partition_size)
        self.check_holder(worker, session, now, protocol)
        rejoin = worker in self.members.registered
        self.members.registered[worker] = partition_size
        if session != 0:
            self.members.sessions[worker] = session
        (self.members.gradients_only.discard if local_steps else self.members.gradients_only.add)(worker)
        self.members.last_seen[worker] = now
        self.first_register = now if self.first_register is None else self.first_register  # 0.0 is a time
        self._resize()
        return self.activate(worker, "worker_rejoined" if rejoin else "worker_joined", version)

    def activate(self, worker: int, event: str, version: int) -> list[Record]:
        if worker in self.members.active:
            return []
        self.members.active.add(worker)
        return [Record(event, {"worker": worker, "version": version, "members": self.members.num_workers})]

    def _resize(self) -> None:
        """N follows an elastic run's members once training started."""
        m = self.members
        if m.bounds is not None and self.started_at is not None:
            m.num_workers = len(m.registered)

    def leavers(self, now: float, waiting: set[int]) -> list[int]:
        """An elastic run's members silent for ``leave_after_s`` at ``now`` (``waiting``: workers whose push
        waits for a reply, who are not silent)."""
        m = self.members
        if m.bounds is None or self.started_at is None or self.done:
            return []
        return sorted(w for w, seen in m.last_seen.items() if seen + m.bounds.leave_after_s <= now
                      and w not in waiting)

    def leave(self, workers: list[int], version: int, reason: str = "silent") -> list[Record]:
        """``workers`` left an elastic run for good (``silent``, or said they ``exited``): out of the barrier
        and of N."""
        for w in workers:
            self.members.remove(w)
        self._resize()
        return [Record("worker_left", {"worker": w, "version": version, "reason": reason,
                                       "members": self.members.num_workers}) for w in workers]

    def pause_records(self, was_paused: bool, version: int) -> list[Record]:
        """``training_paused`` or ``training_resumed`` when membership crossed ``min`` (``was_paused``: before)."""
        m = self.members
        if m.paused == was_paused or self.started_at is None or self.done:
            return []
        assert m.bounds is not None
        return [Record("training_paused" if m.paused else "training_resumed",
                       {"version": version, "members": m.num_workers, "min": m.bounds.min})]

    def regroup(self, d: Decision, policy: str, version: int) -> list[Record]:
        """Take the workers a decision excludes out of the barrier and put those it readmits back."""
        m, out, why = self.members, [], {"reason": d.reason, "policy": policy}
        for w in sorted(d.exclude - m.excluded):
            m.excluded.add(w)
            out.append(Record("worker_excluded", {"worker": w, "version": version, **why}))
        for w in sorted(d.readmit & m.excluded):
            m.excluded.discard(w)
            out.append(Record("worker_readmitted", {"worker": w, "version": version, **why}))
        return out

    def deactivate(self, missed: list[tuple[int, str]], version: int) -> list[Record]:
        """Workers that missed a deadline (with why) are inactive until their next push."""
        self.members.active.difference_update(w for w, _ in missed)
        return [Record("deadline_missed", {"worker": w, "version": version, "reason": why}) for w, why in missed]

    def start(self, now: float) -> list[Record] | None:
        """Start training now if it may (then ``started_at`` is ``now``; returns its records), else None."""
        m = self.members
        if self.started_at is not None or not self.initialized or self.first_register is None:
            return None
        complete = len(m.registered) >= m.num_workers
        if not complete and now - self.first_register < self.startup_timeout_s:
            return None
        self.started_at = now
        self._resize()
        m.last_seen = dict.fromkeys(m.registered, now)  # the wait for the others was no silence
        workers = {"workers": sorted(m.registered)}
        return ([] if complete else [Record("started_incomplete", workers)]) + [Record("training_started", workers)]

    def next_timer(self, protocol: AggregationRule) -> float | None:
        """When the core next wants the time: the start-up timeout before training starts; while it runs,
        the time limit, an elastic member's leaving, or the deadline or window of ``protocol`` (the one in
        force; none while paused), whichever is first."""
        if self.started_at is None:
            first = self.first_register
            return first + self.startup_timeout_s if first is not None and self.initialized else None
        if self.done:
            return None
        m = self.members
        end = self.started_at + self.train.seconds if self.train.seconds else None
        rule = None if m.paused else protocol.next_timer(m)
        leave = None
        if m.bounds is not None:
            waiting = self.waiting(protocol)
            leave = min((t + m.bounds.leave_after_s for w, t in m.last_seen.items() if w not in waiting),
                        default=None)
        return min((t for t in (rule, end, leave) if t is not None), default=None)

    def waiting(self, protocol: AggregationRule) -> set[int]:
        """The workers with a push waiting for its reply (in ``protocol``, or paused)."""
        return {p.worker for p in (*protocol.waiting(), *self.paused)}

    def progress(self, now: float, version: int, samples: int) -> float:
        """The fraction of the training length done: exactly 1.0 once it is reached (compared, not divided,
        as (t0 + s - t0) / s can round below 1)."""
        t, started = self.train, self.started_at
        if t.steps or t.epochs:
            done, length = (version, t.steps) if t.steps else \
                (samples, (t.epochs or 0) * self.members.epoch_samples())
            return 0.0 if not length else 1.0 if done >= length else done / length
        if started is None or not t.seconds:
            return 0.0
        return 1.0 if now >= started + t.seconds else (now - started) / t.seconds

    def finish(self, now: float, version: int, samples: int) -> bool:
        """End training now if it has started and its length is reached; whether it ended now."""
        if self.done or self.started_at is None or self.progress(now, version, samples) < 1.0:
            return False
        self.finished_at = now
        return True

    def state_dict(self, now: float) -> dict[str, Any]:
        m = self.members
        return {"registered": {str(w): n for w, n in m.registered.items()}, "active": sorted(m.active),
                "excluded": sorted(m.excluded), "last_seen": {str(w): t - now for w, t in m.last_seen.items()},
                "gradients_only": sorted(m.gradients_only),
                "initialized": self.initialized, "first_register": relative(self.first_register, now),
                "started_at": relative(self.started_at, now), "finished_at": relative(self.finished_at, now)}

    def load_state_dict(self, d: dict[str, Any], now: float) -> None:
        m = self.members
        m.registered = {int(w): int(n) for w, n in d["registered"].items()}
        m.active, m.excluded = set(d["active"]), set(d["excluded"])
        m.last_seen = {int(w): now + t for w, t in d["last_seen"].items()}
        m.gradients_only = set(d.get("gradients_only", ()))  # a checkpoint from before local steps has none
        m.sessions = {}  # the processes register again: the first at each index holds it
        for w in [w for w in m.registered if w >= m.capacity]:  # a resume lowered the bound: they left
            m.remove(w)
        self.initialized = d["initialized"]
        self.first_register, self.started_at = absolute(d["first_register"], now), absolute(d["started_at"], now)
        self.finished_at = absolute(d["finished_at"], now)
        self._resize()

    def restarted(self, now: float) -> None:
        """After a restart every worker has a fresh deadline (it needs time to reconnect), and a push may
        name a version the crash lost."""
        self.resumed = True
        self.members.last_seen = dict.fromkeys(self.members.registered, now)
