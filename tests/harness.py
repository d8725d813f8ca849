"""A driver of the protocol core for tests: a fake clock, NumPy pushes, plain SGD, no sockets or threads."""

from __future__ import annotations

from collections import Counter
from pathlib import Path
from typing import Any

import numpy as np

from switchps.config.protocol import protocol_spec
from switchps.config.run import SwitchSpec, TrainSpec
from switchps.policies.base import Policy
from switchps.ps_server.checkpointer import Parts
from switchps.ps_server.core.machine import Core
from switchps.ps_server.core.actions import (Action, Apply, Count, Free, Join, Record, Release, SetOptimizer,
                                             execute)
from switchps.ps_server.core.events import Bounds, Push, StepReport
from switchps.ps_server.records import RunRecorder
from switchps.ps_server.sums import Sums

G = np.float32


class Harness:
    """Registers ``workers`` workers and starts training; applies updates as SGD with learning rate 1.

    ``params`` follow every ``Apply`` (ΣG/Σb times the learning-rate factor and scale); ``releases``
    maps push ids to their ``Release``; every push must end in exactly one release (``check_books``).
    Like the gRPC driver, it holds each push's gradient by push id until the core joins or frees it, and
    the sums in ``Sums``; ``freed`` lists the buffers the core let go. With a ``run_dir`` it keeps a run
    record there (``rec``) on its clock, flushed only by its caller; ``parts`` are what a checkpoint holds.
    """

    def __init__(self, workers: int = 3, size: int = 2, protocol: dict[str, Any] | None = None,
                 train: dict[str, Any] | None = None, policy: Policy | None = None, every_k: int = 10,
                 on_switch: dict[str, Any] | None = None, momentum: float = 0.0, start: bool = True,
                 run_dir: Path | None = None, bounds: Bounds | None = None) -> None:
        self.now = 100.0
        self.rec = None if run_dir is None else RunRecorder(run_dir, flush_every_s=None, clock=lambda: self.now)
        self.freed: list[np.ndarray] = []
        self.log: list[Action] = []  # every action, in order
        self.steps: dict[int, int] = {}  # per worker, its next step number (for scripts that name pushes)
        self.grads: dict[int, np.ndarray] = {}
        self.sums = Sums()
        self.core = Core(protocol_spec({"name": "bsp", "batch": 8, **(protocol or {})}),
                         TrainSpec(**(train or {"steps": 10_000})), workers,
                         startup_timeout_s=5.0, on_switch=SwitchSpec(**(on_switch or {})), momentum=momentum,
                         policy=policy, every_k=every_k, bounds=bounds)
        self.params = np.zeros(size, np.float64)
        self.lr_scale, self.momentum = 1.0, momentum
        self.applied: list[Apply] = []
        self.releases: dict[int, Release] = {}
        self.records: list[Record] = []
        self.counts: Counter[str] = Counter()
        self.pushed: dict[int, int] = {}  # push id -> samples
        self._ids = 0
        if start:
            for w in range(workers):
                self.run(self.core.register(w, 100, self.now))
            self.run(self.core.initialized_at(self.now))
            for w in range(workers):
                self.core.issue(w, self.now)  # the first pull: each worker learns its budget

    def parts(self) -> Parts:
        """What a checkpoint of this driver holds (``checkpointer.compose`` and ``restore``)."""
        return Parts(self.core, self.sums, self.rec)

    def run(self, actions: list[Action]) -> None:
        self.log += actions
        if self.rec is not None and self.rec.t0 is None and self.core.started_at is not None:
            self.rec.start(self.core.started_at)
        execute(actions, self)

    # ---- the core's actions (``actions.Executor``) ---------------------------------------------------

    def join(self, a: Join) -> None:
        freed = self.sums.join(a.aggregate_id, self.grads.pop(a.push_id))
        if freed is not None:
            self.freed.append(freed)

    def free(self, a: Free) -> None:
        self.freed.append(self.grads.pop(a.push_id))

    def apply(self, a: Apply) -> None:
        grad = self.sums.take(a.aggregate.id)
        self.params -= self.lr_scale * a.lr_factor * grad.astype(np.float64) / a.aggregate.samples
        self.applied.append(a)
        if self.rec is not None:
            self.rec.update(a, self.lr_scale * a.lr_factor)

    def release(self, a: Release) -> None:
        assert a.push_id not in self.releases, f"push {a.push_id} released twice"
        self.releases[a.push_id] = a

    def set_optimizer(self, a: SetOptimizer) -> None:
        self.lr_scale = a.lr_scale
        self.momentum = a.momentum if a.momentum is not None else self.momentum

    def record(self, a: Record) -> None:
        self.records.append(a)
        if self.rec is not None:
            self.rec.event(a.event, **a.fields)

    def count(self, a: Count) -> None:
        self.counts[f"{a.what}:{a.reason}" if a.reason else a.what] += 1
        if self.rec is not None:
            self.rec.count(a.what, a.reason)

    def push(self, worker: int, value: float | list[float], samples: int = 1, base: int | None = None,
             report: StepReport = StepReport(), step: int = 0, session: int = 0, check: bool = True) -> int:
        """Push ``value`` (the summed gradient) from ``worker``, checked as the service checks it (unless not
        ``check``: its header was checked before something changed); returns the push id."""
        self._ids += 1
        grad = np.array(np.broadcast_to(np.asarray(value, G), self.params.shape), G)
        version = self.core.version if base is None else base
        if check:
            self.core.check_push(worker, samples, version, report, self.now, session)
        p = Push(self._ids, worker, version, samples, 0.0, self.now, step=step, session=session)
        self.pushed[p.id] = samples
        self.grads[p.id] = grad
        if self.rec is not None and not self.core.is_retry(p):  # a retry's step is recorded once
            self.rec.step(worker, version, samples, report)
        self.run(self.core.push(p, report, self.now))
        return p.id

    def register(self, worker: int, partition: int = 100) -> None:
        """``worker`` registers (a newcomer joins) and pulls its first order."""
        self.run(self.core.register(worker, partition, self.now))
        self.core.issue(worker, self.now)

    def released(self, push_id: int) -> bool:
        return push_id in self.releases

    def advance(self, seconds: float) -> None:
        """Let ``seconds`` pass, firing the core's timers when they are due."""
        end = self.now + seconds
        while (t := self.core.next_timer()) is not None and t <= end:
            self.now = max(self.now, t)
            self.run(self.core.timer(self.now))
        self.now = end

    def switch(self, **fields: Any) -> None:
        spec = self.core.switching.respec(fields)
        self.run(self.core.switch(spec, "test", "manual", self.now))

    def events(self, name: str) -> list[dict[str, Any]]:
        return [r.fields for r in self.records if r.event == name]

    def protocols_applied(self) -> list[str]:
        return [a.protocol for a in self.applied]

    def check_books(self) -> None:
        """Nothing lost, nothing twice: every push released once, and applied at most once."""
        assert set(self.releases) == set(self.pushed), "every push gets exactly one reply"
        members = [id(m) for a in self.applied for m in a.aggregate.members]
        assert len(members) == len(set(members)), "no push is applied twice"
        applied = sum(a.aggregate.samples for a in self.applied)
        dropped = sum(self.pushed[i] for i, r in self.releases.items() if not r.outcome.applied)
        assert applied + dropped == sum(self.pushed.values()), "every sample applied once or counted dropped"


class ActionLog:
    """An executor that notes which method got which action."""

    def __init__(self) -> None:
        self.calls: list[tuple[str, Action]] = []

    def join(self, a: Join) -> None:
        self.calls.append(("join", a))

    def free(self, a: Free) -> None:
        self.calls.append(("free", a))

    def apply(self, a: Apply) -> None:
        self.calls.append(("apply", a))

    def release(self, a: Release) -> None:
        self.calls.append(("release", a))

    def set_optimizer(self, a: SetOptimizer) -> None:
        self.calls.append(("set_optimizer", a))

    def record(self, a: Record) -> None:
        self.calls.append(("record", a))

    def count(self, a: Count) -> None:
        self.calls.append(("count", a))
