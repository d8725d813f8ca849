"""One version of the model as the wire chunks its readers stream: published while the update that makes
it runs, or deferred until someone reads them (after an update run inline: see ``store``). Every reader
of a version shares its one ``Snapshot``; no lock is held while the chunks stream out.

Concurrency: chunks are published by whichever thread runs the store's item (the applier, or the event
loop for an inline update), and with a threaded apply (``runtime.ps_threads``) by the apply's threads
too: ``ready`` may run on several threads at once for disjoint element ranges, and each chunk is copied
exactly once, outside the lock, by the thread whose range completes it, so a block's chunk is made
on the core that just updated it. ``publish_until`` is ``ready`` of what it was not given before, for
one thread at a time; a snapshot's elements are each marked ready once, by one of the two. Readers
await the chunks in order on their own event loops, woken with ``call_soon_threadsafe``. ``_lock``
guards the chunks, what is missing of each, the failure, the waiters and whether the snapshot is
deferred; the store's lock (``store_lock``, ``ModelStore.lock``) is held while a deferred snapshot's
values are used or settled. Lock order: the store's lock, then ``_lock``.
"""

from __future__ import annotations

import asyncio
import ctypes
import threading
from typing import AsyncIterator, Callable, TypeVar

import numpy as np

from switchps.protos import wire_dtype
from switchps.protos.codec import COPIES, INLINE_BYTES

T = TypeVar("T")

_api = ctypes.PyDLL(None)  # Python's own C API, with function objects of our own to declare
_new_bytes = _api.PyBytes_FromStringAndSize
_new_bytes.restype, _new_bytes.argtypes = ctypes.py_object, [ctypes.c_void_p, ctypes.c_ssize_t]


def _copy_out(raw: np.ndarray) -> bytes:
    """``raw.tobytes()`` with the GIL released for the copy, so the apply's threads copy their chunks at
    once: a new bytes object, no one else's yet, filled by ``ctypes.memmove`` (a foreign call: ctypes
    releases the GIL), where ``tobytes`` copies holding it (a 2 MiB chunk, page faults included, took
    0.4 ms here: 8 ms of the GIL per 42.7 MB version)."""
    assert raw.dtype == np.uint8 and raw.flags.c_contiguous
    out = _new_bytes(None, raw.size)
    ctypes.memmove(ctypes.c_char_p(out), raw.ctypes.data, raw.size)
    return out


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
        self._total = -(-nbytes // self.chunk_bytes)
        self._chunks: list[bytes | None] = [None] * self._total
        values = nbytes // self._item
        self._missing = [min(self.chunk_values, values - i * self.chunk_values) for i in range(self._total)]
        """Values of each chunk not yet ready."""
        self._until = 0  # elements ``publish_until`` has marked ready
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
        """Publish every whole chunk of float32 ``flat`` that lies below element ``end`` (all of it at the
        end); ``end`` grows from call to call."""
        end = min(end, flat.size)
        if end > self._until:
            self.ready(flat, self._until, end)
            self._until = end

    def ready(self, flat: np.ndarray, start: int, stop: int) -> None:
        """Elements ``[start, stop)`` of float32 ``flat`` hold this version: publish each chunk this
        completes, narrowed to the wire's type as it is made (thread-safe for disjoint ranges: see the
        module docstring)."""
        size = self.chunk_values
        if stop <= start:
            return
        complete = []
        with self._lock:
            for i in range(start // size, -(-stop // size)):
                self._missing[i] -= min(stop, (i + 1) * size) - max(start, i * size)
                if self._missing[i] == 0:
                    complete.append(i)
        for i in complete:
            chunk = self._made(flat[i * size : min((i + 1) * size, flat.size)])
            with self._lock:
                COPIES.add(len(chunk))
                self._chunks[i] = chunk
                self._wake()

    def _made(self, values: np.ndarray) -> bytes:
        """One chunk's bytes: float32 ``values`` as they are, or narrowed (``protos/wire_dtype``)."""
        if self.wire == "float32":
            return _copy_out(values.view(np.uint8))
        out = wire_dtype.empty(values.size, self.wire)
        wire_dtype.narrow(values, out)
        return _copy_out(out.view(np.uint8))

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
                    chunk = self._chunks[i]
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
