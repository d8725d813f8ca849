"""`switchps role` from the command line, and examples/slurm/train.sbatch (and add_workers.sbatch, which
grows an elastic run) on a real SLURM cluster.

The integration test needs a running cluster (`bash scripts/slurm-localhost.sh up`, as root); it never
starts one itself: it skips, saying why, when there is none, and fails under ``CI``, whose `.ci/run` starts one."""

from __future__ import annotations

import csv
import json
import os
import re
import subprocess
import sys
import time
import uuid
from collections.abc import Callable
from pathlib import Path

import pytest
import yaml

from switchps.address import free_port
from conftest import assert_each_push_counted_once
from slurm_local import slurm_env

pytest_plugins = ["slurm_local"]  # slurm_cluster: a running SLURM, or a skip (a failure under CI)

ROOT = Path(__file__).resolve().parent.parent
SBATCH = ROOT / "examples" / "slurm" / "train.sbatch"
ADD_WORKERS = ROOT / "examples" / "slurm" / "add_workers.sbatch"
CONFIG = ROOT / "examples" / "slurm" / "train.yaml"
BIN = Path(sys.executable).parent
SWITCHPS = str(BIN / "switchps")
CLUSTER_ENV = ("SLURM_", "SWITCHPS_ROLE", "SWITCHPS_PS_HOST", "JOB_COMPLETION_INDEX", "TF_CONFIG")
ENDED = ("COMPLETED", "FAILED", "CANCELLED", "TIMEOUT", "NODE_FAIL")


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


def job_env(config: Path, run_dir: Path) -> dict[str, str]:
    """What the example jobs read: SLURM's config, CONFIG, RUN_DIR, and this venv's switchps on PATH."""
    return {**clean_env(), **(slurm_env() or {}), "CONFIG": str(config), "RUN_DIR": str(run_dir),
            "PATH": f"{BIN}:{os.environ['PATH']}"}


def sbatch_wait(tmp_path: Path, config: Path, run_dir: Path, *options: str) -> tuple[dict, str]:
    """Submit the example job and wait for it; its summary and its output."""
    log, env = tmp_path / "job.out", job_env(config, run_dir)
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


def submit(script: Path, env: dict[str, str], log: Path, chdir: Path, *options: str) -> str:
    """Submit ``script`` without waiting; its job id."""
    out = subprocess.run(["sbatch", "--parsable", "--export=ALL", f"--output={log}", f"--chdir={chdir}", *options,
                          str(script)], capture_output=True, text=True, timeout=30, env=env)
    assert out.returncode == 0, out.stderr
    return out.stdout.strip().split(";")[0]


def tail(log: Path) -> str:
    return log.read_text()[-3000:] if log.exists() else ""


def wait_while_running(cond: Callable[[], bool], jobs: dict[str, Path], env: dict[str, str], timeout_s: float,
                       what: str) -> None:
    """Poll ``cond`` while every job in ``jobs`` (id: its output) is queued or running; fail at once,
    with the job's output, if one ended, and after ``timeout_s`` (a hang guard)."""
    give_up = time.monotonic() + timeout_s
    while not cond():
        for job, log in jobs.items():
            assert job_state(job, env) in ("PENDING", "RUNNING", "CONFIGURING"), \
                f"job {job} ended before {what}: {tail(log)}"
        assert time.monotonic() < give_up, f"timed out waiting for {what}"
        time.sleep(0.2)


def wait_until_ended(job: str, log: Path, env: dict[str, str], timeout_s: float) -> str:
    """Wait until ``job`` ended (a hang guard of ``timeout_s``); its final state."""
    give_up = time.monotonic() + timeout_s
    while (state := job_state(job, env)) not in ENDED:
        assert time.monotonic() < give_up, f"job {job} did not end: {tail(log)}"
        time.sleep(0.5)
    return state


