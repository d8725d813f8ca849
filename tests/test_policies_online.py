"""Online policies on scripted snapshots: detector, Greedy, Elastic, Anytime, DynamicBatching."""

from __future__ import annotations

import random
import statistics

import pytest

from switchps.policies.base import Decision, ClusterView, WorkerStats
from switchps.policies.detector import StragglerDetector, medians_of_others
from switchps.policies.online import Anytime, DynamicBatching, Elastic, Greedy, apportion


def snap(times: dict[int, float], *, protocol: str = "bsp", progress: float = 0.0,
         batches: dict[int, int] | None = None, samples: dict[int, float] | None = None,
         compute: dict[int, float] | None = None, active: set[int] | None = None,
         excluded: set[int] | frozenset[int] = frozenset(), num_workers: int | None = None) -> ClusterView:
    """A snapshot whose workers have the given step times (batch 32, samples = batch, compute = step time)."""
    batches = batches or dict.fromkeys(times, 32)
    samples = samples or {w: float(batches[w]) for w in times}
    compute = compute or times
    workers = {w: WorkerStats(step_time_s=t, compute_s=compute[w], samples=samples[w],
                              throughput=samples[w] / t, steps=5) for w, t in times.items()}
    return ClusterView(version=0, time_s=0.0, progress=progress, protocol=protocol,
                    num_workers=num_workers or len(times), active=frozenset(active or times),
                    excluded=frozenset(excluded), workers=workers, batches=batches, train_loss=None,
                    time_budget_s=None)


FAST = {0: 1.0, 1: 1.0, 2: 1.0, 3: 1.0}
SLOW3 = {0: 1.0, 1: 1.0, 2: 1.0, 3: 3.0}


# ---- detector -------------------------------------------------------------------------------

def test_detects_after_patience_and_recovers_after_patience():
    d = StragglerDetector(threshold=1.5, patience=3)
    assert d.observe(SLOW3) == (set(), set())
    assert d.observe(SLOW3) == (set(), set())
    assert d.observe(SLOW3) == ({3}, set())
    assert d.stragglers == {3}
    assert d.observe(SLOW3) == (set(), set())          # already detected: not "newly"
    assert d.observe(FAST) == (set(), set())
    assert d.observe(FAST) == (set(), set())
    assert d.observe(FAST) == (set(), {3})
    assert d.stragglers == set()


def test_interrupted_runs_reset_the_counters():
    d = StragglerDetector(patience=3)
    for times in (SLOW3, SLOW3, FAST, SLOW3, SLOW3):
        assert d.observe(times) == (set(), set())
    assert d.observe(SLOW3) == ({3}, set())
    for times in (FAST, FAST, SLOW3, FAST, FAST):
        assert d.observe(times) == (set(), set())
    assert d.observe(FAST) == (set(), {3})


def test_threshold_is_against_the_median_of_the_others():
    d = StragglerDetector(threshold=1.5, patience=1)
    # 1.6 > 1.5 x 1.0 (the other), though not > 1.5 x the median of all (1.3)
    assert d.observe({0: 1.0, 1: 1.6}) == ({1}, set())
    d = StragglerDetector(threshold=1.5, patience=1)
    assert d.observe({0: 1.0, 1: 1.0, 2: 1.5, 3: 1.51}) == ({3}, set())   # strictly greater
    d = StragglerDetector(threshold=2.0, patience=1)
    assert d.observe({0: 1.0, 1: 1.0, 2: 1.9, 3: 2.5}) == ({3}, set())


def test_each_workers_median_of_the_others_is_statistics_median_bit_for_bit_from_one_sort():
    rng = random.Random(3)
    for n in [2, 3, 4, 5, 8, 33, 256]:
        for ties in (False, True):
            values = {w: float(rng.randint(1, 4)) if ties else rng.uniform(0.1, 3.0) for w in range(n)}
            naive = {w: statistics.median(v for u, v in values.items() if u != w) for w in values}
            assert medians_of_others(values) == naive, (n, ties)


def test_several_stragglers():
    d = StragglerDetector(patience=2)
    times = {0: 1.0, 1: 1.0, 2: 1.0, 3: 4.0, 4: 5.0}
    d.observe(times)
    assert d.observe(times) == ({3, 4}, set())


def test_single_worker_is_never_detected():
    d = StragglerDetector(patience=1)
    for t in (1.0, 100.0, 1000.0):
        assert d.observe({0: t}) == (set(), set())
    assert d.stragglers == set()


