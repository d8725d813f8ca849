"""`switchps run` of an elastic run, changed by `switchps scale`, with real processes: it starts with 4
workers, grows to 6 and shrinks to 3 under BSP, ASP and AMB; ps.csv shows N per update and every push is
counted once. And a second worker process started at a live worker's index is refused and gives up."""

from __future__ import annotations

import csv
import json
import subprocess
import sys
from importlib.resources import files
from pathlib import Path

import pytest

from conftest import assert_each_push_counted_once, wait_until

pytestmark = pytest.mark.integration
SWITCHPS = str(Path(sys.executable).parent / "switchps")
EXAMPLE = Path(str(files("switchps.examples"))) / "elastic.yaml"


def _members(run_dir: Path) -> list[int]:
    with (run_dir / "ps.csv").open() as f:
        return [int(r["members"]) for r in csv.DictReader(f)]


def _scale(run_dir: Path, *args: str) -> subprocess.CompletedProcess:
    return subprocess.run([SWITCHPS, "scale", str(run_dir), *args], capture_output=True, text=True, timeout=60)


PROTOCOLS = {"bsp": [], "asp": ["--set", "protocol.name=asp"],
             "amb": ["--set", "protocol.name=amb", "--set", "protocol.time_budget_s=0.2"]}


@pytest.mark.parametrize("protocol", PROTOCOLS)
def test_switchps_scale_grows_a_run_from_4_to_6_and_shrinks_it_to_3(tmp_path, processes, protocol):
    launcher = processes([SWITCHPS, "run", str(EXAMPLE), "--quiet", "--set", f"output.dir={tmp_path}",
                          "--set", "model.framework=torch", "--set", "cluster.leave_after_s=3",
                          "--set", "train.seconds=45", *PROTOCOLS[protocol]], stderr=subprocess.PIPE, text=True)
    wait_until(lambda: any(tmp_path.glob("elastic-*/ps.csv")), 120, "the run directory")
    run_dir = next(tmp_path.glob("elastic-*"))
    wait_until(lambda: 4 in _members(run_dir), 120, "an update of the 4 starting workers")
    grow = _scale(run_dir, "+2")
    assert grow.returncode == 0 and "for 6 workers (it runs 4)" in grow.stdout, grow.stderr
    wait_until(lambda: 6 in _members(run_dir), 120, "an update of 6 members")
    beyond = _scale(run_dir, "9")
    assert beyond.returncode == 2 and beyond.stderr.strip().endswith("outside cluster.workers' [min, max] = [3, 6]")
    shrink = _scale(run_dir, "--workers", "3")
    assert shrink.returncode == 0, shrink.stderr
    wait_until(lambda: _members(run_dir)[-1:] == [3], 120, "updates of 3 members")
    assert launcher.wait(timeout=180) == 0, launcher.stderr.read()[-3000:] if launcher.stderr else ""
    members = _members(run_dir)
    first6, last6 = members.index(6), len(members) - 1 - members[::-1].index(6)
    assert set(members[:first6]) <= {4, 5} and set(members[last6 + 1:]) <= {3, 4, 5} and members[-1] == 3
    events = [json.loads(line) for line in (run_dir / "events.jsonl").read_text().splitlines()]
    joined = [e["worker"] for e in events if e["event"] == "worker_joined"]
    assert sorted(joined) == [0, 1, 2, 3, 4, 5]
    left = [e for e in events if e["event"] == "worker_left"]
    assert sorted(e["worker"] for e in left) == [3, 4, 5]
    assert {e["reason"] for e in left} == {"exited"}, "a worker stopped by switchps scale says it leaves"
    assert_each_push_counted_once(run_dir)


def test_a_second_worker_process_at_a_live_index_is_refused_and_gives_up(tmp_path, processes):
    """`switchps worker --index 0` while the launcher's worker 0 trains: its registration is refused
    (ALREADY_EXISTS, counted) until cluster.reconnect_s ends; it exits 1 with one line, none of its pushes
    applied, and the run goes on to its end."""
    launcher = processes([SWITCHPS, "run", str(EXAMPLE), "--quiet", "--set", f"output.dir={tmp_path}",
                          "--set", "model.framework=torch", "--set", "train.seconds=25"],
                         stderr=subprocess.PIPE, text=True)
    wait_until(lambda: any(tmp_path.glob("elastic-*/ps.csv")), 120, "the run directory")
    run_dir = next(tmp_path.glob("elastic-*"))
    wait_until(lambda: 4 in _members(run_dir), 120, "an update of the 4 starting workers")
    address = (run_dir / "ps.address").read_text().strip()
    dup = subprocess.run([SWITCHPS, "worker", str(run_dir / "config.yaml"), "--index", "0", "--ps", address,
                          "--set", "cluster.reconnect_s=3"], capture_output=True, text=True, timeout=120)
    last = dup.stderr.strip().splitlines()[-1]
    assert dup.returncode == 1 and "still refused: worker index in use 0" in last, dup.stderr[-3000:]
    assert "Traceback" not in dup.stderr
    assert launcher.wait(timeout=180) == 0, launcher.stderr.read()[-3000:] if launcher.stderr else ""
    summary = assert_each_push_counted_once(run_dir)
    assert summary["rejections"].get("register:index_in_use", 0) >= 1, summary["rejections"]
    events = [json.loads(line) for line in (run_dir / "events.jsonl").read_text().splitlines()]
    assert sorted(e["worker"] for e in events if e["event"] == "worker_joined") == [0, 1, 2, 3]
    assert not [e for e in events if e["event"] == "worker_rejoined"], "the second process never registered"
