"""Which role this task of a cluster job plays, read from the environment the engine gives it.

`switchps role` runs the same command in every task of a job; ``detect`` turns the environment into a
``Placement``: the role (PS, evaluator, worker i), the host the PS runs on, and what the engine says
about restarts and devices. Sources, first match wins:

* SLURM (``SLURM_PROCID`` set): rank ``SLURM_PROCID`` of ``SLURM_NTASKS`` takes ``roles(ntasks)[rank]``;
  the PS's host is the node holding rank 0, from ``SLURM_STEP_NODELIST`` (or ``SLURM_JOB_NODELIST``)
  and ``SLURM_STEP_TASKS_PER_NODE`` (or ``SLURM_TASKS_PER_NODE``), placed in blocks (the default
  distribution; any other is refused).
* Kubernetes (``SWITCHPS_ROLE`` set): one Indexed Job or StatefulSet per role; the index is
  ``JOB_COMPLETION_INDEX`` or the ordinal ending the pod's host name; the PS's host is
  ``SWITCHPS_PS_HOST`` (its stable DNS name under the headless Service).
* TF_CONFIG: its ``task`` names the role and index; its cluster is applied by the role command itself.

Everything here is pure (an env mapping in, a value out) and raises ``ConfigError`` with one line per
problem naming the variable.
"""

from __future__ import annotations

import json
import re
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Literal

from switchps.launch.hostlist import expand, node_of_rank, tasks_per_node
from switchps.problems import ConfigError

Kind = Literal["ps", "evaluator", "worker"]
KINDS: tuple[Kind, ...] = ("ps", "evaluator", "worker")


@dataclass(frozen=True)
class Role:
    """One task's job: ``kind`` and its index among its kind (a PS shard, or worker i; 0 for the evaluator)."""

    kind: Kind
    index: int = 0

    def __str__(self) -> str:
        if self.kind == "ps" and self.index:
            return f"ps shard {self.index}"
        return f"{self.kind} {self.index}" if self.kind == "worker" else self.kind


@dataclass(frozen=True)
class Placement:
    """What the environment says about this task."""

    role: Role
    source: Literal["slurm", "k8s", "tf_config"]
    ps_host: str | None
    """Where the PS runs; None: the config (or TF_CONFIG) says."""
    rank: int = 0
    ntasks: int = 0
    host: str | None = None
    job_id: str | None = None
    restarts: int = 0
    """How often the engine restarted the job (SLURM_RESTART_COUNT); a pod counts as restarted when it
    finds its run directory already there (``restarted`` decides)."""
    gpus: str | None = None
    shard_hosts: tuple[str, ...] = ()
    """A sharded PS under SLURM: where each shard runs (shard 0's is ``ps_host``)."""

    def describe(self) -> str:
        """One log line: role, where it came from, devices."""
        where = f"rank {self.rank} of {self.ntasks}" if self.source == "slurm" else f"index {self.role.index}"
        return (f"{self.role} ({self.source} {where}, host {self.host or '?'}, PS host {self.ps_host or 'from the config'}"
                f", GPUs {self.gpus or 'none'}, restarts {self.restarts})")


def roles(ntasks: int, shards: int = 1) -> list[Role]:
    """The role of each rank: the PS shards first, then the evaluator, then the workers
    (worker index = rank - 1 - shards)."""
    if shards < 1:
        raise ValueError(f"need at least one PS shard, got {shards}")
    if ntasks < shards + 2:
        raise ValueError(f"{ntasks} tasks: need at least {shards + 2} (PS, evaluator, one worker)")
    return ([Role("ps", i) for i in range(shards)] + [Role("evaluator")] +
            [Role("worker", i) for i in range(ntasks - shards - 1)])


def _int(env: Mapping[str, str], name: str, default: int | None = None) -> int:
    raw = env.get(name)
    if raw is None or raw == "":
        if default is None:
            raise ConfigError(f"{name}: not set")
        return default
    if not raw.strip().isdigit():
        raise ConfigError(f"{name}: expected a non-negative integer, got {raw!r}")
    return int(raw)


