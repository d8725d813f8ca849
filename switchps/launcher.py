"""`switchps run`: one PS, one evaluator and N workers as local processes.

Children are started with ``subprocess`` (never fork after TF import), each
logging to ``RUN_DIR/logs/<role>.log``. The launcher shows progress from the
PS's Status RPC, and if any process fails (or on Ctrl-C) it stops all of them
and says which one failed and why.
"""

from __future__ import annotations

import json
import os
import socket
import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path

from rich.console import Console
from rich.progress import BarColumn, Progress, TextColumn, TimeElapsedColumn
from rich.table import Table

from switchps.config import RunConfig
from switchps.worker.client import PSClient, wait_for_ps

console = Console(stderr=True)
STOP_TIMEOUT_S = 10.0


class LaunchError(RuntimeError):
    """A child process failed; the message names it and quotes its log."""


@dataclass
class Child:
    role: str
    proc: subprocess.Popen
    log: Path

    def tail(self, lines: int = 8) -> str:
        text = self.log.read_text(errors="replace").strip().splitlines() if self.log.exists() else []
        return "\n".join(text[-lines:])


def free_port(host: str = "127.0.0.1") -> int:
    with socket.socket() as s:
        s.bind((host, 0))
        return s.getsockname()[1]


def child_env() -> dict[str, str]:
    env = dict(os.environ)
    env.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")
    env.setdefault("OMP_NUM_THREADS", "1")
    env["PYTHONUNBUFFERED"] = "1"
    env["SWITCHPS_PARENT_PID"] = str(os.getpid())
    return env


def spawn(role: str, args: list[str], run_dir: Path) -> Child:
    log = run_dir / "logs" / f"{role}.log"
    log.parent.mkdir(parents=True, exist_ok=True)
    with log.open("w") as f:
        proc = subprocess.Popen([sys.executable, "-m", "switchps.cli", *args], stdout=f, stderr=subprocess.STDOUT,
                                env=child_env(), stdin=subprocess.DEVNULL)
    return Child(role, proc, log)


def stop_all(children: list[Child], timeout_s: float = STOP_TIMEOUT_S) -> None:
    for c in children:
        if c.proc.poll() is None:
            c.proc.terminate()
    end = time.monotonic() + timeout_s
    for c in children:
        try:
            c.proc.wait(max(0.1, end - time.monotonic()))
        except subprocess.TimeoutExpired:
            c.proc.kill()
            c.proc.wait()


def check(children: list[Child]) -> None:
    for c in children:
        code = c.proc.poll()
        if code not in (None, 0):
            raise LaunchError(f"{c.role} exited with code {code}; last lines of {c.log}:\n{c.tail()}")


def launch(cfg: RunConfig, quiet: bool = False) -> tuple[Path, dict]:
    """Run the whole job locally; returns the run directory and its summary."""
    host, _, port = cfg.cluster.ps.rpartition(":")
    if port == "0":
        cfg.cluster.ps = f"{host}:{free_port(host)}"
    if not isinstance(cfg.cluster.workers, int):
        raise LaunchError("cluster.workers lists addresses: start each role with `switchps ps|worker` instead")
    run_dir = Path(cfg.output.dir) / cfg.run_dir_name()
    run_dir.mkdir(parents=True)
    config_path = run_dir / "config.yaml"
    config_path.write_text(cfg.dump())
    cfg_arg = str(config_path)
    children = [spawn("ps", ["ps", cfg_arg, "--run-dir", str(run_dir)], run_dir)]
    try:
        _wait_for_ps(cfg.cluster.ps, children[0])
        children.append(spawn("evaluator", ["evaluator", cfg_arg, "--run-dir", str(run_dir)], run_dir))
        children += [spawn(f"worker-{i}", ["worker", cfg_arg, "--index", str(i)], run_dir)
                     for i in range(cfg.cluster.num_workers)]
        _follow(cfg, children, quiet)
        stop_all(children[1:], STOP_TIMEOUT_S)
    except BaseException:
        stop_all(children, timeout_s=3.0)
        raise
    summary = json.loads((run_dir / "summary.json").read_text())
    return run_dir, summary


def _wait_for_ps(address: str, ps: Child, timeout_s: float = 60.0) -> None:
    end = time.monotonic() + timeout_s
    while True:
        check([ps])
        try:
            wait_for_ps(address, timeout_s=1.0)
            return
        except TimeoutError:
            if time.monotonic() > end:
                raise LaunchError(f"the PS did not come up at {address}; last lines of {ps.log}:\n{ps.tail()}")


def _follow(cfg: RunConfig, children: list[Child], quiet: bool) -> None:
    """Show progress until the PS exits; raise if any process fails first."""
    client = PSClient(cfg.cluster.ps, timeout_s=2.0)
    columns = [TextColumn("[bold]{task.description}"), BarColumn(), TextColumn("{task.percentage:>3.0f}%"),
               TextColumn("v{task.fields[version]} {task.fields[protocol]} acc {task.fields[acc]}"),
               TimeElapsedColumn()]
    with Progress(*columns, console=console, disable=quiet, transient=False) as bar:
        task = bar.add_task(cfg.name, total=1.0, version=0, protocol=cfg.protocol.name, acc="—")
        ps = children[0]
        while ps.proc.poll() is None:
            check(children)
            try:
                s = client.status()
                acc = f"{s.test_accuracy:.4f}" if s.test_accuracy >= 0 else "—"
                bar.update(task, completed=s.progress, version=s.version, protocol=s.protocol, acc=acc)
            except Exception:  # the PS is starting up or shutting down; the poll above decides
                pass
            time.sleep(0.5)
        bar.update(task, completed=1.0)
    client.close()
    check(children)


def summary_table(run_dir: Path, summary: dict) -> Table:
    t = Table(title=f"switchps run: {run_dir}")
    t.add_column("metric")
    t.add_column("value", justify="right")
    for key in ("protocol", "num_workers", "final_test_accuracy", "best_test_accuracy", "wall_time_s", "updates",
                "samples", "samples_per_s", "pushes_accepted", "pushes_rejected", "pushes_dropped",
                "time_to_target_s"):
        v = summary.get(key)
        t.add_row(key, "—" if v is None else f"{v:.4f}" if isinstance(v, float) and key.endswith("accuracy") else str(v))
    return t
