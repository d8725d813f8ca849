"""Membership and the run's lifecycle: who registered, who is active, when training started and ends,
what each member's work orders allow (``Orders``), and which of its pushes arrived (``Receipts``).

Training starts once the model is initialized and every worker registered, or once ``startup_timeout_s``
has passed since the first registration with whoever is there. It ends when ``train`` says (steps,
epochs or seconds), measured by ``progress``. A run restarted from a checkpoint is ``resumed``.

**Orders.** The work orders the core has issued, and what they allow a push to claim.

A worker computes a step under the work order it was last given, so the order bounds what its push may
report: no more samples than the budget, and no more compute (with injected delays) than the time since
the order was issued. A push resent after a lost reply was computed under the order before, so each
bound spans the last two orders. A re-registration or a pull is not a step boundary and only widens the
bounds. Orders issued before a restart have no time in this process: their pushes are bounded by the
run's span plus ``RESTART_SLACK_S`` (the checkpoint's clock leaves out the work the crash lost).

**Receipts.** Which pushes the PS has received, so that a retried push is recognised and never applied twice.

A push is named by (worker, session, step): ``session`` is random per worker process and ``step``
counts that process's pushes; session 0 leaves a push unnamed (a client that never retries). A worker
whose reply was lost (a broken connection, a PS restart) sends the same push again; the core then either hands the retry the original's place in the round
it waits in, or, if the original was already applied or dropped, drops the copy and says so (``repeated``).
The receipts are part of the core's checkpoint, saved with the model they describe.
"""
from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any

from switchps.config.run import TrainSpec
from switchps.policies.base import Decision
from switchps.ps_server.core.events import Membership, Push, Record, StepReport, WorkOrder, absolute, relative
from switchps.ps_server.core.aggregation import AggregationRule
from switchps.refusals import invalid, precondition

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

    @property
    def done(self) -> bool:
        return self.finished_at is not None

    def check_register(self, worker: int, partition_size: int) -> None:
        """Raise ``Rejected`` unless a worker index and partition size are plausible."""
        if not 0 <= worker < self.members.num_workers:
            raise invalid("worker", f"worker index {worker} outside [0, {self.members.num_workers})")
        if not 0 < partition_size <= MAX_PARTITION_SIZE:
            raise invalid("partition_size", f"partition size {partition_size} must be in [1, {MAX_PARTITION_SIZE}]")

    def check_push(self, worker: int) -> None:
        """Raise ``Rejected`` unless ``worker`` registered and training has started."""
        if worker not in self.members.registered:
            raise invalid("unknown_worker", f"unknown worker id {worker}")
        if self.started_at is None:
            raise precondition("not_started", "training has not started")

    def check_version(self, base_version: int, version: int) -> None:
        """Raise ``Rejected`` unless a push's ``base_version`` is one the core has made (``version``: the
        newest; after a restart, newer ones may have been lost in the crash)."""
        if base_version < 0 or (base_version > version and not self.resumed):
            raise invalid("version", f"base version {base_version} is not in [0, {version}]")

    def register(self, worker: int, partition_size: int, now: float, version: int) -> list[Record]:
        """A worker registers (again, after a restart: it rejoins); ``Rejected`` unless it is plausible."""
        self.check_register(worker, partition_size)
        rejoin = worker in self.members.registered
        self.members.registered[worker] = partition_size
        self.members.last_seen[worker] = now
        self.first_register = now if self.first_register is None else self.first_register  # 0.0 is a time
        return self.activate(worker, "worker_rejoined" if rejoin else "worker_joined", version)

    def activate(self, worker: int, event: str, version: int) -> list[Record]:
        if worker in self.members.active:
            return []
        self.members.active.add(worker)
        return [Record(event, {"worker": worker, "version": version})]

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
        workers = {"workers": sorted(m.registered)}
        return ([] if complete else [Record("started_incomplete", workers)]) + [Record("training_started", workers)]

    def next_timer(self, protocol: AggregationRule) -> float | None:
        """When the core next wants the time: the start-up timeout before training starts; while it runs,
        the time limit or the deadline or window of ``protocol`` (the one in force), whichever is first."""
        if self.started_at is None:
            first = self.first_register
            return first + self.startup_timeout_s if first is not None and self.initialized else None
        if self.done:
            return None
        end = self.started_at + self.train.seconds if self.train.seconds else None
        return min((t for t in (protocol.next_timer(self.members), end) if t is not None), default=None)

    def progress(self, now: float, version: int, samples: int) -> float:
        """The fraction of the training length done: exactly 1.0 once it is reached (compared, not divided,
        as (t0 + s - t0) / s can round below 1)."""
        t, started = self.train, self.started_at
        if t.steps or t.epochs:
            done, length = (version, t.steps) if t.steps else \
                (samples, (t.epochs or 0) * sum(self.members.registered.values()))
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
                "initialized": self.initialized, "first_register": relative(self.first_register, now),
                "started_at": relative(self.started_at, now), "finished_at": relative(self.finished_at, now)}

    def load_state_dict(self, d: dict[str, Any], now: float) -> None:
        m = self.members
        m.registered = {int(w): int(n) for w, n in d["registered"].items()}
        m.active, m.excluded = set(d["active"]), set(d["excluded"])
        m.last_seen = {int(w): now + t for w, t in d["last_seen"].items()}
        self.initialized = d["initialized"]
        self.first_register, self.started_at = absolute(d["first_register"], now), absolute(d["started_at"], now)
        self.finished_at = absolute(d["finished_at"], now)

    def restarted(self, now: float) -> None:
        """After a restart every worker has a fresh deadline (it needs time to reconnect), and a push may
        name a version the crash lost."""
        self.resumed = True
        self.members.last_seen = dict.fromkeys(self.members.registered, now)


