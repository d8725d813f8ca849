"""Live switching, learning-rate rules and the policy flow, on the core with a fake clock."""

from __future__ import annotations

import json

import itertools

import numpy as np
import pytest

from harness import Harness
from switchps.policies.base import ClusterView, Decision, Policy
from switchps.policies.schedule import Schedule
from switchps.ps_server.core.events import StepReport

PROTOCOLS = {"bsp": {}, "fmb": {}, "amb": {"time_budget_s": 1.0}, "asp": {}, "ssp": {"staleness": 1},
             "kasync": {"k": 2}, "timed": {"window_s": 1.0}, "backup": {"backup_workers": 1}}


def test_bsp_to_asp_completes_the_round_in_flight_then_applies_on_arrival():
    h = Harness(workers=3, protocol={"batch": 1})
    a = h.push(0, 3.0)
    h.switch(name="asp")
    assert h.core.spec.name == "bsp" and not h.released(a), "the switch waits for the round in flight"
    b, c = h.push(1, 6.0), h.push(2, 9.0)
    assert h.core.version == 1 and h.core.spec.name == "asp"
    assert {h.releases[i].order.protocol for i in (a, b, c)} == {"asp"}, "the next orders carry the new protocol"
    np.testing.assert_allclose(h.params, -6.0)  # (3 + 6 + 9) / 3, one update
    h.push(0, 1.0)
    assert h.core.version == 2 and h.protocols_applied() == ["bsp", "asp"]
    (sw,) = h.events("switch")
    assert (sw["from"], sw["to"], sw["reason"], sw["policy"], sw["version"]) == ("bsp", "asp", "test", "manual", 1)
    h.check_books()


def test_asp_to_bsp_enters_gradients_in_flight_into_the_first_round():
    h = Harness(workers=3, protocol={"name": "asp", "batch": 1})
    h.push(0, 2.0)  # v1 under ASP; workers 1 and 2 still compute on v0
    h.switch(name="bsp")
    a = h.push(0, 1.0)
    b = h.push(1, 4.0, base=0)  # in flight from the ASP phase: joins the round
    assert not h.released(a) and not h.released(b), "the first BSP round waits for everyone"
    h.push(2, 7.0, base=0)
    assert h.core.version == 2 and h.counts["dropped"] == 0
    np.testing.assert_allclose(h.params, -2.0 - 3 * 4.0)  # linear rule: effective batch 1 -> 3
    assert max(m.staleness for m in h.applied[-1].aggregate.members) == 1, "their staleness is recorded"
    late = h.push(1, 50.0, base=1)  # after the first round a stale push is late again
    assert not h.releases[late].outcome.applied and h.counts["dropped:late"] == 1
    h.check_books()


def test_ssp_holders_are_released_by_a_switch_to_asp():
    h = Harness(workers=2, protocol={"name": "ssp", "staleness": 0})
    held = h.push(0, 1.0)
    assert not h.released(held)
    h.switch(name="asp")
    assert h.releases[held].order.protocol == "asp"


@pytest.mark.parametrize("before, after", [pair for pair in itertools.permutations(PROTOCOLS, 2)])
def test_every_switch_direction_loses_no_gradient_and_applies_none_twice(before, after):
    h = Harness(workers=3, protocol={"name": before, **PROTOCOLS[before]})
    h.push(0, 1.0)
    h.push(1, 1.0)
    h.switch(name=after, **PROTOCOLS[after])
    for w in range(3):
        h.push(w, 1.0, base=0)
    h.advance(2.0)  # windows and deadlines pass
    for w in range(3):
        h.push(w, 1.0)
    h.advance(40.0)
    h.switch(name=before, **PROTOCOLS[before])  # and back, flushing whatever the second held
    h.advance(40.0)
    h.check_books()


