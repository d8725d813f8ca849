"""The protobuf form of the core's actions (``shard.action_wire``): every field of a carried action survives
the trip to a follower, a join or a free names its push's part there, and each action type is either
carried or stays on shard 0 by name."""

from __future__ import annotations

import dataclasses
from typing import get_args

from switchps.protos import switchps_pb2 as pb
from switchps.ps_server.core.actions import Action, Apply, Count, Free, Join, Record, Release, SetOptimizer
from switchps.config.optimizer import OptimizerSpec
from switchps.ps_server.core.events import Aggregate, Local, Outcome, Push, WorkOrder
from switchps.ps_server.shard.action_wire import CARRIED, from_wire, to_wire

KEYS = {7: (3, 11, 5, 99), 8: (4, 12, 6, 1)}
MEMBERS = [Push(7, 3, 40, 16, 2.5, 101.25, staleness=2, step=5, session=11, squares=9.5),
           Push(9, 1, 41, 8, 1.25, 101.5, staleness=1, step=6, session=12, squares=0.75)]
MOVED = [Push(10, 2, 41, 32, 3.0, 102.0, staleness=1, step=7, session=13, local_steps=4)]
NESTEROV = OptimizerSpec(name="nesterov", learning_rate=0.7, params={"momentum": 0.9})
CARRIED_ACTIONS: list[Action] = [
    Join(7, 4),
    Free(8),
    Apply(42, Aggregate(100.5, MEMBERS, 24, 4, {3, 1}), 0.5, "ssp", 0.25, 1.5),
    Release(7, 3, Outcome(False, 2, 0.125, "stale"), WorkOrder("amb", 42, 16, 0.5, 4, True)),
    Apply(43, Aggregate(101.5, MOVED, 32, 5, {2}), 0.5, "async_diloco", None, 0.0, NESTEROV),
    Release(10, 2, Outcome(True, 1, 0.0, ""), WorkOrder("async_diloco", 43, 32, None, 8, False,
                                                         local=Local(4, 8, NESTEROV, True))),
    SetOptimizer(0.5, 0.9, "scale", 0.25),
    SetOptimizer(2.0, None),
]
STAYS: list[Action] = [Record("switch", {"to": "asp"}), Count("dropped", "stale")]


def test_every_action_type_is_carried_or_stays_here_by_name():
    assert {type(a) for a in CARRIED_ACTIONS + STAYS} == set(get_args(Action))
    assert not {type(a) for a in CARRIED_ACTIONS} & {type(a) for a in STAYS}


def test_every_field_of_a_carried_action_survives_the_trip():
    for a in CARRIED_ACTIONS:
        msg = to_wire(a, KEYS)
        assert msg is not None and msg.WhichOneof("kind") in CARRIED
        back = from_wire(pb.ShardAction.FromString(msg.SerializeToString()), {})
        assert type(back) is type(a) and dataclasses.asdict(back) == dataclasses.asdict(a), a


def test_a_join_or_a_free_names_its_pushs_part_on_the_follower():
    names: dict[int, tuple[int, int, int, int]] = {}
    for a in (Join(7, 4), Free(8)):
        msg = to_wire(a, KEYS)
        assert msg is not None
        from_wire(msg, names)
    assert names == KEYS


def test_records_and_counts_stay_on_shard_zero():
    assert [to_wire(a, KEYS) for a in STAYS] == [None, None]
