"""The protobuf form of the core's actions, both ways: what shard 0 sends its followers, in order.

``to_wire`` and ``from_wire`` are the only translations, each a ``match`` ending in ``assert_never``, so
an action type added to ``actions.Action`` fails mypy here until it is carried or said to stay on shard 0.
Every field of a carried action survives the trip (``tests/test_action_wire.py``). ``Record`` and
``Count`` are not carried: the run record is shard 0's alone.

A push is named by shard 0's push id; a ``Join`` or a ``Free``, the first action that names a push, also
carries the name its parts go by on every shard (``followers.Key``), which ``from_wire`` notes in the
follower's ``names``; an executor forgets a name at the push's ``Release``.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping, MutableMapping
from typing import assert_never

from switchps.config.optimizer import OptimizerSpec
from switchps.protos import orders, switchps_pb2 as pb
from switchps.ps_server import work_orders
from switchps.ps_server.core.actions import Action, Apply, Count, Free, Join, Record, Release, SetOptimizer
from switchps.ps_server.core.events import Aggregate, Outcome, Push
from switchps.ps_server.shard.followers import Key, key_of, part_key

CARRIED = ("join", "free", "apply", "release", "optimizer")
"""The ``ShardAction`` kinds that are core actions; the others are shard 0's own (setup, drop, stop, ...)."""
_PUSH_FIELDS = [f.name for f in dataclasses.fields(Push)]


def to_wire(a: Action, names: Mapping[int, Key]) -> pb.ShardAction | None:
    """``a`` as sent to the followers (``names``: push id -> its parts' name), or None if it stays here."""
    match a:
        case Join():
            return pb.ShardAction(join=pb.JoinPart(key=part_key(names[a.push_id]), aggregate=a.aggregate_id,
                                                   push=a.push_id))
        case Free():
            return pb.ShardAction(free=pb.FreePart(key=part_key(names[a.push_id]), push=a.push_id))
        case Apply():
            agg = a.aggregate
            return pb.ShardAction(apply=pb.ApplyPart(
                aggregate=agg.id, samples=agg.samples, lr_factor=a.lr_factor, version=a.version,
                started=agg.started, members=[pb.PushInfo(**{f: getattr(m, f) for f in _PUSH_FIELDS})
                                              for m in agg.members],
                protocol=a.protocol, time_budget_s=orders.to_wire(a.time_budget_s), wait_s=a.wait_s,
                outer_optimizer=a.outer.model_dump_json() if a.outer else "", num_workers=a.members))
        case Release():
            return pb.ShardAction(release=pb.ReleasePart(
                push=a.push_id, worker=a.worker, outcome=pb.PushOutcome(**vars(a.outcome)),
                order=work_orders.to_wire(a.order)))
        case SetOptimizer():
            return pb.ShardAction(optimizer=pb.OptimizerChange(
                lr_scale=a.lr_scale, has_momentum=a.momentum is not None, momentum=a.momentum or 0.0,
                state=a.state, state_scale=a.state_scale))
        case Record() | Count():
            return None
        case _:
            assert_never(a)


def from_wire(msg: pb.ShardAction, names: MutableMapping[int, Key]) -> Action:
    """The action ``msg`` carries (its kind one of ``CARRIED``); a join or a free's part name goes to
    ``names``."""
    kind = msg.WhichOneof("kind")
    match kind:
        case "join":
            names[msg.join.push] = key_of(msg.join.key)
            return Join(msg.join.push, msg.join.aggregate)
        case "free":
            names[msg.free.push] = key_of(msg.free.key)
            return Free(msg.free.push)
        case "apply":
            u = msg.apply
            members = [Push(**{f: getattr(m, f) for f in _PUSH_FIELDS}) for m in u.members]
            agg = Aggregate(u.started, members, u.samples, u.aggregate, {m.worker for m in members})
            return Apply(u.version, agg, u.lr_factor, u.protocol, orders.from_wire(u.time_budget_s), u.wait_s,
                         OptimizerSpec.model_validate_json(u.outer_optimizer) if u.outer_optimizer else None, u.num_workers)
        case "release":
            r = msg.release
            o = r.outcome
            return Release(r.push, r.worker, Outcome(o.applied, o.staleness, o.wait_s, o.note),
                           work_orders.from_wire(r.order))
        case "optimizer":
            c = msg.optimizer
            return SetOptimizer(c.lr_scale, c.momentum if c.has_momentum else None, c.state or "keep", c.state_scale)
    raise ValueError(f"not a core action: {kind}")
