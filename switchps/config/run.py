"""One YAML file describes a run; this module validates it strictly, before any process starts.

Every section forbids unknown keys, numbers are finite and bounded, and the
names of protocols, optimizers, schedules and datasets are checked against
``switchps.names``. ``load_config`` raises ``ConfigError`` listing every
problem at once, one line each naming its field; ``--set`` style overrides
(``protocol.name=asp``) are applied before validation.

This module imports no role, so the core and the workers can read a config.
Whether the optimizer, schedule, model, data and policy would build is asked
of the ``checks`` a command passes (``switchps.checks.PREFLIGHT``, which
imports the roles); with its ``role`` it also imports a ``module:function``
model (the ``ps`` only finds its module) and finds the dataset files.
"""

from __future__ import annotations

import os
from collections.abc import Iterable, Sequence
from datetime import datetime
from importlib.resources import files
from pathlib import Path
from typing import Annotated, Any, Literal

import yaml
from pydantic import Field, ValidationError, ValidationInfo, field_validator, model_validator

from switchps import names
from switchps.problems import ConfigError, Problems, describe, did_you_mean, under
from switchps.config.schema import (
    MAX_SEED, MAX_SHARDS, MAX_SIM_WORKERS, MAX_STEPS, MAX_THREADS, MAX_WORKERS, Checks, Role, Section, checks_of, role_of,
)
from switchps.config.policy import PolicySpec, SwitchSpec
from switchps.config.protocol import ProtocolSpec, Rounds, renamed, unflattened
from switchps.config.cpu_binding import CpuBindingSpec
from switchps.config.ray_cluster import RaySpec
from switchps.config.security import SecuritySpec
from switchps.config.stragglers import StragglerSpec
from switchps.yamlfile import apply_override, read_yaml

__all__ = ["ConfigError", "PolicySpec", "ProtocolSpec", "RunConfig", "SwitchSpec", "load_config", "parse_config"]


class Cluster(Section):
    ps: str | list[str] = "127.0.0.1:0"
    """host:port clients reach the PS at; port 0: the PS binds a port the OS picks and publishes the
    address in RUN_DIR/ps.address (`switchps run` passes it to the workers and the evaluator). A list:
    one address per PS shard, shard 0 first (the model is spread over them; see *Sharded PS*)."""
    bind: str | None = None
    """host:port the PS listens on (default: `ps` itself, loopback unless `ps` names another host)."""
    workers: int | list[str] = 4
    """Number of local workers, or the list of worker addresses (one per host); at most 1024 (100,000 in a
    simulation)."""
    startup_timeout_s: float = Field(120.0, gt=0)
    """How long the PS waits for every worker to register before starting with those present."""
    reconnect_s: float = Field(60.0, gt=0, le=86400)
    """How long workers and the evaluator retry an unreachable PS before they give up."""
    max_restarts: int = Field(3, ge=0, le=1000)
    """`switchps run` restarts a PS process that died, from its checkpoint, this many times."""
    ray: RaySpec = Field(default_factory=RaySpec)
    """Placement and restarts under `switchps run --backend ray` (ignored otherwise)."""

    @property
    def num_workers(self) -> int:
        return self.workers if isinstance(self.workers, int) else len(self.workers)

    @property
    def shards(self) -> list[str]:
        """Every PS shard's address, shard 0 (the one that decides) first; one for an unsharded PS."""
        return [self.ps] if isinstance(self.ps, str) else list(self.ps)

    @field_validator("workers")
    @classmethod
    def _count(cls, v: int | list[str], info: ValidationInfo) -> int | list[str]:
        n = v if isinstance(v, int) else len(v)
        if n < 1:
            raise ValueError("need at least one worker")
        if role_of(info) == "simulate" and n > MAX_SIM_WORKERS:
            raise ValueError(f"at most {MAX_SIM_WORKERS} simulated workers, got {n}")
        if role_of(info) != "simulate" and n > MAX_WORKERS:
            raise ValueError(f"at most {MAX_WORKERS} workers, got {n} (a simulation takes up to {MAX_SIM_WORKERS})")
        return v

    @field_validator("ps", "bind")
    @classmethod
    def _address(cls, v: str | list[str] | None) -> str | list[str] | None:
        for a in [] if v is None else [v] if isinstance(v, str) else v:
            host, sep, port = a.rpartition(":")
            if not sep or not host or not port.isdigit() or int(port) > 65535:
                raise ValueError(f"expected host:port, got {a!r}")
        if isinstance(v, list) and not 1 <= len(v) <= MAX_SHARDS:
            raise ValueError(f"expected 1 to {MAX_SHARDS} shard addresses, got {len(v)}")
        if isinstance(v, list) and len(set(v)) < len(v) and not all(a.endswith(":0") for a in v):
            raise ValueError("two shards at one address")
        return v


