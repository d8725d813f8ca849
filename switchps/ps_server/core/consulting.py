"""Consulting the policy: what it sees (a frozen ``ClusterView`` built from recent steps) and when it is
asked (after every round; every ``every_k`` updates under asynchronous protocols), and the per-worker
batches its decisions set."""

from __future__ import annotations

from collections import deque
from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

from switchps.policies.base import ClusterView, Decision, Policy
from switchps.ps_server import observer
from switchps.ps_server.events import Batches, Membership, Push, Record, StepReport
from switchps.ps_server.protocols import SyncProtocol


class Consulting:
    """The policy, its cadence, what it has seen lately, and the batches it set."""

    def __init__(self, policy: Policy | None, every_k: int, window: int, num_workers: int) -> None:
        self.policy, self.every_k, self.num_workers = policy, every_k, num_workers
        self.recent = observer.Recent(window, 2 * num_workers)
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

    def view(self, protocol: SyncProtocol, m: Membership, version: int, samples: int, time_s: float,
             progress: float) -> ClusterView:
        """The frozen view the policy gets, with every active worker's budget and the protocol's T."""
        budgets = {w: protocol.budget(w, self.batches) for w in [-1, *sorted(m.active)]}
        return observer.view(self.recent, m, version, samples, protocol.name, budgets, time_s, progress)

    def set_batches(self, d: Decision, policy: str, version: int) -> list[Record]:
        """Per-worker sample budgets a decision sets."""
        if not d.batches:
            return []
        self.batches.update(d.batches)
        return [Record("batches", {"version": version, "reason": d.reason, "policy": policy,
                                   "batches": {str(w): b for w, b in sorted(self.batches.items())}})]

    def step_s(self) -> float:
        """A worker's normal step lately (``observer.normal_step_s``)."""
        return observer.normal_step_s(self.recent)

    def measured(self) -> Batches:
        """What an effective batch depends on now: the batches set, and the recent measured ones."""
        r = self.recent
        return Batches(self.num_workers, dict(self.batches), observer.mean(r.step_samples),
                       observer.mean(r.update_samples))

    def state_dict(self, now: float) -> dict[str, Any]:  # no times
        return {"since": self.since, "batches": {str(w): b for w, b in self.batches.items()},
                "recent": observer.state(self.recent),
                "policy": None if self.policy is None else self.policy.state_dict()}

    def load_state_dict(self, d: dict[str, Any], now: float) -> None:
        self.since = d["since"]
        self.batches = {int(w): b for w, b in d["batches"].items()}
        self.recent = observer.Recent(self.recent.window, self.recent.span)
        observer.restore(self.recent, d["recent"])
        if self.policy is not None and d["policy"] is not None:
            self.policy.load_state_dict(d["policy"])
