"""Checkpoints and resume on a real PS over loopback; a PS killed with kill -9 under `switchps run`."""

from __future__ import annotations

import json
import subprocess
import time
from pathlib import Path

import numpy as np
import psutil
import pytest

from cluster import LiveCluster, start_cluster
from switchps.config.run import parse_config
from switchps.errors import RunDirError
from switchps.ps_server import checkpoint
from switchps.ps_server.rpc.main import prepare_run_dir

from test_launch import CONFIGS, SWITCHPS, check_run_dir, rows
from test_outputs import score_in_plain_python

pytest_plugins = ["cluster"]  # cluster_factory: a PS on loopback

SIZE = 8
EVERY_2 = {"every_updates": 2, "every_s": None}
ASP = {"name": "asp"}


def crash(c: LiveCluster) -> None:
    """Stop a PS as a kill would leave it: no summary, no final flush beyond what the flusher did."""
    assert c.ps.checkpointer is not None and c.ps.checkpointer.wait(10)
    c.ps.store.wait_idle(10)
    c.rec.flush()
    for w in c.workers:
        w.client.close()
    c.server.stop(grace=None)


def stop(c: LiveCluster) -> None:
    for w in c.workers:
        w.client.close()
    c.server.stop(grace=None)


def pushed_to_version_5(tmp_path: Path) -> LiveCluster:
    """ASP, plain SGD at rate 1, a gradient of ones each push: version v holds -v everywhere.
    Checkpoints at versions 0, 2 and 4; version 5 is applied but not checkpointed when the PS dies."""
    a = start_cluster(tmp_path, workers=2, size=SIZE, protocol=ASP, checkpoint=EVERY_2)
    for step in range(5):
        a.workers[0].push(np.ones(SIZE), 1, session=11, step=step)
        assert a.ps.checkpointer is not None and a.ps.checkpointer.wait(10)  # none deferred: at 0, 2 and 4
    assert a.core.version == 5
    crash(a)
    return a


def ps_versions(run_dir: Path, name: str = "ps.csv") -> list[int]:
    return [int(r["version"]) for r in rows(run_dir / name)]


def test_resume_continues_the_version_numbering_the_model_and_the_records(tmp_path):
    a = pushed_to_version_5(tmp_path)
    b = start_cluster(tmp_path, workers=2, size=SIZE, protocol=ASP, checkpoint=EVERY_2, resume=True)
    try:
        assert b.core.version == 4 and b.workers[0].version == 4
        np.testing.assert_array_equal(b.params, np.full(SIZE, -4.0, np.float32))
        (resumed,) = b.events("resumed")
        assert resumed["version"] == 4 and resumed["lost_updates"] == 1
        assert ps_versions(tmp_path) == [1, 2, 3, 4] and ps_versions(tmp_path, "ps.lost.csv") == [5]
        retry = b.workers[0].push(np.ones(SIZE), 1, base_version=4, session=11, step=4)  # lost with v5: again
        assert retry.reply.applied and b.core.version == 5
        dup = b.workers[0].push(np.ones(SIZE), 1, base_version=3, session=11, step=3)  # in the checkpoint
        assert not dup.reply.applied and dup.reply.note == "dropped: repeated" and b.core.version == 5
        b.ps.store.wait_idle(10)
        b.rec.flush()
        assert ps_versions(tmp_path) == [1, 2, 3, 4, 5]
        pushes = [p for r in rows(tmp_path / "ps.csv") for p in r["pushes"].split(";")]
        assert len(pushes) == len(set(pushes)) == 5, "each push applied once"
        assert b.rec.counts["accepted"] == 4 + 1, "counters continue from the checkpoint"
        assert a.ps.store.layout.digest == b.ps.store.layout.digest
    finally:
        stop(b)


def test_a_torn_latest_checkpoint_is_ignored_in_favour_of_the_one_before(tmp_path):
    pushed_to_version_5(tmp_path)
    newest = checkpoint.files(tmp_path / "checkpoints")[0]
    assert newest.name == "v0000000004.ckpt"
    newest.write_bytes(newest.read_bytes()[:-1000])
    b = start_cluster(tmp_path, workers=2, size=SIZE, protocol=ASP, checkpoint=EVERY_2, resume=True)
    try:
        assert b.core.version == 2
        np.testing.assert_array_equal(b.params, np.full(SIZE, -2.0, np.float32))
        (resumed,) = b.events("resumed")
        assert resumed["checkpoint"] == "v0000000002.ckpt" and resumed["lost_updates"] == 3
    finally:
        stop(b)


def test_a_retried_push_is_applied_once(cluster_factory):
    c = cluster_factory(workers=2, size=SIZE, protocol=ASP)
    first = c.workers[0].push(np.ones(SIZE), 1, session=7, step=0)
    again = c.workers[0].push(np.ones(SIZE), 1, base_version=0, session=7, step=0)  # its reply was lost
    assert first.reply.applied and not again.reply.applied and again.reply.note == "dropped: repeated"
    assert c.core.version == 1 and again.order.version == 1, "the retry gets the current model"
    np.testing.assert_array_equal(c.params, np.full(SIZE, -1.0, np.float32))
    assert c.rec.reasons["dropped:repeated"] == 1