@pytest.mark.parametrize("rule, expected", [("linear", 1 / 3), ("keep", 1.0), (2.0, 0.5)])
def test_lr_rescale_at_a_switch(rule, expected):
    h = Harness(workers=3, on_switch={"lr": rule})
    h.switch(name="asp")  # effective batch 3 x 8 -> 8
    assert h.lr_scale == pytest.approx(expected)
    h.switch(name="bsp")
    assert h.lr_scale == pytest.approx(1.0)


def test_lr_scale_after_a_round_trip_does_not_depend_on_who_was_active():
    h = Harness(workers=8, protocol={"deadline_s": 1.0})
    h.switch(name="asp")
    assert h.lr_scale == pytest.approx(1 / 8)
    h.core.members.active -= {6, 7}  # two of eight miss a deadline meanwhile
    h.switch(name="bsp")
    assert h.lr_scale == 1.0
    for _ in range(5):  # greedy flips
        h.switch(name="asp")
        h.switch(name="bsp")
    assert h.lr_scale == 1.0
    h.run(h.core.decide(Decision("slow", exclude=frozenset({5})), "manual", h.now))
    h.switch(name="asp")
    assert h.lr_scale == pytest.approx(1 / 8), "an exclusion is not a protocol change"


def test_amb_rescales_by_the_samples_its_workers_measurably_did():
    h = Harness(workers=2)
    h.switch(name="amb", time_budget_s=0.5)
    assert h.lr_scale == 1.0, "nothing measured under AMB yet: the nominal batch"
    h.push(0, 1.0, samples=2)
    h.push(1, 1.0, samples=6)
    assert h.lr_scale == pytest.approx(8 / 16), "a mean of 4 samples per worker-step against 8"


def test_asynchrony_momentum_rule_and_optimizer_state():
    h = Harness(workers=4, momentum=0.9, on_switch={"momentum": "asynchrony", "optimizer_state": "reset"})
    h.switch(name="asp")  # 0.9 - (1 - 1/4) = 0.15; lr: linear 1/4, then (1 - 0.15) / (1 - 0.9) = 8.5
    assert h.lr_scale == pytest.approx(0.25 * 8.5) and h.momentum == pytest.approx(0.15)
    assert h.events("switch")[-1]["momentum"] == pytest.approx(0.15)
    h.switch(name="ssp")  # asynchronous to asynchronous: nothing changes
    assert h.lr_scale == pytest.approx(0.25 * 8.5) and h.momentum == pytest.approx(0.15)
    h.switch(name="bsp")
    assert h.lr_scale == pytest.approx(1.0) and h.momentum == pytest.approx(0.9)
    kept = Harness(workers=4, momentum=0.9, on_switch={"momentum": "keep"})
    kept.switch(name="asp")
    assert kept.lr_scale == pytest.approx(0.25) and kept.momentum == 0.9


def test_the_momentum_cut_alone_does_not_raise_the_learning_rate_and_is_the_default():
    for h in (Harness(workers=4, momentum=0.9, on_switch={"momentum": "cut"}), Harness(workers=4, momentum=0.9)):
        h.switch(name="asp")
        assert h.lr_scale == pytest.approx(0.25) and h.momentum == pytest.approx(0.15)
        h.switch(name="bsp")
        assert h.lr_scale == pytest.approx(1.0) and h.momentum == pytest.approx(0.9)


def factors_after_switch(h: Harness, updates: int) -> list[float]:
    h.switch(name="asp")
    for _ in range(updates):
        h.push(0, 1.0)
    return [a.lr_factor for a in h.applied if a.protocol == "asp"]


def test_the_restored_step_is_reached_linearly_over_restore_updates():
    h = Harness(workers=4, momentum=0.9, on_switch={"momentum": "asynchrony", "restore_updates": 4})
    f = factors_after_switch(h, 6)
    assert h.lr_scale == pytest.approx(0.25 * 8.5), "the scale in force is the restored one"
    # effective rate = scale x factor: from the cut's 0.25 up to 0.25 x 8.5 in 4 updates, then flat
    assert [h.lr_scale * x for x in f] == pytest.approx([0.25 * (1 + 7.5 * k / 4) for k in range(4)] + [0.25 * 8.5] * 2)


