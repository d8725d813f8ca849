"""`switchps run` with a sharded PS: real PS shards, evaluator and TensorFlow workers on loopback."""

from __future__ import annotations

import json
import subprocess
import time
from pathlib import Path

import keras
import numpy as np
import psutil
import pytest
import yaml

from test_launch import SWITCHPS, check_run_dir, rows, run
from test_observability import read_events, scalars
from test_plots import compare_rows

pytestmark = pytest.mark.integration
THREE = ["127.0.0.1:0"] * 3


def config(tmp_path: Path, ps: str | list[str], **sections: object) -> Path:
    """Digits on a small MLP whose kernels are cut into row blocks (``shard_max_mb`` 4 KB)."""
    cfg = {"name": "sharded", "cluster": {"workers": 2, "ps": ps},
           "model": {"name": "mlp", "kwargs": {"hidden": [32]}}, "data": {"name": "digits"},
           "optimizer": {"name": "momentum", "learning_rate": 0.05}, "protocol": {"name": "bsp", "batch": 16},
           "train": {"steps": 50}, "checkpoint": {"every_s": None}, "runtime": {"shard_max_mb": 0.004},
           **sections}
    path = tmp_path / "sharded.yaml"
    path.write_text(yaml.safe_dump(cfg))
    return path


def shard_records(run_dir: Path) -> list[dict]:
    return [json.loads((run_dir / f"shard-{k}.json").read_text()) for k in (1, 2)]


def test_three_shards_train_to_the_same_bits_as_one(tmp_path):
    """BSP, 2 workers, fixed data order: the order of summation is the same, so the models are identical."""
    models, run_dirs = [], []
    for name, ps, shards in (("one", "127.0.0.1:0", 1), ("three", THREE, 3)):
        (tmp_path / name).mkdir()
        proc, run_dir = run(tmp_path / name, str(config(tmp_path / name, ps)))
        assert proc.returncode == 0, proc.stderr[-3000:]
        assert run_dir is not None
        summary = check_run_dir(run_dir)
        assert summary["final_version"] == summary["updates"] == 50
        assert (summary["ps_shards"], summary["framework"], summary["device"], summary["hosts"]) == (
            shards, "tensorflow", "cpu", 1), "what it ran on: every role on this one host"
        models.append(keras.models.load_model(run_dir / "model.keras").get_weights())
        run_dirs.append(run_dir)
    assert all(np.array_equal(a, b) for a, b in zip(*models)), "bit-identical parameters after 50 rounds"
    table = compare_rows(*run_dirs, "--out", str(tmp_path / "compare.png"))
    assert [table[label][-4:] for label in ("sharded (" + d.name + ")" for d in run_dirs)] == [
        ["tensorflow", "cpu", "1", "1"], ["tensorflow", "cpu", "3", "1"]], table
    shards = shard_records(run_dir)
    assert [s["final_version"] for s in shards] == [50, 50] and [s["parts_applied"] for s in shards] == [100, 100]
    for s in shards:  # the workers share the shards' host: every push's part came through a segment
        assert s["bytes_in_shared"] == s["bytes_in"] - 4 * s["parameters"] == 100 * 4 * s["parameters"]
    status = subprocess.run([SWITCHPS, "status", str(run_dir)], capture_output=True, text=True, timeout=60)
    assert "PS shard 1" in status.stdout and "PS shard 2" in status.stdout and "v50, 50 updates" in status.stdout
    shard1 = scalars(read_events(run_dir / "tensorboard" / "shard-1"))
    assert shard1["shard/bytes_in_mb"][-1] == (50, pytest.approx(shards[0]["bytes_in"] / 1e6)), "its last record"
    assert sum(s["parameters"] for s in shards) < sum(w.size for w in models[1]), "each shard holds a part"


def test_a_switch_bsp_asp_amb_bsp_on_three_shards_loses_and_repeats_nothing(tmp_path):
    phases = [{"bsp": 0.25}, {"asp": 0.25}, {"amb": 0.25}, {"bsp": 0.25}]
    path = config(tmp_path, THREE, protocol={"name": "bsp", "batch": 16},
                  policy={"name": "schedule", "kwargs": {"phases": phases},
                          "protocols": [{"name": "amb", "time_budget_s": 0.05}]}, train={"steps": 80},
                  device={"samples_per_s": 800})
    proc, run_dir = run(tmp_path, str(path))
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert run_dir is not None
    summary = check_run_dir(run_dir)
    updates = rows(run_dir / "ps.csv")
    protocols = [u["protocol"] for u in updates]
    assert [p for i, p in enumerate(protocols) if i == 0 or p != protocols[i - 1]] == ["bsp", "asp", "amb", "bsp"]
    pushes = [p for u in updates for p in u["pushes"].split(";")]
    assert len(pushes) == len(set(pushes)) == summary["pushes_accepted"], "no push applied twice or lost"
    for s in shard_records(run_dir):  # every shard applied exactly what shard 0 decided
        assert s["final_version"] == s["updates"] == summary["updates"] == 80
        assert s["parts_applied"] == summary["pushes_accepted"] and s["rejections"] == {}
        assert s["parts_freed"] == summary["pushes_dropped"]


