"""The simulator against the real system: a straggler trace a real run records is replayed step by step,
exactly, by a simulation and by another real run, and a simulation with the same seed draws the same
delays; a policy's switch happens at the same version in a real run and in its simulation; and two
``switchps simulate`` processes write byte-identical records.

Real runs are small (2 workers, a few steps of 10 samples on an emulated device) and each is launched with
``launcher.launch``, which stops every process it started, also when it fails."""

from __future__ import annotations

import copy
import csv
import json
import os
import subprocess
import sys
from pathlib import Path
from typing import Any, Literal

import pytest

from switchps.config.run import RunConfig, parse_config
from switchps.launch.launcher import launch
from switchps.sim.run import simulate
from switchps.workload.frameworks import FRAMEWORKS

pytestmark = pytest.mark.integration
SWITCHPS = str(Path(sys.executable).parent / "switchps")
STEPS = 8
STRAGGLERS = {"mixture": {"preset": "cedar", "scale": 0.5}, "shifted_exponential": {"shift_s": 0.01, "rate_per_s": 50},
              "slowdown": {"factors": {1: 2.0}}, "comm_delay": {"sigma_s": 0.01}}
"""Every kind whose draws depend only on (seed, worker, step): transient episodes start at wall-clock times."""

Trace = dict[tuple[int, int], tuple[float, float, float]]


def raw_config(out: Path, **sections: Any) -> dict[str, Any]:
    """A small run, real or simulated: 2 workers, BSP batches of 10 at 100 samples/s (0.1 s a step), 8
    updates, real runs under ``out``; ``sections`` replace the base's."""
    raw: dict[str, Any] = {"name": "simreal", "cluster": {"workers": 2}, "model": {"name": "logreg"},
                           "data": {"name": "digits"}, "train": {"steps": STEPS},
                           "device": {"samples_per_s": 100.0}, "protocol": {"name": "bsp", "batch": 10},
                           "optimizer": {"name": "sgd", "learning_rate": 0.1}, "eval": {"every_s": 1.0},
                           "output": {"dir": str(out)}}
    return {**raw, **sections}


def run_config(raw: dict[str, Any], role: Literal["run", "simulate"]) -> RunConfig:
    return parse_config(copy.deepcopy(raw), role=role)  # a copy: launching sets the config's secret file


def real_run(raw: dict[str, Any]) -> Path:
    """Launch ``raw`` for real: its run directory, once every process has exited."""
    run_dir, summary = launch(run_config(raw, "run"), quiet=True)
    assert summary["updates"] == raw["train"]["steps"], summary
    return run_dir


def simulated(raw: dict[str, Any], run_dir: Path) -> Path:
    s = simulate(run_config(raw, "simulate"), run_dir, time_only=True)
    assert s["updates"] == raw["train"]["steps"], s
    return run_dir


def rows(run_dir: Path, table: str) -> list[dict[str, str]]:
    with (run_dir / table).open(newline="") as f:
        return list(csv.DictReader(f))


def trace(run_dir: Path) -> Trace:
    """stragglers.csv as (worker, step) -> (sleep_s, factor, comm_s); each step is recorded once."""
    recorded = rows(run_dir, "stragglers.csv")
    out = {(int(r["worker"]), int(r["step"])): (float(r["sleep_s"]), float(r["factor"]), float(r["comm_s"]))
           for r in recorded}
    assert len(out) == len(recorded), "no step recorded twice"
    return out


def switches(run_dir: Path) -> list[dict[str, Any]]:
    """The protocol switches in events.jsonl, without their (wall or virtual) time."""
    events = [json.loads(line) for line in (run_dir / "events.jsonl").read_text().splitlines()]
    return [{k: v for k, v in e.items() if k != "time_s"} for e in events if e["event"] == "switch"]


# ---- a straggler trace, replayed identically ----------------------------------------------------


@pytest.fixture(scope="module")
def recorded(tmp_path_factory: pytest.TempPathFactory) -> tuple[dict[str, Any], Path]:
    """A real BSP run with stragglers of every seeded kind: its config and run directory."""
    raw = raw_config(tmp_path_factory.mktemp("recorded"), stragglers=STRAGGLERS)
    return raw, real_run(raw)


def check_recording(t: Trace) -> None:
    """The recording is the one every test compares with: a step of each worker, with every kind's delay."""
    assert set(t) == {(w, s) for w in range(2) for s in range(STEPS)}, "BSP: every worker pushes every step"
    assert all(factor == (2.0 if w == 1 else 1.0) for (w, _), (_, factor, _) in t.items()), "worker 1's slowdown"
    assert all(sleep > 0.01 and comm > 0 for sleep, _, comm in t.values()), "shift, mixture and comm drawn"


@pytest.mark.parametrize("replay", [True, False], ids=["replaying-the-trace", "same-seed-and-spec"])
def test_a_simulation_applies_the_real_runs_delays_step_by_step(recorded: tuple[dict[str, Any], Path],
                                                                tmp_path: Path, replay: bool) -> None:
    raw, real = recorded
    recording = trace(real)
    check_recording(recording)
    stragglers = {"trace": str(real / "stragglers.csv")} if replay else STRAGGLERS
    sim = simulated({**raw, "stragglers": stragglers}, tmp_path / "sim")
    # Exact: the PS writes delays at full precision (repr), a replay reads them back as the same floats;
    # without a trace, the simulated workers run the same StragglerInjector keyed by (seed, worker, step).
    assert trace(sim) == recording


