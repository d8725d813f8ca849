"""The model the PS holds: flat float32 parameters, optimizer, version.

Parameters live in one contiguous float32 vector; the layout maps it back to
named variables. One applier thread is the only writer. ``submit`` reserves
the next version at once and queues the update; while the optimizer works
through the vector block by block, the new version's wire chunks are
published one by one, so replies start streaming before the apply has
finished. Every reader of a version shares its one ``Snapshot``, and no lock
is held while parameters stream out.
"""

from __future__ import annotations

import hashlib
import logging
import math
import queue
import threading
from dataclasses import dataclass
from typing import Callable, Iterator

import numpy as np

from switchps.protos import switchps_pb2 as pb
from switchps.protos.codec import COPIES, DEFAULT_CHUNK_BYTES, INLINE_BYTES
from switchps.ps_server.optimizers import Optimizer

log = logging.getLogger("switchps.ps")


def layout_digest(variables: list[tuple[str, tuple[int, ...]]]) -> str:
    text = ";".join(f"{name}:{'x'.join(map(str, shape))}" for name, shape in variables)
    return hashlib.sha1(text.encode()).hexdigest()


def make_layout(variables: list[tuple[str, tuple[int, ...]]]) -> pb.Layout:
    return pb.Layout(
        variables=[pb.Variable(name=n, shape=list(s)) for n, s in variables],
        digest=layout_digest(variables),
    )


def layout_size(layout: pb.Layout) -> int:
    return sum(math.prod(v.shape) for v in layout.variables)


class BufferPool:
    """Reuses large gradient buffers so pushes don't page-fault fresh memory each time."""

    def __init__(self, size: int) -> None:
        self.size = size
        self._free: list[np.ndarray] = []
        self._lock = threading.Lock()

    def get(self) -> np.ndarray:
        with self._lock:
            if self._free:
                return self._free.pop()
        return np.empty(self.size, np.float32)

    def put(self, buf: np.ndarray) -> None:
        with self._lock:
            if len(self._free) < 8:
                self._free.append(buf)


class Snapshot:
    """One version's parameters as wire chunks, readable while they are still being published."""

    def __init__(self, version: int, nbytes: int, chunk_bytes: int) -> None:
        self.version = version
        self.nbytes = nbytes
        self.chunk_bytes = max(chunk_bytes, nbytes) if nbytes <= INLINE_BYTES else chunk_bytes  # inline = 1 chunk
        self._chunks: list[bytes] = []
        self._total = -(-nbytes // self.chunk_bytes)
        self._failed: BaseException | None = None
        self._cond = threading.Condition()

    @classmethod
    def of(cls, version: int, flat: np.ndarray, chunk_bytes: int) -> "Snapshot":
        snap = cls(version, flat.nbytes, chunk_bytes)
        snap.publish_until(flat, flat.size)
        return snap

    def publish_until(self, flat: np.ndarray, end: int) -> None:
        """Publish every whole chunk of ``flat`` that lies below element ``end`` (all of it at the end)."""
        raw = flat.view(np.uint8)
        limit = raw.size if end >= flat.size else end * 4
        while len(self._chunks) < self._total:
            lo = len(self._chunks) * self.chunk_bytes
            hi = min(lo + self.chunk_bytes, raw.size)
            if hi > limit:
                return
            chunk = raw[lo:hi].tobytes()
            COPIES.add(len(chunk))
            with self._cond:
                self._chunks.append(chunk)
                self._cond.notify_all()

    def fail(self, error: BaseException) -> None:
        with self._cond:
            self._failed = error
            self._cond.notify_all()

    def chunks(self) -> Iterator[bytes]:
        """The chunks in order, waiting for any not yet published."""
        for i in range(self._total):
            with self._cond:
                while len(self._chunks) <= i and self._failed is None:
                    self._cond.wait()
                if self._failed is not None:
                    raise RuntimeError(f"update to version {self.version} failed") from self._failed
                chunk = self._chunks[i]
            yield chunk


@dataclass
class _Update:
    grad: np.ndarray
    samples: int
    lr_factor: float
    snapshot: Snapshot
    on_applied: Callable[[float], None] | None


class ModelStore:
    """Holds parameters and optimizer state; the applier thread is the only writer."""

    def __init__(self, make_optimizer: Callable[[int], Optimizer], chunk_bytes: int = DEFAULT_CHUNK_BYTES) -> None:
        self._make_optimizer = make_optimizer
        self.chunk_bytes = chunk_bytes
        self.lock = threading.Lock()
        self.layout: pb.Layout | None = None
        self.params: np.ndarray | None = None
        self.optimizer: Optimizer | None = None
        self.buffers: BufferPool | None = None
        self.version = 0  # the newest version: its update may still be in the applier's queue
        self._latest: Snapshot | None = None
        self._queue: queue.SimpleQueue[_Update | Callable[[Optimizer], None]] = queue.SimpleQueue()
        self._idle = threading.Condition()
        self._pending = 0
        threading.Thread(target=self._apply_loop, name="switchps-applier", daemon=True).start()

    @property
    def initialized(self) -> bool:
        return self.params is not None

    @property
    def nbytes(self) -> int:
        return 0 if self.params is None else self.params.nbytes

    def initialize(self, layout: pb.Layout, values: np.ndarray) -> None:
        with self.lock:
            self.layout = layout
            self.params = values
            self.optimizer = self._make_optimizer(values.size)
            self.buffers = BufferPool(values.size)
            self._latest = Snapshot.of(self.version, values, self.chunk_bytes)

    def submit(self, grad_sum: np.ndarray, samples: int, lr_factor: float = 1.0,
               on_applied: Callable[[float], None] | None = None) -> Snapshot:
        """Queue the mean gradient ``grad_sum / samples``; returns the new version's snapshot at once.

        ``grad_sum`` is consumed (returned to the buffer pool). ``on_applied(lr)`` runs
        on the applier thread before the snapshot's last chunk is published, so a
        reader that has the whole snapshot also sees the update recorded.
        """
        with self.lock:
            self.version += 1
            snap = self._latest = Snapshot(self.version, self.nbytes, self.chunk_bytes)
        self._enqueue(_Update(grad_sum, samples, lr_factor, snap, on_applied))
        return snap

    def control(self, change: Callable[[Optimizer], None]) -> None:
        """Change the optimizer (learning-rate scale, state) between the updates queued before and after."""
        self._enqueue(change)

    def _enqueue(self, item: "_Update | Callable[[Optimizer], None]") -> None:
        with self._idle:
            self._pending += 1
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
            u = self._queue.get()
            try:
                if isinstance(u, _Update):
                    self._apply(u)
                else:
                    u(self.optimizer)
            except BaseException as e:  # surfaced to every reader of that version
                log.exception("applier: %s failed", u)
                if isinstance(u, _Update):
                    u.snapshot.fail(e)
            finally:
                with self._idle:
                    self._pending -= 1
                    self._idle.notify_all()

    def _apply(self, u: _Update) -> None:
        params, snap = self.params, u.snapshot
        last = params.size - (params.size % (snap.chunk_bytes // 4) or snap.chunk_bytes // 4)
        lr = self.optimizer.apply(params, u.grad, u.lr_factor, grad_scale=1.0 / u.samples,
                                  on_block=lambda end: snap.publish_until(params, min(end, last)))
        self.buffers.put(u.grad)
        if u.on_applied:
            u.on_applied(lr)
        snap.publish_until(params, params.size)