class ModelSpec(Section):
    name: str = "mlp"
    """A zoo name (logreg, mlp, cnn, resnet20, resnet32) or an import path `module:function`
    (a module in the working directory is found without PYTHONPATH)."""
    kwargs: dict[str, Any] = Field(default_factory=dict)
    """Passed to the builder; checked against its signature."""

    @model_validator(mode="after")
    def _builds(self, info: ValidationInfo) -> "ModelSpec":
        if (checks := checks_of(info)) and (problems := checks.model(self.name, self.kwargs, role_of(info))):
            raise Problems(problems)
        return self


def one_of(v: str, names: Iterable[str], what: str) -> str:
    """``v`` if it is one of ``names`` (the list that builds the thing), else a one-line error."""
    names = list(names)
    if v not in names:
        raise ValueError(f"unknown {what} {v!r}{did_you_mean(v, names)}; expected one of {', '.join(names)}")
    return v


class DataSpec(Section):
    name: str = "digits"
    """One of ``switchps.names.DATASETS``."""
    path: str | None = None
    test_fraction: float = Field(0.2, gt=0, lt=1)
    num_samples: int = Field(10000, gt=0, le=10**7)
    """synthetic (generated in memory): at most 10**7 samples, and 10**4 features and classes."""
    num_features: int = Field(20, gt=0, le=10**4)
    num_classes: int = Field(10, gt=1, le=10**4)
    sampling: Literal["partition", "replacement"] = "partition"
    """partition: worker i draws reshuffled epochs of every N-th sample; replacement: each worker draws
    from the whole training set with replacement (seeded per worker), for more workers than a partition
    of the data can feed (1,024 workers on digits)."""

    @field_validator("name")
    @classmethod
    def _known(cls, v: str) -> str:
        return one_of(v, names.DATASETS, "dataset")

    @model_validator(mode="after")
    def _files(self, info: ValidationInfo) -> "DataSpec":
        """npz needs a path; processes that load the data need its files, checked before anything starts."""
        if self.name == "npz" and not self.path:
            raise ValueError("path is required when name is npz")
        if (checks := checks_of(info)) and (problems := checks.data(self.name, self.path, role_of(info))):
            raise Problems(problems)
        return self


Step = Annotated[int, Field(ge=0, le=MAX_STEPS)]


class ScheduleSpec(Section):
    """Built by the checks as the PS builds it, so a bad combination fails before any process starts."""

    kind: str = "constant"
    """One of ``switchps.names.SCHEDULES``."""
    boundaries: list[Step] | None = None
    """step: increasing update counts; these and the other step counts are at most 2**31 - 1."""
    values: list[float] | None = None
    decay_steps: int | None = Field(None, gt=0, le=MAX_STEPS)
    decay_rate: float | None = Field(None, gt=0)
    alpha: float = 0.0
    staircase: bool = False
    warmup_steps: int = Field(0, ge=0, le=MAX_STEPS)

    @field_validator("kind")
    @classmethod
    def _known(cls, v: str) -> str:
        return one_of(v, names.SCHEDULES, "schedule")

    @model_validator(mode="after")
    def _builds(self, info: ValidationInfo) -> "ScheduleSpec":
        params = self.model_dump(exclude={"kind"}, exclude_none=True)
        if (checks := checks_of(info)) and (problems := checks.schedule(self.kind, params)):
            raise Problems(problems)
        return self


class OptimizerSpec(Section):
    name: str = "sgd"
    """One of ``switchps.names.OPTIMIZERS``."""
    learning_rate: float = Field(0.1, gt=0)
    schedule: ScheduleSpec = Field(default_factory=ScheduleSpec)
    params: dict[str, float] = Field(default_factory=dict)
    """Extra hyper-parameters: momentum, rho, beta_1, beta_2, epsilon, initial_accumulator_value,
    as the optimizer named accepts them."""

    @field_validator("name")
    @classmethod
    def _known(cls, v: str) -> str:
        return one_of(v, names.OPTIMIZERS, "optimizer")

    @field_validator("params")
    @classmethod
    def _builds(cls, v: dict[str, float], info: ValidationInfo) -> dict[str, float]:
        checks = checks_of(info)
        if checks and "name" in info.data and (problems := checks.optimizer(info.data["name"], v)):
            raise Problems(problems)
        return v