RATE = 1.05
"""Another host's clock may run this much faster than the PS's."""
SLACK_S = 1.0
"""Added to every time bound: timer resolution, and a reply's time on the wire."""
RESTART_SLACK_S = 3600.0
"""What a push computed before a PS restart may claim beyond the resumed run's span."""
MAX_FACTOR = 1e6
"""The largest slowdown factor a step may report (the straggler config's factors are >= 1)."""


@dataclass
class Order:
    """What a worker's next push may claim: at most ``samples``, computed since ``since`` (None: before a
    restart)."""

    samples: int
    since: float | None
    budget: int  # the newest order's sample budget
    issued_at: float | None  # when the newest order was issued


class Orders:
    """Per worker, the bounds its latest work orders set (see the module docstring)."""

    def __init__(self) -> None:
        self.current: dict[int, Order] = {}

    def issue(self, worker: int, order: WorkOrder, now: float, step: bool = True) -> WorkOrder:
        """Note ``order`` given to ``worker`` at ``now``, for a new step (``step``) or the same step again (a
        registration, a pull), which only widens the bounds; a reader (-1) computes nothing."""
        if worker < 0:
            return order
        samples, old = order.sample_budget, self.current.get(worker)
        if old is None:
            self.current[worker] = Order(samples, now, samples, now)
        elif step:
            self.current[worker] = Order(max(samples, old.budget), old.issued_at, samples, now)
        else:
            self.current[worker] = Order(max(samples, old.samples), old.since, max(samples, old.budget),
                                         old.issued_at)
        return order

    def check(self, worker: int, samples: int, report: StepReport, now: float, span_s: float) -> None:
        """Raise ``Rejected`` (INVALID_ARGUMENT) unless a push's claims fit its orders; ``span_s`` is how long
        the run has gone on, which bounds every duration."""
        values = (report.step, report.compute_s, report.sleep_s, report.send_s, report.wait_s,
                  report.delay_sleep_s, report.delay_comm_s, report.delay_factor, abs(report.loss_sum))
        if not all(math.isfinite(x) and x >= 0 for x in values):
            raise invalid("stats", "step statistics must be finite, with durations and step >= 0")
        order = self.current.get(worker)
        allowed = order.samples if order else 0
        if not 0 < samples <= allowed:
            raise invalid("samples", f"sample count {samples} is not in [1, {allowed}], the budget of this "
                                     "worker's work order")
        busy = report.compute_s + report.sleep_s
        since = order.since if order is not None else None
        if since is not None and busy > RATE * (now - since) + SLACK_S:
            raise invalid("stats", f"compute_s + sleep_s = {busy:.6g} s exceeds the "
                                   f"{RATE * (now - since) + SLACK_S:.6g} s since the work order was issued")
        limit = RATE * span_s + SLACK_S + (RESTART_SLACK_S if since is None else 0.0)
        durations = {"send_s": report.send_s, "wait_s": report.wait_s, "delay_sleep_s": report.delay_sleep_s,
                     "delay_comm_s": report.delay_comm_s, "compute_s + sleep_s": busy}
        for name, value in durations.items():
            if value > limit:
                raise invalid("stats", f"{name} = {value:.6g} s exceeds the run's {limit:.6g} s")
        if report.delay_factor > MAX_FACTOR:
            raise invalid("stats", f"delay_factor {report.delay_factor:.6g} exceeds {MAX_FACTOR:g}")

    def state_dict(self, now: float) -> dict[str, Any]:
        return {str(w): [o.samples, relative(o.since, now), o.budget, relative(o.issued_at, now)]
                for w, o in self.current.items()}

    def load_state_dict(self, d: dict[str, Any], now: float) -> None:
        self.current = {int(w): Order(int(s), absolute(since, now), int(b), absolute(at, now))
                        for w, (s, since, b, at) in d.items()}

    def restarted(self) -> None:
        """The orders' times belong to the crashed process's clock (a checkpoint's clock leaves out the
        outage and the work it lost): only the run's span bounds their pushes now."""
        self.current = {w: Order(o.samples, None, o.budget, None) for w, o in self.current.items()}


class Receipts:
    """The newest push received from each worker."""

    def __init__(self) -> None:
        self.last: dict[int, tuple[int, int]] = {}  # worker -> (session, step)
        self.restored: set[int] = set()  # workers whose last receipt predates a restart

    def check(self, worker: int, session: int, step: int) -> None:
        """Raise ``Rejected`` if ``step`` skips ahead of the worker's last push of the same session (a worker
        process pushes once per step). After a restart the pushes the crash lost may be missing, so a
        worker's first receipt since then is taken as it comes."""
        last = self.last.get(worker)
        if session != 0 and last is not None and last[0] == session and worker not in self.restored \
                and step > last[1] + 1:
            raise invalid("stats", f"step {step} skips ahead of this worker's last step {last[1]}")

    def seen(self, p: Push) -> bool:
        """Whether ``p`` repeats a push already received (same session, a step not newer)."""
        last = self.last.get(p.worker)
        return p.session != 0 and last is not None and last[0] == p.session and p.step <= last[1]

    def note(self, p: Push) -> None:
        if p.session != 0:  # session 0: an unnamed push (a client that does not retry)
            self.last[p.worker] = (p.session, p.step)
            self.restored.discard(p.worker)

    def state_dict(self, now: float) -> dict[str, Any]:  # no times
        return {str(w): list(v) for w, v in self.last.items()}

    def load_state_dict(self, d: dict[str, Any], now: float) -> None:
        self.last = {int(w): (int(v[0]), int(v[1])) for w, v in d.items()}

    def restarted(self) -> None:
        """The pushes received after the checkpoint are unknown: each worker's next receipt anchors anew."""
        self.restored = set(self.last)
