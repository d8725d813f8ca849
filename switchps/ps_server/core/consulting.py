"""Consulting the policy: what it sees (a frozen ``ClusterView`` built from recent steps) and when it is
asked (after every round; every ``every_k`` updates under asynchronous protocols), and the per-worker
batches its decisions set.

``Recent`` is plain data that the core appends to on every push and update; the functions below it read
it only when a policy is consulted, a switch is recorded or a protocol's learning rate depends on
measured batches."""

from __future__ import annotations

from collections import deque
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from statistics import median
from typing import Any

from switchps.policies.base import ClusterView, Decision, Policy, WorkerStats
from switchps.ps_server.core.actions import Record
from switchps.ps_server.core.events import Batches, Budget, Membership, Push, StepReport
from switchps.ps_server.core.protocols import Protocol


Step = tuple[float, float, int, float]
"""One worker step: compute, busy time (compute + injected delay), samples, summed loss."""


@dataclass
class Recent:
    """Per-worker windows of ``window`` steps, and the cluster's last ``2 N`` steps and updates."""

    window: int
    span: int
    steps: dict[int, deque[Step]] = field(default_factory=dict)
    step_s: deque[float] = field(init=False)
    """Each step's compute, injected delay and communication, without its barrier wait."""
    step_samples: deque[int] = field(init=False)
    update_samples: deque[int] = field(init=False)

    def __post_init__(self) -> None:
        self.step_s, self.step_samples, self.update_samples = (deque(maxlen=self.span) for _ in range(3))


def worker_stats(r: Recent) -> dict[int, WorkerStats]:
    out = {}
    for w, steps in r.steps.items():
        compute, busy, samples = (sum(s[i] for s in steps) / len(steps) for i in range(3))
        out[w] = WorkerStats(step_time_s=busy, compute_s=compute, samples=samples,
                             throughput=samples / busy if busy > 0 else 0.0, steps=len(steps))
    return out


def train_loss(r: Recent) -> float | None:
    losses = [s[3] / s[2] for steps in r.steps.values() for s in steps]
    return sum(losses) / len(losses) if losses else None


def normal_step_s(r: Recent) -> float:
    """A worker's median recent step, without barrier waits."""
    return float(median(r.step_s)) if r.step_s else 0.0


def mean(values: deque[int]) -> float | None:
    return sum(values) / len(values) if values else None


def recent_state(r: Recent) -> dict[str, Any]:
    return {"steps": {str(w): [list(s) for s in d] for w, d in r.steps.items()},
            "step_s": list(r.step_s), "step_samples": list(r.step_samples), "update_samples": list(r.update_samples)}


def restore_recent(r: Recent, d: dict[str, Any]) -> None:
    r.steps = {int(w): deque(((c, b, int(n), loss) for c, b, n, loss in v), maxlen=r.window)
               for w, v in d["steps"].items()}
    for key in ("step_s", "step_samples", "update_samples"):
        getattr(r, key).extend(d[key])


def cluster_view(r: Recent, m: Membership, version: int, samples: int, protocol: str, budgets: dict[int, Budget],
         time_s: float, progress: float) -> ClusterView:
    """The frozen view a policy gets; ``budgets`` holds each active worker's, and -1's for the protocol's T."""
    return ClusterView(
        version=version, time_s=time_s, progress=progress, protocol=protocol, num_workers=m.num_workers,
        active=frozenset(m.active), excluded=frozenset(m.excluded), workers=worker_stats(r),
        batches={w: b.samples for w, b in budgets.items() if w >= 0}, train_loss=train_loss(r),
        time_budget_s=budgets[-1].time_budget_s, epoch=samples / m.epoch_samples(),
        local_steps=local.steps if (local := budgets[-1].local) else None)


class Consulting:
    """The policy, its cadence, what it has seen lately, and the batches it set."""

    def __init__(self, policy: Policy | None, every_k: int, window: int, num_workers: int) -> None:
        self.policy, self.every_k = policy, every_k
        self.recent = Recent(window, 2 * num_workers)  # num_workers: the most there can be
        self.batches: dict[int, int] = {}  # per-worker sample budgets a policy set
        self.since = 0  # updates since the policy was last consulted
        self.consulting = False  # a decision being applied completes updates: no second consultation

    def note_step(self, p: Push, report: StepReport) -> None:
        r = self.recent
        window = r.steps.get(p.worker) or r.steps.setdefault(p.worker, deque(maxlen=r.window))
        window.append((report.compute_s, report.compute_s + report.sleep_s, p.samples, p.loss_sum))
        r.step_s.append(report.compute_s + report.sleep_s + max(0.0, report.send_s - report.wait_s))
        r.step_samples.append(p.samples)

    def note_update(self, samples: int) -> None:
        self.recent.update_samples.append(samples)

    def due(self, updates: int, asynchronous: bool) -> bool:
        """Count ``updates``; whether the policy is to be asked now."""
        self.since += updates
        return self.policy is not None and not self.consulting and (not asynchronous or self.since >= self.every_k)

    @contextmanager
    def asking(self) -> Iterator[Policy]:
        """The policy, while it is asked and its decision applied (which may complete updates: they do not
        consult it a second time); the count of updates since it was last asked starts anew."""
        assert self.policy is not None
        self.since, self.consulting = 0, True
        try:
            yield self.policy
        finally:
            self.consulting = False

    def view(self, protocol: Protocol, m: Membership, version: int, samples: int, time_s: float,
             progress: float) -> ClusterView:
        """The frozen view the policy gets, with every active worker's budget and the protocol's T."""
        budgets = {w: protocol.work.budget(w, self.batches) for w in [-1, *sorted(m.active)]}
        return cluster_view(self.recent, m, version, samples, protocol.name, budgets, time_s, progress)

    def forget(self, workers: list[int]) -> None:
        """Workers that left for good: their steps and batches count no more."""
        for w in workers:
            self.recent.steps.pop(w, None)
            self.batches.pop(w, None)

    def set_batches(self, d: Decision, policy: str, version: int) -> list[Record]:
        """Per-worker sample budgets a decision sets."""
        if not d.batches:
            return []
        self.batches.update(d.batches)
        return [Record("batches", {"version": version, "reason": d.reason, "policy": policy,
                                   "batches": {str(w): b for w, b in sorted(self.batches.items())}})]

    def step_s(self) -> float:
        """A worker's normal step lately (``normal_step_s``)."""
        return normal_step_s(self.recent)

    def measured(self, m: Membership) -> Batches:
        """What an effective batch depends on now: N in force, the batches set, and the recent measured ones."""
        r = self.recent
        return Batches(m.num_workers, dict(self.batches), mean(r.step_samples), mean(r.update_samples),
                       tuple(m.in_force()) if m.bounds else ())

    def state_dict(self, now: float) -> dict[str, Any]:  # no times
        return {"since": self.since, "batches": {str(w): b for w, b in self.batches.items()},
                "recent": recent_state(self.recent),
                "policy": None if self.policy is None else self.policy.state_dict()}

    def load_state_dict(self, d: dict[str, Any], now: float) -> None:
        self.since = d["since"]
        self.batches = {int(w): b for w, b in d["batches"].items()}
        self.recent = Recent(self.recent.window, self.recent.span)
        restore_recent(self.recent, d["recent"])
        if self.policy is not None and d["policy"] is not None:
            self.policy.load_state_dict(d["policy"])
