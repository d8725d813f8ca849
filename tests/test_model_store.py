"""The model store: one writer at a time (the applier, or the submitting thread for a small model), snapshots
published chunk by chunk while the apply runs."""

from __future__ import annotations

import threading
import time

import numpy as np
import pytest

from switchps.protos.layout import make_layout
from switchps.ps_server.model import ModelStore, Snapshot
from switchps.ps_server.optimizers import make_optimizer
from switchps.ps_server.schedules import make_schedule

CHUNK = 4096  # bytes = 1024 floats


def _store(size: int) -> ModelStore:
    """A store that updates a model of at most 64 KiB on the submitting thread (the default is 4 MiB)."""
    store = ModelStore(lambda n: make_optimizer("sgd", n, make_schedule("constant", 1.0)), chunk_bytes=CHUNK,
                       inline_bytes=2**16)
    store.initialize(make_layout([("w", (size,))]), np.zeros(size, np.float32))
    return store


def test_snapshot_readers_wait_for_each_chunk_in_order():
    flat = np.arange(20000, dtype=np.float32)  # 80 KB: streamed in 20 chunks
    snap = Snapshot(1, flat.nbytes, CHUNK)
    got: list[bytes] = []
    reader = threading.Thread(target=lambda: got.extend(snap.chunks()))
    reader.start()
    snap.publish_until(flat, 1500)  # only the first chunk (elements 0..1023) is whole
    time.sleep(0.2)
    assert len(got) == 1 and reader.is_alive()
    snap.publish_until(flat, flat.size)
    reader.join(5)
    assert np.array_equal(np.frombuffer(b"".join(got), np.float32), flat)


def test_failed_update_is_raised_to_readers():
    snap = Snapshot(3, 8192, CHUNK)
    snap.fail(ValueError("boom"))
    with pytest.raises(RuntimeError, match="version 3"):
        list(snap.chunks())


def test_submit_reserves_versions_in_order_and_applies_all():
    store = _store(5000)
    applied: list[float] = []
    for i in range(5):
        store.join(i, np.full(5000, 2.0, np.float32))
    snaps = [store.submit(i, 2, on_applied=applied.append) for i in range(5)]
    assert [s.version for s in snaps] == [1, 2, 3, 4, 5] and store.version == 5
    last = b"".join(snaps[-1].chunks())
    assert store.wait_idle(5)
    np.testing.assert_array_equal(np.frombuffer(last, np.float32), np.full(5000, -5.0))
    np.testing.assert_array_equal(np.frombuffer(b"".join(snaps[1].chunks()), np.float32), np.full(5000, -2.0))
    assert applied == [1.0] * 5


def test_update_is_recorded_before_its_last_chunk_is_published():
    store = _store(20000)
    seen_complete_at_record: list[int] = []
    holder: dict[str, Snapshot] = {}

    def on_applied(lr: float) -> None:
        seen_complete_at_record.append(len(holder["snap"]._chunks))

    store.join(0, np.ones(20000, np.float32))
    holder["snap"] = store.submit(0, 1, on_applied=on_applied)
    list(holder["snap"].chunks())
    assert seen_complete_at_record == [19]  # 20 chunks in all: the last waits for the record


def test_a_small_models_items_run_on_the_submitting_thread_and_a_large_ones_on_the_applier():
    ran_on: list[str] = []
    for size in (1000, 20000):  # 4 KB: inline; 80 KB: above the store's inline_bytes
        store = _store(size)
        store.join(0, np.ones(size, np.float32))
        snap = store.submit(0, 1, on_applied=lambda lr: ran_on.append(threading.current_thread().name))
        assert store.wait_idle(5)
        np.testing.assert_array_equal(np.frombuffer(b"".join(snap.chunks()), np.float32), np.full(size, -1.0))
    assert ran_on == [threading.current_thread().name, "switchps-applier"]


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
    np.testing.assert_array_equal(np.frombuffer(b"".join(snap.chunks()), np.float32), np.full(1000, -1.0))
