"""One YAML file describes a run; this module validates it strictly, before any process starts. Its
sections live by idea beside it (``cluster``, ``workload``, ``optimizer``, ``protocol``, ``policy``,
``stragglers``, ``emulation``, ``security``); here are the run's length, evaluation, checkpoints, output
and runtime, the whole ``RunConfig``, and loading it.

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
from collections.abc import Sequence
from dataclasses import dataclass
from datetime import datetime
from importlib.resources import files
from pathlib import Path
from typing import Annotated, Any, Literal

import yaml
from pydantic import Field, ValidationError, ValidationInfo, model_validator

from switchps.config.churn import ChurnSpec, churn_problems
from switchps.config.cluster import Cluster
from switchps.config.cpu_binding import CpuBindingSpec
from switchps.config.emulation import DeviceSpec, NetworkSpec
from switchps.config.optimizer import OptimizerSpec
from switchps.config.policy import PolicySpec, SwitchSpec
from switchps.config.protocol import ProtocolSpec, Rounds, renamed, unflattened
from switchps.config.schema import MAX_SEED, MAX_STEPS, MAX_THREADS, Checks, Role, Section, checks_of, role_of
from switchps.config.security import SecuritySpec
from switchps.config.stragglers import StragglerSpec
from switchps.config.workload import DataSpec, ModelSpec
from switchps.problems import ConfigError, Problems, describe, under
from switchps.yamlfile import apply_override, read_yaml

__all__ = ["ConfigError", "PolicySpec", "ProtocolSpec", "RunConfig", "SwitchSpec", "load_config", "parse_config"]


class CheckpointSpec(Section):
    """When the PS saves its whole state (docs/fault-tolerance.md); either trigger, or both."""

    every_s: float | None = Field(30.0, gt=0)
    every_updates: int | None = Field(None, gt=0, le=MAX_STEPS)
    keep: int = Field(2, ge=1, le=1000)


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
    """Evaluate the latest model on the held-out set at most this often; the final evaluation comes as soon as
    training ends, however long this is."""
    target_accuracy: float | None = Field(None, gt=0, le=1)
    final_timeout_s: float = Field(60.0, gt=0)


class MlflowOutput(Section):
    """Live MLflow logging of the run (needs switchps[mlflow]): the PS's record flusher logs each flush's new
    ps.csv and eval.csv rows as metrics; a failing tracking store is logged once and counted, never stops
    training."""

    tracking_uri: str = Field(min_length=1)
    """The tracking store, e.g. ``http://mlflow.example:5000`` or ``sqlite:///mlflow.db``."""
    experiment: str = Field("switchps", min_length=1)
    """The experiment, created if missing."""


class OutputSpec(Section):
    dir: str = "runs"
    mlflow: MlflowOutput | None = None
    """Log the run to MLflow as it goes (see docs/outputs.md, MLflow). None: off; `switchps export mlflow
    RUN_DIR` logs a finished run."""


@dataclass(frozen=True)
class Pipeline:
    """Whether a worker may overlap a push with its next step (``runtime.pipeline_depth``,
    ``runtime.pipeline_sync``): the PS says so in each work order, for the protocol in force."""

    depth: int = 0
    sync: bool = False

    def overlaps(self, asynchronous: bool) -> bool:
        """Whether a worker overlaps under a protocol that is ``asynchronous`` (else a round protocol)."""
        return self.depth > 0 and (asynchronous or self.sync)


class RuntimeSpec(Section):
    intra_op_threads: int = Field(1, ge=1, le=MAX_THREADS)
    """The framework's threads per process (TensorFlow's intra-op pool, torch's `set_num_threads`), at most
    256 (as is inter_op_threads)."""
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
    """Serve the PS's Prometheus series (docs/metrics.md) over HTTP on this port; follower shard K of a sharded
    PS on this port + K. 0: each PS process a free port the OS picks (logged). None: off."""
    ps_threads: Annotated[int, Field(ge=1, le=MAX_THREADS)] | Literal["auto"] = "auto"
    """Threads (1 to 256) each PS process, each shard, applies an update and joins pushes on, block by
    block, with bit-identical results on any number. auto: 1 with fewer than 8 usable cores per PS process
    on the host (the shards on one host share its cores), else half of them, at most 8."""
    shared_memory: bool = True
    """A worker on the PS's host pushes through a shared-memory segment, not gRPC bytes (others cannot)."""
    wire_dtype: Literal["float32", "bfloat16", "float16"] = "float32"
    """The type gradients and values cross the wire and shared memory in: float32, bfloat16 or float16 (half
    the bytes of a push and of a reply). The PS keeps float32 values and optimizer state and checkpoints; a
    worker registering with another type than the PS's is refused (FAILED_PRECONDITION, ``register:wire_dtype``).
    float16 overflows beyond ±65504: such a gradient is infinite, and the PS refuses it."""
    shard_max_mb: float = Field(4.0, gt=0, le=2**20)
    """Several PS shards: a variable larger than this is cut into row blocks spread over the shards
    (BytePS's piece size); the partition is the same on every role."""
    pipeline_depth: Literal[0, 1] = 0
    """1: a switchps worker computes its next step on the values it has while its push is in flight (one push
    at most), under the asynchronous protocols (asp, ssp, kasync, timed); its pushes are one step staler,
    and recorded so (their base version is that of the values they were computed on). 0: push, wait, step."""
    pipeline_sync: bool = False
    """With pipeline_depth 1, overlap under the round protocols too (bsp, fmb, amb, backup): one-step-delayed
    updates, a round taking each worker's push computed on the values before the previous round's. False:
    they keep their semantics exactly and a worker does not overlap while one is in force."""
    cpu: CpuBindingSpec = Field(default_factory=CpuBindingSpec)
    device: str = Field("auto", pattern=r"^(auto|cpu|cuda|cuda:\d+)$")
    """Where torch workers compute: auto (worker i on GPU i mod the GPUs there are, else the CPU), cpu,
    cuda (the first GPU) or cuda:K, a GPU the host has. TensorFlow roles run on the CPU (auto or cpu)."""

    @property
    def pipeline(self) -> Pipeline:
        return Pipeline(self.pipeline_depth, self.pipeline_sync)

    @property
    def chunk_bytes(self) -> int:
        return int(self.chunk_mb * 1024 * 1024) // 4 * 4

    @property
    def shard_max_bytes(self) -> int:
        return int(self.shard_max_mb * 2**20)


