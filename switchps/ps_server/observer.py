"""Recent worker steps and updates: what a policy sees, what a normal step is, what batches were measured.

``Recent`` is plain data that the core appends to on every push and update; the
functions here read it only when a policy is consulted, a switch is recorded or a
protocol's learning rate depends on measured batches.
"""

from __future__ import annotations

from collections import deque
from dataclasses import dataclass, field
from statistics import median
from typing import Any

from switchps.policies.base import ClusterView, WorkerStats
from switchps.ps_server.events import Budget, Membership

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


def state(r: Recent) -> dict[str, Any]:
    return {"steps": {str(w): [list(s) for s in d] for w, d in r.steps.items()},
            "step_s": list(r.step_s), "step_samples": list(r.step_samples), "update_samples": list(r.update_samples)}


def restore(r: Recent, d: dict[str, Any]) -> None:
    r.steps = {int(w): deque(((c, b, int(n), loss) for c, b, n, loss in v), maxlen=r.window)
               for w, v in d["steps"].items()}
    for key in ("step_s", "step_samples", "update_samples"):
        getattr(r, key).extend(d[key])


def view(r: Recent, m: Membership, version: int, samples: int, protocol: str, budgets: dict[int, Budget],
         time_s: float, progress: float) -> ClusterView:
    """The frozen view a policy gets; ``budgets`` holds each active worker's, and -1's for the protocol's T."""
    return ClusterView(
        version=version, time_s=time_s, progress=progress, protocol=protocol, num_workers=m.num_workers,
        active=frozenset(m.active), excluded=frozenset(m.excluded), workers=worker_stats(r),
        batches={w: b.samples for w, b in budgets.items() if w >= 0}, train_loss=train_loss(r),
        time_budget_s=budgets[-1].time_s or None, epoch=samples / (sum(m.registered.values()) or 1))
