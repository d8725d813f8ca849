"""`switchps run --backend ray`: each role a Ray actor that runs the role's `switchps` command.

``RayBackend`` implements ``switchps.launch.backends.Backend``; the launcher's logic (PS first, its published
address, worker and PS restarts from a checkpoint) is unchanged. One placement group holds a bundle per
role (``cluster.ray``: its strategy and each role's resources), and each role's actor (``RoleActor``)
starts ``switchps <role> ...`` as a **subprocess** on its node (never a fork after TF import), its output
appended to the role's log. The data path stays switchps's own gRPC between those processes; Ray only
places, watches and restarts them. No filesystem need be shared: each role runs in a stage on its node
(``cluster.ray.staging_dir``), seeded from the driver's run directory, and its actor sends what the role
writes there every ``cluster.ray.sync_every_s`` and once the role has ended (``switchps.launch.ray_sync``) to
the run's ``RunStore``, an actor on the driver's node that applies it to the run directory. The run
directory so ends up on the driver's host as with a local run; one thread per actor reads its stage,
and the actor's ``wait_exit`` answers only once the last batch is applied and the stage removed.

Restarts: Ray restarts an actor whose process or node died, up to ``cluster.ray.max_restarts`` times;
the new actor reruns the same command, so a worker rejoins as a restarted worker does, and the PS, whose
arguments always say ``--resume RUN_DIR``, comes back from its latest checkpoint (the launcher's own
rule for a PS that died): the new incarnation's ``__init__`` seeds its stage from the ``RunStore``, so
it starts from the checkpoints the driver has then, with no call from the driver. A role process
that dies of a signal while its actor lives ends the actor and is restarted by the launcher
(``cluster.max_restarts``), as under the local backend. The driver logs each placement (``ray_placed``)
and each Ray restart (``ray_restarted``) it sees in the run's ``events.jsonl``.

The run secret never touches a file or a command line: the driver holds it in its environment
(``security.secret_env``), hands it to each actor as an argument (in memory; Ray keeps actor creation
arguments in its control store to restart the actor) and the actor to the role through the environment.

Concurrency contract (``switchps.launch.backends``): ``RayBackend.start`` submits the actor and returns at once.
No ``RayRole`` method blocks: each looks at futures with ``ray.wait(timeout=0)`` and fetches only ready
ones; ``stop``/``kill`` submit a signal (and ``ray.kill``) without waiting; ``wait(timeout)`` polls within
``timeout``. A ``RayRole`` is used from the launcher's thread only. ``RayBackend.open`` (before the launch)
is the one call that waits: for the placement group, at most ``cluster.ray.placement_timeout_s``.
"""

from __future__ import annotations

import logging
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import threading
import time
from collections import Counter
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import psutil
import ray
from ray.exceptions import ActorUnavailableError, RayActorError
from ray.util.placement_group import PlacementGroup, placement_group, remove_placement_group
from ray.util.scheduling_strategies import NodeAffinitySchedulingStrategy, PlacementGroupSchedulingStrategy

from switchps.config import ray_placement as placement
from switchps.security.auth import new_secret
from switchps.launch.backends import RoleSpec, child_env
from switchps.config.run import RunConfig
from switchps.jsonfile import dumps
from switchps.launch.launcher import LaunchError, console
from switchps.launch.ray_sync import Batch, Mirror, Stage, staged

RUN_SECRET_ENV = "SWITCHPS_RUN_SECRET"
"""Where the driver keeps a run secret it made (when the config names none)."""
GAVE_UP = 1
"""``returncode`` of a role whose actor Ray will not restart (its restarts used up): a failure."""
POLL_S = 0.05
NAMESPACE = "switchps"
"""Actors are named ``RUN_DIR_NAME/ROLE/N`` in this namespace (``ray.get_actor(name, namespace=...)``)."""


@ray.remote(num_cpus=0, max_concurrency=8)  # type: ignore[call-overload]
class RunStore:
    """The driver's run directory, served on the driver's node: a new stage's seed, and every batch a
    role's stage sends (``ray_sync.Mirror``). Batches from several roles are applied one at a time."""

    def __init__(self, root: str) -> None:
        self.mirror, self.lock = Mirror(Path(root)), threading.Lock()

    def seed(self, role: str) -> dict[str, bytes]:
        with self.lock:
            return self.mirror.seed(role)

    def apply(self, batch: Batch) -> list[str]:
        """Apply ``batch``; the paths refused (outside the run directory)."""
        with self.lock:
            return self.mirror.apply(batch)


