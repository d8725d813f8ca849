"""The backend seam of `switchps run`: where and how a role's process runs.

``switchps.launch.launcher`` decides what runs (a PS, an evaluator, N workers: one ``RoleSpec`` each), in
which order, and what to do when one dies; a ``Backend`` only starts a role and hands back a ``Handle``,
through which the launcher watches and stops it. ``LocalBackend`` runs each role as a child process of
the launcher; an engine such as Ray or SLURM plugs in as another ``Backend`` without touching the
launch logic. The launcher learns where the PS serves from the file the PS writes once it has bound
its port (``switchps.address``), never from the backend, so a backend need not know about ports.

Concurrency contract (the launcher's Ctrl-C promise rests on it; see ``switchps.launch.launcher``):

- ``start`` returns once the role is started, not once it is ready, and may be called with SIGINT
  recorded as a flag (it must not wait on the role).
- No ``Handle`` method blocks: ``returncode``, ``alive``, ``stop`` and ``kill`` return at once, and
  ``wait(timeout)`` within ``timeout`` whatever state the handle is in.
- ``returncode`` follows ``subprocess.Popen``: None while the role runs, ``-N`` if signal N killed it
  (the launcher restarts those), otherwise its exit code.
- A role's output goes to ``RoleSpec.log``, appended to: a restarted role continues its predecessor's
  log. Handles are used from the launcher's thread only.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
from contextlib import contextmanager, suppress
from dataclasses import dataclass, field
from pathlib import Path
from typing import Iterator, Protocol

from switchps.config.cpu_binding import ENV as CPU_BINDING_ENV, CpuBinding


@dataclass(frozen=True)
class RoleSpec:
    """One role of a run: its name (``ps``, ``evaluator``, ``worker-<i>``) and its ``switchps`` arguments."""

    role: str
    args: list[str]
    run_dir: Path

    @property
    def log(self) -> Path:
        return self.run_dir / "logs" / f"{self.role}.log"


class Handle(Protocol):
    """A started role, as the launcher sees it (see the module's concurrency contract)."""

    role: str
    log: Path

    @property
    def returncode(self) -> int | None: ...

    def alive(self) -> bool: ...

    def wait(self, timeout: float) -> int | None:
        """The return code once the role has ended; None if it still runs after ``timeout`` seconds."""

    def stop(self) -> None:
        """Ask the role to end (SIGTERM), if it runs."""

    def kill(self) -> None:
        """End the role at once (SIGKILL), if it runs."""


class Backend(Protocol):
    def start(self, role: RoleSpec) -> Handle: ...


@contextmanager
def sigint_blocked() -> Iterator[None]:
    """Block SIGINT in this thread; a child forked meanwhile inherits the mask through exec."""
    previous = signal.pthread_sigmask(signal.SIG_BLOCK, {signal.SIGINT})
    try:
        yield
    finally:
        signal.pthread_sigmask(signal.SIG_SETMASK, previous)


def child_env() -> dict[str, str]:
    env = dict(os.environ)
    env.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")
    env.setdefault("OMP_NUM_THREADS", "1")
    env["PYTHONUNBUFFERED"] = "1"
    env["SWITCHPS_PARENT_PID"] = str(os.getpid())
    return env


@dataclass
class Child:
    """A role running as a local process."""

    role: str
    proc: subprocess.Popen
    log: Path

    @property
    def returncode(self) -> int | None:
        # Popen.poll takes its waitpid lock without blocking: a lock left held by an interrupted reap
        # makes it answer None, never hang
        return self.proc.poll()

    def alive(self) -> bool:
        return self.returncode is None

    def wait(self, timeout: float) -> int | None:
        with suppress(subprocess.TimeoutExpired):  # given a timeout, Popen.wait never blocks on the lock
            return self.proc.wait(max(0.0, timeout))
        return None

    def stop(self) -> None:
        self._signal(signal.SIGTERM)

    def kill(self) -> None:
        self._signal(signal.SIGKILL)

    def _signal(self, sig: signal.Signals) -> None:
        if self.proc.poll() is None:
            self.proc.send_signal(sig)


@dataclass
class LocalBackend:
    """Each role a child process of the launcher, started with ``subprocess`` (never a fork: the
    launcher may have imported TF), stdin closed, its output appended to its log.

    ``command``: what the role's arguments follow; ``switchps`` in this interpreter.
    """

    command: list[str] = field(default_factory=lambda: [sys.executable, "-m", "switchps.cli"])
    bindings: dict[str, CpuBinding] = field(default_factory=dict)
    """Cores and niceness by role name (``switchps.config.cpu_binding``); a role not named here gets neither."""

    def start(self, role: RoleSpec) -> Child:
        """Start ``role`` with SIGINT blocked: a Ctrl-C during its imports waits for its handler
        (``switchps.cli``), and the environment of ``child_env`` (which names the launcher's pid), plus
        the role's CPU binding if it has one."""
        role.log.parent.mkdir(parents=True, exist_ok=True)
        env = child_env()
        if role.role in self.bindings:
            env[CPU_BINDING_ENV] = self.bindings[role.role].to_env()
        with role.log.open("a") as f, sigint_blocked():
            proc = subprocess.Popen([*self.command, *role.args], stdout=f, stderr=subprocess.STDOUT,
                                    env=env, stdin=subprocess.DEVNULL)
        return Child(role.role, proc, role.log)


def tail(log: Path, lines: int = 8) -> str:
    """The last ``lines`` lines of a role's log, to quote when it failed."""
    text = log.read_text(errors="replace").strip().splitlines() if log.exists() else []
    return "\n".join(text[-lines:])
