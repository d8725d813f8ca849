"""The model the PS holds: flat float32 values, optimizer and version, changed by one writer at a time,
which also owns the open aggregates' sums (``sums.Sums``) and publishes each version (``snapshot.Snapshot``).

Values live in one contiguous float32 vector; the layout maps it back to named variables: the trainable
parameters first, which the optimizer updates, then the non-trainable state (BatchNorm moving
statistics), which each update replaces with the mean of its contributors' values (the round's workers
under BSP, the one pusher under ASP). ``submit`` reserves the next version at once and queues the update.

Concurrency: the store's work (joins, updates, optimizer changes) runs in the order it was submitted, one
item at a time, under ``_writing``: that item is the only writer of ``values``, the sums and the
optimizer. An item runs on the applier thread, which publishes the new version's chunks block by block
as the optimizer finishes them, so replies stream before the apply ends; or, for a model of at most
``inline_bytes`` with nothing queued before it, at once on the submitting thread (the event loop). Such
a model's pushes travel as one message (``codec.WHOLE_BYTES``): its reply cannot leave before the update
ends, and the hand-off to the applier and back cost more than ten times a 7,850-parameter update (at
784k parameters, applying on the loop made 1.13-1.15x the steps/s). An inline update defers its
snapshot's chunks (``Snapshot.defer``): a reply copies the values straight out, and the chunks are made
only for a reader that asks, or before the next update if anyone still holds the snapshot (a weak
reference tells), which saves a pass over the values per push. ``ModelStore.lock`` guards ``version``,
the latest snapshot and a deferred snapshot's values; each ``Snapshot``'s ``_lock`` guards its chunks;
``_idle`` is the condition "no item pending". Lock order: ``_writing``, ``lock``, a snapshot's
``_lock``; ``_idle`` is never held with another.

Optimizers: a gradient's update steps the run's ``optimizer``, which ``control`` changes (the lr scale, the
momentum, the state a switch keeps, resets or scales); an update of pushed movements (local steps,
``actions.Apply.outer``) steps the outer optimizer its spec names (``outer.OuterOptimizers``: one per
distinct spec, with its own state, kept across switches and in checkpoints), at its spec's learning rate
times the update's ``lr_factor``, and ``control`` never touches it. Both are the writer's alone, like
``values``.

With ``threads`` > 1 (``runtime.ps_threads``), an item on the applier spreads its blocks over the store's
``lanes`` (a pool made once, the applier waiting meanwhile): an update's blocks, each chunk of the new
version copied by the thread whose block completes it (``Snapshot.ready``), and a join's additions. The
item still runs alone under ``_writing`` and returns once every block is done. A model of at most ``inline_bytes``
keeps one thread. The gradient's finiteness check stays where it is, in the receiving pass on the event
loop (``codec.PayloadWriter``): a non-finite push must be refused before it joins a sum, long before the
apply's pass.
"""

from __future__ import annotations

import logging
import queue
import threading
import time
import weakref
from dataclasses import dataclass
from functools import partial
from typing import Callable

import numpy as np

from switchps.config.optimizer import OptimizerSpec
from switchps.protos import switchps_pb2 as pb
from switchps.protos.codec import DEFAULT_CHUNK_BYTES, WHOLE_BYTES
from switchps.protos.layout import trainable_size, variable_sizes
from switchps.protos.wire_dtype import wire_nbytes
from switchps.refusals import invalid, precondition
from switchps.optim.lanes import SERIAL, Lanes
from switchps.optim.optimizers import Optimizer, apply_update
from switchps.ps_server.outer import OuterOptimizers
from switchps.ps_server.receiving import BufferPool, Slots
from switchps.ps_server.snapshot import Snapshot
from switchps.ps_server.sums import Sums

log = logging.getLogger("switchps.ps")


@dataclass
class _Update:
    aggregate_id: int
    samples: int
    contributors: int
    lr_factor: float
    snapshot: Snapshot
    on_applied: Callable[[float], None] | None
    outer: OptimizerSpec | None = None


