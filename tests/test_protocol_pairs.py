"""A protocol is a work rule and an aggregation rule: the registry's pairs, what each pair does, the time
budget's one "none" across the wire, and a checkpoint from before the split that still resumes."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import numpy as np
import pytest

from harness import Harness
from switchps import names
from switchps.config.protocol import protocol_spec
from switchps.protos import switchps_pb2 as pb
from switchps.protos.orders import from_wire
from switchps.ps_server.checkpointer import restore
from switchps.ps_server.core.aggregation import Bounded, EveryK, OnArrival, Rounds, Windowed
from switchps.ps_server.core.actions import Apply
from switchps.ps_server.core.events import Batches, Budget, WorkOrder
from switchps.ps_server.core.protocols import PROTOCOLS, make_protocol
from switchps.ps_server.core.work_rules import LocalSteps, Samples, TimeBudget
from switchps.ps_server.work_orders import to_wire as _order
from test_core_state import SCRIPT, _fresh, _push, _run

PAIRS = {"bsp": (Rounds, Samples), "fmb": (Rounds, Samples), "amb": (Rounds, TimeBudget),
         "backup": (Rounds, Samples), "asp": (OnArrival, Samples), "ssp": (Bounded, Samples),
         "kasync": (EveryK, Samples), "timed": (Windowed, Samples), "local_sgd": (Rounds, LocalSteps),
         "diloco": (Rounds, LocalSteps), "async_local_sgd": (OnArrival, LocalSteps),
         "async_diloco": (OnArrival, LocalSteps)}
REQUIRED = {"amb": {"time_budget_s": 0.5}, "timed": {"window_s": 1.0}}


@pytest.mark.parametrize("name", names.PROTOCOLS)
def test_each_name_is_its_pair_of_rules(name):
    p = make_protocol(protocol_spec({"name": name, "batch": 8, **REQUIRED.get(name, {})}))
    assert (type(p.rule), type(p.work)) == PAIRS[name]
    assert p.rule.__class__ is PROTOCOLS[name].rule and (p.local or type(p.work) is PROTOCOLS[name].work)
    assert set(PAIRS) == set(names.PROTOCOLS)


def test_the_work_rule_alone_sets_the_order_and_the_measured_batch():
    """AMB and FMB share their aggregation rule; only the work rule tells them apart (no test on a name)."""
    amb, fmb = (make_protocol(protocol_spec({"name": n, "batch": 8, "micro_batch": 2, **REQUIRED.get(n, {})}))
                for n in ("amb", "fmb"))
    assert type(amb.rule) is type(fmb.rule)
    assert amb.work.budget(0, {0: 3}) == Budget(32, 0.5, 2) and fmb.work.budget(0, {0: 3}) == Budget(3, None, 2)
    measured = Batches(4, {}, step_samples=5.0)
    assert (amb.measures_batch, amb.effective_batch(measured)) == (True, 20.0)
    assert (fmb.measures_batch, fmb.effective_batch(measured)) == (False, 32.0)


def test_backup_is_rounds_with_at_least_one_backup_worker():
    h = Harness(workers=4, size=4, protocol={"name": "backup"})
    assert h.core.spec.backup_workers == 1
    for w in range(3):
        h.push(w, 1.0)
    assert h.core.version == 1, "the round completes on N - 1 pushes"
    late = h.push(3, 1.0, base=0)
    assert not h.releases[late].outcome.applied and h.counts["dropped:backup"] == 1 and h.core.version == 1
    h.check_books()


@pytest.mark.parametrize("budget, wire", [(None, 0.0), (0.25, 0.25)])
def test_the_time_budget_crosses_the_wire_as_0_for_none(budget, wire):
    sent = _order(WorkOrder("amb" if budget else "bsp", 3, 16, budget, 4, False))
    received = pb.WorkOrder.FromString(sent.SerializeToString())
    assert received.time_budget_s == wire and from_wire(received.time_budget_s) == budget


# ---- a checkpoint from before the split --------------------------------------------------------------

SAVED = json.loads((Path(__file__).parent / "data" / "core_state_flat_spec.json").read_text())
"""Core checkpoints taken by main's code before the split (3141d23: the flat ``ProtocolSpec`` of every
protocol's fields, ``SyncProtocol`` states), each with the applies and parameters the rest of its script
produced there: at steps 5 (BSP, a switch to ASP pending), 13 (SSP, a push held) and 27 (timed, a
window open) of ``test_core_state.SCRIPT``, and AMB with a round in flight and a switch to BSP pending."""
AMB_REST = [_push(1, 2.0), _push(2, 3.0), _push(0), _push(1), _push(2)]


def _amb(start: bool) -> Harness:
    return Harness(workers=3, protocol={"name": "amb", "batch": 8, "time_budget_s": 0.25, "max_batch": 16,
                                        "deadline_s": 30.0}, on_switch={"warmup_updates": 3}, momentum=0.9,
                   start=start)


def _applied(a: Apply) -> list[Any]:
    members = [[m.id, m.worker, m.samples, m.staleness] for m in a.aggregate.members]
    return ["apply", a.version, a.aggregate.id, members, a.lr_factor, a.protocol, a.time_budget_s, a.wait_s]


@pytest.mark.parametrize("case", sorted(SAVED))
def test_a_checkpoint_of_the_flat_layout_resumes_as_it_did(case):
    saved = SAVED[case]
    h = _amb(start=False) if case.startswith("amb") else _fresh(start=False)
    h.now, h._ids, h.params = saved["now"], saved["ids"], np.array(saved["params"])
    h.steps = {int(w): s for w, s in saved["steps"].items()}
    h.lr_scale, h.momentum = saved["lr_scale"], saved["momentum"]
    state = {"core": saved["checkpoint"]["core"],
             "sums": {k: np.array(v, np.float32) for k, v in saved["checkpoint"]["sums"].items()}}
    restore(h.parts(), state, state["core"]["version"], h.now, crash=False)
    rest = AMB_REST if case.startswith("amb") else SCRIPT[int(case.rpartition("_")[2]):]
    _run(h, rest)
    assert [_applied(a) for a in h.applied] == saved["applied"]
    np.testing.assert_allclose(h.params, saved["final_params"], rtol=1e-12)
