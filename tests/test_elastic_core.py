"""Elastic membership on the core itself (``cluster.workers: {min, max, start}``): workers join up to ``max``,
leave for good after ``leave_after_s`` of silence, N follows, and training pauses below ``min``. A fake
clock, no sockets, no threads, no sleeps."""

from __future__ import annotations

import numpy as np
import pytest

from harness import Harness
from switchps.ps_server.core.events import Bounds
from switchps.refusals import Rejected

ELASTIC = Bounds(min=2, max=6, leave_after_s=10.0)


def _round(h: Harness, workers: range | list[int], value: float = 1.0) -> list[int]:
    return [h.push(w, value) for w in workers]


@pytest.mark.parametrize("protocol", ["bsp", "asp", "amb"])
def test_a_run_grows_from_4_to_6_and_shrinks_to_3_with_n_per_update(protocol):
    spec = {"name": protocol, **({"time_budget_s": 1.0} if protocol == "amb" else {})}
    h = Harness(workers=4, protocol=spec, bounds=ELASTIC)
    assert h.core.members.num_workers == 4
    _round(h, range(4))
    for w in (4, 5):
        h.register(w)
    assert h.core.members.num_workers == 6
    assert [(e["worker"], e["members"]) for e in h.events("worker_joined")][-2:] == [(4, 5), (5, 6)]
    pushes = _round(h, range(6))
    assert all(h.released(p) for p in pushes), "every member's push is answered"
    h.advance(5.0)
    _round(h, [0, 1, 2])  # 3, 4 and 5 go silent
    h.advance(5.0)
    _round(h, [0, 1, 2])
    h.advance(5.1)  # 3, 4, 5 were last seen 15.1 s ago
    assert [e["worker"] for e in h.events("worker_left")] == [3, 4, 5]
    assert h.core.members.num_workers == 3 and sorted(h.core.members.registered) == [0, 1, 2]
    _round(h, [0, 1, 2])
    members = [a.members for a in h.applied]
    assert members[0] == 4 and members[-1] == 3 and 6 in members, members
    if protocol != "asp":  # a round is one update of every member's push
        assert [len(a.aggregate.members) for a in h.applied] == [4, 6, 3, 3, 3]
    h.check_books()


def test_a_round_in_flight_completes_without_a_member_that_leaves():
    h = Harness(workers=3, bounds=ELASTIC)
    a, b = h.push(0, 1.0), h.push(1, 1.0)
    h.advance(9.9)
    assert not h.released(a), "worker 2 has not been silent for leave_after_s yet"
    h.advance(0.2)
    assert h.released(a) and h.released(b) and h.core.version == 1
    assert h.events("worker_left") == [{"worker": 2, "version": 0, "reason": "silent", "members": 2}]
    np.testing.assert_allclose(h.params, [-1, -1])
    h.check_books()


def test_a_worker_whose_push_waits_is_not_silent():
    h = Harness(workers=2, protocol={"name": "bsp"}, bounds=Bounds(min=2, max=4, leave_after_s=10.0))
    h.advance(5.0)
    a = h.push(0, 1.0)  # waits for worker 1, which leaves; then, paused below min, for a newcomer
    h.advance(100.0)
    assert [e["worker"] for e in h.events("worker_left")] == [1], "the waiting worker 0 stays"
    assert not h.released(a) and h.core.members.num_workers == 1


def test_below_min_training_pauses_and_resumes_when_enough_join():
    h = Harness(workers=3, protocol={"name": "asp"}, bounds=Bounds(min=3, max=6, leave_after_s=10.0))
    h.advance(5.0)
    _round(h, [0, 1])
    h.advance(5.1)  # worker 2 leaves: 2 members, below min
    assert h.events("training_paused") == [{"version": 2, "members": 2, "min": 3}]
    held = _round(h, [0, 1])
    assert not any(h.released(p) for p in held) and h.core.version == 2, "nothing is applied while paused"
    h.advance(30.0)
    assert h.core.members.num_workers == 2, "workers whose pushes wait do not leave"
    h.register(3)
    assert h.events("training_resumed") == [{"version": 2, "members": 3, "min": 3}]
    assert all(h.released(p) for p in held) and h.core.version == 4, "the pushes that waited, in order"
    assert [m.worker for a in h.applied[2:] for m in a.aggregate.members] == [0, 1]
    h.check_books()


def test_a_round_waits_while_paused_and_completes_after():
    h = Harness(workers=2, bounds=Bounds(min=2, max=4, leave_after_s=10.0))
    h.advance(9.0)
    a = h.push(0, 1.0)
    h.advance(1.1)  # worker 1 leaves: 1 member, paused, and the round holds worker 0's push
    assert h.events("training_paused") and not h.released(a) and h.core.version == 0
    h.register(2)
    assert h.events("training_resumed") and not h.released(a), "the round now needs the newcomer"
    h.push(2, 3.0)
    assert h.released(a) and h.core.version == 1
    np.testing.assert_allclose(h.params, [-2, -2])
    h.check_books()


def test_registration_beyond_max_is_refused_and_changes_nothing():
    h = Harness(workers=2, bounds=Bounds(min=1, max=3, leave_after_s=10.0))
    with pytest.raises(Rejected, match="outside"):
        h.core.register(3, 100, h.now)
    assert h.core.members.num_workers == 2 and 3 not in h.core.members.registered


def test_a_fixed_size_run_keeps_its_n_when_a_worker_goes_silent():
    h = Harness(workers=3)
    h.advance(10_000.0)
    assert h.core.members.num_workers == 3 and not h.events("worker_left")


