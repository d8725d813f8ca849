"""`switchps run`: one PS, one evaluator and N workers, started through a backend.

The launcher decides what runs and supervises it; a backend (``switchps.launch.backends``; ``LocalBackend``:
local processes started with ``subprocess``, never a fork after TF import) starts each role, which logs
to ``RUN_DIR/logs/<role>.log``. The PS starts first, binds its port and publishes its address in
``RUN_DIR/ps.address`` (``switchps.address``); once that address answers health checks, the evaluator
and the workers start with ``--ps`` naming it. The launcher shows progress from the PS's Status RPC,
and if any role fails (or on Ctrl-C) it stops all of them and says which one failed and why.

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
``stop_all`` is bounded, as no backend ``Handle`` method blocks (the
backends' contract). A terminal's Ctrl-C also reaches the children (same
process group): they start with SIGINT blocked and unblock it once their own
handler is in place, which logs one line and exits 130 (``switchps.cli``).
Before `launch` runs there is no child, and KeyboardInterrupt reaches
``switchps.cli.main`` as usual.
"""

from __future__ import annotations

import os
import signal
import time
from contextlib import contextmanager
from collections import Counter
from dataclasses import dataclass, field
from pathlib import Path
from types import FrameType
from typing import Callable, Iterator

from rich.console import Console
from rich.progress import BarColumn, Progress, TextColumn, TimeElapsedColumn
from rich.table import Table

from switchps import resources
from switchps.address import ADDRESS_FILE, Stamp, published_since, stamp
from switchps.security.auth import new_secret, write_private
from switchps.launch.backends import Backend, Handle, LocalBackend, RoleSpec, tail
from switchps.launch.scaling import Scaler
from switchps.security.channels import ClientSecurity, client_security
from switchps.config.run import RunConfig
from switchps.errors import EXIT_SHARD_LOST
from switchps.protos import switchps_pb2 as pb
from switchps.config.cpu_binding import local_bindings
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


def stop_all(handles: list[Handle], timeout_s: float = STOP_TIMEOUT_S) -> None:
    """SIGTERM every running role, SIGKILL those alive after ``timeout_s``; returns within ``timeout_s + REAP_S``
    (no ``Handle`` method blocks, and ``wait`` is given what is left of the bound)."""
    for h in handles:
        h.stop()
    _wait_all(handles, timeout_s)
    for h in handles:
        h.kill()
    _wait_all(handles, REAP_S)


def _wait_all(handles: list[Handle], timeout_s: float) -> None:
    end = time.monotonic() + timeout_s
    for h in handles:
        h.wait(max(0.0, end - time.monotonic()))


def check(handles: list[Handle]) -> None:
    for h in handles:
        code = h.returncode
        if code not in (None, 0):
            raise LaunchError(f"{h.role} exited with code {code}; last lines of {h.log}:\n{tail(h.log)}")


@dataclass
class Restarts:
    """Restarts a role killed by a signal (kill -9, the OOM killer), up to ``limit`` times per role. One
    that exited with an error is not restarted: it would fail again. A PS comes back from its latest
    checkpoint (its arguments say ``--resume``) and, if it can, on the port it had (``switchps.address``);
    workers and the evaluator reconnect. The shards of a sharded PS (the first ``shards`` handles) go
    back together: when one is killed, or ends because another shard left (``EXIT_SHARD_LOST``), all
    of them are started again by ``restart_ps``, from shard 0's latest checkpoint (counted as ``ps``)."""

    limit: int
    roles: dict[str, RoleSpec]
    backend: Backend
    used: Counter[str] = field(default_factory=Counter)
    shards: int = 1
    restart_ps: Callable[[list[Handle]], object] | None = None
    """Starts every PS shard again, appending their handles to the list given."""

    def revive(self, handles: list[Handle]) -> None:
        first = 0
        if self.shards > 1:
            first = self.shards
            if any(_restartable(h.returncode, lost_too=True) for h in handles[:first]):
                self._shards_again(handles)
        for i, h in enumerate(handles[first:], start=first):
            code = h.returncode
            if not _restartable(code) or self.used[h.role] >= self.limit:
                continue
            self.used[h.role] += 1
            console.print(f"switchps: {h.role} exited with code {code}; restarting it "
                          f"({self.used[h.role]} of {self.limit})")
            handles[i] = self.backend.start(self.roles[h.role])

    def _shards_again(self, handles: list[Handle]) -> None:
        if self.used["ps"] >= self.limit or self.restart_ps is None:
            return
        self.used["ps"] += 1
        down = ", ".join(f"{h.role} ({h.returncode})" for h in handles[:self.shards] if h.returncode is not None)
        console.print(f"switchps: PS shards down: {down}; restarting all {self.shards} from the latest "
                      f"checkpoint ({self.used['ps']} of {self.limit})")
        stop_all(handles[:self.shards])
        new: list[Handle] = []
        try:
            self.restart_ps(new)
        finally:
            handles[:self.shards] = new + handles[len(new):self.shards]