# max_concurrency: wait_exit blocks in one thread while signal and where run in others
@ray.remote(max_concurrency=4)  # type: ignore[call-overload]
class RoleActor:
    """Runs one role's ``switchps`` command as a child process of the actor's worker process, in a stage
    (``switchps.launch.ray_sync``) on its node, and sends what the role writes there to the ``RunStore``."""

    def __init__(self, role: str, args: list[str], run_dir: str, cwd: str, env: dict[str, str], store: Any,
                 staging: str | None, sync_every_s: float) -> None:
        """Start the role. Ray reruns this on a restart with the same arguments, and the new stage is
        seeded with what the driver has then (a PS resumes from the latest checkpoint it collected).
        ``env`` (the run secret) joins ``backends.child_env``, which names this actor's process as the
        role's parent: a role whose actor dies exits within a second (``switchps.cli``)."""
        root = Path(staging or tempfile.gettempdir(), "switchps-ray", Path(run_dir).name)
        for old in root.glob(f"{role}.*"):  # an earlier incarnation's, on this node (the driver has it)
            if old.suffix[1:].isdigit() and not psutil.pid_exists(int(old.suffix[1:])):
                shutil.rmtree(old, ignore_errors=True)
        self.store = store
        self.code: int | None = None
        """The role's exit code, once it has ended and been collected."""
        self.stage = Stage.seeded(root / f"{role}.{os.getpid()}", ray.get(store.seed.remote(role)))
        here = str(self.stage.root)
        log = self.stage.root / "logs" / f"{role}.log"
        log.parent.mkdir(exist_ok=True)
        with log.open("a") as f:
            self.proc = subprocess.Popen([sys.executable, "-m", "switchps.cli", *staged(args, run_dir, here)],
                                         stdout=f, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL,
                                         cwd=cwd if os.path.isdir(cwd) else here, env={**child_env(), **env})
        self.syncer = threading.Thread(target=self._sync, args=(sync_every_s,), name="switchps-ray-sync",
                                       daemon=True)
        self.syncer.start()

    def _sync(self, every_s: float) -> None:
        """The one thread that reads the stage: a batch every ``every_s``, the last one once the role
        has ended; then the stage is removed and ``code`` set."""
        try:
            code = self._collect(every_s)
        except Exception as e:  # the store is gone with the driver: nothing can reach the run directory
            print(f"switchps: the driver's run directory is out of reach ({e}); ending the role", file=sys.stderr)
            self.proc.kill()
            code = GAVE_UP
        shutil.rmtree(self.stage.root, ignore_errors=True)
        self.code = code

    def _collect(self, every_s: float) -> int:
        while True:
            try:
                code: int | None = self.proc.wait(timeout=every_s)
            except subprocess.TimeoutExpired:
                code = None
            batch = self.stage.changes(final=code is not None)
            if batch.changes or batch.deleted:
                ray.get(self.store.apply.remote(batch))
            if code is not None:
                return code

    def where(self) -> dict[str, Any]:
        """The node and processes of this incarnation of the actor."""
        ctx = ray.get_runtime_context()
        return {"node_id": ctx.get_node_id(), "actor_pid": os.getpid(), "role_pid": self.proc.pid,
                "reconstructed": ctx.was_current_actor_reconstructed}

    def wait_exit(self) -> int:
        """The role's exit code (``Popen``'s: ``-N`` for signal N), once it has ended and everything it
        wrote has reached the driver."""
        self.syncer.join()
        assert self.code is not None
        return self.code

    def signal(self, sig: int) -> None:
        if self.proc.poll() is None:
            self.proc.send_signal(sig)