def shard_process(launcher_pid: int, shard: int) -> psutil.Process:
    """The process of PS shard ``shard`` among the launcher's children."""
    for child in psutil.Process(launcher_pid).children():
        args = child.cmdline()
        if "ps" in args and (("--shard" in args and args[args.index("--shard") + 1] == str(shard))
                             or (shard == 0 and "--shard" not in args)):
            return child
    raise AssertionError(f"no process of shard {shard}")


@pytest.mark.parametrize("shard", [1, 0])
def test_a_killed_shard_takes_every_shard_back_to_the_last_checkpoint_and_the_run_completes(
        tmp_path, processes, shard):
    path = config(tmp_path, THREE, protocol={"name": "asp", "batch": 16}, train={"steps": 300},
                  device={"samples_per_s": 400}, checkpoint={"every_s": None, "every_updates": 20},
                  output={"dir": str(tmp_path)})
    launcher = processes([SWITCHPS, "run", str(path), "--quiet"], stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                         text=True, cwd=tmp_path)
    deadline = time.monotonic() + 120
    while len(list(tmp_path.glob("*/checkpoints/v*.ckpt"))) < 2:  # shard 0's: every shard's part saved
        assert launcher.poll() is None and time.monotonic() < deadline, launcher.communicate()[1][-3000:]
        time.sleep(0.05)
    shard_process(launcher.pid, shard).kill()
    _, err = launcher.communicate(timeout=240)
    assert launcher.returncode == 0, err[-3000:]
    (run_dir,) = [d for d in tmp_path.iterdir() if (d / "summary.json").exists()]
    summary = check_run_dir(run_dir)
    assert summary["resumes"] == 1 and summary["final_version"] == summary["updates"] == 300
    versions = [int(r["version"]) for r in rows(run_dir / "ps.csv")]
    assert versions == list(range(1, 301)), "every version once (what the crash lost is in ps.lost.csv)"
    pushes = [p for r in rows(run_dir / "ps.csv") for p in r["pushes"].split(";")]
    assert len(pushes) == len(set(pushes)), "no push applied twice"
    (resumed,) = [json.loads(x) for x in (run_dir / "events.jsonl").read_text().splitlines()
                  if json.loads(x)["event"] == "resumed"]
    for s in shard_records(run_dir):  # every shard went back to the version shard 0 resumed from
        assert s["resumed_at"] == resumed["version"] and s["resumed_at"] + s["updates"] == s["final_version"] == 300
        assert s["bytes_in_shared"] == s["bytes_in"] > 0, "after the restart, parts through segments attached again"
    exported = subprocess.run([SWITCHPS, "export", str(run_dir)], capture_output=True, text=True, timeout=120)
    assert exported.returncode == 0, exported.stderr[-3000:]
    final = keras.models.load_model(run_dir / "model.keras").get_weights()
    joined = keras.models.load_model(run_dir / "model-v300.keras").get_weights()
    assert all(np.array_equal(a, b) for a, b in zip(final, joined)), "export joins every shard's part"


def test_a_resume_with_a_shards_part_missing_refuses_with_one_line(tmp_path):
    path = config(tmp_path, THREE, train={"steps": 20}, checkpoint={"every_s": None, "every_updates": 10})
    proc, run_dir = run(tmp_path, str(path))
    assert proc.returncode == 0 and run_dir is not None, proc.stderr[-3000:]
    latest = sorted((run_dir / "checkpoints" / "shard-2").glob("v*.ckpt"))[-1]
    latest.unlink()
    resumed = subprocess.run([SWITCHPS, "run", "--resume", str(run_dir), "--quiet"], capture_output=True, text=True,
                             timeout=240, cwd=tmp_path)
    assert resumed.returncode == 1, resumed.stderr[-3000:]  # the launcher's error: a role failed
    assert "ps exited with code 2" in resumed.stderr, resumed.stderr[-3000:]
    line = f"PS shard 2 cannot resume: {latest} is missing (shard 0 resumed from version 20)"
    assert (run_dir / "logs" / "ps.log").read_text().splitlines()[-1] == f"switchps: {line}", "the launcher quotes it"
    assert line in (run_dir / "logs" / "ps-2.log").read_text(), "shard 2 says it too"


def test_a_shard_index_outside_the_config_is_one_config_error_line(tmp_path):
    out = subprocess.run([SWITCHPS, "ps", str(config(tmp_path, THREE)), "--shard", "3", "--run-dir",
                          str(tmp_path / "run"), "--set", "security.insecure=true"], capture_output=True, text=True,
                         timeout=60)
    assert out.returncode == 2 and not (tmp_path / "run").exists()
    assert out.stderr.splitlines() == ["switchps: config error: ps: --shard 3 outside [0, 3) (cluster.ps lists 3 shards)"]
