"""The gRPC driver's ``Executor``: the core's actions carried out on the model store and the run record.

Concurrency: ``execute`` calls it on the PS's event loop (``service``). ``join``, ``free``, ``apply`` and
``set_optimizer`` hand their work to the store, whose applier thread carries it out in the order handed
over; ``release`` completes a pusher's future on the loop.
"""

from __future__ import annotations

import asyncio
import logging
from dataclasses import dataclass
from functools import partial

import numpy as np

from switchps.ps_server.core.actions import Apply, Count, Free, Join, Record, Release, SetOptimizer
from switchps.ps_server.metrics import Tally
from switchps.ps_server.snapshot import Snapshot
from switchps.ps_server.store import ModelStore
from switchps.optim.optimizers import adjust_optimizer
from switchps.ps_server.records import RunRecorder

LOGGED = frozenset({"worker_left", "training_paused", "training_resumed"})
"""Events the PS's log says as they happen (an elastic run's membership), besides recording them."""
log = logging.getLogger("switchps.ps")

@dataclass
class StoreExecutor:
    """Carries out the core's actions for the service, which holds each push's gradient (``grads``) and
    each held pusher's future (``held``) by push id until an action takes them."""

    store: ModelStore
    rec: RunRecorder
    grads: dict[int, np.ndarray]
    held: dict[int, asyncio.Future[tuple[Release, Snapshot]]]
    tally: Tally

    def join(self, a: Join) -> None:
        self.store.join(a.aggregate_id, self.grads.pop(a.push_id))

    def free(self, a: Free) -> None:
        self.store.recycle(self.grads.pop(a.push_id))

    def apply(self, a: Apply) -> None:
        agg = a.aggregate
        snap = self.store.submit(agg.id, agg.samples, len(agg.members), a.lr_factor,
                                 on_applied=partial(self._applied, a), outer=a.outer)
        assert snap.version == a.version, "the store and the core count versions alike"

    def _applied(self, a: Apply, lr: float) -> None:
        """On the applier's thread, once it knows the rate it applied: the record's row and the series'."""
        self.rec.update(a, lr)
        self.tally.applied(a, lr)

    def release(self, a: Release) -> None:
        fut = self.held.pop(a.push_id, None)
        if fut is not None and not fut.done():  # a cancelled pusher is no longer listening
            fut.set_result((a, self.store.snapshot()))

    def set_optimizer(self, a: SetOptimizer) -> None:
        self.store.control(partial(adjust_optimizer, lr_scale=a.lr_scale, state=a.state,
                                   state_scale=a.state_scale, momentum=a.momentum))

    def record(self, a: Record) -> None:
        self.rec.event(a.event, **a.fields)
        if a.event in LOGGED:
            log.warning("%s: %s", a.event.replace("_", " "), ", ".join(f"{k} {v}" for k, v in a.fields.items()))

    def count(self, a: Count) -> None:
        self.rec.count(a.what, a.reason)
