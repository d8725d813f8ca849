"""`switchps run` end to end: real PS, evaluator and worker processes on loopback, digits data."""

from __future__ import annotations

import csv
import json
import os
import signal
import subprocess
import sys
import time
from importlib.resources import files
from pathlib import Path

import numpy as np
import pytest

pytestmark = pytest.mark.integration
CONFIGS = Path(str(files("switchps.configs")))
SWITCHPS = str(Path(sys.executable).parent / "switchps")
SUMMARY_KEYS = {"final_test_accuracy", "best_test_accuracy", "wall_time_s", "updates", "samples",
                "pushes_accepted", "pushes_rejected", "pushes_dropped", "protocol"}


def run(tmp_path: Path, *args: str, timeout: float = 240) -> tuple[subprocess.CompletedProcess, Path | None]:
    proc = subprocess.run([SWITCHPS, "run", *args, "--quiet", "--set", f"output.dir={tmp_path}"],
                          capture_output=True, text=True, timeout=timeout, cwd=tmp_path)
    dirs = [d for d in tmp_path.iterdir() if d.is_dir() and (d / "config.yaml").exists()]
    return proc, (dirs[0] if len(dirs) == 1 else None)


def rows(path: Path) -> list[dict]:
    with path.open() as f:
        return list(csv.DictReader(f))


def check_run_dir(run_dir: Path) -> dict:
    for name in ("config.yaml", "ps.csv", "workers.csv", "eval.csv", "events.jsonl", "summary.json"):
        assert (run_dir / name).exists(), name
    summary = json.loads((run_dir / "summary.json").read_text())
    assert SUMMARY_KEYS <= summary.keys()
    assert len(rows(run_dir / "ps.csv")) == summary["updates"] > 0
    assert summary["final_version"] == summary["updates"], "the final accuracy is of the last version"
    evals = rows(run_dir / "eval.csv")
    assert int(evals[-1]["version"]) == summary["updates"]
    assert float(evals[-1]["test_accuracy"]) == pytest.approx(summary["final_test_accuracy"], abs=1e-6)
    assert (run_dir / "model.keras").stat().st_size > 0
    assert rows(run_dir / "workers.csv")
    events = [json.loads(x)["event"] for x in (run_dir / "events.jsonl").read_text().splitlines()]
    assert "training_started" in events and "training_finished" in events
    return summary


def no_process_mentions(text: str) -> bool:
    out = subprocess.run(["pgrep", "-f", text], capture_output=True, text=True)
    return out.stdout.strip() == ""


@pytest.mark.parametrize("config", ["bsp", "asp", "ssp", "backup", "amb", "fmb"])
def test_example_config_trains_digits_to_090(tmp_path, config):
    proc, run_dir = run(tmp_path, str(CONFIGS / f"{config}.yaml"))
    assert proc.returncode == 0, proc.stderr[-3000:]
    summary = check_run_dir(run_dir)
    assert summary["final_test_accuracy"] >= 0.90, summary
    assert summary["pushes_rejected"] == 0
    updates = rows(run_dir / "ps.csv")
    contributors = [len(u["workers"].split(";")) for u in updates]
    if config in ("bsp", "fmb"):
        assert set(contributors) == {3} and {u["staleness_max"] for u in updates} == {"0"}
    if config == "fmb":
        assert {u["b_min"] for u in updates} == {"16"} and {u["b_max"] for u in updates} == {"16"}
    if config == "amb":  # all three every round; the 3x slower worker contributes fewer samples
        assert set(contributors) == {3} and {u["time_budget_s"] for u in updates} == {"0.12"}
        assert np.mean([float(u["b_min"]) for u in updates]) < 0.6 * np.mean([float(u["b_max"]) for u in updates])
        assert summary["emulated_device"] == {"samples_per_s": 200.0}
        assert (run_dir / "stragglers.csv").exists()
    elif config == "backup":  # N - k = 2 per round; the third push of each round is dropped and counted
        assert set(contributors) == {2}
        assert summary["pushes_dropped"] >= 0.5 * summary["updates"]
        assert set(summary["push_reasons"]) <= {"dropped:backup", "dropped:finished"}
    if config in ("asp", "ssp"):  # one push per update, applied on arrival, some of them stale
        assert set(contributors) == {1}
        assert max(int(u["staleness_max"]) for u in updates) >= 1
    if config == "ssp":  # a worker's pushes never run more than s + 1 versions behind 3 workers' clocks
        assert max(int(u["staleness_max"]) for u in updates) <= (2 + 1) * 3


def test_crashed_worker_stops_everything_and_is_named(tmp_path):
    # the config check imports the builder and binds its arguments; only calling it fails, in the children
    (tmp_path / "crashing_model.py").write_text("def build(input_shape, num_classes, **kwargs):\n"
                                                "    raise RuntimeError('crashing_model: boom')\n")
    proc, run_dir = run(tmp_path, str(CONFIGS / "bsp.yaml"), "--set", "model.name=crashing_model:build")
    assert proc.returncode == 1
    assert "exited with code 1" in proc.stderr and "crashing_model: boom" in proc.stderr
    assert any(role in proc.stderr for role in ("worker-", "evaluator"))
    assert no_process_mentions(str(run_dir)), "orphan processes survived"


def test_ctrl_c_stops_all_processes(tmp_path):
    launcher = subprocess.Popen([SWITCHPS, "run", str(CONFIGS / "asp.yaml"), "--quiet", "--set",
                                 f"output.dir={tmp_path}", "--set", "train.epochs=1000"],
                                stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, cwd=tmp_path)
    deadline = time.monotonic() + 120
    run_dir = None
    while time.monotonic() < deadline:  # wait until training is under way
        dirs = list(tmp_path.glob("asp-*"))
        if dirs and (dirs[0] / "ps.csv").exists() and len((dirs[0] / "ps.csv").read_text().splitlines()) > 5:
            run_dir = dirs[0]
            break
        time.sleep(0.5)
    assert run_dir, "training never started"
    launcher.send_signal(signal.SIGINT)
    _, err = launcher.communicate(timeout=60)
    assert launcher.returncode == 130, err
    assert "interrupted" in err
    time.sleep(1.0)
    assert no_process_mentions(str(run_dir)), "orphan processes survived Ctrl-C"
    assert os.path.exists(run_dir / "logs" / "ps.log")
