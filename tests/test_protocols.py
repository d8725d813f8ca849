"""Protocol semantics on a real loopback PS: BSP, deadlines, backup workers, ASP, SSP, concurrency."""

from __future__ import annotations

import threading
import time

import numpy as np

G = np.float32


def test_bsp_waits_for_all_and_applies_one_update_with_sum_over_samples(cluster_factory):
    c = cluster_factory(workers=3, size=4)
    w0, w1, w2 = c.workers
    grads = [np.full(4, 3.0, G), np.full(4, 10.0, G), np.array([1, 2, 3, 4], G)]
    samples = [3, 5, 2]  # unequal b_i: the update must be ΣG / Σb, not a mean of means
    p0 = w0.push_async(grads[0], samples[0])
    deadline = time.monotonic() + 10
    while c.engine.rec.counts["accepted"] < 1 and time.monotonic() < deadline:  # arrival order: 0, then 1
        time.sleep(0.01)
    p1 = w1.push_async(grads[1], samples[1])
    time.sleep(0.5)
    assert p0.is_alive() and p1.is_alive(), "BSP released before every worker pushed"
    assert c.engine.store.version == 0
    r2 = w2.push(grads[2], samples[2])
    r0, r1 = p0.result(), p1.result()
    assert c.engine.store.version == 1, "exactly one update per round"
    expected = -(grads[0] + grads[1] + grads[2]) / sum(samples)  # sgd, lr = 1
    np.testing.assert_allclose(c.params, expected, rtol=1e-6)
    for r, w in ((r0, w0), (r1, w1), (r2, w2)):
        assert r.reply.applied and r.order.version == 1
        np.testing.assert_array_equal(w.params, c.params)  # released with the new parameters
    rows = c.ps_rows()
    assert len(rows) == 1 and rows[0]["workers"].split(";") == ["0", "1", "2"] and rows[0]["samples"] == "10"


def test_bsp_deadline_drops_silent_worker_which_rejoins(cluster_factory):
    c = cluster_factory(workers=3, size=4, protocol={"deadline_s": 0.6})
    w0, w1, w2 = c.workers
    t0 = time.monotonic()
    p0 = w0.push_async(np.ones(4, G), 1)
    w1.push(np.ones(4, G), 1)
    p0.result()
    assert time.monotonic() - t0 >= 0.5, "round completed before its deadline"
    assert c.engine.store.version == 1 and 2 not in c.engine.active
    assert [e["worker"] for e in c.events("deadline_missed")] == [2]
    # The silent worker's late push (for version 0) is dropped and counted, never applied...
    late = w2.push(np.full(4, 100.0, G), 1)
    assert not late.reply.applied and late.order.version == 1
    assert c.engine.rec.reasons["dropped:late"] == 1
    np.testing.assert_allclose(c.params, -np.ones(4))
    # ... and it rejoins: the next round needs all three again.
    assert 2 in c.engine.active and [e["worker"] for e in c.events("worker_rejoined")] == [2]
    p0, p1 = w0.push_async(np.ones(4, G), 1), w1.push_async(np.ones(4, G), 1)
    time.sleep(0.3)
    assert p0.is_alive() and c.engine.store.version == 1
    w2.push(np.ones(4, G), 1)
    p0.result(), p1.result()
    assert c.engine.store.version == 2


def test_backup_workers_drop_exactly_k_per_round(cluster_factory):
    c = cluster_factory(workers=4, size=4, protocol={"backup_workers": 1})
    fast, slow = c.workers[:3], c.workers[3]
    for round_ in range(3):
        for r in [w.push_async(np.ones(4, G), 2) for w in fast]:
            r.result()
        assert c.engine.store.version == round_ + 1, "round must complete on N-k pushes"
        late = slow.push(np.full(4, 50.0, G), 2)  # computed on the previous version
        assert not late.reply.applied
        slow.version = late.order.version
    assert c.engine.rec.reasons["dropped:backup"] == 3
    np.testing.assert_allclose(c.params, np.full(4, -1.5))  # 3 rounds of 3/6; late ones never landed


def test_asp_applies_on_arrival_with_staleness(cluster_factory):
    c = cluster_factory(workers=2, size=4, protocol={"name": "asp"})
    w0, w1 = c.workers
    r = w0.push(np.ones(4, G), 1)
    assert c.engine.store.version == 1 and r.order.version == 1 and r.reply.staleness == 0
    np.testing.assert_array_equal(w0.params, np.full(4, -1.0))
    r = w1.push(np.ones(4, G), 2)  # still based on version 0
    assert r.reply.staleness == 1 and c.engine.store.version == 2
    np.testing.assert_allclose(c.params, np.full(4, -1.5))
    rows = c.ps_rows()
    assert [row["staleness_max"] for row in rows] == ["0", "1"]


