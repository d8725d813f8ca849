"""`switchps run`: one PS, one evaluator and N workers as local processes.

Children are started with ``subprocess`` (never fork after TF import), each
logging to ``RUN_DIR/logs/<role>.log``. The launcher shows progress from the
PS's Status RPC, and if any process fails (or on Ctrl-C) it stops all of them
and says which one failed and why.

Ctrl-C contract: within 10 s of a SIGINT, whatever `launch` was doing
(waiting for the PS, spawning, following, stopping), every child has been
sent SIGTERM, then SIGKILL if it outlived ``KILL_AFTER_S``, and `launch`
raises KeyboardInterrupt, which `switchps run` reports in one stderr line
before exiting 130; further SIGINTs change nothing. To keep that promise the
signal never raises at an arbitrary bytecode: a KeyboardInterrupt landing
between a lock's acquire and its release (``Popen.poll``'s waitpid lock, a
gRPC channel's condition) leaves the lock held, and the next ``wait()`` or
``close()`` blocks forever. The handler only sets a flag, which the launcher
checks between RPCs, sleeps and spawns (at most ~2.5 s apart); every wait in
``stop_all`` is bounded. A terminal's Ctrl-C also reaches the children (same
process group): they start with SIGINT blocked and unblock it once their own
handler is in place, which logs one line and exits 130 (``switchps.cli``).
Before `launch` runs there is no child, and KeyboardInterrupt reaches
``switchps.cli.main`` as usual.
"""

from __future__ import annotations

import json
import os
import signal
import socket
import subprocess
import sys
import time
from contextlib import contextmanager, suppress
from collections import Counter
from dataclasses import dataclass, field
from pathlib import Path
from types import FrameType
from typing import Iterator

from rich.console import Console
from rich.progress import BarColumn, Progress, TextColumn, TimeElapsedColumn
from rich.table import Table

from switchps.auth import new_secret, write_private
from switchps.channels import ClientSecurity, client_security
from switchps.config import RunConfig
from switchps.worker.client import PSClient, wait_for_ps

console = Console(stderr=True)
STOP_TIMEOUT_S = 10.0
KILL_AFTER_S = 3.0  # SIGTERM -> SIGKILL grace after a failure or Ctrl-C
REAP_S = 1.0  # bounds the wait after SIGKILL, which no process can refuse


class LaunchError(RuntimeError):
    """A child process failed; the message names it and quotes its log."""


class CtrlC:
    """SIGINT recorded as a flag, turned into KeyboardInterrupt only where stopping is safe."""

    def __init__(self) -> None:
        self.pressed = False

    def record(self, signum: int, frame: FrameType | None) -> None:
        self.pressed = True

    def check(self) -> None:
        if self.pressed:
            raise KeyboardInterrupt


@contextmanager
def sigint_as_flag() -> Iterator[CtrlC]:
    """Defer SIGINT to ``CtrlC.check`` for the duration.

    This also overrides an inherited SIG_IGN (a background job of a non-interactive shell), under
    which `switchps run` would otherwise ignore every Ctrl-C and ``kill -INT``.
    """
    ctrl_c = CtrlC()
    previous = signal.signal(signal.SIGINT, ctrl_c.record)
    try:
        yield ctrl_c
    finally:
        signal.signal(signal.SIGINT, previous)
    ctrl_c.check()  # a Ctrl-C during the last steps still counts


@contextmanager
def sigint_blocked() -> Iterator[None]:
    """Block SIGINT in this thread; a child forked meanwhile inherits the mask through exec."""
    previous = signal.pthread_sigmask(signal.SIG_BLOCK, {signal.SIGINT})
    try:
        yield
    finally:
        signal.pthread_sigmask(signal.SIG_SETMASK, previous)


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
    """Start a role with SIGINT blocked: a Ctrl-C during its imports waits for its handler (see cli).
    Its log is appended to: a restarted process continues its predecessor's log."""
    log = run_dir / "logs" / f"{role}.log"
    log.parent.mkdir(parents=True, exist_ok=True)
    with log.open("a") as f, sigint_blocked():
        proc = subprocess.Popen([sys.executable, "-m", "switchps.cli", *args], stdout=f, stderr=subprocess.STDOUT,
                                env=child_env(), stdin=subprocess.DEVNULL)
    return Child(role, proc, log)


def stop_all(children: list[Child], timeout_s: float = STOP_TIMEOUT_S) -> None:
    """SIGTERM every running child, SIGKILL those alive after ``timeout_s``; returns within ``timeout_s + REAP_S``."""
    _signal_all(children, signal.SIGTERM)
    _wait_all(children, timeout_s)
    _signal_all(children, signal.SIGKILL)
    _wait_all(children, REAP_S)


def _signal_all(children: list[Child], sig: signal.Signals) -> None:
    for c in children:
        if c.proc.poll() is None:
            c.proc.send_signal(sig)


def _wait_all(children: list[Child], timeout_s: float) -> None:
    end = time.monotonic() + timeout_s
    for c in children:
        with suppress(subprocess.TimeoutExpired):
            c.proc.wait(max(0.0, end - time.monotonic()))


def check(children: list[Child]) -> None:
    for c in children:
        code = c.proc.poll()
        if code not in (None, 0):
            raise LaunchError(f"{c.role} exited with code {code}; last lines of {c.log}:\n{c.tail()}")