def _gpus(env: Mapping[str, str]) -> str | None:
    return env.get("SLURM_STEP_GPUS") or env.get("CUDA_VISIBLE_DEVICES") or None


def from_slurm(env: Mapping[str, str], shards: int = 1) -> Placement:
    """The placement of the SLURM task this environment belongs to (``SLURM_PROCID`` set); ranks 0 to
    ``shards - 1`` are the PS's shards."""
    rank, ntasks = _int(env, "SLURM_PROCID"), _int(env, "SLURM_NTASKS")
    nodelist = env.get("SLURM_STEP_NODELIST") or env.get("SLURM_JOB_NODELIST")
    counts = env.get("SLURM_STEP_TASKS_PER_NODE") or env.get("SLURM_TASKS_PER_NODE")
    problems = [f"{name}: not set" for name, v in
                (("SLURM_STEP_NODELIST (or SLURM_JOB_NODELIST)", nodelist),
                 ("SLURM_STEP_TASKS_PER_NODE (or SLURM_TASKS_PER_NODE)", counts)) if not v]
    distribution = env.get("SLURM_DISTRIBUTION", "block")
    if not distribution.startswith("block"):
        problems.append(f"SLURM_DISTRIBUTION: {distribution!r}; switchps role places tasks in blocks "
                        "(srun -m block, the default)")
    if rank >= ntasks:
        problems.append(f"SLURM_PROCID: {rank} is not below SLURM_NTASKS={ntasks}")
    if problems:
        raise ConfigError(*problems)
    assert nodelist is not None and counts is not None
    try:
        nodes, per_node = expand(nodelist), tasks_per_node(counts)
        shard_hosts = tuple(node_of_rank(k, nodes, per_node) for k in range(shards))
        host = node_of_rank(rank, nodes, per_node)
        role = roles(ntasks, shards)[rank]
    except ValueError as e:
        raise ConfigError(f"SLURM environment: {e}") from None
    if sum(per_node) != ntasks:
        raise ConfigError(f"SLURM_NTASKS: {ntasks}, but the tasks per node ({counts}) add up to {sum(per_node)}")
    return Placement(role, "slurm", shard_hosts[0], rank=rank, ntasks=ntasks, host=host, job_id=env.get("SLURM_JOB_ID"),
                     restarts=_int(env, "SLURM_RESTART_COUNT", 0), gpus=_gpus(env), shard_hosts=shard_hosts)


def pod_index(env: Mapping[str, str], hostname: str) -> int:
    """An Indexed Job's ``JOB_COMPLETION_INDEX``, else the StatefulSet ordinal ending ``hostname``
    (``switchps-worker-3`` -> 3)."""
    if env.get("JOB_COMPLETION_INDEX", "") != "":
        return _int(env, "JOB_COMPLETION_INDEX")
    m = re.search(r"-(\d+)$", hostname)
    if not m:
        raise ConfigError(f"SWITCHPS_ROLE: set, but neither JOB_COMPLETION_INDEX nor a host name ending in "
                          f"-ORDINAL (a StatefulSet pod) gives the index; host name is {hostname!r}")
    return int(m.group(1))


def from_k8s(env: Mapping[str, str], hostname: str) -> Placement:
    """The placement of a Kubernetes pod (``SWITCHPS_ROLE`` set)."""
    kind = env.get("SWITCHPS_ROLE", "")
    if kind not in KINDS:
        raise ConfigError(f"SWITCHPS_ROLE: {kind!r}; expected one of {', '.join(KINDS)}")
    ps_host = env.get("SWITCHPS_PS_HOST") or None
    if ps_host is None:
        raise ConfigError("SWITCHPS_PS_HOST: not set; every pod needs the PS pod's host name "
                          "(e.g. switchps-ps-0.switchps, its name under the headless Service)")
    index = pod_index(env, hostname)
    if kind == "evaluator" and index != 0:
        raise ConfigError(f"JOB_COMPLETION_INDEX: the evaluator runs once (index 0), got index {index}")
    role = Role(kind, index)
    return Placement(role, "k8s", ps_host, host=hostname, gpus=_gpus(env))