class CheckpointSpec(Section):
    """When the PS saves its whole state (see README, Fault tolerance); either trigger, or both."""

    every_s: float | None = Field(30.0, gt=0)
    every_updates: int | None = Field(None, gt=0, le=MAX_STEPS)
    keep: int = Field(2, ge=1, le=1000)


class DeviceSpec(Section):
    samples_per_s: float | None = Field(None, gt=0)
    """Emulate a device of this speed: each micro-batch takes micro_batch / samples_per_s seconds
    (never less than the real compute), so studies with many workers run honestly on 2 cores."""


class NetworkSpec(Section):
    ps_link_mbit_s: float | None = Field(None, gt=0)
    """Emulate the PS's network link at this rate (full duplex): workers' pushes share its inbound side
    and the parameters sent back its outbound side, so a BSP round's N simultaneous transfers take N
    times as long as one. Loopback alone makes communication nearly free."""
    push_overhead_s: float = Field(0.0, ge=0, le=60)
    """A simulation only: seconds each push costs beyond the link model (serialization, the RPC, the PS's
    work), added to its way in; a real run pays its own. Fit it from a real run with
    `python bench/sim_vs_real.py fit REAL_STUDY_DIR`."""
    push_jitter_s: float = Field(0.0, ge=0, le=60)
    """A simulation only: the mean of an exponential delay added to each push on top of
    ``push_overhead_s``, drawn per (seed, worker, step): the scheduling and RPC noise that keeps real
    workers out of lockstep. Fitted with ``push_overhead_s``."""


class TrainSpec(Section):
    steps: int | None = Field(None, gt=0, le=MAX_STEPS)
    """Stop after this many model updates (versions), at most 2**31 - 1."""
    epochs: float | None = Field(None, gt=0)
    """Stop after this many passes over the training set (counted in applied samples)."""
    seconds: float | None = Field(None, gt=0)
    """Stop after this much wall time."""

    @model_validator(mode="after")
    def _one_length(self) -> "TrainSpec":
        given = [k for k in ("steps", "epochs", "seconds") if getattr(self, k) is not None]
        if len(given) != 1:
            raise ValueError("give exactly one of steps, epochs, seconds")
        return self


class EvalSpec(Section):
    every_s: float = Field(1.0, gt=0)
    """Evaluate the latest model on the held-out set at most this often."""
    target_accuracy: float | None = Field(None, gt=0, le=1)
    final_timeout_s: float = Field(60.0, gt=0)


class OutputSpec(Section):
    dir: str = "runs"


class RuntimeSpec(Section):
    intra_op_threads: int = Field(1, ge=1, le=MAX_THREADS)
    """TensorFlow threads per process, at most 256 (as is inter_op_threads)."""
    inter_op_threads: int = Field(1, ge=1, le=MAX_THREADS)
    chunk_mb: float = Field(2.0, gt=0, le=32)
    """Size of raw tensor frames on the wire (a push of at most 4 MiB, or a chunk, goes as one message)."""
    receive_timeout_s: float = Field(30.0, gt=0, le=3600)
    """The PS cuts a request stream that sends no frame for this long (DEADLINE_EXCEEDED, counted)."""
    max_model_mb: float = Field(8192.0, gt=0, le=2**20)
    """The largest model (parameters and state) the PS accepts from a Register."""
    max_grad_norm: float | None = Field(None, gt=0)
    """The PS refuses a push whose gradient's L2 norm per sample exceeds this (INVALID_ARGUMENT, counted
    as ``push:grad_norm``): a bound on what a buggy worker's finite but absurd gradient can do. None: off.
    A simulation's gradients are its own: not checked."""
    metrics_port: int | None = Field(None, ge=0, le=65535)
    """Expose Prometheus metrics from the PS on this port."""
    shared_memory: bool = True
    """A worker on the PS's host pushes through a shared-memory segment, not gRPC bytes (others cannot)."""
    shard_max_mb: float = Field(4.0, gt=0, le=2**20)
    """Several PS shards: a variable larger than this is cut into row blocks spread over the shards
    (BytePS's piece size); the partition is the same on every role."""
    cpu: CpuBindingSpec = Field(default_factory=CpuBindingSpec)

    @property
    def chunk_bytes(self) -> int:
        return int(self.chunk_mb * 1024 * 1024) // 4 * 4

    @property
    def shard_max_bytes(self) -> int:
        return int(self.shard_max_mb * 2**20)


