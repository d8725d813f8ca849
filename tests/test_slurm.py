"""`switchps role` from the command line, and examples/slurm/train.sbatch on a real SLURM cluster.

The integration test needs a running cluster (`bash scripts/slurm-localhost.sh up`, as root); it never
starts one itself: it skips, saying why, when there is none, and fails under ``CI``, whose `.ci/run` starts one."""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
import time
import uuid
from pathlib import Path

import pytest
import yaml

from switchps.address import free_port
from slurm_local import slurm_env

pytest_plugins = ["slurm_local"]  # slurm_cluster: a running SLURM, or a skip (a failure under CI)

ROOT = Path(__file__).resolve().parent.parent
SBATCH = ROOT / "examples" / "slurm" / "train.sbatch"
CONFIG = ROOT / "examples" / "slurm" / "train.yaml"
BIN = Path(sys.executable).parent
SWITCHPS = str(BIN / "switchps")
CLUSTER_ENV = ("SLURM_", "SWITCHPS_ROLE", "SWITCHPS_PS_HOST", "JOB_COMPLETION_INDEX", "TF_CONFIG")


def clean_env() -> dict[str, str]:
    """This environment without any cluster variable (pytest itself may run inside a SLURM job)."""
    return {k: v for k, v in os.environ.items() if not k.startswith(CLUSTER_ENV)}


def test_role_help_runs_the_cli() -> None:
    out = subprocess.run([SWITCHPS, "role", "--help"], capture_output=True, text=True, timeout=60)
    assert out.returncode == 0, out.stderr
    assert out.stdout.startswith("usage: switchps role") and "--run-dir" in out.stdout


def test_role_outside_a_cluster_is_a_one_line_config_error(tmp_path: Path) -> None:
    out = subprocess.run([SWITCHPS, "role", str(CONFIG), "--run-dir", str(tmp_path)], capture_output=True,
                         text=True, timeout=60, env=clean_env())
    assert out.returncode == 2
    assert out.stderr.strip().splitlines() == [out.stderr.strip()]
    assert "no cluster environment" in out.stderr and "Traceback" not in out.stderr


def test_role_with_port_zero_names_cluster_ps(tmp_path: Path) -> None:
    env = {**clean_env(), "SLURM_PROCID": "2", "SLURM_NTASKS": "4", "SLURM_STEP_NODELIST": "n[1-2]",
           "SLURM_STEP_TASKS_PER_NODE": "2(x2)"}
    out = subprocess.run([SWITCHPS, "role", str(CONFIG), "--set", "cluster.ps=127.0.0.1:0", "--run-dir",
                          str(tmp_path)], capture_output=True, text=True, timeout=60, env=env)
    assert out.returncode == 2
    assert out.stderr.startswith("switchps: config error: cluster.ps:") and "Traceback" not in out.stderr


def job_config(tmp_path: Path, shards: int = 1) -> Path:
    """train.yaml on ports free now (the job's PS shards bind them), runs under tmp_path."""
    raw = yaml.safe_load(CONFIG.read_text())
    ports = sorted({free_port() for _ in range(4 * shards)})[:shards]
    raw["cluster"]["ps"] = f"0.0.0.0:{ports[0]}" if shards == 1 else [f"0.0.0.0:{p}" for p in ports]
    raw["runtime"]["shard_max_mb"] = 0.004
    raw["output"] = {"dir": str(tmp_path / "runs")}
    path = tmp_path / "train.yaml"
    path.write_text(yaml.safe_dump(raw))
    return path


def sbatch_wait(tmp_path: Path, config: Path, run_dir: Path, *options: str) -> tuple[dict, str]:
    """Submit the example job and wait for it; its summary and its output."""
    log = tmp_path / "job.out"
    env = {**clean_env(), **(slurm_env() or {}), "CONFIG": str(config), "RUN_DIR": str(run_dir),
           "PATH": f"{BIN}:{os.environ['PATH']}"}
    name = f"switchps-test-{uuid.uuid4().hex[:8]}"
    try:
        out = subprocess.run(["sbatch", "--wait", "--export=ALL", f"--job-name={name}", f"--output={log}",
                              f"--chdir={tmp_path}", "--time=00:03:00", *options, str(SBATCH)],
                             capture_output=True, text=True, timeout=170, env=env)
    finally:
        subprocess.run(["scancel", f"--name={name}"], capture_output=True, timeout=30, env=env)
    text = log.read_text() if log.exists() else ""
    assert out.returncode == 0, f"{out.stdout}{out.stderr}\n{text[-3000:]}"
    summary = json.loads((run_dir / "summary.json").read_text())
    assert summary["final_version"] == summary["updates"] == yaml.safe_load(config.read_text())["train"]["steps"]
    return summary, text