def test_the_learning_rate_and_momentum_follow_n():
    """Under the asynchrony rule the momentum in force is 0.9 - (1 - 1/N) for the N in force."""
    h = Harness(workers=4, momentum=0.9, on_switch={"momentum": "asynchrony"},
                bounds=Bounds(min=1, max=8, leave_after_s=10.0))
    h.switch(name="asp")
    assert h.momentum == pytest.approx(0.9 - 0.75)
    for w in (4, 5, 6, 7):
        h.register(w)
    assert h.momentum == pytest.approx(0.9 - (1 - 1 / 8))
    assert h.lr_scale == pytest.approx((1 - h.momentum) / (1 - 0.9) / 8), "ASP's batch is 1/N of BSP's"


def test_k_async_default_k_and_backup_workers_follow_n():
    h = Harness(workers=2, protocol={"name": "kasync"}, bounds=Bounds(min=1, max=4, leave_after_s=10.0))
    h.register(2)
    _round(h, [0, 1])
    assert h.core.version == 0, "K is N = 3 now"
    h.push(2, 1.0)
    assert h.core.version == 1
    b = Harness(workers=3, protocol={"backup_workers": 1}, bounds=Bounds(min=2, max=4, leave_after_s=10.0))
    b.register(3)
    _round(b, [0, 1])
    assert b.core.version == 0
    b.push(2, 1.0)
    assert b.core.version == 1, "N - k = 3 of 4"


def test_an_ssp_newcomer_starts_level_with_the_slowest():
    h = Harness(workers=2, protocol={"name": "ssp", "staleness": 1}, bounds=Bounds(min=1, max=4, leave_after_s=60.0))
    for _ in range(5):
        _round(h, [0, 1])
    h.register(2)
    ahead = h.push(0, 1.0)
    assert h.released(ahead), "the newcomer has no clock until it pushes: it holds nobody back"
    h.push(2, 1.0)
    again = h.push(0, 1.0)
    assert not h.released(again), "0 is now 2 pushes ahead of 1 (and of 2, level with 1)"
    h.push(1, 1.0)
    assert h.released(again)


def test_the_membership_survives_a_checkpoint():
    h = Harness(workers=2, protocol={"name": "asp"}, bounds=ELASTIC)
    h.register(4)
    state = h.core.state_dict(h.now)
    r = Harness(workers=2, protocol={"name": "asp"}, bounds=ELASTIC, start=False)
    r.core.load_state_dict(state, r.now)
    assert r.core.members.num_workers == 3 and sorted(r.core.members.registered) == [0, 1, 4]
    low = Harness(workers=2, protocol={"name": "asp"}, bounds=Bounds(2, 4, 10.0), start=False)
    low.core.load_state_dict(state, low.now)  # a resume that lowered max: worker 4 left
    assert low.core.members.num_workers == 2 and sorted(low.core.members.registered) == [0, 1]


def test_an_epoch_of_an_elastic_run_is_the_data_set_once():
    """Every member draws from the whole set (it registers the set's size): an epoch does not grow with N."""
    h = Harness(workers=2, protocol={"name": "asp"}, train={"epochs": 1}, bounds=ELASTIC, start=False)
    for w in range(2):
        h.run(h.core.register(w, 40, h.now))
    h.run(h.core.initialized_at(h.now))
    for w in range(2):
        h.core.issue(w, h.now)
    h.register(2, 40)
    for _ in range(4):
        _round(h, [0, 1, 2], 1.0)  # 3 samples a round
    assert h.core.progress(h.now) == pytest.approx(12 / 40)


def test_a_resume_may_change_the_worker_count_only_when_workers_draw_with_replacement():
    from switchps.ps_server.resume_rules import resume_problems

    def cfg(workers, sampling):
        return {"cluster": {"workers": workers}, "data": {"name": "digits", "sampling": sampling}}

    elastic = {"min": 2, "max": 6, "start": 4}
    assert resume_problems(cfg(4, "replacement"), cfg(elastic, "replacement")) == []
    assert resume_problems(cfg(elastic, "replacement"), cfg({"min": 1, "max": 3}, "replacement")) == []
    [line] = resume_problems(cfg(4, "partition"), cfg(6, "partition"))
    assert line.startswith("cluster.workers: the checkpoint was made with 4, this config says 6")


def test_a_worker_that_says_it_leaves_is_gone_at_once():
    h = Harness(workers=3, bounds=ELASTIC)
    a, b = h.push(0, 1.0), h.push(1, 1.0)
    h.run(h.core.leave(2, h.now))
    assert h.released(a) and h.released(b) and h.core.version == 1, "the round completes without it"
    assert h.events("worker_left") == [{"worker": 2, "version": 0, "reason": "exited", "members": 2}]
    with pytest.raises(Rejected, match="unknown worker id 2"):
        h.core.leave(2, h.now)


def test_a_fixed_size_run_stops_waiting_for_a_worker_that_leaves_until_it_pushes():
    h = Harness(workers=3)
    a, b = h.push(0, 1.0), h.push(1, 1.0)
    h.run(h.core.leave(2, h.now))
    assert h.released(a) and h.core.version == 1 and h.core.members.num_workers == 3
    assert h.events("worker_exited") == [{"worker": 2, "version": 0}]
    h.push(0, 1.0), h.push(1, 1.0)
    assert h.core.version == 2
    h.push(2, 1.0, base=2)
    assert 2 in h.core.members.active, "it rejoins by pushing"


def test_a_push_read_while_its_worker_left_is_dropped_and_counted():
    h = Harness(workers=3, protocol={"name": "asp"}, bounds=ELASTIC)
    h.run(h.core.leave(2, h.now))  # between the check of its push's header and the push's arrival
    p = h.push(2, 1.0, check=False)
    assert h.counts["dropped:left"] == 1 and not h.releases[p].outcome.applied
    assert 2 not in h.core.members.last_seen, "a departed worker's push does not bring it back"
    h.check_books()
