"""Protocol semantics on the core itself: a fake clock, no sockets, no threads, no sleeps."""

from __future__ import annotations

import numpy as np
import pytest

from harness import Harness
from switchps.policies.base import Decision
from switchps.ps_server.core.events import StepReport
from switchps.refusals import Rejected

# ---- BSP, backup workers, deadlines -----------------------------------------------------------


def test_bsp_waits_for_all_and_applies_one_update_with_sum_over_samples():
    h = Harness(workers=3, size=4)
    a = h.push(0, 3.0, samples=3)
    b = h.push(1, 10.0, samples=5)
    assert not h.released(a) and not h.released(b) and h.core.version == 0, "BSP released before everyone"
    c = h.push(2, [1, 2, 3, 4], samples=2)
    assert h.core.version == 1 and len(h.applied) == 1, "exactly one update per round"
    np.testing.assert_allclose(h.params, -(np.array([3, 3, 3, 3]) + 10 + np.array([1, 2, 3, 4])) / 10)
    for pid in (a, b, c):  # everyone released with the new version's work order
        r = h.releases[pid]
        assert r.outcome.applied and r.order.version == 1
    assert [m.worker for m in h.applied[0].aggregate.members] == [0, 1, 2]
    h.check_books()


def test_bsp_deadline_drops_the_silent_worker_which_rejoins():
    h = Harness(workers=3, protocol={"deadline_s": 0.6})
    a, b = h.push(0, 1.0), h.push(1, 1.0)
    h.advance(0.5)
    assert not h.released(a), "the round waits until its deadline"
    h.advance(0.2)
    assert h.released(a) and h.released(b) and h.core.version == 1
    assert [e["worker"] for e in h.events("deadline_missed")] == [2] and 2 not in h.core.members.active
    late = h.push(2, 100.0, base=0)  # its push for version 0 is dropped and counted, never applied
    assert not h.releases[late].outcome.applied and h.counts["dropped:late"] == 1
    np.testing.assert_allclose(h.params, [-1, -1])
    assert 2 in h.core.members.active and [e["worker"] for e in h.events("worker_rejoined")] == [2]
    a, b = h.push(0, 1.0), h.push(1, 1.0)
    assert not h.released(a), "the next round needs all three again"
    h.push(2, 1.0)
    assert h.core.version == 2
    h.check_books()


def test_backup_workers_drop_exactly_k_per_round():
    h = Harness(workers=4, size=4, protocol={"backup_workers": 1})
    for round_ in range(3):
        for w in range(3):
            h.push(w, 1.0, samples=2)
        assert h.core.version == round_ + 1, "the round completes on N - k pushes"
        late = h.push(3, 50.0, samples=2, base=round_)
        assert not h.releases[late].outcome.applied
    assert h.counts["dropped:backup"] == 3
    np.testing.assert_allclose(h.params, np.full(4, -1.5))
    h.check_books()


def test_a_time_limit_mid_round_applies_the_partial_round():
    h = Harness(workers=3, train={"seconds": 0.8})
    a = h.push(0, 1.0)
    h.advance(1.0)
    r = h.releases[a]
    assert r.order.stop and h.core.done and h.core.version == 1 and h.core.samples == 1
    np.testing.assert_allclose(h.params, [-1, -1])
    h.check_books()


# ---- asynchronous protocols --------------------------------------------------------------------


def test_asp_applies_on_arrival_with_staleness_and_optional_damping():
    h = Harness(workers=2, protocol={"name": "asp"})
    a = h.push(0, 1.0)
    assert h.released(a) and h.core.version == 1 and h.releases[a].outcome.staleness == 0
    b = h.push(1, 1.0, samples=2, base=0)
    assert h.releases[b].outcome.staleness == 1
    np.testing.assert_allclose(h.params, [-1.5, -1.5])
    damped = Harness(workers=2, protocol={"name": "asp", "staleness_lr": True})
    damped.push(0, 1.0)
    damped.push(1, 1.0, base=0)  # staleness 1: lr / 2
    np.testing.assert_allclose(damped.params, [-1.5, -1.5])
    h.check_books()


def test_ssp_holds_a_worker_s_plus_one_ahead_until_the_slowest_catches_up():
    h = Harness(workers=2, protocol={"name": "ssp", "staleness": 1})
    assert h.released(h.push(0, 1.0)), "one ahead of the slowest is allowed"
    held = h.push(0, 1.0)
    assert not h.released(held) and h.core.version == 2, "held, but applied on arrival"
    h.push(1, 1.0)
    assert h.released(held) and h.core.version == 3
    h.check_books()


def test_ssp_laggard_that_misses_the_deadline_releases_the_held():
    h = Harness(workers=2, protocol={"name": "ssp", "staleness": 0, "deadline_s": 2.0})
    held = h.push(0, 1.0)
    h.advance(1.9)
    assert not h.released(held)
    h.advance(0.2)
    assert h.released(held) and [e["reason"] for e in h.events("deadline_missed")] == ["ssp_deadline"]


def test_kasync_applies_one_update_every_k_pushes_and_never_holds():
    h = Harness(workers=3, size=2, protocol={"name": "kasync", "k": 2})
    first = h.push(0, 2.0, samples=1)
    assert h.released(first) and h.core.version == 0, "released at once, applied only with K pushes"
    h.push(1, 4.0, samples=3)
    assert h.core.version == 1
    np.testing.assert_allclose(h.params, [-1.5, -1.5])  # (2 + 4) / (1 + 3): every sample once
    stale = h.push(2, 1.0, base=0)  # one version behind: still taken, staleness recorded
    assert h.releases[stale].outcome.staleness == 1
    h.push(0, 1.0)
    assert h.core.version == 2 and [m.staleness for m in h.applied[-1].aggregate.members] == [1, 0]
    default = Harness(workers=3, protocol={"name": "kasync"})  # K defaults to the number of workers
    for w in range(3):
        default.push(w, 1.0)
    assert default.core.version == 1 and len(default.applied[0].aggregate.members) == 3
    h.check_books()


