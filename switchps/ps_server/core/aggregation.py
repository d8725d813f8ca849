"""Aggregation rules: which pushes form an update, when it is applied, and when a pusher hears back.

Each class is one rule over push metadata (never a gradient); what a worker's order asks is the work
rule's (``work_rules``), and a protocol is one of each (``protocols``). The core admits a push; the
rule answers with an ``Effect``: the aggregate it joins, updates to apply now, held pushes to release,
whether this pusher waits, or why it is dropped. Time is an argument, never read. Like ps-lite's
request handlers, the rules differ only in which replies they release, and when:
- ``Rounds`` (bsp, fmb, amb, backup): each worker in the barrier pushes once per version; the round,
  minus ``backup_workers`` late pushes, becomes one update and releases everyone; a stale push is dropped,
  but for one a pipelined worker computed on the version before (``Push.lag``: ``runtime.pipeline_sync``).
  A round older than ``deadline_s`` completes without its missing workers.
- ``OnArrival`` (asp): every push is one update, at once. ``Bounded`` (ssp): the same, but a worker
  more than ``s`` pushes ahead of the slowest active worker waits.
- ``EveryK`` (kasync): one update of the first K pushes, whatever their versions; nobody waits.
- ``Windowed`` (timed): one update of whatever arrived in each ``window_s``, at least one push.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from typing import Any, ClassVar

from switchps.config import protocol as spec
from switchps.ps_server.core.events import (
    Aggregate, Batches, Effect, Membership, Push, Update, aggregate_from, aggregate_state, push_from, push_state,
)


def required(m: Membership) -> set[int]:
    """The workers a round waits for."""
    return m.active - m.excluded


def join(a: Aggregate, p: Push) -> Aggregate:
    """Take ``p`` into ``a`` (the driver adds its gradient into ``a``'s sum, told by the core's ``Join``)."""
    a.members.append(p)
    a.workers.add(p.worker)
    a.samples += p.samples
    return a


class AggregationRule(ABC):
    """One aggregation rule; see the module docstring. Subclasses set ``asynchronous``."""

    asynchronous: ClassVar[bool]
    """Pushes may be stale by design (the asynchrony momentum rule applies)."""
    measures_batch: ClassVar[bool] = False
    """An update's samples are what was measured, so the learning rate follows them update by update."""

    def __init__(self, s: spec.Base) -> None:
        self.s = s  # its spec member's fields; a switch to other parameters of the same rule replaces it

    @abstractmethod
    def admit(self, p: Push, m: Membership, now: float) -> Effect:
        """Take a push in (its staleness set, its worker active)."""

    def enter(self, previous: AggregationRule | None, m: Membership, now: float) -> None:
        """Come into force after ``previous`` (None at the start)."""

    def busy(self) -> bool:
        """Whether a switch must wait (a round in flight completes first)."""
        return False

    def waiting(self) -> list[Push]:  # the admitted pushes whose pushers still wait for a reply
        return []

    def drain(self, m: Membership, now: float) -> Effect:
        """Leave force or end training: apply what is pending and release whoever waits."""
        return Effect()

    def on_timer(self, m: Membership, now: float) -> Effect:  # a deadline or a window passed
        return Effect()

    def next_timer(self, m: Membership) -> float | None:  # when ``on_timer`` is next due
        return None

    def on_membership(self, m: Membership, now: float) -> Effect:
        """Workers joined, left or were excluded."""
        return Effect()

    @abstractmethod
    def effective_batch(self, b: Batches, per: list[float]) -> float:
        """Samples per update, for the learning-rate rule (``per``: each worker's per step, the work rule's)."""

    def state_dict(self, now: float) -> dict[str, Any]:
        """Everything the rule holds, times relative to ``now``."""
        return {}

    def load_state_dict(self, d: dict[str, Any], now: float) -> None:
        pass