@dataclass
class RayRole:
    """A role's actor, as the launcher's ``Handle`` (see the module's concurrency contract)."""

    role: str
    log: Path
    actor: Any
    journal: Path
    """The run's event log, where the driver's events go (whole lines, as the PS's are collected)."""
    node_id: str | None = None
    restarts: int = 0
    _code: int | None = None
    _killed: bool = False
    _seen: tuple[str, int] | None = None
    _where: Any = None
    _exit: Any = None

    def __post_init__(self) -> None:
        self._watch()

    def _watch(self) -> None:
        """Ask the actor (this incarnation, or the next once Ray has restarted it) where it runs and
        when its role ends."""
        # `where` is retried through a restart (it fails only once Ray has given the actor up);
        # `wait_exit` is not: its failure is how a restart is noticed
        self._where = self.actor.where.options(max_task_retries=-1).remote()
        self._exit = self.actor.wait_exit.remote()

    @property
    def returncode(self) -> int | None:
        if self._code is None:
            self._poll_where()
        if self._code is None and _ready(self._exit):
            try:
                self._end(ray.get(self._exit, timeout=0))
            except (RayActorError, ActorUnavailableError):  # Ray restarts it, or `where` says it is gone
                self._watch()
        return self._code

    def _poll_where(self) -> None:
        if not _ready(self._where):
            return
        try:
            where = ray.get(self._where, timeout=0)
        except ActorUnavailableError:  # restarting: ask again
            self._where = self.actor.where.options(max_task_retries=-1).remote()
            return
        except RayActorError as e:
            self._gone(e)
            return
        self._where = None
        incarnation = (where["node_id"], where["actor_pid"])
        if incarnation != self._seen:
            event = "ray_placed" if self._seen is None else "ray_restarted"
            self.restarts += event == "ray_restarted"
            self._seen, self.node_id = incarnation, where["node_id"]
            self._record(event, **where)

    def _end(self, code: int) -> None:
        """The role ended: free its bundle (the launcher may start the role again in it)."""
        self._code = code
        ray.kill(self.actor, no_restart=True)

    def _gone(self, error: RayActorError) -> None:
        """Ray will not bring the actor back: a failure, unless the launcher killed it."""
        self._code = -signal.SIGKILL if self._killed else GAVE_UP
        if not self._killed:
            reason = str(error).splitlines()[0][:300]
            self._record("ray_gave_up", error=reason)
            with self.log.open("a") as f:
                f.write(f"switchps: Ray will not restart the actor of {self.role} "
                        f"({self.restarts} restarts): {reason}\n")

    def _record(self, event: str, **fields: Any) -> None:
        """An event of the driver's, in the run's event log (``time``: Unix seconds; the PS's events
        count ``time_s`` from the start of training, which the driver does not know)."""
        with self.journal.open("a") as f:
            f.write(dumps({"time": time.time(), "event": event, "role": self.role, **fields}) + "\n")

    def alive(self) -> bool:
        return self.returncode is None

    def wait(self, timeout: float) -> int | None:
        end = time.monotonic() + max(0.0, timeout)
        while (code := self.returncode) is None and time.monotonic() < end:
            time.sleep(min(POLL_S, max(0.0, end - time.monotonic())))
        return code

    def stop(self) -> None:
        if self._code is None:
            self.actor.signal.remote(signal.SIGTERM)

    def kill(self) -> None:
        """SIGKILL the role and end its actor for good (an orphaned role exits within a second)."""
        if self._code is None:
            self._killed = True
            self.actor.signal.remote(signal.SIGKILL)
            ray.kill(self.actor, no_restart=True)


def _ready(ref: Any) -> bool:
    return ref is not None and bool(ray.wait([ref], timeout=0)[0])


