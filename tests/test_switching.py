"""Live protocol switching on a real loopback PS: no gradient lost or applied twice, LR rescale, events."""

from __future__ import annotations

import time

import numpy as np
import pytest

from switchps.config import ProtocolSpec

G = np.float32


def _switch(c, **fields) -> None:
    with c.engine.cond:
        c.engine.switch(ProtocolSpec.model_validate({**c.engine.protocol.model_dump(), **fields}), "test", "manual")


def _lr_scale(c) -> float:
    c.engine.store.wait_idle(5)
    return c.engine.store.optimizer.lr_scale


def test_bsp_to_asp_completes_the_round_in_flight_then_applies_on_arrival(cluster_factory):
    c = cluster_factory(workers=3, size=2, protocol={"batch": 1})
    w0, w1, w2 = c.workers
    p0 = w0.push_async(np.full(2, 3.0, G), 1)
    time.sleep(0.2)
    _switch(c, name="asp")
    assert c.engine.protocol.name == "bsp", "the switch waits for the round in flight"
    p1 = w1.push_async(np.full(2, 6.0, G), 1)
    r2 = w2.push(np.full(2, 9.0, G), 1)
    r0, r1 = p0.result(), p1.result()
    assert c.engine.store.version == 1 and c.engine.protocol.name == "asp"
    assert {r.order.protocol for r in (r0, r1, r2)} == {"asp"}, "the next work orders carry the new protocol"
    np.testing.assert_allclose(c.params, np.full(2, -6.0))  # (3 + 6 + 9) / 3, one update
    w0.push(np.full(2, 1.0, G), 1)  # ASP: applied on arrival, alone
    assert c.engine.store.version == 2
    assert c.engine.rec.counts["accepted"] == 4 and c.engine.rec.counts["dropped"] == 0
    assert [r["protocol"] for r in c.ps_rows()] == ["bsp", "asp"]
    (sw,) = c.events("switch")
    assert (sw["from"], sw["to"], sw["reason"], sw["policy"], sw["version"]) == ("bsp", "asp", "test", "manual", 1)


def test_asp_to_bsp_enters_in_flight_gradients_into_the_first_round(cluster_factory):
    c = cluster_factory(workers=3, size=2, protocol={"name": "asp", "batch": 1})
    w0, w1, w2 = c.workers
    w0.push(np.full(2, 2.0, G), 1)  # v1 under ASP; w1 and w2 are still computing on v0
    _switch(c, name="bsp")
    p0 = w0.push_async(np.full(2, 1.0, G), 1)   # on v1
    p1 = w1.push_async(np.full(2, 4.0, G), 1)   # on v0: in flight from the ASP phase, joins the round
    time.sleep(0.2)
    assert p0.is_alive() and p1.is_alive(), "the first BSP round waits for everyone"
    r2 = w2.push(np.full(2, 7.0, G), 1)         # on v0 as well
    p0.result(), p1.result()
    assert c.engine.store.version == 2
    assert c.engine.rec.counts["accepted"] == 4 and c.engine.rec.counts["dropped"] == 0, "none lost"
    # 2 under ASP; then (1 + 4 + 7) / 3 with lr x 3 (linear rule: effective batch 1 -> 3)
    np.testing.assert_allclose(c.params, np.full(2, -2.0 - 3 * 4.0))
    last = c.ps_rows()[-1]
    assert (last["protocol"], last["staleness_max"]) == ("bsp", "1"), "their staleness is recorded"
    assert r2.order.protocol == "bsp"
    # after the first round, a stale push is late again (not applied twice)
    late = w1.push(np.full(2, 50.0, G), 1, base_version=1)
    assert not late.reply.applied and c.engine.rec.reasons["dropped:late"] == 1


def test_ssp_holders_are_released_by_a_switch_to_asp(cluster_factory):
    c = cluster_factory(workers=2, size=2, protocol={"name": "ssp", "staleness": 0})
    blocked = c.workers[0].push_async(np.ones(2, G), 1)
    time.sleep(0.3)
    assert blocked.is_alive()
    _switch(c, name="asp")
    assert blocked.result().order.protocol == "asp"


@pytest.mark.parametrize("rule, expected", [("linear", 1 / 3), ("keep", 1.0), (2.0, 0.5)])
def test_lr_rescale_at_a_switch(cluster_factory, rule, expected):
    c = cluster_factory(workers=3, size=2, protocol={"batch": 8}, policy={"on_switch": {"lr": rule}})
    _switch(c, name="asp")  # effective batch 3 x 8 -> 8
    assert _lr_scale(c) == pytest.approx(expected)
    _switch(c, name="bsp")  # and back
    assert _lr_scale(c) == pytest.approx(1.0)


