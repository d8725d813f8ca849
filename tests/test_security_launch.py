"""Safe defaults with real processes: `switchps run` authenticates with a fresh secret that no command
line shows, and a PS without a secret refuses to start unless told it may run insecure."""

from __future__ import annotations

import json
import subprocess
import sys
import time
from pathlib import Path

import grpc
import psutil
import pytest

from switchps.security import auth
from switchps.security.channels import ClientSecurity
from switchps.address import free_port
from switchps.worker.client import PSClient, wait_for_ps

pytestmark = pytest.mark.integration
SWITCHPS = str(Path(sys.executable).parent / "switchps")


def _descendants_cmdlines(pid: int) -> list[str]:
    try:
        return [" ".join(p.cmdline()) for p in psutil.Process(pid).children(recursive=True)]
    except psutil.Error:
        return []


def test_a_local_run_is_authenticated_and_its_secret_is_on_no_command_line(tmp_path, processes):
    proc = processes([SWITCHPS, "run", "--quiet", "--set", f"output.dir={tmp_path}", "--set",
                      "cluster.workers=2", "--set", "train.epochs=2"], cwd=tmp_path,
                     stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    seen: list[str] = []
    while proc.poll() is None and len(seen) < 4:  # the PS, the evaluator and two workers
        seen = _descendants_cmdlines(proc.pid)
        time.sleep(0.1)
    secret_files = list(tmp_path.glob("*/secret"))
    assert len(secret_files) == 1, "the launcher wrote the run's secret before starting any process"
    secret = secret_files[0].read_text().strip()
    assert len(seen) >= 4 and not any(secret in c for c in seen), seen
    out, err = proc.communicate(timeout=240)
    assert proc.returncode == 0, err[-2000:]
    run_dir = secret_files[0].parent
    assert secret_files[0].stat().st_mode & 0o777 == 0o600
    assert f"secret_file: {secret_files[0].resolve()}" in (run_dir / "config.yaml").read_text()
    summary = json.loads((run_dir / "summary.json").read_text())
    assert summary["rejections"] == {} and summary["final_version"] == summary["updates"] > 0


def _ps(tmp_path: Path, security: str) -> tuple[subprocess.Popen, str]:
    port = free_port()
    cfg = tmp_path / "ps.yaml"
    cfg.write_text(f"cluster: {{ps: '127.0.0.1:{port}', workers: 1, startup_timeout_s: 60}}\nsecurity: {security}\n")
    proc = subprocess.Popen([SWITCHPS, "ps", str(cfg), "--run-dir", str(tmp_path / "run")], cwd=tmp_path,
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    return proc, f"127.0.0.1:{port}"


def test_a_ps_without_a_secret_refuses_to_start_in_one_line(tmp_path):
    proc, _ = _ps(tmp_path, "{}")
    _, err = proc.communicate(timeout=60)
    assert proc.returncode == 2
    assert err.strip().splitlines() == ["switchps: config error: security: no run secret: set security.secret_file "
                                        "or security.secret_env (the same on every host), or security.insecure: "
                                        "true on a trusted network"]
    assert not (tmp_path / "run").exists()


def test_a_ps_process_with_a_secret_file_refuses_anonymous_calls(tmp_path):
    secret = tmp_path / "secret"
    secret.write_text(auth.new_secret())
    secret.chmod(0o600)
    proc, address = _ps(tmp_path, f"{{secret_file: {secret}}}")
    try:
        wait_for_ps(address, 60)
        with pytest.raises(grpc.RpcError) as e:
            PSClient(address, timeout_s=5).status()
        assert e.value.code() == grpc.StatusCode.UNAUTHENTICATED
        token = auth.token(secret.read_text().encode(), "status")
        assert PSClient(address, timeout_s=5, security=ClientSecurity(token)).status().version == 0
    finally:
        proc.kill()
        proc.communicate(timeout=30)


def test_an_explicitly_insecure_ps_starts_with_a_warning(tmp_path):
    proc, address = _ps(tmp_path, "{insecure: true}")
    try:
        wait_for_ps(address, 60)
        assert PSClient(address, timeout_s=5).status().version == 0
    finally:
        proc.kill()
        _, err = proc.communicate(timeout=30)
    assert "WARNING security.insecure: true" in err