def test_timed_applies_what_arrived_each_window_and_waits_for_one_push():
    h = Harness(workers=3, protocol={"name": "timed", "window_s": 1.0})
    h.push(0, 1.0)
    h.push(1, 3.0)
    assert h.core.version == 0
    h.advance(1.0)
    assert h.core.version == 1 and len(h.applied[0].aggregate.members) == 2
    h.advance(1.5)  # an empty window: nothing applied, and the next push closes it at once
    assert h.core.version == 1
    h.push(2, 1.0)
    assert h.core.version == 2 and len(h.applied[-1].aggregate.members) == 1
    h.advance(0.5)
    h.push(0, 1.0)
    h.advance(0.5)
    assert h.core.version == 3, "a new window started when the push closed the empty one"
    h.check_books()


# ---- work orders -------------------------------------------------------------------------------


def test_amb_fmb_and_per_worker_batches_reach_the_work_orders():
    amb = Harness(workers=2, protocol={"name": "amb", "time_budget_s": 0.25, "batch": 8, "micro_batch": 2})
    o = amb.core.work_order(0)
    assert (o.protocol, o.time_budget_s, o.sample_budget, o.micro_batch) == ("amb", 0.25, 32, 2)
    fmb = Harness(workers=2, protocol={"name": "fmb", "batch": 8})
    assert (fmb.core.work_order(0).time_budget_s, fmb.core.work_order(0).sample_budget) == (None, 8)
    amb.push(0, 6.0, samples=2)
    amb.push(1, 2.0, samples=6)
    np.testing.assert_allclose(amb.params, [-1, -1])  # ΣG/Σb = 8/8, not the mean of per-worker means
    from switchps.policies.base import Decision

    amb.run(amb.core.decide(Decision("speeds", batches={0: 12, 1: 4}), "manual", amb.now))
    amb.switch(name="bsp")
    assert [amb.core.work_order(w).sample_budget for w in (0, 1)] == [12, 4]


@pytest.mark.parametrize("header, reason", [
    ({"worker": 9}, "unknown_worker"), ({"samples": 2**62}, "samples"), ({"samples": 9}, "samples"),
    ({"samples": 0}, "samples"), ({"base_version": 5}, "version"),
])
def test_pushes_are_checked_before_their_payload_is_read(header, reason):
    h = Harness(workers=1)
    fields = {"worker": 0, "samples": 8, "base_version": 0, **header}
    with pytest.raises(Rejected) as err:
        h.core.check_push(fields["worker"], fields["samples"], fields["base_version"], StepReport(), h.now)
    assert err.value.reason == reason and err.value.code == "INVALID_ARGUMENT"


DAYS = 3 * 86400.0


@pytest.mark.parametrize("report", [
    StepReport(compute_s=DAYS), StepReport(sleep_s=DAYS), StepReport(send_s=DAYS), StepReport(wait_s=DAYS),
    StepReport(delay_sleep_s=DAYS), StepReport(delay_comm_s=DAYS), StepReport(delay_factor=1e9),
    StepReport(compute_s=10.0),  # more than the 2 s since the worker's work order was issued
], ids=["compute", "sleep", "send", "wait", "delay_sleep", "delay_comm", "factor", "compute_since_order"])
def test_statistics_beyond_what_the_work_order_allows_are_rejected(report):
    h = Harness(workers=1, protocol={"name": "asp"})
    h.advance(2.0)
    with pytest.raises(Rejected) as err:
        h.core.check_push(0, 8, 0, report, h.now)
    assert err.value.reason == "stats" and err.value.code == "INVALID_ARGUMENT"
    h.core.check_push(0, 8, 0, StepReport(compute_s=2.0, send_s=2.0), h.now)  # what did fit is accepted


def test_samples_are_bounded_by_the_newest_budget_once_the_push_before_it_is_answered():
    h = Harness(workers=1, protocol={"name": "asp", "batch": 8})
    h.run(h.core.decide(Decision("smaller", batches={0: 4}), "manual", h.now))
    h.push(0, 1.0, samples=8)  # computed under the order before the decision
    h.push(0, 1.0, samples=8)  # a resend of that step may still claim it
    h.push(0, 1.0, samples=4)
    with pytest.raises(Rejected) as err:
        h.core.check_push(0, 8, h.core.version, StepReport(), h.now)
    assert err.value.reason == "samples"


def test_a_step_that_skips_ahead_of_its_session_is_rejected():
    h = Harness(workers=1, protocol={"name": "asp"})
    h.push(0, 1.0, samples=8, step=0, session=7)
    h.core.check_push(0, 8, 1, StepReport(step=1), h.now, session=7)
    h.core.check_push(0, 8, 1, StepReport(step=9), h.now, session=8)  # a restarted worker process
    with pytest.raises(Rejected) as err:
        h.core.check_push(0, 8, 1, StepReport(step=2), h.now, session=7)
    assert err.value.reason == "stats"


def test_training_starts_when_every_worker_is_ready_or_the_startup_timeout_passes():
    h = Harness(workers=2, start=False)
    h.run(h.core.register(0, 100, h.now))
    h.run(h.core.initialized_at(h.now))
    assert h.core.started_at is None and h.core.next_timer() == h.now + 5.0
    with pytest.raises(Rejected, match="not started"):
        h.core.check_push(0, 1, 0, StepReport(), h.now)
    h.advance(5.0)
    assert h.core.started_at == 105.0 and h.events("started_incomplete") == [{"workers": [0]}]
