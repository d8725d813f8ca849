"""The protocol core driven by the real gRPC service on loopback: held replies, timers, concurrency, state.

The semantics of each protocol and switch are tested on the core itself (test_core*.py); these check
what only a real server shows.
"""

from __future__ import annotations

import threading

import numpy as np

from conftest import wait_until

pytest_plugins = ["cluster"]  # cluster_factory: a PS on loopback

G = np.float32


def test_a_bsp_round_holds_each_reply_until_the_last_push_and_sends_the_new_version(cluster_factory):
    c = cluster_factory(workers=3, size=4)
    w0, w1, w2 = c.workers
    p0 = w0.push_async(np.full(4, 3.0, G), 3)
    wait_until(lambda: c.rec.counts["accepted"] == 1)
    p1 = w1.push_async(np.full(4, 10.0, G), 5)
    wait_until(lambda: c.rec.counts["accepted"] == 2)
    assert p0.is_alive() and p1.is_alive() and c.core.version == 0, "released before every worker pushed"
    w2.push(np.array([1, 2, 3, 4], G), 2)
    for r, w in ((p0.result(), w0), (p1.result(), w1)):
        assert r.reply.applied and r.order.version == 1
        np.testing.assert_array_equal(w.params, c.params)  # released with the new parameters
    np.testing.assert_allclose(c.params, -(np.array([3, 3, 3, 3]) + 10 + np.array([1, 2, 3, 4])) / 10, rtol=1e-6)
    rows = c.ps_rows()
    assert len(rows) == 1 and rows[0]["workers"].split(";") == ["0", "1", "2"] and rows[0]["samples"] == "10"


def test_the_services_timer_ends_a_time_limited_run_mid_round(cluster_factory):
    c = cluster_factory(workers=3, size=2, train={"seconds": 0.8})
    r = c.workers[0].push_async(np.ones(2, G), 1).result(timeout=10)  # the other two never push
    assert r.order.stop and c.core.version == 1 and c.core.samples == 1
    c.store.wait_idle(5)
    np.testing.assert_allclose(c.params, -np.ones(2))
    assert c.rec.counts["accepted"] == 1 and c.rec.counts["dropped"] == 0 and c.ps.finished.is_set()


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
    assert c.core.version == threads * per_thread
    c.store.wait_idle(5)
    np.testing.assert_array_equal(c.params, np.full(64, -float(threads * per_thread)))
    assert c.rec.counts["accepted"] == threads * per_thread


def test_a_policy_switch_reaches_the_workers_and_the_record(cluster_factory):
    c = cluster_factory(workers=2, size=2, train={"steps": 6}, protocol={"batch": 1},
                        policy={"name": "schedule", "kwargs": {"phases": [{"bsp": 0.5}, {"asp": 0.5}]}})
    for _ in range(3):  # three BSP rounds = 3 of 6 steps
        replies = [r.result() for r in [w.push_async(np.ones(2, G), 1) for w in c.workers]]
    assert {r.order.protocol for r in replies} == {"asp"}, "the round's replies carry the new protocol"
    while not c.core.done:
        c.workers[0].push(np.ones(2, G), 1)
    assert [r["protocol"] for r in c.ps_rows()] == ["bsp"] * 3 + ["asp"] * 3
    assert [e["to"] for e in c.events("switch")] == ["asp"] and c.rec.counts["dropped"] == 0


def test_bsp_state_is_the_mean_of_the_rounds_contributors_and_the_optimizer_never_touches_it(cluster_factory):
    c = cluster_factory(workers=2, size=2, state=2, protocol={"batch": 4})
    w0, w1 = c.workers
    p0 = w0.push_async(np.array([1, 1, 2, 4], G), 2)  # Σ gradient over 2 samples, then this worker's state
    w1.push(np.array([3, 3, 4, 8], G), 2)
    p0.result()
    np.testing.assert_allclose(c.params, [-1, -1, 3, 6])  # gradient (1 + 3) / 4 with lr 1; state (2+4)/2, (4+8)/2
    np.testing.assert_array_equal(w1.params, c.params)  # the reply carries the new state too
    assert c.store.optimizer.size == 2, "the optimizer holds slots for the trainable part only"


def test_asp_state_is_the_latest_pushers(cluster_factory):
    c = cluster_factory(workers=2, size=2, state=2, protocol={"name": "asp"})
    c.workers[0].push(np.array([1, 1, 5, 5], G), 1)
    c.workers[1].push(np.array([1, 1, 7, 9], G), 1)
    c.store.wait_idle(5)
    np.testing.assert_allclose(c.params, [-2, -2, 7, 9])
