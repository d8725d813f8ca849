"""What every test may use: waiting on a condition, and processes killed at teardown. Nothing here
imports grpc or the PS driver (the loopback cluster is the ``cluster`` plugin), so the core's tests
collect without them."""

from __future__ import annotations

import contextlib
import csv
import json
from dataclasses import dataclass
import subprocess
import time
from pathlib import Path

import psutil
import pytest

pytest.register_assert_rewrite("cluster")  # imported by name in some tests before pytest loads it as a plugin


@dataclass
class FakeClock:
    """A ``worker.steps.Clock`` whose time passes only when something sleeps, or a test says so."""

    t: float = 100.0

    def now(self) -> float:
        return self.t

    def sleep(self, seconds: float) -> None:
        self.t += seconds


def wait_until(cond, timeout_s: float = 10.0, what: str = "the condition") -> None:
    """Poll ``cond`` (a state the project produces: a count, a file, a version) until it holds."""
    end = time.monotonic() + timeout_s
    while not cond():
        assert time.monotonic() < end, f"timed out waiting for {what}"
        time.sleep(0.01)


def assert_each_push_counted_once(run_dir: Path) -> dict:
    """A finished run's records agree: every accepted push is in exactly one update of ps.csv, and every push
    a worker recorded (workers.csv) was accepted or dropped. Returns its summary."""
    summary = json.loads((run_dir / "summary.json").read_text())
    with (run_dir / "ps.csv").open() as f:
        applied = sum(len(r["workers"].split(";")) for r in csv.DictReader(f))
    with (run_dir / "workers.csv").open() as f:
        received = sum(1 for _ in csv.DictReader(f))
    assert summary["pushes_accepted"] == applied, "every accepted push is in exactly one update"
    assert received == summary["pushes_accepted"] + summary["pushes_dropped"], "every push received is counted"
    return summary


def kill_tree(proc: subprocess.Popen) -> None:
    """SIGKILL a process and every descendant it left (a failed test must not leave a run going)."""
    try:
        tree = [psutil.Process(proc.pid), *psutil.Process(proc.pid).children(recursive=True)]
    except psutil.NoSuchProcess:
        tree = []
    for p in tree:
        with contextlib.suppress(psutil.Error):
            p.kill()
    with contextlib.suppress(subprocess.TimeoutExpired):
        proc.communicate(timeout=10)


@pytest.fixture
def processes():
    """``start(args, **popen)``: a process this test owns; whatever of it still runs at teardown is killed."""
    started: list[subprocess.Popen] = []

    def start(args: list[str], **popen) -> subprocess.Popen:
        proc = subprocess.Popen(args, **popen)
        started.append(proc)
        return proc

    yield start
    for proc in started:
        kill_tree(proc)


def pytest_terminal_summary(terminalreporter) -> None:
    """One line that counts the skipped tests with their reasons, so that a skip is read, not lost in an 's'."""
    reasons: dict[str, int] = {}
    for report in terminalreporter.stats.get("skipped", []):
        reason = report.longrepr[2] if isinstance(report.longrepr, tuple) else str(report.longrepr)
        reason = reason.removeprefix("Skipped: ")
        reasons[reason] = reasons.get(reason, 0) + 1
    listed = "; ".join(f"{n} × {why}" for why, n in sorted(reasons.items(), key=lambda kv: -kv[1]))
    terminalreporter.write_line(f"skipped: {sum(reasons.values())}" + (f" ({listed})" if listed else ""))