@dataclass
class Restarts:
    """Restarts a child killed by a signal (kill -9, the OOM killer), up to ``limit`` times per role. One
    that exited with an error is not restarted: it would fail again. A PS comes back from its latest
    checkpoint (its arguments say ``--resume``); workers and the evaluator reconnect."""

    limit: int
    args: dict[str, list[str]]
    run_dir: Path
    used: Counter[str] = field(default_factory=Counter)

    def revive(self, children: list[Child]) -> None:
        for i, c in enumerate(children):
            code = c.proc.poll()
            if code is None or code >= 0 or code == -signal.SIGINT or self.used[c.role] >= self.limit:
                continue
            self.used[c.role] += 1
            console.print(f"switchps: {c.role} exited with code {code}; restarting it "
                          f"({self.used[c.role]} of {self.limit})")
            children[i] = spawn(c.role, self.args[c.role], self.run_dir)


def launch(cfg: RunConfig, quiet: bool = False, resume: Path | None = None) -> tuple[Path, dict]:
    """Run the whole job locally; returns the run directory and its summary (Ctrl-C: see the module doc).
    ``resume``: continue that run directory from its latest checkpoint."""
    if not isinstance(cfg.cluster.workers, int):
        raise LaunchError("cluster.workers lists addresses: start each role with `switchps ps|worker` instead")
    run_dir = resume or _new_run_dir(cfg)
    cfg_arg = str(run_dir / "config.yaml")
    roles = {"ps": ["ps", cfg_arg, "--resume", str(run_dir)],  # a new run directory starts afresh
             "evaluator": ["evaluator", cfg_arg, "--run-dir", str(run_dir)]}
    roles |= {f"worker-{i}": ["worker", cfg_arg, "--index", str(i), "--run-dir", str(run_dir)]
              for i in range(cfg.cluster.num_workers)}
    restarts = Restarts(cfg.cluster.max_restarts, roles, run_dir)
    children: list[Child] = []
    with sigint_as_flag() as ctrl_c:
        try:
            children.append(spawn("ps", roles["ps"], run_dir))
            _wait_for_ps(cfg.cluster.ps, children[0], ctrl_c, client_security(cfg, "status"))
            for role, args in list(roles.items())[1:]:
                ctrl_c.check()
                children.append(spawn(role, args, run_dir))
            _follow(cfg, children, quiet, ctrl_c, restarts)
            stop_all(children[1:], STOP_TIMEOUT_S)
        except BaseException:
            stop_all(children, KILL_AFTER_S)
            ctrl_c.check()  # a child that died of the same (group-wide) Ctrl-C is not a failure
            raise
    summary = json.loads((run_dir / "summary.json").read_text())
    return run_dir, summary


def _new_run_dir(cfg: RunConfig) -> Path:
    """A fresh run directory holding the config, with a free port chosen if the config says 0, and a
    fresh run secret if the config names none (and is not explicitly insecure)."""
    host, _, port = cfg.cluster.ps.rpartition(":")
    if port == "0":
        cfg.cluster.ps = f"{host}:{free_port(host)}"
    run_dir = Path(cfg.output.dir) / cfg.run_dir_name()
    run_dir.mkdir(parents=True)
    sec = cfg.security
    if sec.secret_file is None and sec.secret_env is None and not sec.insecure:
        sec.secret_file = str(write_private(run_dir / "secret", f"{new_secret()}\n".encode()).resolve())
    (run_dir / "config.yaml").write_text(cfg.dump())
    return run_dir


def _wait_for_ps(address: str, ps: Child, ctrl_c: CtrlC, security: ClientSecurity,
                 timeout_s: float = 60.0) -> None:
    end = time.monotonic() + timeout_s
    while True:
        ctrl_c.check()
        check([ps])
        try:
            wait_for_ps(address, timeout_s=1.0, security=security)
            return
        except TimeoutError:
            if time.monotonic() > end:
                raise LaunchError(f"the PS did not come up at {address}; last lines of {ps.log}:\n{ps.tail()}")


def _follow(cfg: RunConfig, children: list[Child], quiet: bool, ctrl_c: CtrlC, restarts: Restarts) -> None:
    """Show progress until the PS finishes, restarting children that die; raise if one fails for good
    or Ctrl-C is pressed first."""
    client = PSClient(cfg.cluster.ps, timeout_s=2.0, security=client_security(cfg, "status"))
    try:
        _progress(cfg, children, quiet, ctrl_c, client, restarts)
    finally:
        client.close()
    check(children)


def _progress(cfg: RunConfig, children: list[Child], quiet: bool, ctrl_c: CtrlC, client: PSClient,
              restarts: Restarts) -> None:
    columns = [TextColumn("[bold]{task.description}"), BarColumn(), TextColumn("{task.percentage:>3.0f}%"),
               TextColumn("v{task.fields[version]} {task.fields[protocol]} acc {task.fields[acc]}"),
               TimeElapsedColumn()]
    with Progress(*columns, console=console, disable=quiet, transient=False) as bar:
        task = bar.add_task(f"{cfg.name}: starting the PS", total=1.0, version=0, protocol=cfg.protocol.name,
                            acc="—")
        while True:
            ctrl_c.check()
            restarts.revive(children)
            check(children)
            if children[0].proc.poll() == 0:
                break
            try:
                s = client.status()
                acc = f"{s.test_accuracy:.4f}" if s.test_accuracy >= 0 else "—"
                phase = cfg.name if s.version or s.progress else \
                    f"{cfg.name}: workers starting ({s.active_workers}/{cfg.cluster.num_workers} ready)"
                bar.update(task, completed=s.progress, version=s.version, protocol=s.protocol, acc=acc,
                           description=phase)
            except Exception:  # the PS is starting up or shutting down; the poll above decides
                pass
            time.sleep(0.5)
        bar.update(task, completed=1.0)


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
