"""The model store: one writer at a time (the applier, or the submitting thread for a small model), snapshots
published chunk by chunk while the apply runs, or deferred until the next update for a small model."""

from __future__ import annotations

import asyncio
import gc
import threading

import numpy as np
import pytest

from conftest import wait_until
from switchps.protos.codec import COPIES
from switchps.protos.layout import make_layout
from switchps.ps_server.snapshot import Snapshot
from switchps.ps_server.store import ModelStore
from switchps.optim import optimizers
from switchps.optim.optimizers import make_optimizer
from switchps.optim.schedules import make_schedule

CHUNK = 4096  # bytes = 1024 floats


def _chunks(snap: Snapshot, got: list[bytes] | None = None) -> list[bytes]:
    """A snapshot's chunks, read as the PS's handlers read them (on an event loop of this thread's own),
    each appended to ``got`` as it comes."""
    got = [] if got is None else got

    async def read() -> None:
        async for chunk in snap.achunks():
            got.append(chunk)
    asyncio.run(read())
    return got


def _values(snap: Snapshot) -> np.ndarray:
    return np.frombuffer(b"".join(_chunks(snap)), np.float32)


def _published(snap: Snapshot) -> int:
    return sum(c is not None for c in snap._chunks)


def _store(size: int, threads: int = 1) -> ModelStore:
    """A store that updates a model of at most 64 KiB on the submitting thread (the default is 4 MiB)."""
    store = ModelStore(lambda n: make_optimizer("sgd", n, make_schedule("constant", 1.0)), chunk_bytes=CHUNK,
                       inline_bytes=2**16, threads=threads)
    store.initialize(make_layout([("w", (size,))]), np.zeros(size, np.float32))
    return store


def test_snapshot_readers_wait_for_each_chunk_in_order():
    flat = np.arange(20000, dtype=np.float32)  # 80 KB: streamed in 20 chunks
    snap = Snapshot(1, flat.nbytes, CHUNK)
    got: list[bytes] = []
    reader = threading.Thread(target=_chunks, args=(snap, got))
    reader.start()
    snap.publish_until(flat, 1500)  # only the first chunk (elements 0..1023) is whole
    wait_until(lambda: len(got) == 1 and bool(snap._waiters), what="the reader to wait for chunk 1")
    assert len(got) == 1 and reader.is_alive()
    snap.publish_until(flat, flat.size)
    reader.join(5)
    assert np.array_equal(np.frombuffer(b"".join(got), np.float32), flat)


def test_chunks_completed_out_of_order_on_several_threads_are_each_copied_once():
    flat = np.arange(20000, dtype=np.float32)  # 20 chunks of 1024 elements
    snap = Snapshot(1, flat.nbytes, CHUNK)
    ranges = [(i, min(i + 700, flat.size)) for i in range(0, flat.size, 700)]  # across chunk boundaries
    got: list[bytes] = []
    reader = threading.Thread(target=_chunks, args=(snap, got))
    reader.start()
    snap.ready(flat, *ranges[1])  # elements 700..1399: chunk 0 still lacks 0..699
    wait_until(lambda: bool(snap._waiters), what="the reader to wait for chunk 0")
    assert got == [] and _published(snap) == 0
    made = COPIES.bytes_copied
    rest = ranges[:1] + ranges[2:]
    threads = [threading.Thread(target=lambda part=part: [snap.ready(flat, *r) for r in part])
               for part in (rest[::-1][0::3], rest[::-1][1::3], rest[::-1][2::3])]  # from the end, interleaved
    for t in threads:
        t.start()
    for t in threads:
        t.join(5)
    reader.join(5)
    assert np.array_equal(np.frombuffer(b"".join(got), np.float32), flat)
    assert COPIES.bytes_copied - made == flat.nbytes, "every chunk copied exactly once"


def test_failed_update_is_raised_to_readers():
    snap = Snapshot(3, 8192, CHUNK)
    snap.fail(ValueError("boom"))
    with pytest.raises(RuntimeError, match="version 3"):
        _chunks(snap)


def test_submit_reserves_versions_in_order_and_applies_all():
    store = _store(5000)
    applied: list[float] = []
    for i in range(5):
        store.join(i, np.full(5000, 2.0, np.float32))
    snaps = [store.submit(i, 2, on_applied=applied.append) for i in range(5)]
    assert [s.version for s in snaps] == [1, 2, 3, 4, 5] and store.version == 5
    last = _values(snaps[-1])
    assert store.wait_idle(5)
    np.testing.assert_array_equal(last, np.full(5000, -5.0))
    np.testing.assert_array_equal(_values(snaps[1]), np.full(5000, -2.0))
    assert applied == [1.0] * 5