def _restartable(code: int | None, lost_too: bool = False) -> bool:
    """A role that a restart may bring back: killed by a signal other than Ctrl-C's, or (``lost_too``) a
    PS shard that ended because another one left."""
    return code is not None and ((code < 0 and code != -signal.SIGINT) or (lost_too and code == EXIT_SHARD_LOST))


def launch(cfg: RunConfig, quiet: bool = False, resume: Path | None = None,
           backend: Backend | None = None) -> tuple[Path, dict]:
    """Run the whole job, each role started by ``backend`` (default: local processes); returns the run
    directory and its summary (Ctrl-C: see the module doc). ``resume``: continue that run directory from
    its latest checkpoint."""
    if isinstance(cfg.cluster.workers, list):
        raise LaunchError("cluster.workers lists addresses: start each role with `switchps ps|worker` instead")
    backend = backend or local_backend(cfg)
    run_dir = resume or _new_run_dir(cfg)
    if resume is not None:  # what a resume may change (`--set`) reaches every role, which reads this file
        (run_dir / "config.yaml").write_text(cfg.dump())
    # --resume: a PS resumes from the latest checkpoint if there is one; a new run directory starts afresh
    ps = RoleSpec("ps", ["ps", str(run_dir / "config.yaml"), "--resume", str(run_dir)], run_dir)
    handles: list[Handle] = []
    scaler: Scaler | None = None
    with sigint_as_flag() as ctrl_c:
        try:
            def start_ps(started: list[Handle]) -> list[str]:
                """Every PS shard, shard 0 first; the addresses they published."""
                before = stamp(run_dir)  # a resumed run directory holds its previous PS's address
                started.append(backend.start(ps))
                address = _wait_for_ps(run_dir, before, started[0], ctrl_c, client_security(cfg, "status"))
                return [address, *_start_followers(backend, _follower_roles(cfg, run_dir, address), run_dir,
                                                   started, ctrl_c)]

            addresses = start_ps(handles)
            roles = {r.role: r for r in [ps, *_client_roles(cfg, run_dir, ",".join(addresses))]}
            for role in list(roles.values())[1:]:
                ctrl_c.check()
                handles.append(backend.start(role))
            restarts = Restarts(cfg.cluster.max_restarts, roles, backend, shards=len(addresses),
                                restart_ps=start_ps)
            if cfg.cluster.elastic:
                common = _client_args(run_dir, ",".join(addresses))
                scaler = Scaler(run_dir, cfg.cluster.max_workers, backend, roles,
                                lambda i: _worker_role(i, common, run_dir))
                scaler.publish(handles)
            _follow(cfg, addresses[0], handles, quiet, ctrl_c, restarts, scaler)
            stop_all(handles[1:] + (scaler.retired if scaler else []), STOP_TIMEOUT_S)
        except BaseException:
            stop_all(handles + (scaler.retired if scaler else []), KILL_AFTER_S)
            ctrl_c.check()  # a child that died of the same (group-wide) Ctrl-C is not a failure
            raise
    return run_dir, resources.complete(run_dir)


def local_backend(cfg: RunConfig) -> LocalBackend:
    """Each role a child process of this one, workers and evaluator bound to this host's cores as
    ``runtime.cpu`` says (``switchps.config.cpu_binding``): a worker's block is its framework's threads,
    and with ``runtime.pipeline_depth`` 1 one core more, for the push it has in flight while it computes
    (on a worker's one core the two took turns: on an H200 a ResNet-18 step's compute grew from 9 to 21 ms
    and the overlap gained nothing)."""
    r = cfg.runtime
    return LocalBackend(bindings=local_bindings(cfg.cluster.num_workers, r.intra_op_threads + r.pipeline_depth,
                                                r.cpu, list(os.sched_getaffinity(0))))


def _follower_roles(cfg: RunConfig, run_dir: Path, leader: str) -> list[RoleSpec]:
    """Shards 1..N-1 of a sharded PS, told where shard 0 serves."""
    return [RoleSpec(f"ps-{k}", ["ps", str(run_dir / "config.yaml"), "--run-dir", str(run_dir), "--shard", str(k),
                                 "--ps", leader], run_dir)
            for k in range(1, len(cfg.cluster.shards))]


def _start_followers(backend: Backend, shards: list[RoleSpec], run_dir: Path, handles: list[Handle],
                     ctrl_c: CtrlC, timeout_s: float = 60.0) -> list[str]:
    """Start the follower shards; the addresses they publish, once every one has."""
    before = [stamp(run_dir, k) for k in range(1, len(shards) + 1)]
    for role in shards:
        ctrl_c.check()
        handles.append(backend.start(role))
    end, addresses = time.monotonic() + timeout_s, []
    for k, (stamped, handle) in enumerate(zip(before, handles[-len(shards):] if shards else []), start=1):
        while (address := published_since(run_dir, stamped, k)) is None:
            ctrl_c.check()
            check([handle])
            if time.monotonic() > end:
                raise LaunchError(f"PS shard {k} did not come up; last lines of {handle.log}:\n{tail(handle.log)}")
            time.sleep(0.1)
        addresses.append(address)
    return addresses