CLIP_ACROSS_SHARDS = {
    "global_clip_norm": "no shard sees the whole gradient's norm",
    "clip_norm": "a variable above runtime.shard_max_mb is cut into row blocks on several shards",
}
"""The clips a sharded PS refuses, and why (``protos.partition``)."""


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
    churn: ChurnSpec = Field(default_factory=ChurnSpec)
    policy: PolicySpec = Field(default_factory=PolicySpec)
    checkpoint: CheckpointSpec = Field(default_factory=CheckpointSpec)
    security: SecuritySpec = Field(default_factory=SecuritySpec)

    @model_validator(mode="after")
    def _cross_checks(self, info: ValidationInfo) -> "RunConfig":
        n = self.cluster.num_workers
        ps_host = self.cluster.shards[0].rpartition(":")[0]
        problems = under("security", self.security.role_problems(role_of(info), ps_host))
        if (elastic := self.cluster.elastic) is not None:
            n = elastic.min
            problems += elastic_problems(self)
        problems += churn_problems(self.churn, self.cluster, role_of(info))
        if isinstance(self.protocol, Rounds) and self.protocol.backup_workers >= n:
            fewest = "the fewest members (cluster.workers.min)" if elastic else "the number of workers"
            problems.append(("protocol.backup_workers", f"must be below {fewest} ({n})"))
        if self.runtime.pipeline_sync and not self.runtime.pipeline_depth:
            problems.append(("runtime.pipeline_sync", "overlaps steps only with runtime.pipeline_depth: 1"))
        if len(self.cluster.shards) > 1:
            ps_optimizers = {"optimizer": self.optimizer,
                             "protocol.outer_optimizer": getattr(self.protocol, "outer_optimizer", None)}
            problems += [(f"{at}.{key}", f"clips on one PS process, not {len(self.cluster.shards)} shards ({why})")
                         for at, spec in ps_optimizers.items() if spec is not None
                         for key, why in CLIP_ACROSS_SHARDS.items() if getattr(spec, key) is not None]
        if self.model.framework == "tensorflow" and self.runtime.device.startswith("cuda"):
            problems.append(("runtime.device", f"{self.runtime.device} is for model.framework torch; TensorFlow "
                                               "roles run on the CPU (auto or cpu)"))
        if not problems and (checks := checks_of(info)):
            problems = checks.workload(self, role_of(info))
        if problems:
            raise Problems(problems)
        return self

    def new_run_dir(self, claim: bool = False) -> Path:
        """``output.dir/NAME-YYYYmmdd-HHMMSS``, with ``-2``, ``-3``... if that exists (simulations of a
        study can start within one second). ``claim``: create it, empty, in the same step, so that runs
        started at once by several processes (``switchps study --jobs``) never get the same one."""
        stem = Path(self.output.dir) / f"{self.name}-{datetime.now():%Y%m%d-%H%M%S}"
        path, n = stem, 1
        while not _free(path, claim):
            n += 1
            path = stem.with_name(f"{stem.name}-{n}")
        return path

    def dump(self) -> str:
        return yaml.safe_dump(self.model_dump(mode="json"), sort_keys=False)


def elastic_problems(cfg: RunConfig) -> list[tuple[str, str]]:
    """What an elastic run (``cluster.workers: {min, max}``) cannot have."""
    if cfg.data.sampling == "partition":
        return [("data.sampling", "an elastic run draws with replacement: worker i's every-N-th share "
                                  "means nothing once N moves (set data.sampling: replacement)")]
    return []


def _free(path: Path, claim: bool) -> bool:
    """Whether ``path`` does not exist; ``claim``: whether this call created it (``mkdir`` fails on a
    directory another process created first)."""
    if not claim:
        return not path.exists()
    path.parent.mkdir(parents=True, exist_ok=True)
    try:
        path.mkdir()
    except FileExistsError:
        return False
    return True


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