class Rounds(AggregationRule):
    asynchronous = False
    s: spec.Rounds

    def __init__(self, s: spec.Rounds) -> None:
        super().__init__(s)
        self.round: Aggregate | None = None
        self.joins: set[int] = set()  # their next push joins the round whatever its version

    def enter(self, previous: AggregationRule | None, m: Membership, now: float) -> None:
        if previous is not None and previous.asynchronous:
            self.joins = set(m.active)  # gradients in flight from asynchronous orders join the first round

    def admit(self, p: Push, m: Membership, now: float) -> Effect:
        excluded = p.worker in m.excluded
        joins = p.worker in self.joins or (excluded and self.s.excluded_pushes == "join")
        self.joins.discard(p.worker)
        if p.staleness > p.lag and not joins:
            return Effect(drop="excluded_stale" if excluded else "backup" if self.s.backup_workers else "late")
        r = self.round = self.round or Aggregate(started=p.arrived)
        if p.worker in r.workers:
            return Effect(drop="duplicate")
        join(r, p)
        effect = self._complete_if_ready(m)
        effect.joined, effect.hold = r, p not in effect.release
        return effect

    def _complete_if_ready(self, m: Membership) -> Effect:
        r, k = self.round, self.s.backup_workers
        if r is None or len(r.workers) < max(1, len(m.active) - len(m.excluded) - k):
            return Effect()  # fewer members than the barrier's least size: no need to build the barrier
        barrier = required(m)
        if len(r.workers & barrier) < max(1, len(barrier) - k):
            return Effect()
        return self._complete()

    def _complete(self) -> Effect:
        r, self.round = self.round, None
        return Effect(apply=[Update(r)], release=list(r.members)) if r else Effect()

    def busy(self) -> bool:
        return self.round is not None

    def waiting(self) -> list[Push]:
        return list(self.round.members) if self.round else []

    def drain(self, m: Membership, now: float) -> Effect:
        return self._complete()

    def on_membership(self, m: Membership, now: float) -> Effect:
        return self._complete_if_ready(m)

    def next_timer(self, m: Membership) -> float | None:
        return self.round.started + self.s.deadline_s if self.round else None

    def on_timer(self, m: Membership, now: float) -> Effect:
        r = self.round
        if r is None or now < r.started + self.s.deadline_s:
            return Effect()
        missing = sorted(required(m) - r.workers)
        effect = self._complete()
        effect.deactivate = [(w, "bsp_deadline") for w in missing]
        return effect

    def effective_batch(self, b: Batches, per: list[float]) -> float:
        return sum(per) * (b.num_workers - self.s.backup_workers) / b.num_workers

    def state_dict(self, now: float) -> dict[str, Any]:
        return {"joins": sorted(self.joins), "round": aggregate_state(self.round, now)}

    def load_state_dict(self, d: dict[str, Any], now: float) -> None:
        self.joins, self.round = set(d["joins"]), aggregate_from(d["round"], now)


def alone(p: Push, lr_factor: float = 1.0) -> Effect:
    """``p`` as an update of its own, applied at once, its pusher released."""
    u = Update(join(Aggregate(started=p.arrived), p), lr_factor)
    return Effect(joined=u.aggregate, apply=[u], release=[p])


def _damping(s: spec.ASP, p: Push) -> float:
    """lr / (1 + staleness) if ``staleness_lr``."""
    return 1.0 / (1 + p.staleness) if s.staleness_lr else 1.0


class OnArrival(AggregationRule):
    asynchronous = True
    s: spec.ASP

    def admit(self, p: Push, m: Membership, now: float) -> Effect:
        return alone(p, _damping(self.s, p))

    def effective_batch(self, b: Batches, per: list[float]) -> float:
        return sum(per) / len(per)


class Bounded(AggregationRule):
    asynchronous = True
    s: spec.SSP

    def __init__(self, s: spec.SSP) -> None:
        super().__init__(s)
        self.clocks: dict[int, int] = {}
        self.held: list[Push] = []

    def enter(self, previous: AggregationRule | None, m: Membership, now: float) -> None:
        self.clocks = dict.fromkeys(m.registered, 0)

    def admit(self, p: Push, m: Membership, now: float) -> Effect:
        if p.worker not in self.clocks:
            self.clocks[p.worker] = self._slowest(m) or 0
        self.clocks[p.worker] += 1
        slowest = self._slowest(m)  # once per push: the release and this push's hold read it
        effect = self._release(slowest)
        mine = alone(p, _damping(self.s, p))
        effect.apply, effect.joined = mine.apply, mine.joined
        effect.hold = self._ahead(p.worker, slowest)
        if effect.hold:
            self.held.append(p)
        else:
            effect.release.append(p)
        return effect

    def _slowest(self, m: Membership) -> int | None:
        """The slowest clock of the active workers that have one; None if none has (then nobody lags). A
        worker that joined has none until it first pushes, when it starts level with the slowest."""
        clocks = self.clocks
        return min((clocks[w] for w in m.active if w in clocks), default=None)

    def _ahead(self, worker: int, slowest: int | None) -> bool:
        """Whether ``worker`` is more than ``s`` pushes ahead of ``slowest`` (some active worker lags it by more
        than the bound)."""
        return slowest is not None and self.clocks.get(worker, 0) - slowest > self.s.staleness

    def _release(self, slowest: int | None) -> Effect:
        """The held pushes no active worker lags by more than the bound, given the ``slowest`` active clock:
        one pass over the held pushes (not one over the workers per held push)."""
        free: list[Push] = []
        held: list[Push] = []
        for p in self.held:
            (held if self._ahead(p.worker, slowest) else free).append(p)
        self.held = held
        return Effect(release=free)

    def on_membership(self, m: Membership, now: float) -> Effect:
        for w in [w for w in self.clocks if w not in m.registered]:  # left for good: it comes back level
            del self.clocks[w]
        slowest = self._slowest(m)
        if slowest is not None:
            for w in m.active:  # a worker that rejoins starts level with the slowest, never behind it
                self.clocks.setdefault(w, slowest)
        return self._release(slowest)

    def drain(self, m: Membership, now: float) -> Effect:
        held, self.held = self.held, []
        return Effect(release=held)

    def waiting(self) -> list[Push]:
        return list(self.held)

    def _overdue(self, m: Membership) -> dict[int, float]:
        """Each laggard holding someone back (more than ``s`` pushes behind the furthest held worker), with
        when it misses its deadline."""
        if not self.held:
            return {}
        bar = max(self.clocks.get(p.worker, 0) for p in self.held) - self.s.staleness
        clocks = self.clocks
        return {w: m.last_seen.get(w, 0.0) + self.s.deadline_s for w in m.active if w in clocks and clocks[w] < bar}

    def next_timer(self, m: Membership) -> float | None:
        return min(self._overdue(m).values(), default=None)

    def on_timer(self, m: Membership, now: float) -> Effect:
        late = sorted(w for w, t in self._overdue(m).items() if t <= now)
        return Effect(deactivate=[(w, "ssp_deadline") for w in late])

    def effective_batch(self, b: Batches, per: list[float]) -> float:
        return sum(per) / len(per)

    def state_dict(self, now: float) -> dict[str, Any]:
        return {"clocks": {str(w): c for w, c in self.clocks.items()},
                "held": [push_state(p, now) for p in self.held]}

    def load_state_dict(self, d: dict[str, Any], now: float) -> None:
        self.clocks = {int(w): int(c) for w, c in d["clocks"].items()}
        self.held = [push_from(p, now) for p in d["held"]]