def test_asynchrony_momentum_rule_lowers_momentum_in_asp_and_keeps_the_effective_step(cluster_factory):
    c = cluster_factory(workers=4, size=2, protocol={"batch": 8}, optimizer={"name": "momentum", "learning_rate": 0.1},
                        policy={"on_switch": {"momentum": "asynchrony"}})
    opt = c.engine.store.optimizer
    _switch(c, name="asp")
    # 0.9 explicit - (1 - 1/4) implicit = 0.15; lr: linear 1/4, then x (1 - 0.15) / (1 - 0.9) = 8.5
    assert _lr_scale(c) == pytest.approx(0.25 * 8.5) and opt.hyper["momentum"] == pytest.approx(0.15)
    assert c.events("switch")[-1]["momentum"] == pytest.approx(0.15)
    _switch(c, name="ssp")  # async to async: nothing changes
    assert _lr_scale(c) == pytest.approx(0.25 * 8.5) and opt.hyper["momentum"] == pytest.approx(0.15)
    _switch(c, name="bsp")
    assert _lr_scale(c) == pytest.approx(1.0) and opt.hyper["momentum"] == pytest.approx(0.9)


def test_momentum_is_kept_at_a_switch_by_default(cluster_factory):
    c = cluster_factory(workers=4, size=2, optimizer={"name": "momentum", "learning_rate": 0.1})
    _switch(c, name="asp")
    assert _lr_scale(c) == pytest.approx(0.25) and c.engine.store.optimizer.hyper["momentum"] == 0.9


def test_optimizer_state_kept_by_default_and_reset_on_request(cluster_factory):
    for state, survives in (("keep", True), ("reset", False)):
        c = cluster_factory(workers=1, size=2, protocol={"name": "asp"},
                            optimizer={"name": "momentum", "learning_rate": 0.1},
                            policy={"on_switch": {"optimizer_state": state}})
        c.workers[0].push(np.ones(2, G), 1)
        _switch(c, name="bsp")
        c.engine.store.wait_idle(5)
        velocity = c.engine.store.optimizer.state["momentum"]
        assert bool(np.any(velocity != 0)) is survives


def test_schedule_policy_switches_at_its_fraction(cluster_factory):
    c = cluster_factory(workers=2, size=2, train={"steps": 6}, protocol={"batch": 1},
                        policy={"name": "schedule", "kwargs": {"phases": [{"bsp": 0.5}, {"asp": 0.5}]}})
    for _ in range(3):  # three BSP rounds = 3 of 6 steps
        for r in [w.push_async(np.ones(2, G), 1) for w in c.workers]:
            r.result()
    assert c.engine.protocol.name == "asp"
    while not c.engine.done:
        c.workers[0].push(np.ones(2, G), 1)
    assert [r["protocol"] for r in c.ps_rows()] == ["bsp"] * 3 + ["asp"] * 3
    assert [e["to"] for e in c.events("switch")] == ["asp"]
    from switchps.ps_server.overhead import switch_overheads

    assert switch_overheads(c.engine.switches, c.engine.update_times) and c.engine.rec.counts["dropped"] == 0


def test_elastic_exclusion_uses_stale_contributions(cluster_factory):
    c = cluster_factory(workers=3, size=2, protocol={"batch": 1})
    w0, w1, w2 = c.workers
    with c.engine.cond:
        c.engine.exclude(frozenset({2}), "slow", "manual")
    w0.push_async(np.ones(2, G), 1), w1.push(np.ones(2, G), 1)
    time.sleep(0.1)
    assert c.engine.store.version == 1, "the round did not wait for the excluded worker"
    p2 = w2.push_async(np.full(2, 4.0, G), 1)  # stale (base 0): joins round 2 as a stale contribution
    time.sleep(0.2)
    for r in (w0.push_async(np.ones(2, G), 1), w1.push_async(np.ones(2, G), 1)):
        r.result()
    r2 = p2.result()
    assert r2.reply.applied and r2.reply.staleness == 1
    assert c.engine.store.version == 2 and c.engine.rec.counts["dropped"] == 0
    last = c.ps_rows()[-1]
    assert sorted(last["workers"].split(";")) == ["0", "1", "2"] and last["staleness_max"] == "1"
    with c.engine.cond:
        c.engine.readmit(frozenset({2}), "recovered", "manual")
    assert [e["event"] for e in c.events() if "excluded" in e["event"] or "readmitted" in e["event"]] == \
        ["worker_excluded", "worker_readmitted"]


