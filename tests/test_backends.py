"""The launcher's backend seam: the local backend with a trivial role, and `launch` through a backend
that records what it was asked to start (the PS first, the others told the address the PS published)."""

from __future__ import annotations

import json
import os
import signal
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path

import pytest

from switchps.address import published, split
from switchps.launch.backends import Handle, LocalBackend, RoleSpec
from switchps.config.run import load_config
from switchps.launch.launcher import LaunchError, check, launch, stop_all

from test_launch import CONFIGS

ROLE = """
import os, signal, sys, time
if "--ignore-term" in sys.argv:
    signal.signal(signal.SIGTERM, signal.SIG_IGN)
blocked = signal.SIGINT in signal.pthread_sigmask(signal.SIG_BLOCK, [])
print("launcher", os.environ["SWITCHPS_PARENT_PID"], "stdin empty", sys.stdin.read() == "",
      "sigint blocked", blocked, flush=True)
open(sys.argv[1], "w").close()
time.sleep(60)
"""


def wait_for(path: Path, timeout_s: float = 30) -> None:
    deadline = time.monotonic() + timeout_s
    while not path.exists():
        assert time.monotonic() < deadline, f"{path} never appeared"
        time.sleep(0.02)


def test_local_backend_starts_waits_stops_and_kills_a_role(tmp_path):
    backend = LocalBackend([sys.executable, "-c", ROLE])
    started: list[Handle] = []
    try:
        h = backend.start(RoleSpec("trivial", [str(tmp_path / "ready-1")], tmp_path))
        started.append(h)
        wait_for(tmp_path / "ready-1")
        assert h.alive() and h.returncode is None and h.wait(0.1) is None
        h.stop()
        assert h.wait(10) == -signal.SIGTERM and not h.alive() and h.returncode == -signal.SIGTERM
        stubborn = backend.start(RoleSpec("trivial", [str(tmp_path / "ready-2"), "--ignore-term"], tmp_path))
        started.append(stubborn)
        wait_for(tmp_path / "ready-2")
        stubborn.stop()
        assert stubborn.wait(0.5) is None and stubborn.alive(), "SIGTERM is ignored"
        stubborn.kill()
        assert stubborn.wait(10) == -signal.SIGKILL
    finally:
        stop_all(started, 1.0)
    assert h.log == tmp_path / "logs" / "trivial.log" == stubborn.log
    line = f"launcher {os.getpid()} stdin empty True sigint blocked True"
    assert h.log.read_text().splitlines() == [line, line], "the restarted role appends to the same log"


def test_a_failed_role_is_named_with_its_log(tmp_path):
    backend = LocalBackend([sys.executable, "-c", "import sys; print('boom'); sys.exit(3)"])
    h = backend.start(RoleSpec("worker-7", [], tmp_path))
    assert h.wait(30) == 3
    with pytest.raises(LaunchError, match=r"worker-7 exited with code 3; last lines of .*worker-7.log:\nboom"):
        check([h])


@dataclass
class Recording:
    """A backend that starts roles locally and remembers what it was asked to start."""

    started: list[RoleSpec] = field(default_factory=list)
    local: LocalBackend = field(default_factory=LocalBackend)

    def start(self, role: RoleSpec) -> Handle:
        self.started.append(role)
        return self.local.start(role)


@pytest.mark.integration
def test_launch_binds_the_ps_first_and_tells_the_others_where_it_serves(tmp_path):
    cfg = load_config(CONFIGS / "asp.yaml", [f"output.dir={tmp_path}", "cluster.workers=2", "train.epochs=3"],
                      role="run")
    assert split(cfg.cluster.ps) == ("127.0.0.1", 0), "the default: the PS binds a port the OS picks"
    backend = Recording()
    run_dir, summary = launch(cfg, quiet=True, backend=backend)
    assert summary["final_version"] == summary["updates"] > 0
    address = published(run_dir)
    assert address is not None and split(address)[0] == "127.0.0.1" and split(address)[1] > 0
    assert "ps: 127.0.0.1:0" in (run_dir / "config.yaml").read_text(), "the config keeps what was asked"
    assert [r.role for r in backend.started] == ["ps", "evaluator", "worker-0", "worker-1"]
    assert backend.started[0].args == ["ps", str(run_dir / "config.yaml"), "--resume", str(run_dir)]
    assert all(r.args[r.args.index("--ps") + 1] == address for r in backend.started[1:])
    events = [json.loads(line) for line in (run_dir / "events.jsonl").read_text().splitlines()]
    assert [e["address"] for e in events if e["event"] == "ps_serving"] == [address]
    changed = load_config(run_dir / "config.yaml", ["eval.every_s=0.7"], role="run")
    _, resumed = launch(changed, quiet=True, resume=run_dir)  # a finished run: the PS resumes and ends
    assert "every_s: 0.7" in (run_dir / "config.yaml").read_text(), "a resume's --set reaches the roles"
    assert resumed["resumes"] == 1 and resumed["final_version"] == summary["final_version"]