def test_a_warm_up_raises_the_rate_from_1_over_n_after_each_switch_and_survives_a_checkpoint():
    h = Harness(workers=2, on_switch={"warmup_updates": 4})
    assert factors_after_switch(h, 6) == pytest.approx([0.25, 0.5, 0.75, 1.0, 1.0, 1.0])
    again = Harness(workers=2, on_switch={"warmup_updates": 4}, start=False)
    h.switch(name="bsp")
    h.push(0, 1.0)
    again.core.load_state_dict(h.core.state_dict(h.now), h.now)
    assert again.core.switching.switched_at == h.core.switching.switched_at and \
        again.core.switching.restore == h.core.switching.restore


def test_elastic_exclusion_takes_stale_contributions_or_drops_them():
    h = Harness(workers=3, protocol={"batch": 1})
    h.run(h.core.decide(Decision("slow", exclude=frozenset({2})), "manual", h.now))
    h.push(0, 1.0)
    h.push(1, 1.0)
    assert h.core.version == 1, "the round did not wait for the excluded worker"
    stale = h.push(2, 4.0, base=0)  # joins round 2 as a stale contribution
    h.push(0, 1.0)
    h.push(1, 1.0)
    assert h.releases[stale].outcome.applied and h.releases[stale].outcome.staleness == 1
    assert sorted(m.worker for m in h.applied[-1].aggregate.members) == [0, 1, 2]
    h.run(h.core.decide(Decision("recovered", readmit=frozenset({2})), "manual", h.now))
    assert [e for e in ("worker_excluded", "worker_readmitted") if h.events(e)] == \
        ["worker_excluded", "worker_readmitted"]
    drop = Harness(workers=2, protocol={"excluded_pushes": "drop"})
    drop.run(drop.core.decide(Decision("slow", exclude=frozenset({1})), "manual", drop.now))
    drop.push(0, 1.0)
    late = drop.push(1, 1.0, base=0)
    assert not drop.releases[late].outcome.applied and drop.counts["dropped:excluded_stale"] == 1


class Recorder(Policy):
    """A policy that notes what it saw and asks for ASP at version 2."""

    name = "recorder"

    def __init__(self) -> None:
        self.views: list[ClusterView] = []

    def decide(self, s: ClusterView) -> Decision | None:
        self.views.append(s)
        return Decision("two versions", protocol="asp") if s.version == 2 and s.protocol == "bsp" else None


def test_the_policy_sees_a_frozen_view_and_its_decision_is_applied_by_the_core():
    policy = Recorder()
    h = Harness(workers=2, policy=policy, every_k=3)
    assert [v.version for v in policy.views] == [0], "consulted at the start"
    for _ in range(2):
        h.push(0, 1.0, report=StepReport(compute_s=0.2))
        h.push(1, 1.0, report=StepReport(compute_s=0.4))
    assert h.core.spec.name == "asp" and [v.version for v in policy.views] == [0, 1, 2]
    v = policy.views[-1]
    assert v.workers[1].compute_s == pytest.approx(0.4) and v.active == frozenset({0, 1})
    for _ in range(3):  # under ASP the policy is consulted every k = 3 updates
        h.push(0, 1.0)
    assert [v.version for v in policy.views] == [0, 1, 2, 5]
    h.run(h.core.decide(Decision("bad", protocol="amb"), "manual", h.now))  # AMB needs a T
    assert h.events("decision_rejected") and h.core.spec.name == "asp"