class _Accumulating(AggregationRule):
    """Sums pushes as they come, without holding anyone; subclasses decide when the sum is applied."""

    asynchronous = True

    def __init__(self, s: spec.Base) -> None:
        super().__init__(s)
        self.acc: Aggregate | None = None

    def _take(self, p: Push) -> Aggregate:
        self.acc = self.acc or Aggregate(started=p.arrived)
        return join(self.acc, p)

    def _flush(self) -> list[Update]:
        acc, self.acc = self.acc, None
        return [Update(acc)] if acc else []

    def drain(self, m: Membership, now: float) -> Effect:
        return Effect(apply=self._flush())

    def state_dict(self, now: float) -> dict[str, Any]:
        return {"acc": aggregate_state(self.acc, now)}

    def load_state_dict(self, d: dict[str, Any], now: float) -> None:
        self.acc = aggregate_from(d["acc"], now)


class EveryK(_Accumulating):
    s: spec.KAsync

    def k(self, m: Membership) -> int:
        return self.s.k or m.num_workers

    def admit(self, p: Push, m: Membership, now: float) -> Effect:
        acc = self._take(p)
        return Effect(joined=acc, apply=self._flush() if len(acc.members) >= self.k(m) else [], release=[p])

    def effective_batch(self, b: Batches, per: list[float]) -> float:
        return (self.s.k or b.num_workers) * sum(per) / len(per)


class Windowed(_Accumulating):
    s: spec.Timed
    measures_batch = True

    def __init__(self, s: spec.Timed) -> None:
        super().__init__(s)
        self.window_end: float | None = None  # None: the window ended empty; the next push closes it

    @property
    def window_s(self) -> float:
        return self.s.window_s

    def enter(self, previous: AggregationRule | None, m: Membership, now: float) -> None:
        self.window_end = now + self.window_s

    def admit(self, p: Push, m: Membership, now: float) -> Effect:
        acc = self._take(p)
        if self.window_end is None:  # the window ended with nothing in it: this push closes it
            self.window_end = now + self.window_s
            return Effect(joined=acc, apply=self._flush(), release=[p])
        return Effect(joined=acc, release=[p])

    def next_timer(self, m: Membership) -> float | None:
        return self.window_end

    def on_timer(self, m: Membership, now: float) -> Effect:
        if self.window_end is None or now < self.window_end:
            return Effect()
        updates = self._flush()
        self.window_end = now + self.window_s if updates else None
        return Effect(apply=updates)

    def state_dict(self, now: float) -> dict[str, Any]:
        end = self.window_end
        return {**super().state_dict(now), "window_end": None if end is None else end - now}

    def load_state_dict(self, d: dict[str, Any], now: float) -> None:
        super().load_state_dict(d, now)
        self.window_end = None if d["window_end"] is None else now + d["window_end"]

    def effective_batch(self, b: Batches, per: list[float]) -> float:
        return b.update_samples if b.update_samples is not None else sum(per) / len(per)