def test_elastic_stale_contributions_can_be_dropped_and_counted(cluster_factory):
    c = cluster_factory(workers=2, size=2, protocol={"batch": 1}, policy={"on_switch": {"stale": "drop"}})
    with c.engine.cond:
        c.engine.exclude(frozenset({1}), "slow", "manual")
    c.workers[0].push(np.ones(2, G), 1)
    late = c.workers[1].push(np.ones(2, G), 1)  # based on v0, now v1
    assert not late.reply.applied and c.engine.rec.reasons["dropped:excluded_stale"] == 1


def test_per_worker_batches_reach_the_work_orders(cluster_factory):
    c = cluster_factory(workers=2, size=2, protocol={"batch": 8})
    with c.engine.cond:
        c.engine.set_batches({0: 12, 1: 4}, "speeds", "manual")
    r = [w.push_async(np.ones(2, G), 8) for w in c.workers]
    orders = [x.result().order for x in r]
    assert [o.sample_budget for o in orders] == [12, 4]


def test_switch_overhead_subtracts_one_normal_step():
    from switchps.ps_server.overhead import SwitchRecord, switch_overheads

    # decided at 10.0; under ASP updates then come every 0.05 s, but a worker step takes 0.25 s
    asp = SwitchRecord(decided_at=10.0, to="asp", step_s=0.25, first_update_at=10.27)
    updates = [(10.27 + 0.05 * i, "asp") for i in range(12)]
    assert switch_overheads([asp], updates) == [pytest.approx(0.02)]
    # into BSP, a round (0.6 s) is longer than a worker step: that is the normal step
    bsp = SwitchRecord(decided_at=20.0, to="bsp", step_s=0.25, first_update_at=20.7)
    rounds = [(20.7 + 0.6 * i, "bsp") for i in range(5)]
    assert switch_overheads([bsp], rounds) == [pytest.approx(0.1)]
    assert switch_overheads([SwitchRecord(1.0, "asp")], []) == [], "no update yet: nothing to report"


def test_a_normal_step_counts_communication_but_not_barrier_waits(cluster_factory):
    from switchps.protos import switchps_pb2 as pb

    c = cluster_factory(workers=2, size=2)
    # the push took 0.5 s to answer, 0.4 s of it waiting for the round: 0.1 s of communication
    c.engine.observe_step(0, pb.StepStats(compute_s=0.2, sleep_s=0.05, send_s=0.5, wait_s=0.4), 8)
    assert list(c.engine.step_times) == [pytest.approx(0.35)]


def test_a_switch_remembers_the_step_in_force_when_it_was_decided(cluster_factory):
    c = cluster_factory(workers=3, size=2)
    c.engine.step_times.extend([1.0] * 20 + [0.3] * 6)  # the last 2N steps are the recent ones
    _switch(c, name="asp")
    assert c.engine.switches[-1].step_s == pytest.approx(0.3)


def test_lr_scale_after_a_round_trip_does_not_depend_on_who_was_active(cluster_factory):
    c = cluster_factory(workers=8, size=2, protocol={"batch": 4})
    _switch(c, name="asp")
    assert _lr_scale(c) == pytest.approx(1 / 8)
    with c.engine.cond:  # two of eight workers miss a deadline while ASP is in force
        for w in (6, 7):
            c.engine._deactivate(w, "test")
    _switch(c, name="bsp")
    assert _lr_scale(c) == 1.0
    for _ in range(5):  # greedy flips back and forth
        _switch(c, name="asp")
        _switch(c, name="bsp")
    assert _lr_scale(c) == 1.0
    with c.engine.cond:
        c.engine.exclude(frozenset({5}), "slow", "manual")  # elastic exclusion is not a protocol change
    _switch(c, name="asp")
    assert _lr_scale(c) == pytest.approx(1 / 8)


def test_amb_rescales_by_the_samples_its_workers_measurably_did(cluster_factory):
    c = cluster_factory(workers=2, size=2, protocol={"batch": 8})
    _switch(c, name="amb", time_budget_s=0.5)
    assert _lr_scale(c) == 1.0, "nothing measured yet: the nominal batch"
    p = c.workers[0].push_async(np.ones(2, G), 2)
    c.workers[1].push(np.ones(2, G), 6)
    p.result()
    assert _lr_scale(c) == pytest.approx(8 / 16), "a mean of 4 samples per worker-step against 8"