def test_schedule_policy_switches_at_its_fraction_and_the_overhead_is_recorded():
    h = Harness(workers=2, train={"steps": 6}, protocol={"batch": 1},
                policy=Schedule(phases=[{"bsp": 0.5}, {"asp": 0.5}]))
    for _ in range(3):
        h.push(0, 1.0, report=StepReport(compute_s=0.25))
        h.push(1, 1.0, report=StepReport(compute_s=0.25))
    assert h.core.spec.name == "asp"
    while not h.core.done:
        h.now += 0.1
        h.push(0, 1.0)
    assert h.protocols_applied() == ["bsp"] * 3 + ["asp"] * 3
    (sw,) = h.core.switching.switches
    assert sw.to == "asp" and sw.step_s == pytest.approx(0.25) and sw.first_update_at == pytest.approx(100.1)


def test_a_switch_keeps_only_the_updates_its_overhead_needs_and_they_survive_a_checkpoint():
    from switchps.ps_server.core.overhead import INTERVALS, switch_overheads

    h = Harness(workers=2, train={"steps": 100}, protocol={"batch": 1},
                policy=Schedule(phases=[{"bsp": 0.02}, {"asp": 0.98}]))
    while not h.core.done:
        for w in (0, 1):
            h.now += 0.1
            h.push(w, 1.0, report=StepReport(compute_s=0.05))
    (sw,) = h.core.switching.switches
    assert len(sw.updates) == INTERVALS + 1 and sw.updates[0] == sw.first_update_at
    state = h.core.state_dict(h.now)
    assert len(json.dumps(state)) < 4000, "a checkpoint does not grow with the updates"
    again = Harness(workers=2, train={"steps": 100}, protocol={"batch": 1})
    again.core.load_state_dict(state, h.now)
    assert again.core.switching.switches[0].updates == pytest.approx(sw.updates)
    assert switch_overheads(again.core.switching.switches) == pytest.approx(switch_overheads([sw]))


def test_a_checkpoint_that_kept_every_updates_time_still_resumes():
    """Checkpoints written before 2026-11-25 hold a switch's first update alone, and every update's time."""
    h = Harness(workers=2, protocol={"batch": 1})
    state = h.core.state_dict(h.now)
    times = [[-3.0 + 0.5 * i, "bsp" if i < 2 else "asp"] for i in range(6)]
    state["switching"]["switches"] = [[-3.5, "asp", 0.2, -2.0]]
    state["switching"]["update_times"] = times
    h.core.load_state_dict(state, 100.0)
    (sw,) = h.core.switching.switches
    assert sw.to == "asp" and sw.updates == pytest.approx([98.0, 98.5, 99.0, 99.5])


def test_a_normal_step_counts_communication_but_not_barrier_waits():
    from switchps.ps_server.core.consulting import normal_step_s

    h = Harness(workers=2, protocol={"name": "asp"})
    # the push took 0.5 s to answer, 0.4 s of it waiting for the round: 0.1 s of communication
    h.push(0, 1.0, report=StepReport(compute_s=0.2, sleep_s=0.05, send_s=0.5, wait_s=0.4))
    assert normal_step_s(h.core.consulting.recent) == pytest.approx(0.35)


def test_state_dicts_restore_the_protocol_membership_and_policy():
    h = Harness(workers=3, protocol={"name": "ssp", "staleness": 1}, policy=Schedule(phases=[{"ssp": 1.0}]))
    h.push(0, 1.0)
    h.push(0, 1.0)
    h.run(h.core.decide(Decision("d", batches={1: 5}, exclude=frozenset({2})), "manual", h.now))
    state = h.core.state_dict(h.now)
    fresh = Harness(workers=3, protocol={"name": "bsp"}, policy=Schedule(phases=[{"ssp": 1.0}]), start=False)
    fresh.core.load_state_dict(state, fresh.now)
    assert fresh.core.state_dict(fresh.now) == state
    c = fresh.core
    assert (c.spec.name, c.version, c.members.excluded, c.consulting.batches) == ("ssp", 2, {2}, {1: 5})
    assert c.switching.protocol.state_dict(fresh.now)["clocks"] == {"0": 2, "1": 0, "2": 0}
    assert c.work_order(1).sample_budget == 5 and c.started_at == fresh.now