def ranks(text: str, ntasks: int) -> dict[str, str]:
    """Each rank's role, as the job's output says."""
    return dict(re.findall(rf"^(\d+): .*switchps role: (ps shard \d+|ps|evaluator|worker \d+) \(slurm rank \1 "
                           rf"of {ntasks}", text, re.M))


@pytest.mark.usefixtures("slurm_cluster")
def test_sbatch_trains_with_each_task_in_its_role(tmp_path: Path) -> None:
    config, run_dir = job_config(tmp_path), tmp_path / "run"
    summary, text = sbatch_wait(tmp_path, config, run_dir)
    assert ranks(text, 4) == {"0": "ps", "1": "evaluator", "2": "worker 0", "3": "worker 1"}
    assert (run_dir / "secret").stat().st_mode & 0o777 == 0o600
    assert (run_dir / "secret").read_text().strip() not in text


@pytest.mark.usefixtures("slurm_cluster")
def test_sbatch_places_a_sharded_ps_on_the_first_ranks(tmp_path: Path) -> None:
    config, run_dir = job_config(tmp_path, shards=2), tmp_path / "run"
    summary, text = sbatch_wait(tmp_path, config, run_dir, "--ntasks=5")
    assert ranks(text, 5) == {"0": "ps", "1": "ps shard 1", "2": "evaluator", "3": "worker 0", "4": "worker 1"}
    shard = json.loads((run_dir / "shard-1.json").read_text())
    assert shard["final_version"] == summary["final_version"] and shard["parts_applied"] == summary["pushes_accepted"]


def trained_checkpoint(run_dir: Path) -> bool:
    """The PS has written a checkpoint of a version after 0 (v0 is the model before any update)."""
    return any(p.name != "v0000000000.ckpt" for p in (run_dir / "checkpoints").glob("v*.ckpt"))


def job_state(job: str, env: dict[str, str]) -> str:
    out = subprocess.run(["scontrol", "show", "job", job], capture_output=True, text=True, timeout=30, env=env)
    m = re.search(r"JobState=(\S+)", out.stdout)
    return m.group(1) if m else "UNKNOWN"


@pytest.mark.usefixtures("slurm_cluster")
def test_a_requeued_job_resumes_from_its_checkpoint(tmp_path: Path) -> None:
    """`scontrol requeue` once the PS has checkpointed a trained version: the job runs again in the same
    run directory, the PS resumes (summary resumes == 1) and training still ends at train.steps."""
    config, run_dir, log = job_config(tmp_path), tmp_path / "run", tmp_path / "job.out"
    raw = yaml.safe_load(config.read_text())
    raw.update(device={"samples_per_s": 200}, checkpoint={"every_updates": 40}, train={"steps": 400})
    config.write_text(yaml.safe_dump(raw))
    env = {**clean_env(), **(slurm_env() or {}), "CONFIG": str(config), "RUN_DIR": str(run_dir),
           "PATH": f"{BIN}:{os.environ['PATH']}"}
    out = subprocess.run(["sbatch", "--parsable", "--export=ALL", f"--output={log}", f"--chdir={tmp_path}",
                          "--time=00:04:00", str(SBATCH)], capture_output=True, text=True, timeout=30, env=env)
    job = out.stdout.strip().split(";")[0]
    try:
        assert out.returncode == 0, out.stderr
        give_up = time.monotonic() + 270  # a hang guard past the job's own --time, not a timing assertion
        while not trained_checkpoint(run_dir):
            assert job_state(job, env) in ("PENDING", "RUNNING", "CONFIGURING"), log.read_text()[-3000:]
            assert time.monotonic() < give_up, "no checkpoint of a trained version"
            time.sleep(0.2)
        assert subprocess.run(["scontrol", "requeue", job], env=env, timeout=30).returncode == 0
        give_up = time.monotonic() + 270  # the requeued job has its --time again
        while job_state(job, env) not in ("COMPLETED", "FAILED", "CANCELLED", "TIMEOUT", "NODE_FAIL"):
            assert time.monotonic() < give_up, f"job {job} did not end: {log.read_text()[-3000:]}"
            time.sleep(0.5)
        text = log.read_text()
        assert job_state(job, env) == "COMPLETED", text[-3000:]
    finally:
        subprocess.run(["scancel", job], capture_output=True, timeout=30, env=env)
    summary = json.loads((run_dir / "summary.json").read_text())
    assert summary["resumes"] == 1 and summary["final_version"] == summary["updates"] == 400
    assert "restarts 1); run directory" in text and "(resuming)" in text