def test_missing_workers_keep_their_counters():
    d = StragglerDetector(patience=3)
    d.observe(SLOW3)
    d.observe(SLOW3)
    assert d.observe({0: 1.0, 1: 1.0, 2: 1.0}) == (set(), set())   # 3 absent: count stays at 2
    assert d.observe(SLOW3) == ({3}, set())
    d.observe(FAST)
    d.observe(FAST)
    assert d.observe({0: 1.0, 1: 1.0}) == (set(), set())
    assert d.observe({3: 1.0}) == (set(), set())                      # alone: no comparison
    assert d.observe(FAST) == (set(), {3})


def test_detector_rejects_bad_arguments():
    with pytest.raises(ValueError):
        StragglerDetector(patience=0)
    with pytest.raises(ValueError):
        StragglerDetector(threshold=0.0)


# ---- Greedy ---------------------------------------------------------------------------------

def test_greedy_full_sequence():
    """bsp -> straggler -> asp -> recovery -> bsp -> quota met -> asp, and silence in between."""
    g = Greedy(bsp_fraction=0.25, patience=2)
    step = 1 / 64                       # exact in binary: the quota is 16 calls' progress under bsp
    protocol, progress, log = "bsp", 0.0, []
    script = [FAST] * 4 + [SLOW3] * 6 + [FAST] * 30 + [SLOW3] * 5 + [FAST] * 5
    for i, times in enumerate(script):
        progress += step
        d = g.decide(snap(times, protocol=protocol, progress=progress))
        if d is not None:
            assert d.protocol != protocol and d.protocol in ("asp", "bsp")
            log.append((i, d))
            protocol = d.protocol
    assert [(i, d.protocol) for i, d in log] == [(5, "asp"), (11, "bsp"), (21, "asp")]
    assert "[3]" in log[0][1].reason
    # a call's progress step counts towards the quota when its snapshot says bsp: calls 0-5 and
    # 12-21, 16 steps, so the quota was met at progress 22/64, not at 0.25
    assert log[2][0] + 1 == 22
    assert "quota" in log[2][1].reason


def test_greedy_without_stragglers_switches_once_at_the_quota():
    g = Greedy(bsp_fraction=0.5, async_protocol="ssp")
    protocol, decisions = "bsp", []
    for k in range(1, 11):
        d = g.decide(snap(FAST, protocol=protocol, progress=k / 10))
        if d is not None:
            decisions.append((k, d.protocol))
            protocol = d.protocol
    assert decisions == [(5, "ssp")]


def test_greedy_wants_bsp_before_the_quota():
    assert Greedy(bsp_fraction=0.2).decide(snap(FAST, protocol="asp")).protocol == "bsp"
    assert Greedy(bsp_fraction=0.0).decide(snap(FAST, protocol="bsp")).protocol == "asp"


@pytest.mark.parametrize("kwargs", [{"bsp_fraction": 1.5}, {"bsp_fraction": 0.2, "async_protocol": "amb"}])
def test_greedy_rejects_bad_arguments(kwargs):
    with pytest.raises(ValueError):
        Greedy(**kwargs)


# ---- Elastic --------------------------------------------------------------------------------

def test_elastic_excludes_then_readmits():
    e = Elastic(patience=2)
    assert e.decide(snap(SLOW3)) is None
    d = e.decide(snap(SLOW3))
    assert d == Decision(d.reason, exclude=frozenset({3}))
    assert "[3]" in d.reason
    assert e.decide(snap(SLOW3, excluded={3})) is None            # already out: nothing to do
    assert e.decide(snap(FAST, excluded={3})) is None
    d = e.decide(snap(FAST, excluded={3}))
    assert d == Decision(d.reason, readmit=frozenset({3}))
    assert e.decide(snap(FAST)) is None


def test_elastic_never_empties_the_barrier():
    times = {0: 1.0, 1: 1.0, 2: 1.0, 3: 5.0, 4: 6.0}
    e = Elastic(patience=1)
    d = e.decide(snap(times, active={3, 4}))            # 0-2 inactive: one of 3 and 4 must stay in
    assert d.exclude == {4}                             # the slowest goes out first
    assert e.decide(snap(times, active={3, 4}, excluded={4})) is None
    e = Elastic(patience=1)
    assert e.decide(snap(times)).exclude == {3, 4}      # all active: room for both


# ---- Anytime --------------------------------------------------------------------------------