def _client_roles(cfg: RunConfig, run_dir: Path, address: str) -> list[RoleSpec]:
    """The evaluator and the workers, told where the PS serves. A PS restarted on another port is not
    found by them: they keep the address they were given (``switchps.worker.client.Reconnect``)."""
    common = _client_args(run_dir, address)
    return [RoleSpec("evaluator", ["evaluator", *common], run_dir),
            *(_worker_role(i, common, run_dir) for i in range(cfg.cluster.num_workers))]


def _client_args(run_dir: Path, address: str) -> list[str]:
    return [str(run_dir / "config.yaml"), "--run-dir", str(run_dir), "--ps", address]


def _worker_role(index: int, common: list[str], run_dir: Path) -> RoleSpec:
    return RoleSpec(f"worker-{index}", ["worker", *common, "--index", str(index)], run_dir)


def _new_run_dir(cfg: RunConfig) -> Path:
    """A fresh run directory holding the config (its PS port as given: 0 lets the PS bind one the OS
    picks), and a fresh run secret if the config names none (and is not explicitly insecure)."""
    run_dir = cfg.new_run_dir(claim=True)
    sec = cfg.security
    if sec.secret_file is None and sec.secret_env is None and not sec.insecure:
        sec.secret_file = str(write_private(run_dir / "secret", f"{new_secret()}\n".encode()).resolve())
    (run_dir / "config.yaml").write_text(cfg.dump())
    return run_dir


def _wait_for_ps(run_dir: Path, before: Stamp | None, ps: Handle, ctrl_c: CtrlC, security: ClientSecurity,
                 timeout_s: float = 60.0) -> str:
    """The address the PS published (a publication newer than ``before``), once it answers health
    checks; polls at most ~1 s apart so that a Ctrl-C is seen."""
    end = time.monotonic() + timeout_s
    while True:
        ctrl_c.check()
        check([ps])
        address = published_since(run_dir, before)
        if address is None:
            time.sleep(0.1)
        else:
            try:
                wait_for_ps(address, timeout_s=1.0, security=security)
                return address
            except TimeoutError:
                pass
        if time.monotonic() > end:
            where = f"at {address}" if address else f"(no address in {run_dir / ADDRESS_FILE})"
            raise LaunchError(f"the PS did not come up {where}; last lines of {ps.log}:\n{tail(ps.log)}")


def _follow(cfg: RunConfig, address: str, handles: list[Handle], quiet: bool, ctrl_c: CtrlC,
            restarts: Restarts, scaler: Scaler | None) -> None:
    """Show progress until the PS finishes, restarting roles that die and (an elastic run) changing the
    workers as `switchps scale` asks; raise if a role fails for good or Ctrl-C is pressed first."""
    client = PSClient(address, timeout_s=2.0, security=client_security(cfg, "status"))
    try:
        _progress(cfg, handles, quiet, ctrl_c, client, restarts, scaler)
    finally:
        client.close()
    check(handles)


def _progress(cfg: RunConfig, handles: list[Handle], quiet: bool, ctrl_c: CtrlC, client: PSClient,
              restarts: Restarts, scaler: Scaler | None) -> None:
    columns = [TextColumn("[bold]{task.description}"), BarColumn(), TextColumn("{task.percentage:>3.0f}%"),
               TextColumn("v{task.fields[version]} {task.fields[protocol]} acc {task.fields[acc]}"),
               TimeElapsedColumn()]
    with Progress(*columns, console=console, disable=quiet, transient=False) as bar:
        task = bar.add_task(f"{cfg.name}: starting the PS", total=1.0, version=0, protocol=cfg.protocol.name,
                            acc="—")
        while True:
            ctrl_c.check()
            restarts.revive(handles)
            if scaler is not None:
                scaler.poll(handles)
            check(handles)
            if handles[0].returncode == 0:
                break
            try:
                s = client.status()
                acc = f"{s.test_accuracy:.4f}" if s.test_accuracy >= 0 else "—"
                bar.update(task, completed=s.progress, version=s.version, protocol=s.protocol, acc=acc,
                           description=_phase(cfg, s))
            except Exception:  # the PS is starting up or shutting down; the poll above decides
                pass
            time.sleep(0.5)
        bar.update(task, completed=1.0)


def _phase(cfg: RunConfig, s: pb.Status) -> str:
    """What the progress bar says the run is doing."""
    if s.paused:
        return f"{cfg.name}: paused, {s.members} members (below cluster.workers.min)"
    if s.version or s.progress:
        return cfg.name
    return f"{cfg.name}: workers starting ({s.active_workers}/{cfg.cluster.num_workers} ready)"


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