@pytest.mark.parametrize("threads", [1, 3])
def test_update_is_recorded_before_its_last_chunk_is_published(monkeypatch, threads):
    monkeypatch.setattr(optimizers, "BLOCK", 1500)  # blocks across chunks, on several threads
    store = _store(20000, threads)
    seen_complete_at_record: list[int] = []
    holder: dict[str, Snapshot] = {}

    def on_applied(lr: float) -> None:
        seen_complete_at_record.append(_published(holder["snap"]))

    store.join(0, np.ones(20000, np.float32))
    holder["snap"] = store.submit(0, 1, on_applied=on_applied)
    _chunks(holder["snap"])
    assert seen_complete_at_record == [19]  # 20 chunks in all: the last waits for the record


def test_a_small_models_items_run_on_the_submitting_thread_and_a_large_ones_on_the_applier():
    ran_on: list[str] = []
    for size in (1000, 20000):  # 4 KB: inline; 80 KB: above the store's inline_bytes
        store = _store(size)
        store.join(0, np.ones(size, np.float32))
        snap = store.submit(0, 1, on_applied=lambda lr: ran_on.append(threading.current_thread().name))
        assert store.wait_idle(5)
        np.testing.assert_array_equal(_values(snap), np.full(size, -1.0))
    assert ran_on == [threading.current_thread().name, "switchps-applier"]


@pytest.mark.parametrize("name", ["sgd", "adam"])
def test_a_threaded_store_publishes_the_same_bytes_as_one_thread(monkeypatch, name):
    monkeypatch.setattr(optimizers, "BLOCK", 1500)
    size, rng = 30001, np.random.default_rng(1)
    grads = rng.standard_normal((3, 3, size)).astype(np.float32)  # 3 versions of 3 pushes
    layout = make_layout([("w", (size - 7,))], [("moving_mean", (7,))])
    published = []
    for threads in (1, 4):
        store = ModelStore(lambda n: make_optimizer(name, n, make_schedule("constant", 0.1)), chunk_bytes=CHUNK,
                           inline_bytes=0, threads=threads)
        store.initialize(layout, np.zeros(size, np.float32))
        for version, pushes in enumerate(grads):
            for g in pushes:
                store.join(version, g.copy())
            snap = store.submit(version, 10, contributors=3)
        published.append(np.frombuffer(b"".join(_chunks(snap)), np.uint32))
        assert store.wait_idle(5)
    assert np.array_equal(*published)


def test_a_small_models_item_never_overtakes_one_queued_before_it():
    store = _store(1000)
    order: list[str] = []
    release = threading.Event()
    store.inline_bytes = 0  # this one goes to the applier, and holds it
    store.control(lambda _: (release.wait(5), order.append("control")))
    store.inline_bytes = 2**16
    store.join(0, np.ones(1000, np.float32))
    snap = store.submit(0, 1, on_applied=lambda lr: order.append("update"))
    assert order == [], "queued behind the held item, not run on this thread"
    release.set()
    assert store.wait_idle(5) and order == ["control", "update"]
    np.testing.assert_array_equal(_values(snap), np.full(1000, -1.0))


def _update(store: ModelStore, size: int, version: int) -> Snapshot:
    """Submit an update of ``size`` gradient ones (SGD at rate 1: every value drops by 1)."""
    store.join(version, np.ones(size, np.float32))
    return store.submit(version, 1)


def test_an_inline_update_defers_its_chunks_and_a_reply_copies_its_values_straight_out():
    store = _store(1000)
    made = COPIES.bytes_copied
    snap = _update(store, 1000, 1)
    out = np.zeros(1000, np.float32)
    assert snap.deferred(lambda values: np.copyto(out, values) or True)
    np.testing.assert_array_equal(out, np.full(1000, -1.0))
    assert _published(snap) == 0 and COPIES.bytes_copied == made, "no chunks were made"


def test_a_deferred_snapshot_still_held_keeps_its_version_when_the_next_update_comes():
    store = _store(1000)
    held = _update(store, 1000, 1)
    _update(store, 1000, 2)
    assert held.deferred(lambda values: values) is None, "settled: it no longer reads the store's values"
    np.testing.assert_array_equal(_values(held), np.full(1000, -1.0))
    np.testing.assert_array_equal(_values(store.snapshot()), np.full(1000, -2.0))


def test_a_deferred_snapshot_nobody_holds_is_dropped_without_its_chunks_being_made():
    store = _store(1000)
    _update(store, 1000, 1)
    gc.collect()
    made = COPIES.bytes_copied
    snap = _update(store, 1000, 2)  # the store's latest: version 1's snapshot is no one's now
    assert COPIES.bytes_copied == made and snap.version == 2


def test_a_reader_already_waiting_makes_the_chunks_of_a_snapshot_deferred_after_it_began():
    values = np.arange(3000, dtype=np.float32)  # 3 chunks
    snap = Snapshot(1, values.nbytes, CHUNK)
    got: list[bytes] = []
    reader = threading.Thread(target=lambda: got.extend(_chunks(snap)))
    reader.start()
    wait_until(lambda: bool(snap._waiters), what="the reader to wait for chunk 0")
    snap.defer(values)
    reader.join(5)
    assert not reader.is_alive()
    np.testing.assert_array_equal(np.frombuffer(b"".join(got), np.float32), values)
