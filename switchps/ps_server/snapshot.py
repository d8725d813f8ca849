"""One version of the model as the wire chunks its readers stream: published while the update that makes
it runs, or deferred until someone reads them (after an update run inline: see ``store``). Every reader
of a version shares its one ``Snapshot``; no lock is held while the chunks stream out.

Concurrency: chunks are published by whichever thread runs the store's item (the applier, or the event
loop for an inline update); readers await them on their own event loops, woken with
``call_soon_threadsafe``. ``_lock`` guards the chunks, the failure, the waiters and whether the
snapshot is deferred; the store's lock (``store_lock``, ``ModelStore.lock``) is held while a deferred
snapshot's values are used or settled. Lock order: the store's lock, then ``_lock``.
"""

from __future__ import annotations

import asyncio
import threading
from typing import AsyncIterator, Callable, TypeVar

import numpy as np

from switchps.protos import wire_dtype
from switchps.protos.codec import COPIES, INLINE_BYTES

T = TypeVar("T")


class Snapshot:
    """One version's values as wire chunks, which asyncio readers await (``achunks``) as they are published,
    woken through their event loop.

    A deferred snapshot (``defer``) has no chunks yet: its values are the store's own until the store's
    next update, so a reply may use them in place (``deferred``); a reader of chunks has them made first.
    """

    def __init__(self, version: int, nbytes: int, chunk_bytes: int, store_lock: threading.Lock | None = None,
                 wire: str = "float32") -> None:
        """``nbytes``: the values' on the wire, in ``wire`` values (``protos/wire_dtype``): each chunk is
        narrowed once, as it is made, for every reader of this version."""
        self.version = version
        self.nbytes = nbytes
        self.wire, self._item = wire, wire_dtype.itemsize(wire)
        if wire != "float32":  # chunks of whole values
            chunk_bytes -= chunk_bytes % self._item
        self.chunk_bytes = max(chunk_bytes, nbytes) if nbytes <= INLINE_BYTES else chunk_bytes  # inline = 1 chunk
        self.chunk_values = self.chunk_bytes // self._item
        """Values per chunk."""
        self._chunks: list[bytes] = []
        self._total = -(-nbytes // self.chunk_bytes)
        self._failed: BaseException | None = None
        self._lock = threading.Lock()  # guards the chunks, the failure, the waiters and ``_source`` is set
        self._waiters: list[tuple[asyncio.AbstractEventLoop, asyncio.Future[None]]] = []
        self._store_lock = store_lock or threading.Lock()  # held while deferred values are used or change
        self._source: np.ndarray | None = None  # deferred: the store's values

    @classmethod
    def of(cls, version: int, flat: np.ndarray, chunk_bytes: int, wire: str = "float32") -> "Snapshot":
        snap = cls(version, wire_dtype.wire_nbytes(flat.size, wire), chunk_bytes, wire=wire)
        snap.publish_until(flat, flat.size)
        return snap

    def publish_until(self, flat: np.ndarray, end: int) -> None:
        """Publish every whole chunk of float32 ``flat`` that lies below element ``end`` (all of it at the end)."""
        if self.wire != "float32":
            return self._publish_narrow(flat, end)
        raw = flat.view(np.uint8)
        limit = raw.size if end >= flat.size else end * 4
        while len(self._chunks) < self._total:
            lo = len(self._chunks) * self.chunk_bytes
            hi = min(lo + self.chunk_bytes, raw.size)
            if hi > limit:
                return
            self._publish(raw[lo:hi].tobytes())

    def _publish_narrow(self, flat: np.ndarray, end: int) -> None:
        """``publish_until`` for a narrow wire: each chunk's values narrowed straight into its bytes."""
        step = self.chunk_values
        limit = min(end, flat.size)
        while len(self._chunks) < self._total:
            lo = len(self._chunks) * step
            hi = min(lo + step, flat.size)
            if hi > limit:
                return
            out = wire_dtype.empty(hi - lo, self.wire)
            wire_dtype.narrow(flat[lo:hi], out)
            self._publish(out.tobytes())

    def _publish(self, chunk: bytes) -> None:
        COPIES.add(len(chunk))
        with self._lock:
            self._chunks.append(chunk)
            self._wake()

    def defer(self, values: np.ndarray) -> None:
        """Make no chunks yet: ``values`` hold this version until the store settles it (under its lock)."""
        with self._lock:
            self._source = values
            self._wake()  # a reader already waiting makes the chunks itself

    def deferred(self, use: Callable[[np.ndarray], T]) -> T | None:
        """``use`` of a deferred snapshot's values, kept this version's meanwhile; None, not calling it, if
        the snapshot is not deferred."""
        with self._store_lock:
            return None if self._source is None else use(self._source)

    def settle(self) -> None:
        """A deferred snapshot's chunks, made now (for a reader, or before the store's values change)."""
        with self._store_lock:
            values, self._source = self._source, None
            if values is not None:
                self.publish_until(values, values.size)

    def fail(self, error: BaseException) -> None:
        with self._lock:
            self._failed = error
            self._wake()

    def _wake(self) -> None:
        """Caller holds ``_lock``."""
        for loop, fut in self._waiters:
            loop.call_soon_threadsafe(_resolve, fut)
        self._waiters = []

    async def achunks(self) -> AsyncIterator[bytes]:
        """The chunks in order, awaiting any not yet published; raises if the update failed."""
        loop = asyncio.get_running_loop()
        for i in range(self._total):
            while True:
                with self._lock:
                    if self._failed is not None:
                        raise RuntimeError(f"update to version {self.version} failed") from self._failed
                    chunk = self._chunks[i] if i < len(self._chunks) else None
                    deferred = self._source is not None
                    if chunk is None and not deferred:
                        fut: asyncio.Future[None] = loop.create_future()
                        self._waiters.append((loop, fut))
                if chunk is not None:
                    break
                if deferred:
                    self.settle()
                else:
                    await fut
            yield chunk


def _resolve(fut: asyncio.Future[None]) -> None:
    if not fut.done():
        fut.set_result(None)