def read_tf_config(raw: str) -> tuple[dict[str, Any], dict[str, Any]]:
    """TF_CONFIG's ``cluster`` and ``task`` (each ``{}`` if absent); ConfigError if it is not such JSON."""
    try:
        tf_config = json.loads(raw)
        cluster, task = tf_config.get("cluster") or {}, tf_config.get("task") or {}
    except (json.JSONDecodeError, AttributeError):
        raise ConfigError("TF_CONFIG: not a JSON object with cluster and task") from None
    if not isinstance(cluster, dict) or not isinstance(task, dict):
        raise ConfigError("TF_CONFIG: not a JSON object with cluster and task")
    return cluster, task


def from_tf_config(raw: str) -> Placement:
    """The role TF_CONFIG's ``task`` names (its ``type`` ``ps``, ``evaluator`` or ``worker``)."""
    task = read_tf_config(raw)[1]
    kind, index = task.get("type"), task.get("index", 0)
    if kind not in KINDS:
        raise ConfigError(f"TF_CONFIG: task.type is {kind!r}; expected one of {', '.join(KINDS)}")
    if not isinstance(index, int) or index < 0:
        raise ConfigError(f"TF_CONFIG: task.index is {index!r}; expected a non-negative integer")
    return Placement(Role(kind, index), "tf_config", None)


def detect(env: Mapping[str, str], hostname: str, shards: int = 1) -> Placement:
    """This task's placement: SLURM, then Kubernetes, then TF_CONFIG (see the module doc); ``shards``:
    how many PS shards the config lists (SLURM gives them the first ranks)."""
    if env.get("SLURM_PROCID", "") != "":
        return from_slurm(env, shards)
    if env.get("SWITCHPS_ROLE", "") != "":
        return from_k8s(env, hostname)
    if env.get("TF_CONFIG", "") != "":
        return from_tf_config(env["TF_CONFIG"])
    raise ConfigError("switchps role: no cluster environment found: expected SLURM_PROCID (SLURM, under srun), "
                      "SWITCHPS_ROLE (a Kubernetes pod) or TF_CONFIG")


def ps_address(placement: Placement, configured: str) -> str:
    """``cluster.ps`` for this job: the PS's host with the configured port, which must be fixed (every
    task computes the address itself, so the PS cannot pick a port and publish it)."""
    host, _, port = configured.rpartition(":")
    if placement.ps_host is None:
        return configured
    if not port.isdigit() or int(port) == 0:
        raise ConfigError(f"cluster.ps: {configured!r} has port 0; under `switchps role` every task derives the "
                          "PS's address from its host name, so give a fixed port (e.g. cluster.ps: 0.0.0.0:7070; "
                          "its host part is replaced)")
    return f"{placement.ps_host}:{port}"


def run_dir(placement: Placement, given: str | None, output_dir: str, name: str) -> Path:
    """The run directory every task shares: ``--run-dir``, else ``OUTPUT_DIR/NAME-slurm<jobid>`` for a
    SLURM job; a pod or a TF_CONFIG task must be given one (it has no job id the others share)."""
    if given:
        return Path(given)
    if placement.source == "slurm" and placement.job_id:
        return Path(output_dir) / f"{name}-slurm{placement.job_id}"
    raise ConfigError(f"--run-dir: required under {placement.source} (only a SLURM job id names a shared "
                      "run directory by itself)")


def resumes(placement: Placement, run_dir: Path) -> bool:
    """Whether the PS continues ``run_dir`` (``switchps ps --resume``) rather than starting it: the
    directory already holds a run's config and the task was restarted (a SLURM requeue, or any pod:
    a pod that finds its run directory on the volume is a restarted one)."""
    if placement.role.kind != "ps" or not (run_dir / "config.yaml").is_file():
        return False
    return placement.source == "k8s" or placement.restarts > 0
