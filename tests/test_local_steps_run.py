"""Local SGD and DiLoCo end to end (issue 46): real runs on loopback (a PS, an evaluator and worker processes
of either framework), the PS's record read back: every push of a local protocol carries H local steps of b
samples, the model trains, and a live switch from gradients to local steps and back loses no push.

One run per framework walks all four names by a schedule, from gradients (BSP) to local SGD and back, then
DiLoCo, asynchronous local SGD and asynchronous DiLoCo (two runs: some 2 minutes on 2 cores)."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest

from switchps.workload.frameworks import FRAMEWORKS
from test_launch import check_run_dir, model_file, rows, run

pytestmark = pytest.mark.integration
H, B = 4, 16
SGD, ADAMW = {"name": "sgd", "learning_rate": 0.05}, {"name": "adamw", "learning_rate": 0.01}
PROTOCOLS = [{"name": "bsp", "batch": B, "local_steps": None},
             *({"name": name, "batch": B, "local_steps": H, "inner_optimizer": inner}
               for name, inner in (("local_sgd", SGD), ("diloco", ADAMW), ("async_local_sgd", SGD),
                                   ("async_diloco", ADAMW))),
             {"name": "amb", "batch": B, "time_budget_s": 0.025, "local_steps": H, "inner_optimizer": SGD}]
"""What a switch to each protocol puts in force; amb with local steps is anytime local SGD."""
PHASES = [("bsp", 2), ("local_sgd", 3), ("bsp", 2), ("diloco", 3), ("amb", 3), ("async_local_sgd", 4),
          ("async_diloco", 4)]
"""Updates per phase: gradients, then local steps and back (nothing lost), then each local name in turn; the
schedule is asked after each update, and a switch waits for the round in flight."""
DEVICE = {"samples_per_s": 1600}
"""An emulated device: a local step of B samples takes 10 ms, so anytime local SGD's T of 25 ms fits about 3."""


def config(tmp_path: Path, framework: str, protocol: dict[str, Any], steps: int, **more: Any) -> str:
    """A short run of 2 workers on digits; the run's optimizer steps gradients (and, on a PS without outer
    optimizers, movements too)."""
    raw = {"name": "local", "cluster": {"workers": 2}, "model": {"name": "logreg", "framework": framework},
           "data": {"name": "digits"}, "optimizer": {"name": "sgd", "learning_rate": 0.5},
           "protocol": protocol, "train": {"steps": steps}, "eval": {"every_s": 1.0}, **more}
    path = tmp_path / "run.yaml"
    path.write_text(json.dumps(raw))  # JSON is YAML
    return str(path)


def check_local(row: dict[str, str]) -> None:
    """An update made of pushes of H local steps of B samples each."""
    assert int(row["b_min"]) == int(row["b_max"]) == H * B, row
    workers = row["workers"].split(";")
    if row["protocol"] in ("local_sgd", "diloco"):  # a round: both workers' movements (a gradient is applied alone)
        assert len(workers) == 2, row
    assert int(row["local_steps"]) == H * len(workers), row  # the PS's record: the local steps behind the update


@pytest.mark.parametrize("framework", FRAMEWORKS)
def test_each_local_protocol_trains_between_live_switches_with_every_push_of_h_local_steps(tmp_path,
                                                                                           framework) -> None:
    walk = [p for p, _ in PHASES]
    policy = {"name": "schedule", "every_k": 1, "protocols": PROTOCOLS,
              "kwargs": {"unit": "steps", "phases": [{p: n} for p, n in PHASES]}}
    steps = sum(n for _, n in PHASES)
    proc, run_dir = run(tmp_path, config(tmp_path, framework, {"name": "bsp", "batch": B}, steps, policy=policy,
                                          device=DEVICE),
                        timeout=300)
    assert proc.returncode == 0 and run_dir is not None, proc.stderr[-3000:]
    summary = check_run_dir(run_dir, framework, model_file(framework))
    events = [json.loads(x) for x in (run_dir / "events.jsonl").read_text().splitlines()]
    assert [(e["from"], e["to"]) for e in events if e["event"] == "switch"] == list(zip(walk, walk[1:]))
    updates = rows(run_dir / "ps.csv")
    assert [int(r["version"]) for r in updates] == list(range(1, steps + 1)), "versions advance, one per update"
    assert {r["protocol"] for r in updates} == set(walk), "every phase made updates"
    for r in updates:  # a switch waits for the round in flight: no push of the other kind joins an update
        if r["protocol"] == "bsp":
            assert int(r["b_min"]) == int(r["b_max"]) == B and int(r["local_steps"]) == 0, r
        elif r["protocol"] == "amb":  # as many whole local steps as started within T: at least one, at most H
            assert int(r["b_min"]) % B == int(r["b_max"]) % B == 0 and B <= int(r["b_min"]) <= int(r["b_max"]) <= H * B
            assert len(r["workers"].split(";")) == 2 and int(r["local_steps"]) * B == int(r["samples"]), r
        else:
            check_local(r)
    applied = sum(len(r["pushes"].split(";")) for r in updates)
    assert applied == summary["pushes_accepted"], "every accepted push is in an update"
    assert len(rows(run_dir / "workers.csv")) == summary["pushes_accepted"] + summary["pushes_dropped"]
    assert summary["pushes_rejected"] == 0
    assert summary["final_test_accuracy"] > 0.5, "trained, from chance (0.1)"