def test_a_new_ps_refuses_a_run_directory_that_holds_a_run(tmp_path):
    c = start_cluster(tmp_path, workers=1, size=SIZE, protocol=ASP)
    c.workers[0].push(np.ones(SIZE), 1)
    crash(c)
    before = {p: p.read_bytes() for p in tmp_path.rglob("*") if p.is_file()}
    with pytest.raises(RunDirError, match="already holds a run"):
        prepare_run_dir(parse_config({}), tmp_path, resume=False)
    proc = subprocess.run([SWITCHPS, "ps", str(CONFIGS / "asp.yaml"), "--run-dir", str(tmp_path),
                           "--set", "security.insecure=true"],
                          capture_output=True, text=True, timeout=60)
    assert proc.returncode == 2 and "Traceback" not in proc.stderr
    assert [line for line in proc.stderr.splitlines() if "switchps:" in line] == \
        [f"switchps: {tmp_path} already holds a run; resume it with --resume {tmp_path}, or choose another --run-dir"]
    assert {p: p.read_bytes() for p in tmp_path.rglob("*") if p.is_file()} == before, "nothing was touched"


def _ps_process(launcher: psutil.Process) -> psutil.Process | None:
    for p in launcher.children():
        try:
            if p.cmdline()[3:4] == ["ps"]:
                return p
        except psutil.Error:  # gone, or a zombie
            pass
    return None


def _kill_ps_after(launcher: subprocess.Popen, out: Path, rows_before: int) -> int:
    """Wait until ps.csv has ``rows_before`` rows, then kill -9 the PS; returns the version it reached."""
    deadline = time.monotonic() + 180
    while time.monotonic() < deadline and launcher.poll() is None:
        found = list(out.glob("*/ps.csv"))
        if found and len(found[0].read_text().splitlines()) > rows_before:
            ps = _ps_process(psutil.Process(launcher.pid))
            assert ps is not None
            ps.kill()
            return len(found[0].read_text().splitlines()) - 1
        time.sleep(0.05)
    raise AssertionError("the run never reached the moment of the kill")


@pytest.mark.integration
def test_switchps_run_restarts_a_killed_ps_and_the_workers_ride_it_out(tmp_path, processes):
    launcher = processes([SWITCHPS, "run", str(CONFIGS / "asp.yaml"), "--quiet", "--set",
                          f"output.dir={tmp_path}", "--set", "checkpoint.every_updates=25"],
                         stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, cwd=tmp_path)
    _kill_ps_after(launcher, tmp_path, rows_before=60)
    _, err = launcher.communicate(timeout=240)
    assert launcher.returncode == 0, err[-3000:]
    (run_dir,) = [d for d in tmp_path.iterdir() if (d / "config.yaml").exists()]
    summary = check_run_dir(run_dir)
    assert summary["resumes"] == 1 and summary["final_test_accuracy"] >= 0.9
    lost_eval = summary["rejections"].pop("eval:version", 0)  # an evaluation of a version the crash lost
    assert summary["rejections"] == {}, "the restarted PS reads the run's secret: every token still holds"
    assert lost_eval <= 1, "only the evaluation in flight at the kill can name a lost version"
    assert ps_versions(run_dir) == list(range(1, summary["updates"] + 1)), "one row per version, in order"
    pushes = [p for r in rows(run_dir / "ps.csv") for p in r["pushes"].split(";")]
    assert len(pushes) == len(set(pushes)), "no push applied twice"
    events = [json.loads(line) for line in (run_dir / "events.jsonl").read_text().splitlines()]
    (resumed,) = [e for e in events if e["event"] == "resumed"]
    # The interval, plus the updates applied while the newest checkpoint was being written (a checkpoint
    # falling due meanwhile is deferred until that write ends), plus the unflushed tail of ps.csv.
    assert 0 <= resumed["lost_updates"] <= 2 * 25 + 5, "at most what the documented interval allows"
    serving = [e["address"] for e in events if e["event"] == "ps_serving"]
    assert serving == 2 * [(run_dir / "ps.address").read_text().strip()], "the PS came back on its port"
    assert "ps exited with code -9; restarting it (1 of 3)" in err
    logs = [(run_dir / "logs" / f"worker-{i}.log").read_text() for i in range(3)]
    assert all("unreachable" in log and "is back" in log for log in logs)
    assert all(log.count("pushes through shared memory") == 2 for log in logs), "attached again on rejoining"
    exported = subprocess.run([SWITCHPS, "export", str(run_dir), "--out", str(tmp_path / "exported.keras")],
                              capture_output=True, text=True, timeout=120)
    assert exported.returncode == 0, exported.stderr[-2000:]
    accuracy, _, _ = score_in_plain_python(tmp_path / "exported.keras", tmp_path)
    assert accuracy == summary["final_test_accuracy"], "the latest checkpoint holds the final model"


def test_export_names_the_checkpoints_kept_when_asked_for_another(tmp_path):
    pushed_to_version_5(tmp_path)
    proc = subprocess.run([SWITCHPS, "export", str(tmp_path), "--checkpoint", "3"], capture_output=True,
                          text=True, timeout=60)
    assert proc.returncode == 2 and "Traceback" not in proc.stderr
    assert proc.stderr.strip().splitlines()[-1] == \
        f"switchps: {tmp_path}: no readable checkpoint of version 3 (versions kept: 4, 2)"



@pytest.mark.parametrize("args, message", [
    (["--resume", "{tmp}/nowhere"], "switchps: {tmp}/nowhere is not a run directory (no config.yaml)"),
    ([str(CONFIGS / "asp.yaml"), "--resume", "{tmp}"],
     "switchps: config error: run: give a config or --resume RUN_DIR (which holds its config), not both"),
])
def test_run_resume_mistakes_are_one_line_before_any_process_starts(tmp_path, args, message):
    proc = subprocess.run([SWITCHPS, "run", *[a.format(tmp=tmp_path) for a in args]], capture_output=True,
                          text=True, timeout=60, cwd=tmp_path)
    assert proc.returncode == 2 and proc.stderr.strip().splitlines() == [message.format(tmp=tmp_path)]
    assert not (tmp_path / "runs").exists()