class ModelStore:
    """Holds the values and optimizer state; the one item running (see the module docstring) is the only writer.

    ``values`` is the whole vector (trainable parameters, then non-trainable
    state); the optimizers (the run's, ``outer``'s) see only its first ``trainable`` elements.
    """

    def __init__(self, make_optimizer: Callable[[int], Optimizer], chunk_bytes: int = DEFAULT_CHUNK_BYTES,
                 workers: int = 8, inline_bytes: int = WHOLE_BYTES, threads: int = 1,
                 wire: str = "float32") -> None:
        """``workers``: the run's, each of which may hold ``EACH`` payloads at once (``slots``), with
        workers + 1 free buffers kept for reuse; ``inline_bytes``: models up to this size run their items
        on the submitting thread (see the module docstring); 0: always on the applier; ``threads``: an
        item's blocks run on this many threads (``lanes``)."""
        self._make_optimizer = make_optimizer
        self.wire = wire  # ``runtime.wire_dtype``: the type pushes and replies carry (values stay float32)
        self.chunk_bytes, self.inline_bytes = chunk_bytes, inline_bytes
        self.lanes = Lanes(threads)
        self.slots = Slots(workers)  # the event loop's; kept across ``initialize``, which replaces the pool
        self.lock = threading.Lock()
        self.layout = pb.Layout()
        self.values = np.empty(0, np.float32)
        self.trainable = 0
        self.optimizer = make_optimizer(0)
        self.outer = OuterOptimizers()
        self.buffers = BufferPool(0, workers + 1)
        self.initialized = False
        self.version = 0  # the newest version: its update may still be in the applier's queue
        self._latest = Snapshot.of(0, self.values, chunk_bytes)
        self.sums = Sums()  # the open aggregates' sums: the applier's alone
        self._queue: queue.SimpleQueue[_Update | Callable[[], None]] = queue.SimpleQueue()
        self._idle = threading.Condition()
        self._pending = 0
        self._writing = threading.Lock()  # held by the one item running, on whichever thread
        self._deferred: weakref.ref[Snapshot] | None = None  # the last update's deferred snapshot
        self.apply_s, self.applied = 0.0, 0  # the updates' own time, from their start to their last block
        threading.Thread(target=self._apply_loop, name="switchps-applier", daemon=True).start()

    @property
    def nbytes(self) -> int:
        """The values' bytes on the wire (a push's, a reply's)."""
        return wire_nbytes(self.values.size, self.wire)

    def initialize(self, layout: pb.Layout, values: np.ndarray) -> None:
        with self.lock:
            self.layout = layout
            self.values = values
            self.trainable = trainable_size(layout)
            self.optimizer = self._make_optimizer(self.trainable)
            self.optimizer.set_variables(variable_sizes(layout))  # per-variable clipping's boundaries
            self.outer = OuterOptimizers(self.trainable, variable_sizes(layout))
            self.buffers = BufferPool(values.size, self.buffers.limit)
            self._latest = Snapshot.of(self.version, values, self.chunk_bytes, self.wire)
            self.initialized = True

    def restore(self, layout: pb.Layout, values: np.ndarray, optimizer_state: dict, version: int,
                outer_state: dict | None = None) -> None:
        """Continue from a checkpoint: its values, optimizer states and version (before serving); a
        checkpoint from before outer optimizers has no ``outer_state``."""
        self.version = version
        self.initialize(layout, values)
        self.optimizer.load_state_dict(optimizer_state)
        self.outer.load_state_dict(outer_state or {})

    def join(self, aggregate_id: int, grad: np.ndarray) -> None:
        """Queue a push's gradient to be added into an aggregate's sum (``sums``), in order with the updates."""
        self._enqueue(partial(self._join, aggregate_id, grad))

    def _join(self, aggregate_id: int, grad: np.ndarray) -> None:
        freed = self.sums.join(aggregate_id, grad, self._lanes())
        if freed is not None:
            self.recycle(freed)

    def submit(self, aggregate_id: int, samples: int, contributors: int = 1, lr_factor: float = 1.0,
               on_applied: Callable[[float], None] | None = None, outer: OptimizerSpec | None = None) -> Snapshot:
        """Queue one update of an aggregate's sum; returns the new version's snapshot at once.

        The sum holds the summed gradient over ``samples`` followed by the sum of ``contributors``
        workers' state; the update applies their means and consumes the sum (its buffer returns to the
        pool): with the run's optimizer, or, for movements, with ``outer``'s (the module docstring).
        ``on_applied(lr)`` runs where the update runs, before the snapshot's last chunk is published, so a
        reader that has the whole snapshot also sees the update recorded.
        """
        with self.lock:
            self.version += 1
            snap = self._latest = Snapshot(self.version, self.nbytes, self.chunk_bytes, self.lock, self.wire)
        self._enqueue(_Update(aggregate_id, samples, contributors, lr_factor, snap, on_applied, outer))
        return snap

    def master(self) -> Snapshot:
        """The newest version's float32 values in a snapshot of their own, whatever the wire's type (the
        evaluator's pull): published on the writer's turn, after every update queued before it."""
        with self.lock:
            snap = Snapshot(self.version, self.values.nbytes, self.chunk_bytes)

        def publish() -> None:
            try:
                snap.publish_until(self.values, self.values.size)
            except BaseException as e:
                snap.fail(e)
                raise

        self._enqueue(publish)
        return snap

    def check(self, digest: str, nbytes: int) -> None:
        """Raise ``Rejected`` unless a payload declares this model's layout and size."""
        if not self.initialized:
            raise precondition("not_initialized", "the model is not initialized")
        if digest != self.layout.digest:
            raise precondition("layout", "the push's variable layout is not the model's")
        if nbytes != self.nbytes:
            raise invalid("size", f"payload declares {nbytes} bytes, the model has {self.nbytes}")

    def recycle(self, buffer: np.ndarray) -> None:
        """Give a gradient buffer back to the pool."""
        self.buffers.put(buffer)

    def control(self, change: Callable[[Optimizer], None]) -> None:
        """Change the optimizer (learning-rate scale, state) between the updates queued before and after."""
        self._enqueue(lambda: change(self.optimizer))

    def _enqueue(self, item: "_Update | Callable[[], None]") -> None:
        """Run ``item`` now if the model is small and nothing is pending (so order is kept), else queue it."""
        with self._idle:
            inline = self._pending == 0 and self.values.nbytes <= self.inline_bytes
            self._pending += 1
        if inline:
            self._run(item, inline=True)
        else:
            self._queue.put(item)

    def snapshot(self) -> Snapshot:
        """The newest version's snapshot (possibly still being published)."""
        with self.lock:
            return self._latest

    def wait_idle(self, timeout: float | None = None) -> bool:
        """Block until every submitted update has been applied."""
        with self._idle:
            return self._idle.wait_for(lambda: self._pending == 0, timeout)

    def _apply_loop(self) -> None:
        while True:
            self._run(self._queue.get())

    def _run(self, u: "_Update | Callable[[], None]", inline: bool = False) -> None:
        """Run one item as the only writer, then count it done; a failed update fails its snapshot."""
        try:
            with self._writing:
                if isinstance(u, _Update):
                    self._apply(u, inline)
                else:
                    u()
        except BaseException as e:  # surfaced to every reader of that version
            log.exception("applier: %s failed", u)
            if isinstance(u, _Update):
                u.snapshot.fail(e)
        finally:
            with self._idle:
                self._pending -= 1
                self._idle.notify_all()

    def _apply(self, u: _Update, inline: bool) -> None:
        """Update ``values``, publishing the chunks as the blocks finish (readers may wait on another
        thread); run inline, defer them instead (``Snapshot.defer``) until the next update settles them."""
        t0 = time.perf_counter()
        self._settle()
        values, snap, grad = self.values, u.snapshot, self.sums.take(u.aggregate_id)
        per_chunk = snap.chunk_values
        last = values.size - (values.size % per_chunk or per_chunk)  # the last chunk waits for the record

        def publish(start: int, stop: int) -> None:  # on the lane that updated the block
            snap.ready(values, start, min(stop, last))
        lanes = self._lanes()
        threaded = lanes.parallel and not inline
        optimizer = self.optimizer if u.outer is None else self.outer.get(u.outer)
        for end in apply_update(optimizer, values, self.trainable, grad, u.samples, u.contributors,
                                u.lr_factor, lanes, publish if threaded else None):
            if not (inline or threaded):  # one thread: this one, publishing as the blocks finish
                snap.publish_until(values, min(end, last))
        self.buffers.put(grad)
        self.apply_s, self.applied = self.apply_s + time.perf_counter() - t0, self.applied + 1
        if u.on_applied:
            u.on_applied(optimizer.last_lr)
        if not inline:
            snap.ready(values, min(last, self.trainable), values.size)
            return
        with self.lock:
            snap.defer(values)
            self._deferred = weakref.ref(snap)

    @property
    def mean_apply_ms(self) -> float | None:
        """The updates' mean time, the chunks' copies for the replies included (not their wait in the queue)."""
        return round(1e3 * self.apply_s / self.applied, 3) if self.applied else None

    def _lanes(self) -> Lanes:
        """The threads an item runs its blocks on: one for a model small enough to run inline."""
        return self.lanes if self.values.nbytes > self.inline_bytes else SERIAL

    def _settle(self) -> None:
        """Before values change: the last deferred snapshot's chunks, if anyone still holds it."""
        with self.lock:
            held, self._deferred = (self._deferred() if self._deferred else None), None
        if held is not None:
            held.settle()