def test_asp_staleness_aware_lr(cluster_factory):
    c = cluster_factory(workers=2, size=2, protocol={"name": "asp", "staleness_lr": True})
    w0, w1 = c.workers
    w0.push(np.ones(2, G), 1)
    w1.push(np.ones(2, G), 1)  # staleness 1: lr / 2
    np.testing.assert_allclose(c.params, np.full(2, -1.5))


def test_ssp_blocks_s_plus_one_ahead_and_releases(cluster_factory):
    c = cluster_factory(workers=2, size=2, protocol={"name": "ssp", "staleness": 1})
    fast, slow = c.workers
    fast.push(np.ones(2, G), 1)  # clock 1, slowest 0: 1 ahead is allowed
    blocked = fast.push_async(np.ones(2, G), 1)  # clock 2: s+1 ahead -> held
    time.sleep(0.5)
    assert blocked.is_alive(), "SSP let a worker run s+1 clocks ahead"
    assert c.engine.store.version == 2, "SSP still applies on arrival"
    slow.push(np.ones(2, G), 1)
    r = blocked.result()
    assert r.reply.wait_s >= 0.4
    assert c.engine.store.version == 3


def test_ssp_zero_behaves_like_bsp_for_workers(cluster_factory):
    c = cluster_factory(workers=3, size=2, protocol={"name": "ssp", "staleness": 0})
    p = [w.push_async(np.ones(2, G), 1) for w in c.workers[:2]]
    time.sleep(0.4)
    assert all(x.is_alive() for x in p), "s=0 released a worker before the round was complete"
    c.workers[2].push(np.ones(2, G), 1)
    for x in p:
        x.result()


def test_concurrent_asp_pushes_lose_no_update(cluster_factory):
    threads, per_thread = 8, 200
    c = cluster_factory(workers=threads, size=64, protocol={"name": "asp"})
    errors = []

    def hammer(w):
        try:
            for _ in range(per_thread):
                w.push(np.ones(64, G), 1)
        except Exception as e:  # pragma: no cover - reported below
            errors.append(e)

    ts = [threading.Thread(target=hammer, args=(w,)) for w in c.workers]
    for t in ts:
        t.start()
    for t in ts:
        t.join()
    assert not errors
    assert c.engine.store.version == threads * per_thread
    np.testing.assert_array_equal(c.params, np.full(64, -float(threads * per_thread)))
    assert c.engine.rec.counts["accepted"] == threads * per_thread


def test_time_limit_mid_round_applies_the_partial_round(cluster_factory):
    c = cluster_factory(workers=3, size=2, train={"seconds": 0.8})
    p0 = c.workers[0].push_async(np.ones(2, G), 1)  # the other two never push
    time.sleep(1.0)
    c.engine.tick()
    r = p0.result()
    assert r.order.stop
    assert c.engine.store.version == 1 and c.engine.samples_applied == 1
    c.engine.store.wait_idle(5)
    np.testing.assert_allclose(c.params, -np.ones(2))
    assert c.engine.rec.counts["accepted"] == 1 and c.engine.rec.counts["dropped"] == 0


def test_bsp_state_is_the_mean_of_the_rounds_contributors_and_the_optimizer_never_touches_it(cluster_factory):
    c = cluster_factory(workers=2, size=2, state=2, protocol={"batch": 4})
    w0, w1 = c.workers
    p0 = w0.push_async(np.array([1, 1, 2, 4], G), 2)  # Σ gradient over 2 samples, then this worker's state
    w1.push(np.array([3, 3, 4, 8], G), 2)
    p0.result()
    np.testing.assert_allclose(c.params, [-1, -1, 3, 6])  # gradient (1 + 3) / 4 with lr 1; state (2+4)/2, (4+8)/2
    np.testing.assert_array_equal(w1.params, c.params)  # the reply carries the new state too
    assert c.engine.store.optimizer.size == 2, "the optimizer holds slots for the trainable part only"


def test_asp_state_is_the_latest_pushers(cluster_factory):
    c = cluster_factory(workers=2, size=2, state=2, protocol={"name": "asp"})
    c.workers[0].push(np.array([1, 1, 5, 5], G), 1)
    c.workers[1].push(np.array([1, 1, 7, 9], G), 1)
    np.testing.assert_allclose(c.params, [-2, -2, 7, 9])