class RunConfig(Section):
    name: str = "run"
    seed: int = Field(0, ge=0, le=MAX_SEED)
    """Seeds data splits, weights and stragglers; in [0, 2**32 - 1], as NumPy requires."""
    cluster: Cluster = Field(default_factory=Cluster)
    model: ModelSpec = Field(default_factory=ModelSpec)
    data: DataSpec = Field(default_factory=DataSpec)
    optimizer: OptimizerSpec = Field(default_factory=OptimizerSpec)
    protocol: ProtocolSpec = Field(default_factory=Rounds)
    train: TrainSpec = Field(default_factory=lambda: TrainSpec(epochs=10))
    eval: EvalSpec = Field(default_factory=EvalSpec)
    output: OutputSpec = Field(default_factory=OutputSpec)
    runtime: RuntimeSpec = Field(default_factory=RuntimeSpec)
    device: DeviceSpec = Field(default_factory=DeviceSpec)
    network: NetworkSpec = Field(default_factory=NetworkSpec)
    stragglers: StragglerSpec = Field(default_factory=StragglerSpec)
    policy: PolicySpec = Field(default_factory=PolicySpec)
    checkpoint: CheckpointSpec = Field(default_factory=CheckpointSpec)
    security: SecuritySpec = Field(default_factory=SecuritySpec)

    @model_validator(mode="after")
    def _cross_checks(self, info: ValidationInfo) -> "RunConfig":
        n = self.cluster.num_workers
        ps_host = self.cluster.shards[0].rpartition(":")[0]
        problems = under("security", self.security.role_problems(role_of(info), ps_host))
        if isinstance(self.protocol, Rounds) and self.protocol.backup_workers >= n:
            problems.append(("protocol.backup_workers", f"must be below the number of workers ({n})"))
        if problems:
            raise Problems(problems)
        return self

    def new_run_dir(self) -> Path:
        """``output.dir/NAME-YYYYmmdd-HHMMSS``, with ``-2``, ``-3``... if that exists (simulations of a
        study can start within one second)."""
        stem = Path(self.output.dir) / f"{self.name}-{datetime.now():%Y%m%d-%H%M%S}"
        path, n = stem, 1
        while path.exists():
            n += 1
            path = stem.with_name(f"{stem.name}-{n}")
        return path

    def dump(self) -> str:
        return yaml.safe_dump(self.model_dump(mode="json"), sort_keys=False)


def parse_config(raw: Any, overrides: Sequence[str] = (), role: Role | None = None,
                 checks: Checks | None = None) -> RunConfig:
    """Override and validate ``raw``; ``checks`` add what builds the run, for the command ``role``
    (see the module doc)."""
    if raw is None:
        raw = {}
    if not isinstance(raw, dict):
        raise ConfigError(f"config: the top level must be a mapping of sections, got a {type(raw).__name__}")
    problems: list[str] = []
    if isinstance(raw.get("protocol"), dict):  # a run's config.yaml written before the union
        raw["protocol"] = unflattened(raw["protocol"])
    old = _protocol_name(raw)
    for o in overrides:
        try:
            apply_override(raw, o)
        except ConfigError as e:
            problems += e.problems
    if isinstance(raw.get("protocol"), dict) and old is not None:
        raw["protocol"] = renamed(raw["protocol"], old)
    try:
        cfg = RunConfig.model_validate(raw, context={"role": role, "checks": checks})
    except ValidationError as err:
        problems += describe(err, raw, RunConfig)
    if problems:
        raise ConfigError(*problems)
    return cfg


def _protocol_name(raw: dict[str, Any]) -> str | None:
    """The protocol ``raw`` names before any override (bsp when it names none)."""
    section = raw.get("protocol", {})
    return section.get("name", "bsp") if isinstance(section, dict) else None


def load_config(path: str | os.PathLike | None, overrides: Sequence[str] = (), role: Role | None = None,
                checks: Checks | None = None) -> RunConfig:
    """Load, override and validate a YAML config (``None`` = the quickstart) for ``role``."""
    p = Path(path) if path else Path(str(files("switchps.examples") / "quickstart.yaml"))
    return parse_config(read_yaml(p), overrides, role, checks)