def test_a_real_run_replaying_the_trace_applies_its_delays_step_by_step(recorded: tuple[dict[str, Any], Path],
                                                                        tmp_path: Path) -> None:
    raw, real = recorded
    recording = trace(real)
    check_recording(recording)
    replayed = real_run({**raw, "stragglers": {"trace": str(real / "stragglers.csv")},
                         "output": {"dir": str(tmp_path)}})
    assert trace(replayed) == recording
    assert json.loads((replayed / "summary.json").read_text())["stragglers"] == {
        "trace": str(real / "stragglers.csv")}, "the replay ran the trace, not a spec"


# ---- a policy's switch, at the same version -----------------------------------------------------

SCHEDULE = {"name": "schedule", "kwargs": {"phases": [{"bsp": 0.5}, {"asp": 0.5}]}}
GREEDY = {"name": "greedy", "kwargs": {"bsp_fraction": 0.9, "patience": 3}}
"""Greedy decides on step times, yet deterministically here. *Which* steps it sees does not depend on timing:
under BSP each update is a round of both workers and the policy is asked after every update, so after
update v it has seen steps 0..v-1 of each. *What* it sees cannot change its mind: a step is one 10-sample
micro-batch taking t = max(real compute, 0.1 s emulated), and worker 1's slowdown of 10 sleeps 9 t more,
so its step time (compute + sleep, averaged over the window) is 10 t1 against worker 0's t0. The detector
(threshold 1.5) flags worker 1 unless t0 > 6.7 t1 >= 0.67 s (a logreg micro-batch takes milliseconds),
and worker 0 only if t0 > 15 t1. So worker 1 is slow at each of the first three observations and detected
at the third (patience 3): greedy switches to ASP at version 3 in both, long before its BSP quota (0.9 of
the 8 updates) runs out."""


@pytest.mark.parametrize(("policy", "stragglers", "version"),
                         [(SCHEDULE, None, 4), (GREEDY, {"slowdown": {"factors": {1: 10.0}}}, 3)],
                         ids=["schedule", "greedy-with-a-slowdown"])
def test_a_policy_switches_at_the_same_version_in_a_real_run_and_its_simulation(
        tmp_path: Path, policy: dict[str, Any], stragglers: dict[str, Any] | None, version: int) -> None:
    raw = raw_config(tmp_path, policy=policy, **({"stragglers": stragglers} if stragglers else {}))
    real = real_run(raw)
    sim = simulated(raw, tmp_path / "sim")
    (switch,) = switches(sim)
    assert (switch["version"], switch["from"], switch["to"], switch["policy"]) == (version, "bsp", "asp",
                                                                                   policy["name"])
    assert switches(real) == [switch], "the same switch: version, protocols, reason, learning-rate scale"
    protocols = [r["protocol"] for r in rows(sim, "ps.csv")]
    assert protocols == ["bsp"] * version + ["asp"] * (STEPS - version)
    assert [r["protocol"] for r in rows(real, "ps.csv")] == protocols


# ---- the simulator, deterministic across processes ----------------------------------------------


@pytest.mark.parametrize("framework", [None, *FRAMEWORKS], ids=["time-only", *FRAMEWORKS])
def test_two_simulate_processes_write_byte_identical_records(tmp_path: Path, framework: str | None) -> None:
    # A policy that switches back and forth on transient episodes (on virtual time), with the seeded kinds
    # too, on 4 workers: each process has its own hash seed, framework and imports; none may reach a record.
    # With a framework (None: time only), the steps' real gradients are that framework's.
    stragglers = {**{k: v for k, v in STRAGGLERS.items() if k != "slowdown"},
                  "transient": {"workers": 1, "factor": 4.0, "duration_s": 1.0, "every_s": 2.0}}
    raw = raw_config(tmp_path, cluster={"workers": 4}, train={"steps": 60}, stragglers=stragglers,
                     model={"name": "logreg", "framework": framework or "tensorflow"},
                     policy={"name": "greedy", "every_k": 5, "kwargs": {"bsp_fraction": 0.8, "patience": 2}})
    cfg = tmp_path / "cfg.yaml"
    cfg.write_text(json.dumps(raw))  # JSON is YAML
    for name, hash_seed in (("a", "1"), ("b", "2")):
        args = [SWITCHPS, "simulate", str(cfg), "--quiet", "--run-dir", str(tmp_path / name),
                *([] if framework else ["--time-only"])]
        done = subprocess.run(args, capture_output=True, text=True, timeout=240,
                              env={**os.environ, "PYTHONHASHSEED": hash_seed})
        assert done.returncode == 0, done.stderr[-2000:]
    tables = ["ps.csv", "workers.csv", "events.jsonl", "stragglers.csv", *(["eval.csv"] if framework else [])]
    for table in tables:
        assert (tmp_path / "a" / table).read_bytes() == (tmp_path / "b" / table).read_bytes(), table
    summaries = [json.loads((tmp_path / name / "summary.json").read_text()) for name in ("a", "b")]
    assert [{k: v for k, v in s.items() if k != "sim_wall_s"} for s in summaries[1:]] == [
        {k: v for k, v in summaries[0].items() if k != "sim_wall_s"}], "the summary too, but for the wall time"
    assert summaries[0]["framework"] == framework
    assert len(rows(tmp_path / "a", "ps.csv")) == 60
    assert {s["to"] for s in switches(tmp_path / "a")} == {"asp", "bsp"}, "it switched there and back"
