"""The core's checkpoint is complete: saved and restored into a fresh core at *every* step of a script
that crosses every part (BSP rounds, a switch decided mid-round, a learning-rate ramp, an SSP block, a
policy's decision, an exclusion, a time-windowed protocol), the restored core produces exactly the
actions the original does for the rest of the script. A field a part forgets to save fails here."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import numpy as np
import pytest

from harness import Harness
from switchps.policies.base import Decision
from switchps.policies.schedule import Schedule
from switchps.ps_server.checkpointer import compose, restore
from switchps.ps_server.core.actions import Action, Apply, Join
from switchps.ps_server.core.events import Push, StepReport

Op = Callable[[Harness], None]


def _push(worker: int, value: float = 1.0, samples: int = 1) -> Op:
    def op(h: Harness) -> None:
        h.push(worker, value, samples=samples, step=h.steps.get(worker, 0), session=worker + 1,
               report=StepReport(compute_s=0.01 * (worker + 1)))
        h.steps[worker] = h.steps.get(worker, 0) + 1
    return op


def _advance(seconds: float) -> Op:
    return lambda h: h.advance(seconds)


def _switch(**fields: Any) -> Op:
    return lambda h: h.switch(**fields)


def _decide(d: Decision) -> Op:
    return lambda h: h.run(h.core.decide(d, "manual", h.now))


SCRIPT: list[Op] = [
    _push(0), _push(1, 2.0), _push(2, 3.0),                      # a BSP round
    _push(0), _switch(name="asp"), _advance(0.1),                # a switch decided mid-round waits
    _push(1, 2.0), _push(2, 3.0),                                # the round completes: ASP in force
    _push(0), _push(1), _push(0, samples=1),                     # the ramp after the switch
    _switch(name="ssp", staleness=0), _push(0), _push(0),        # worker 0 runs ahead: held (a block)
    _push(1), _push(2),                                          # the block lifts
    _decide(Decision("slow", exclude=frozenset({2}))),           # an exclusion
    _push(0), _push(1), _advance(2.0),
    _switch(name="bsp"), _push(0), _push(1),                     # a round without the excluded worker
    _decide(Decision("back", readmit=frozenset({2}), batches={1: 4})),
    _switch(name="timed", window_s=0.5), _push(0), _advance(0.2), _push(2), _advance(0.6),
    _push(1), _advance(0.6),
    _switch(name="kasync", k=2), _push(0), _push(2), _push(1),
    _advance(40.0),  # past the schedule's first phase: the policy decides
    _push(0), _push(1), _push(2),
]


def _fresh(start: bool = True) -> Harness:
    return Harness(workers=3, protocol={"name": "bsp", "batch": 8, "deadline_s": 30.0},
                   train={"steps": 10_000}, on_switch={"warmup_updates": 3}, momentum=0.9,
                   policy=Schedule(phases=[{"bsp": 0.999}], unit="fraction"), start=start)


def _normal(a: Action) -> Any:
    """An action as comparable data (an ``Apply``'s aggregate by its id and members)."""
    if isinstance(a, Apply):
        members = tuple((m.id, m.worker, m.samples, m.staleness) for m in a.aggregate.members)
        return ("apply", a.version, a.aggregate.id, members, a.lr_factor, a.protocol, a.time_budget_s, a.wait_s)
    return a


def _run(h: Harness, ops: list[Op]) -> list[Any]:
    start = len(h.log)
    for op in ops:
        op(h)
    return [_normal(a) for a in h.log[start:]]


def _restored(h: Harness) -> Harness:
    back = _fresh(start=False)
    back.now, back._ids, back.steps, back.params = h.now, h._ids, dict(h.steps), h.params.copy()
    back.lr_scale, back.momentum = h.lr_scale, h.momentum
    restore(back.parts(), compose(h.parts(), h.now), h.core.version, h.now, crash=False)
    return back


@pytest.mark.parametrize("cut", range(len(SCRIPT) + 1))
def test_a_core_restored_at_any_step_acts_exactly_as_the_original(cut):
    original = _fresh()
    _run(original, SCRIPT[:cut])
    restored = _restored(original)
    assert restored.core.state_dict(restored.now) == original.core.state_dict(original.now)
    expected, got = _run(original, SCRIPT[cut:]), _run(restored, SCRIPT[cut:])
    assert got == expected
    np.testing.assert_array_equal(restored.params, original.params)


def test_the_script_crosses_every_part():
    h = _fresh()
    _run(h, SCRIPT)
    events = {r.event for r in h.records}
    assert {"switch", "worker_excluded", "worker_readmitted", "batches"} <= events
    assert {"asp", "ssp", "bsp", "timed", "kasync"} <= set(h.protocols_applied())
    assert any(isinstance(a, Apply) and a.lr_factor < 1 for a in h.log), "a ramp after a switch"
    h.check_books()


def test_a_pending_switch_survives_a_checkpoint():
    """The defect this file exists for: a switch decided while a round is in flight used to be lost."""
    h = _fresh()
    _run(h, SCRIPT[:5])  # one push of the round, then the switch to ASP
    assert h.core.switching.pending is not None
    back = _restored(h)
    _run(back, [_push(1, 2.0), _push(2, 3.0)])
    assert back.core.spec.name == "asp"


def test_the_core_runs_on_pushes_without_any_payload():
    """A time-only driver (the simulator) has no gradients: the core decides from the pushes alone."""
    h = _fresh()
    core = h.core
    joins = []
    for i, w in enumerate([0, 1, 2, 0, 1, 2]):
        out = core.push(Push(100 + i, w, core.version, 1, 0.0, h.now, step=i // 3, session=9 + w), StepReport(),
                        h.now)
        joins += [a for a in out if isinstance(a, Join)]
    assert core.version == 2 and len(joins) == 6 and len({j.aggregate_id for j in joins}) == 2
