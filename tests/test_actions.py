"""``execute``: each action goes to its executor's method, in the order given (no sockets, no threads)."""

from __future__ import annotations

from typing import get_args

from switchps.ps_server.core.actions import (Action, Apply, Count, Free, Join, Record, Release, SetOptimizer,
                                             execute)
from switchps.ps_server.core.events import Aggregate, Outcome, WorkOrder
from harness import ActionLog

ORDER = WorkOrder("bsp", 3, 32, 0.0, 32, False)
ONE_OF_EACH: list[Action] = [
    Join(1, 7), Free(2), Apply(3, Aggregate(0.5, id=7), 0.5, "bsp", 0.0, 0.1),
    Release(1, 0, Outcome(True, 0, 0.1), ORDER), SetOptimizer(0.5, None), Record("switch", {"to": "asp"}),
    Count("dropped", "stale"),
]


def test_every_action_type_is_covered_here() -> None:
    assert {type(a) for a in ONE_OF_EACH} == set(get_args(Action))


def test_each_action_goes_to_its_method_in_order() -> None:
    log = ActionLog()
    actions = ONE_OF_EACH + ONE_OF_EACH[::-1]
    execute(actions, log)
    assert [a for _, a in log.calls] == actions
    assert [m for m, _ in log.calls][:7] == ["join", "free", "apply", "release", "set_optimizer", "record", "count"]


def test_nothing_to_do() -> None:
    log = ActionLog()
    execute([], log)
    assert log.calls == []