@pytest.mark.usefixtures("slurm_cluster")
def test_a_requeued_job_resumes_from_its_checkpoint(tmp_path: Path) -> None:
    """`scontrol requeue` once the PS has checkpointed a trained version: the job runs again in the same
    run directory, the PS resumes (summary resumes == 1) and training still ends at train.steps."""
    config, run_dir, log = job_config(tmp_path), tmp_path / "run", tmp_path / "job.out"
    raw = yaml.safe_load(config.read_text())
    raw.update(device={"samples_per_s": 200}, checkpoint={"every_updates": 40}, train={"steps": 400})
    config.write_text(yaml.safe_dump(raw))
    env = job_env(config, run_dir)
    job = submit(SBATCH, env, log, tmp_path, "--time=00:04:00")
    try:
        # hang guards past the job's own --time (the requeued job has its --time again), not timing assertions
        wait_while_running(lambda: trained_checkpoint(run_dir), {job: log}, env, 270,
                           "a checkpoint of a trained version")
        assert subprocess.run(["scontrol", "requeue", job], env=env, timeout=30).returncode == 0
        wait_until_ended(job, log, env, 270)
        text = log.read_text()
        assert job_state(job, env) == "COMPLETED", text[-3000:]
    finally:
        subprocess.run(["scancel", job], capture_output=True, timeout=30, env=env)
    summary = json.loads((run_dir / "summary.json").read_text())
    assert summary["resumes"] == 1 and summary["final_version"] == summary["updates"] == 400
    assert "restarts 1); run directory" in text and "(resuming)" in text


def ps_members(run_dir: Path) -> list[int]:
    """N per update, from ps.csv (none before the PS wrote it)."""
    if not (run_dir / "ps.csv").is_file():
        return []
    with (run_dir / "ps.csv").open() as f:
        return [int(r["members"]) for r in csv.DictReader(f)]


def events(run_dir: Path, name: str) -> list[dict]:
    path = run_dir / "events.jsonl"
    lines = path.read_text().splitlines() if path.is_file() else []
    return [e for e in map(json.loads, lines) if e["event"] == name]


@pytest.mark.usefixtures("slurm_cluster")
def test_a_second_job_adds_workers_to_an_elastic_run_and_scancel_takes_them_out(tmp_path: Path) -> None:
    """train.sbatch runs an elastic run of 2 workers (max 4); add_workers.sbatch joins 2 more (indices 2, 3)
    from the run directory alone; `scancel` of that job makes them leave (N back to 2, reason `exited`); the
    training job completes, every push counted once."""
    config, run_dir = job_config(tmp_path), tmp_path / "run"
    raw = yaml.safe_load(config.read_text())
    raw["cluster"]["workers"] = {"min": 2, "max": 4, "start": 2}
    raw["model"]["framework"] = "torch"  # the lighter worker start on a loaded machine
    raw.update(data={"name": "digits", "sampling": "replacement"}, device={"samples_per_s": 400},
               train={"seconds": 60})
    config.write_text(yaml.safe_dump(raw))
    env, train_log, add_log = job_env(config, run_dir), tmp_path / "train.out", tmp_path / "add.out"
    train = submit(SBATCH, env, train_log, tmp_path, "--time=00:04:00")
    jobs = [train]
    try:
        wait_while_running(lambda: 2 in ps_members(run_dir), {train: train_log}, env, 180,
                           "updates of the 2 starting workers")
        added = submit(ADD_WORKERS, {**env, "FIRST_INDEX": "2"}, add_log, tmp_path, "--ntasks=2", "--time=00:04:00")
        jobs.append(added)
        wait_while_running(lambda: 4 in ps_members(run_dir), {train: train_log, added: add_log}, env, 180,
                           "updates of 4 members")
        assert subprocess.run(["scancel", added], env=env, timeout=30).returncode == 0
        wait_while_running(lambda: len(events(run_dir, "worker_left")) == 2 and ps_members(run_dir)[-1] == 2,
                           {train: train_log}, env, 120, "the added workers' leaving")
        assert wait_until_ended(added, add_log, env, 60) == "CANCELLED"
        assert wait_until_ended(train, train_log, env, 240) == "COMPLETED", tail(train_log)
    finally:
        for job in jobs:
            subprocess.run(["scancel", job], capture_output=True, timeout=30, env=env)
    members = ps_members(run_dir)
    first4 = members.index(4)
    assert set(members[:first4]) <= {2, 3} and members[-1] == 2
    assert sorted(e["worker"] for e in events(run_dir, "worker_joined")) == [0, 1, 2, 3]
    left = events(run_dir, "worker_left")
    assert sorted(e["worker"] for e in left) == [2, 3]
    assert {e["reason"] for e in left} == {"exited"}, "a worker SLURM stops with SIGTERM says it leaves"
    assert_each_push_counted_once(run_dir)
