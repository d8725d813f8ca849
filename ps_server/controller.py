"""The protocol controller: watches worker steps, consults the policy, applies its decisions live.

It runs inside the engine's lock, at round boundaries under BSP/AMB/FMB and
every ``every_k`` updates under ASP/SSP, so a decision takes effect with the
very next work orders, with no restart and no checkpoint round trip.
"""

from __future__ import annotations

from collections import defaultdict, deque
from typing import TYPE_CHECKING

from pydantic import ValidationError

from switchps.config import ProtocolSpec
from switchps.policies.base import Decision, Policy, Snapshot, WorkerStats
from switchps.protos import switchps_pb2 as pb

if TYPE_CHECKING:
    from switchps.ps_server.sync import SyncEngine


class Controller:
    def __init__(self, engine: SyncEngine, policy: Policy, window: int = 5) -> None:
        self.engine = engine
        self.policy = policy
        self._steps: defaultdict[int, deque[tuple[float, float, int, float]]] = defaultdict(
            lambda: deque(maxlen=window))
        self._since = 0

    def observe(self, worker: int, stats: pb.StepStats, samples: int) -> None:
        """Record one worker step: compute, busy time (compute + injected delay), samples, loss."""
        self._steps[worker].append((stats.compute_s, stats.compute_s + stats.sleep_s, samples, stats.loss_sum))

    def after_update(self) -> None:
        self._since += 1
        if self.engine.protocol.synchronous or self._since >= self.policy.every_k:
            self.consult()

    def consult(self) -> None:
        self._since = 0
        decision = self.policy.decide(self.snapshot())
        if decision is not None:
            self.apply(decision)

    def snapshot(self) -> Snapshot:
        e = self.engine
        workers, losses = {}, []
        for w, steps in self._steps.items():
            compute = sum(s[0] for s in steps) / len(steps)
            busy = sum(s[1] for s in steps) / len(steps)
            samples = sum(s[2] for s in steps) / len(steps)
            workers[w] = WorkerStats(step_time_s=busy, compute_s=compute, samples=samples,
                                     throughput=samples / busy if busy > 0 else 0.0, steps=len(steps))
            losses += [s[3] / s[2] for s in steps]
        train_size = sum(e.registered.values()) or 1
        return Snapshot(
            version=e.store.version, time_s=e.elapsed(), progress=e.progress(), protocol=e.protocol.name,
            num_workers=e.num_workers, active=frozenset(e.active), excluded=frozenset(e.excluded),
            workers=workers, batches={w: e.budget(w) for w in sorted(e.active)},
            train_loss=sum(losses) / len(losses) if losses else None,
            time_budget_s=e.protocol.time_budget_s if e.protocol.name == "amb" else None,
            epoch=e.samples_applied / train_size,
        )

    def apply(self, d: Decision) -> None:
        e, name = self.engine, self.policy.name
        if d.exclude:
            e.exclude(d.exclude, d.reason, name)
        if d.readmit:
            e.readmit(d.readmit, d.reason, name)
        if d.batches:
            e.set_batches(d.batches, d.reason, name)
        update = dict(d.params)
        if d.protocol:
            update["name"] = d.protocol
        if d.time_budget_s is not None:
            update["time_budget_s"] = d.time_budget_s
        if update:
            try:
                new = ProtocolSpec.model_validate({**e.protocol.model_dump(), **update})
            except ValidationError as err:
                e.rec.event("decision_rejected", policy=name, reason=d.reason, error=str(err.errors()[0]["msg"]))
                return
            e.switch(new, d.reason, name)
