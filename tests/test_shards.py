"""Shard 0's bookkeeping (``switchps.ps_server.shard.followers.Leader``) without sockets: verdicts and the action log."""

from __future__ import annotations

import asyncio
from typing import Any

import pytest

from switchps.protos import switchps_pb2 as pb
from harness import ActionLog
from switchps.ps_server.core.actions import Apply, Join, Record, Release, SetOptimizer, execute
from switchps.ps_server.core.events import Aggregate, Outcome, Push, WorkOrder
from switchps.ps_server.shard.action_wire import from_wire
from switchps.ps_server.shard.followers import Leader, part_key
from switchps.ps_server.shard.zero import Forwarding
from switchps.refusals import Rejected

KEY = (3, 11, 5, 99)


def verdict(reason: str = "") -> pb.Verdict:
    return pb.Verdict(key=part_key(KEY), reason=reason, message=f"the part: {reason}" if reason else "")


def test_a_push_waits_for_every_follower_and_goes_on_once_all_accepted():
    async def scenario() -> list[str]:
        leader, seen = Leader(followers=2, wait_s=30), []
        leader._heard(2, verdict())  # a verdict may arrive before shard 0 has the push
        waiting = asyncio.ensure_future(leader.verdict(KEY))
        await asyncio.sleep(0)
        seen.append("waiting" if not waiting.done() else "done")
        leader._heard(1, verdict())
        await waiting
        seen.append("done")
        assert leader.verdicts == {} and leader.waiting == {}, "nothing kept once decided"
        return seen

    assert asyncio.run(scenario()) == ["waiting", "done"]


def test_one_refusal_refuses_the_push_without_waiting_for_the_others():
    async def scenario() -> None:
        leader = Leader(followers=3, wait_s=30)
        waiting = asyncio.ensure_future(leader.verdict(KEY))
        await asyncio.sleep(0)
        leader._heard(3, verdict("non_finite"))
        with pytest.raises(Rejected) as e:
            await waiting
        assert e.value.reason == "shard3:non_finite" and e.value.code == "INVALID_ARGUMENT"
        assert "PS shard 3" in str(e.value)

    asyncio.run(scenario())


def test_a_part_that_never_arrives_refuses_the_push_naming_the_shard():
    async def scenario() -> None:
        leader = Leader(followers=2, wait_s=0.01)
        leader._heard(1, verdict())
        with pytest.raises(Rejected) as e:
            await leader.verdict(KEY)
        assert e.value.reason == "shard2:no_part" and e.value.code == "UNAVAILABLE", "the worker sends it again"

    asyncio.run(scenario())


def test_the_core_actions_reach_the_followers_in_order_named_by_the_push():
    leader = Leader(followers=1, wait_s=30)
    queue: asyncio.Queue[Any] = asyncio.Queue()  # shard 0's actions (or the refusal that ends the stream)
    leader.queues[1] = queue
    leader.keys[7] = KEY
    push = Push(7, 3, 5, 2, 0.0, 0.0, step=5, session=11)
    agg = Aggregate(0.0, [push], samples=2, id=4)
    release = Release(7, 3, Outcome(True, 0, 0.0), WorkOrder("asp", 1, 2, None, 2, False))
    here = ActionLog()
    actions = [Join(7, 4), Record("x", {}), Apply(1, agg, 0.5, "asp", None, 0.0), release,
               SetOptimizer(2.0, None, "reset")]
    execute(actions, Forwarding(here, leader))
    sent = [queue.get_nowait() for _ in range(queue.qsize())]
    assert [a.WhichOneof("kind") for a in sent] == ["join", "apply", "release", "optimizer"], "records stay here"
    assert [a for _, a in here.calls] == actions, "and shard 0 carries out every action itself, in order"
    names: dict[int, Any] = {}
    joined, applied, released, optimizer = (from_wire(m, names) for m in sent)
    assert joined == Join(7, 4) and names == {7: KEY}, "the join names the push's part"
    assert isinstance(applied, Apply) and (applied.aggregate.id, applied.aggregate.samples,
                                           len(applied.aggregate.members), applied.version, applied.lr_factor) \
        == (4, 2, 1, 1, 0.5)
    assert released == release and leader.keys == {}, "a push's name is forgotten at its release"
    assert optimizer == SetOptimizer(2.0, None, "reset")


def test_a_leader_counts_a_follower_as_attached_only_while_its_stream_is_open():
    leader = Leader(followers=2, wait_s=1)
    with pytest.raises(Rejected) as e:
        leader.check_attached()
    assert e.value.code == "UNAVAILABLE" and "[1, 2]" in str(e.value)
    leader.queues[1] = asyncio.Queue()
    leader.ready.add(1)
    lost: list[tuple[str, bool]] = []
    leader.on_lost = lambda why, resumable: lost.append((why, resumable))
    leader._left(1)
    assert lost == [("PS shard 1 left the run", True)] and leader.lost == lost[0][0]
    assert leader.ready == set(), "a follower that left is waited for again"


def test_after_a_resume_a_follower_is_ready_only_once_it_restored_its_part():
    leader = Leader(followers=1, wait_s=1)
    leader.queues[1] = asyncio.Queue()
    lost: list[tuple[str, bool]] = []
    leader.on_lost = lambda why, resumable: lost.append((why, resumable))
    leader._restored(1, pb.ShardSaved(version=40, error="PS shard 1 cannot resume: v40 is missing"))
    assert not leader.attached and lost == [("PS shard 1 cannot resume: v40 is missing", False)]
    leader._restored(1, pb.ShardSaved(version=40, digest="ab"))
    assert leader.attached


def test_shard_zeros_checkpoint_waits_for_every_followers_part_or_is_not_written():
    leader = Leader(followers=2, wait_s=1)
    leader.saves.add(2, pb.ShardSaved(version=20, digest="d2"))
    leader.saves.add(1, pb.ShardSaved(version=20, digest="d1"))
    assert leader.manifest(20, timeout_s=0) == {"1": "d1", "2": "d2"}
    leader.saves.add(1, pb.ShardSaved(version=40, error="disk full"))
    with pytest.raises(OSError, match="shard 1: disk full"):
        leader.manifest(40, timeout_s=0)
    leader.saves.add(1, pb.ShardSaved(version=60, digest="d1"))
    with pytest.raises(OSError, match="1 of 2"):
        leader.manifest(60, timeout_s=0)