COMPUTE = {0: 0.8, 1: 0.9, 2: 1.0, 3: 1.0}


def test_anytime_switches_to_amb_with_t_from_fast_workers_and_back():
    a = Anytime(patience=2)
    assert a.decide(snap(SLOW3, compute=COMPUTE)) is None
    d = a.decide(snap(SLOW3, compute=COMPUTE))
    assert d.protocol == "amb" and d.params == {}
    assert d.time_budget_s == pytest.approx(0.9)        # median of the fast workers' compute, not 3's
    assert "[3]" in d.reason
    # under AMB everyone is busy for about T; the straggler shows in its samples per step
    amb_slow = dict(times={w: 0.9 for w in FAST}, protocol="amb", samples={0: 32, 1: 32, 2: 32, 3: 10})
    amb_fast = dict(times={w: 0.9 for w in FAST}, protocol="amb", samples={0: 32, 1: 32, 2: 32, 3: 31})
    for _ in range(3):
        assert a.decide(snap(**amb_slow)) is None
    assert a.decide(snap(**amb_fast)) is None
    d = a.decide(snap(**amb_fast))
    assert d.protocol == "bsp" and d.time_budget_s is None
    assert a.decide(snap(FAST)) is None


def test_anytime_returns_to_fmb_with_factor_and_micro_batch():
    a = Anytime(patience=1, factor=2.0, micro_batch=8)
    d = a.decide(snap(SLOW3, protocol="fmb", compute=COMPUTE))
    assert (d.protocol, d.params, d.time_budget_s) == ("amb", {"micro_batch": 8}, pytest.approx(1.8))
    d = a.decide(snap({w: 1.8 for w in FAST}, protocol="amb"))
    assert d.protocol == "fmb"


def test_anytime_leaves_other_protocols_alone():
    a = Anytime(patience=1)
    assert a.decide(snap(SLOW3, protocol="asp")) is None
    assert a.decide(snap(FAST, protocol="amb")) is None      # amb it did not choose: stays


# ---- DynamicBatching ------------------------------------------------------------------------

def test_apportion_holds_the_total_with_largest_remainder():
    assert apportion(128, {0: 1.0, 1: 3.0, 2: 3.0, 3: 3.0}, 1, 1024) == {0: 13, 1: 39, 2: 38, 3: 38}
    assert apportion(10, {0: 1.0, 1: 1.0, 2: 1.0}, 1, 100) == {0: 4, 1: 3, 2: 3}


def test_apportion_clamps_and_redistributes():
    # the paper's bounds [16, 96]: worker 0's share (4.1) is raised to 16, the rest re-split
    assert apportion(128, {0: 1.0, 1: 10.0, 2: 10.0, 3: 10.0}, 16, 96) == {0: 16, 1: 38, 2: 37, 3: 37}
    b = apportion(200, {0: 100.0, 1: 1.0, 2: 1.0}, 16, 96)
    assert b[0] == 96 and sum(b.values()) == 200 and b[1] == b[2] == 52
    # bounds that cannot hold the total are widened just enough
    assert apportion(30, {0: 1.0, 1: 1.0}, 16, 96) == {0: 15, 1: 15}
    assert apportion(300, {0: 1.0, 1: 5.0}, 16, 96) == {0: 150, 1: 150}


def simulate(speed_at, rounds: int, overhead: float = 0.0, **kwargs) -> tuple[dict[int, int], list[int]]:
    """Workers take b_i / speed_i (+ overhead) seconds per step; decisions are fed back into b_i.

    Returns the final batches and the rounds that decided; checks sum(b) is held at every round.
    """
    p = DynamicBatching(**kwargs)
    batches = dict.fromkeys(speed_at(0), 32)
    total, decided = sum(batches.values()), []
    for r in range(rounds):
        speed = speed_at(r)
        d = p.decide(snap({w: batches[w] / speed[w] + overhead for w in speed}, batches=dict(batches)))
        if d is not None:
            assert d.batches is not None and d.batches.keys() == batches.keys()
            batches = d.batches
            decided.append(r)
        assert sum(batches.values()) == total
    return batches, decided