@dataclass
class RayBackend:
    """Each role an actor in one placement group; ``open`` reserves the group, ``close`` releases it."""

    cfg: RunConfig
    env: dict[str, str] = field(default_factory=dict)
    """What each role's environment adds: the run secret, by its ``security.secret_env`` name."""
    local: bool = False
    """Ray was started by this command (``connect`` with no address): its one node is all the cluster
    will have, so roles left at the default share its CPUs, and a group it cannot hold fails at once."""
    bundles: dict[str, dict[str, float]] = field(default_factory=dict)
    """Each role's bundle (``ray_placement.bundles``), set by ``open``."""
    pg: PlacementGroup | None = None
    store: Any = None
    """The ``RunStore`` of the run directory, on this (the driver's) node."""
    actors: list[RayRole] = field(default_factory=list)
    started: Counter[str] = field(default_factory=Counter)

    def roles(self) -> list[str]:
        """The roles in bundle order: an elastic run's up to ``max`` workers, so that `switchps scale` finds
        their places reserved."""
        shards = [f"ps-{k}" for k in range(1, len(self.cfg.cluster.shards))]
        return ["ps", *shards, "evaluator", *(f"worker-{i}" for i in range(self.cfg.cluster.max_workers))]

    def open(self) -> None:
        """Size the bundles and reserve the placement group. ``LaunchError`` at once if the nodes of a
        local Ray cannot hold it, else if it is not ready within ``cluster.ray.placement_timeout_s`` (a
        cluster joined may gain nodes meanwhile: what it cannot hold now is said at once), naming what
        was asked, what the cluster has and the ``num_cpus`` settings that would fit."""
        spec, roles = self.cfg.cluster.ray, self.roles()
        nodes = [n["Resources"] for n in ray.nodes() if n["Alive"]]
        local_cpus = sum(n.get("CPU", 0.0) for n in nodes) if self.local else None
        self.bundles = placement.bundles(spec, roles, local_cpus)
        problem = placement.unplaceable(spec, roles, nodes, local_cpus)
        if problem is not None and self.local:
            raise LaunchError(f"{problem} (the local Ray this command started; --address joins a cluster)")
        if problem is not None:
            console.print(f"switchps: {problem}; waiting up to {spec.placement_timeout_s:g} s "
                          "(cluster.ray.placement_timeout_s) for nodes to join")
        self.pg = placement_group(list(self.bundles.values()), strategy=spec.strategy.upper())
        ready, _ = ray.wait([self.pg.ready()], timeout=spec.placement_timeout_s)
        if not ready:
            remove_placement_group(self.pg)
            self.pg = None
            raise LaunchError(f"Ray could not place the roles ({spec.strategy}: {placement.listed(self.bundles)}) "
                              f"within {spec.placement_timeout_s:g} s; the cluster has {ray.cluster_resources()}"
                              + (f"; {problem}" if problem else ""))

    def start(self, role: RoleSpec) -> RayRole:
        """Submit the role's actor into its bundle; returns before it runs."""
        if self.pg is None:
            self.open()
        assert self.pg is not None
        spec = self.cfg.cluster.ray
        options = _options(self.bundles[role.role], spec.max_restarts)
        strategy = PlacementGroupSchedulingStrategy(placement_group=self.pg,
                                                    placement_group_bundle_index=self.roles().index(role.role))
        name = actor_name(role.run_dir, role.role, self.started[role.role])
        self.started[role.role] += 1
        actor = RoleActor.options(  # type: ignore[attr-defined]
            scheduling_strategy=strategy, name=name, namespace=NAMESPACE, **options,
        ).remote(role.role, role.args, str(role.run_dir), os.getcwd(), self.env, self._store(role.run_dir),
                 spec.staging_dir, spec.sync_every_s)
        handle = RayRole(role.role, role.log.absolute(), actor, role.run_dir.absolute() / "events.jsonl")
        self.actors.append(handle)
        return handle

    def _store(self, run_dir: Path) -> Any:
        """The run directory's ``RunStore``, started on this node the first time."""
        if self.store is None:
            here = NodeAffinitySchedulingStrategy(node_id=ray.get_runtime_context().get_node_id(), soft=False)
            self.store = RunStore.options(  # type: ignore[attr-defined]
                scheduling_strategy=here, name=actor_name(run_dir, "store", 0), namespace=NAMESPACE,
            ).remote(str(run_dir.absolute()))
        return self.store

    def close(self) -> None:
        """End every actor and release the placement group (idempotent)."""
        for h in self.actors:
            ray.kill(h.actor, no_restart=True)
        self.actors.clear()
        if self.store is not None:
            ray.kill(self.store)
            self.store = None
        if self.pg is not None:
            remove_placement_group(self.pg)
            self.pg = None


def actor_name(run_dir: Path, role: str, n: int) -> str:
    """The name of the ``n``-th actor (from 0) the launcher started for ``role``, in ``NAMESPACE``."""
    return f"{run_dir.name}/{role}/{n}"


def _options(bundle: dict[str, float], max_restarts: int) -> dict[str, Any]:
    """An actor's options: its bundle's resources (the actor uses what its bundle reserves)."""
    options: dict[str, Any] = {"num_cpus": bundle.get("CPU", 0.0), "num_gpus": bundle.get("GPU", 0.0),
                               "max_restarts": max_restarts}
    if "memory" in bundle:
        options["memory"] = int(bundle["memory"])
    custom = {k: v for k, v in bundle.items() if k not in ("CPU", "GPU", "memory")}
    if custom:
        options["resources"] = custom
    return options


def run_secret(cfg: RunConfig) -> dict[str, str]:
    """The run secret for the actors, by variable name; makes one in this process's environment when
    the config names none (``RUN_SECRET_ENV``). A ``secret_file`` must be at its path on every node."""
    sec = cfg.security
    if sec.secret_file is None and sec.secret_env is None and not sec.insecure:
        os.environ.setdefault(RUN_SECRET_ENV, new_secret())
        sec.secret_env = RUN_SECRET_ENV
    if sec.secret_env is not None:
        return {sec.secret_env: os.environ[sec.secret_env]}
    return {}


def connect(address: str | None) -> bool:
    """Join the Ray cluster at ``address`` (``auto``: the one this host belongs to), or start a local one
    for the run (never one found running); whether it started one."""
    if ray.is_initialized():
        return False
    ray.init(address=address or "local", logging_level=logging.WARNING, log_to_driver=False,
             include_dashboard=False if address is None else None)
    return address is None
