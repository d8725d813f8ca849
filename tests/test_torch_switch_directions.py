"""Every switch direction with real worker processes of either framework: one run whose schedule walks an
Eulerian circuit of the complete directed graph of the protocols, so every ordered pair of protocols is
switched once, live, on loopback. The switch semantics themselves are tested on the core
(tests/test_core_switching.py); this checks that the workers of each framework follow every direction."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from switchps.names import PROTOCOLS
from switchps.workload.frameworks import FRAMEWORKS
from test_launch import check_run_dir, model_file, rows, run

pytestmark = pytest.mark.integration
PHASE_STEPS = 3
"""Updates per phase: the schedule is asked after each, and a switch waits for the round in flight, so a
phase of a few updates is never skipped."""
FIELDS = [{"name": "amb", "time_budget_s": 0.05}, {"name": "ssp", "staleness": 1}, {"name": "kasync", "k": 2},
          {"name": "timed", "window_s": 0.05}, {"name": "backup", "backup_workers": 1}]
"""What each protocol that needs more than a name gets when a switch puts it in force (3 workers)."""


def eulerian_circuit(nodes: tuple[str, ...]) -> list[str]:
    """A closed walk from ``nodes[0]`` taking every ordered pair of distinct nodes exactly once (Hierholzer)."""
    out = {a: [b for b in nodes if b != a] for a in nodes}
    stack, circuit = [nodes[0]], []
    while stack:
        if out[stack[-1]]:
            stack.append(out[stack[-1]].pop())
        else:
            circuit.append(stack.pop())
    return circuit[::-1]


def test_the_circuit_takes_every_ordered_pair_once() -> None:
    walk = eulerian_circuit(PROTOCOLS)
    pairs = list(zip(walk, walk[1:]))
    assert walk[0] == walk[-1] == PROTOCOLS[0]
    assert sorted(pairs) == sorted((a, b) for a in PROTOCOLS for b in PROTOCOLS if a != b)


@pytest.mark.parametrize("framework", FRAMEWORKS)
def test_workers_follow_every_switch_direction_in_one_run(tmp_path: Path, framework: str) -> None:
    walk = eulerian_circuit(PROTOCOLS)
    raw = {"name": "circuit", "cluster": {"workers": 3}, "model": {"name": "logreg", "framework": framework},
           "data": {"name": "digits"}, "optimizer": {"name": "sgd", "learning_rate": 0.05},
           "protocol": {"name": walk[0], "batch": 16}, "train": {"steps": PHASE_STEPS * len(walk)},
           "eval": {"every_s": 2.0},
           "policy": {"name": "schedule", "every_k": 1, "protocols": FIELDS,
                      "kwargs": {"unit": "steps", "phases": [{p: PHASE_STEPS} for p in walk]}}}
    cfg = tmp_path / "circuit.yaml"
    cfg.write_text(json.dumps(raw))  # JSON is YAML
    proc, run_dir = run(tmp_path, str(cfg), timeout=400)
    assert proc.returncode == 0 and run_dir is not None, proc.stderr[-3000:]
    summary = check_run_dir(run_dir, framework, model_file(framework))
    events = [json.loads(x) for x in (run_dir / "events.jsonl").read_text().splitlines()]
    done = [(e["from"], e["to"]) for e in events if e["event"] == "switch"]
    assert done == list(zip(walk, walk[1:])), "every direction, in the schedule's order, each once"
    in_force = [r["protocol"] for r in rows(run_dir / "ps.csv")]
    changes = [(a, b) for a, b in zip(in_force, in_force[1:]) if a != b]
    assert changes == done, "each switch shows in the protocol the updates were applied under"
    assert summary["pushes_rejected"] == 0 and summary["final_version"] == summary["updates"]
