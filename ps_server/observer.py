"""Recent worker steps: what the policy sees, what a normal step is, and what batches were measured."""

from __future__ import annotations

from collections import deque
from statistics import median
from typing import Any

from switchps.policies.base import WorkerStats
from switchps.ps_server.events import StepReport


class Observer:
    """Per-worker windows of recent steps, and the recent steps and updates of the whole cluster.

    ``window`` steps per worker feed the policy's ``WorkerStats``; the last ``2 N`` steps give a normal
    step (for the switch-overhead figure) and the measured samples per step and per update (for the
    learning-rate rule of protocols whose batch is what their workers did in time).
    """

    def __init__(self, num_workers: int, window: int) -> None:
        self.window = window
        self.steps: dict[int, deque[tuple[float, float, int, float]]] = {}
        self.step_s: deque[float] = deque(maxlen=2 * num_workers)
        self.step_samples: deque[int] = deque(maxlen=2 * num_workers)
        self.update_samples: deque[int] = deque(maxlen=2 * num_workers)

    def step(self, worker: int, report: StepReport, samples: int, loss_sum: float) -> None:
        """One worker step: compute, busy time (compute + injected delay), samples, summed loss."""
        window = self.steps.setdefault(worker, deque(maxlen=self.window))
        window.append((report.compute_s, report.compute_s + report.sleep_s, samples, loss_sum))
        self.step_s.append(report.step_s)
        self.step_samples.append(samples)

    def update(self, samples: int) -> None:
        self.update_samples.append(samples)

    def workers(self) -> dict[int, WorkerStats]:
        out = {}
        for w, steps in self.steps.items():
            compute, busy, samples = (sum(s[i] for s in steps) / len(steps) for i in range(3))
            out[w] = WorkerStats(step_time_s=busy, compute_s=compute, samples=samples,
                                 throughput=samples / busy if busy > 0 else 0.0, steps=len(steps))
        return out

    def train_loss(self) -> float | None:
        losses = [s[3] / s[2] for steps in self.steps.values() for s in steps]
        return sum(losses) / len(losses) if losses else None

    def normal_step_s(self) -> float:
        """A worker's median recent step, without barrier waits."""
        return float(median(self.step_s)) if self.step_s else 0.0

    def mean_step_samples(self) -> float | None:
        return sum(self.step_samples) / len(self.step_samples) if self.step_samples else None

    def mean_update_samples(self) -> float | None:
        return sum(self.update_samples) / len(self.update_samples) if self.update_samples else None

    def state_dict(self) -> dict[str, Any]:
        return {"steps": {str(w): [list(s) for s in d] for w, d in self.steps.items()},
                "step_s": list(self.step_s), "step_samples": list(self.step_samples),
                "update_samples": list(self.update_samples)}

    def load_state_dict(self, d: dict[str, Any]) -> None:
        self.steps = {int(w): deque(((c, b, int(n), loss) for c, b, n, loss in v), maxlen=self.window)
                      for w, v in d["steps"].items()}
        for key in ("step_s", "step_samples", "update_samples"):
            getattr(self, key).extend(d[key])