def test_dynamic_batching_converges_to_speeds():
    """Worker 0 is 3x slower per sample; from round 10 worker 3 is 2x slower as well."""
    def speed_at(r: int) -> dict[int, float]:
        return {0: 100.0, 1: 300.0, 2: 300.0, 3: 300.0 if r < 10 else 150.0}

    batches, decided = simulate(speed_at, 20, every_rounds=2, deadband=0.2)
    assert decided == [1, 11]                           # one evaluation each, then quiet
    speed = speed_at(20)
    for w, v in speed.items():
        target = 128 * v / sum(speed.values())
        assert abs(batches[w] - target) / target < 0.2
    assert batches == {0: 15, 1: 45, 2: 45, 3: 23}


def test_dynamic_batching_settles_inside_the_deadband():
    """With a fixed per-step overhead throughput is not proportional to speed; it still settles."""
    def speed_at(r: int) -> dict[int, float]:
        return {0: 100.0, 1: 300.0, 2: 300.0, 3: 300.0}

    batches, decided = simulate(speed_at, 20, overhead=0.05, every_rounds=2, deadband=0.2)
    assert decided and decided[-1] < 10 and batches[0] < batches[1]
    times = {w: batches[w] / v + 0.05 for w, v in speed_at(0).items()}
    exact = DynamicBatching(every_rounds=1, deadband=0.0).decide(snap(times, batches=dict(batches)))
    assert all(abs(exact.batches[w] - b) < 0.2 * b for w, b in batches.items())


def test_dynamic_batching_evaluates_every_k_calls_and_respects_deadband():
    uneven = {0: 3.0, 1: 1.0}
    p = DynamicBatching(every_rounds=3)
    assert p.decide(snap(uneven)) is None
    assert p.decide(snap(uneven)) is None
    assert p.decide(snap(uneven)).batches == {0: 16, 1: 48}
    near = {0: 1.1, 1: 1.0}                             # about 5% off even: inside the dead-band
    p = DynamicBatching(every_rounds=1)
    assert p.decide(snap(near)) is None
    assert DynamicBatching(every_rounds=1, deadband=0.0).decide(snap(near)).batches == {0: 30, 1: 34}


def test_dynamic_batching_is_idle_under_amb_and_with_one_worker():
    p = DynamicBatching(every_rounds=1)
    assert p.decide(snap({0: 3.0, 1: 1.0}, protocol="amb")) is None
    assert p.decide(snap({0: 3.0})) is None


def test_anytime_gives_diloco_a_time_budget_and_the_switch_keeps_its_local_steps_and_optimizers():
    """Under stragglers DiLoCo becomes anytime local SGD: AMB's T over its local steps, with DiLoCo's AdamW and
    Nesterov outer step kept (not AMB's defaults); back to DiLoCo once they recover."""
    from harness import Harness

    import dataclasses

    a = Anytime(patience=1)
    d = a.decide(dataclasses.replace(snap(SLOW3, protocol="diloco", compute=COMPUTE), local_steps=4))
    assert (d.protocol, d.params, d.time_budget_s) == ("amb", {"local_steps": 4}, pytest.approx(0.9))
    h = Harness(workers=4, protocol={"name": "diloco", "local_steps": 4})
    h.run(h.core.decide(d, "anytime", h.now))
    spec = h.core.spec
    assert (spec.name, spec.local_steps, spec.time_budget_s) == ("amb", 4, pytest.approx(0.9))
    assert (spec.inner_optimizer.name, spec.outer_optimizer.name) == ("adamw", "nesterov")
    order = h.core.work_order(0)
    assert (order.local.steps, order.local.inner.name, order.time_budget_s) == (4, "adamw", pytest.approx(0.9))
    back = a.decide(snap({w: 0.9 for w in FAST}, protocol="amb"))
    assert back.protocol == "diloco"
    h.run(h.core.decide(back, "anytime", h.now))
    assert (h.core.spec.name, h.core.spec.local_steps, h.core.work_order(0).time_budget_s) == ("diloco", 4, None)


def test_greedy_rides_stragglers_out_between_synchronous_and_asynchronous_local_sgd():
    g = Greedy(bsp_fraction=0.5, patience=1, sync_protocol="local_sgd", async_protocol="async_local_sgd")
    assert g.decide(snap(SLOW3, protocol="local_sgd", progress=0.1)).protocol == "async_local_sgd"
    d = g.decide(snap(FAST, protocol="async_local_sgd", progress=0.2))
    assert d.protocol == "local_sgd" and "local_sgd quota 10.0%" in d.reason, "only local_sgd's progress counts"
    with pytest.raises(ValueError, match="sync_protocol must be one of"):
        Greedy(bsp_fraction=0.5, sync_protocol="asp")
