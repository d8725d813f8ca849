"""One YAML file describes a run; this module validates it strictly.

Every section forbids unknown keys. ``load_config`` raises ``ConfigError``
whose message is one line naming the offending field, and ``--set`` style
overrides (``protocol.name=asp``) are applied before validation.
"""

from __future__ import annotations

import os
from importlib.resources import files
from datetime import datetime
from pathlib import Path
from typing import Any, Literal

import yaml
from pydantic import BaseModel, ConfigDict, Field, ValidationError, field_validator, model_validator

from switchps.worker.stragglers import StragglerSpec

PROTOCOLS = ("bsp", "asp", "ssp")


class ConfigError(ValueError):
    """A bad config: the message is one line naming the field."""


class Section(BaseModel):
    model_config = ConfigDict(extra="forbid")


class Cluster(Section):
    ps: str = "127.0.0.1:0"
    """host:port of the PS; port 0 lets `switchps run` pick a free one."""
    workers: int | list[str] = 4
    """Number of local workers, or the list of worker addresses (one per host)."""
    startup_timeout_s: float = Field(120.0, gt=0)
    """How long the PS waits for every worker to register before starting with those present."""

    @property
    def num_workers(self) -> int:
        return self.workers if isinstance(self.workers, int) else len(self.workers)

    @field_validator("workers")
    @classmethod
    def _positive(cls, v: int | list[str]) -> int | list[str]:
        if (v if isinstance(v, int) else len(v)) < 1:
            raise ValueError("need at least one worker")
        return v

    @field_validator("ps")
    @classmethod
    def _address(cls, v: str) -> str:
        host, sep, port = v.rpartition(":")
        if not sep or not host or not port.isdigit() or int(port) > 65535:
            raise ValueError(f"expected host:port, got {v!r}")
        return v


class ModelSpec(Section):
    name: str = "mlp"
    """A zoo name (logreg, mlp, cnn, resnet20, resnet32) or an import path `module:function`."""
    kwargs: dict[str, Any] = Field(default_factory=dict)


class DataSpec(Section):
    name: Literal["digits", "synthetic", "mnist", "fashion_mnist", "cifar10", "cifar100", "npz"] = "digits"
    path: str | None = None
    test_fraction: float = Field(0.2, gt=0, lt=1)
    num_samples: int = Field(10000, gt=0)
    num_features: int = Field(20, gt=0)
    num_classes: int = Field(10, gt=1)

    @model_validator(mode="after")
    def _npz_needs_path(self) -> "DataSpec":
        if self.name == "npz" and not self.path:
            raise ValueError("path is required when name is npz")
        return self


class ScheduleSpec(Section):
    kind: Literal["constant", "step", "exponential", "cosine"] = "constant"
    boundaries: list[int] | None = None
    values: list[float] | None = None
    decay_steps: int | None = Field(None, gt=0)
    decay_rate: float | None = Field(None, gt=0)
    alpha: float = 0.0
    staircase: bool = False
    warmup_steps: int = Field(0, ge=0)


class OptimizerSpec(Section):
    name: Literal["sgd", "momentum", "nesterov", "rmsprop", "adam", "adagrad"] = "sgd"
    learning_rate: float = Field(0.1, gt=0)
    schedule: ScheduleSpec = Field(default_factory=ScheduleSpec)
    params: dict[str, float] = Field(default_factory=dict)
    """Extra hyper-parameters: momentum, rho, beta_1, beta_2, epsilon, initial_accumulator_value."""


SYNCHRONOUS = ("bsp", "amb", "fmb")
"""Protocols that run in rounds: every active worker pushes, then one update is applied."""


class ProtocolSpec(Section):
    name: Literal["bsp", "asp", "ssp", "amb", "fmb"] = "bsp"
    batch: int = Field(32, gt=0)
    """Samples per worker step (the sample budget); FMB is BSP with this fixed batch."""
    micro_batch: int | None = Field(None, gt=0)
    """Samples per gradient micro-batch; defaults to `batch`."""
    time_budget_s: float | None = Field(None, gt=0)
    """AMB only: T, the compute time per step, from receiving the work order to pushing."""
    max_batch: int | None = Field(None, gt=0)
    """AMB only: the upper bound on samples per step (default 4 x batch)."""
    deadline_s: float = Field(30.0, gt=0)
    """A worker that has not pushed this long after a round began is marked inactive."""
    backup_workers: int = Field(0, ge=0)
    """BSP only: complete a round on the first N-k pushes and drop the k late ones."""
    staleness: int = Field(3, ge=0)
    """SSP only: how many clocks a worker may run ahead of the slowest."""
    staleness_lr: bool = False
    """ASP/SSP: damp the learning rate by staleness, lr/(1+tau)."""

    @model_validator(mode="after")
    def _amb_needs_budget(self) -> "ProtocolSpec":
        if self.name == "amb" and self.time_budget_s is None:
            raise ValueError("time_budget_s is required when name is amb")
        return self

    @property
    def synchronous(self) -> bool:
        return self.name in SYNCHRONOUS

    @property
    def sample_budget(self) -> int:
        """Samples a worker may take per step: AMB's upper bound, else the batch."""
        return (self.max_batch or 4 * self.batch) if self.name == "amb" else self.batch

    @property
    def step_time_budget_s(self) -> float:
        """T for AMB; 0 (no time budget) otherwise."""
        return self.time_budget_s if self.name == "amb" else 0.0

    @property
    def effective_micro_batch(self) -> int:
        return min(self.micro_batch or self.batch, self.sample_budget)


class DeviceSpec(Section):
    samples_per_s: float | None = Field(None, gt=0)
    """Emulate a device of this speed: each micro-batch takes micro_batch / samples_per_s seconds
    (never less than the real compute), so studies with many workers run honestly on 2 cores."""


class NetworkSpec(Section):
    ps_link_mbit_s: float | None = Field(None, gt=0)
    """Emulate the PS's network link at this rate (full duplex): workers' pushes share its inbound side
    and the parameters sent back its outbound side, so a BSP round's N simultaneous transfers take N
    times as long as one. Loopback alone makes communication nearly free."""


class SwitchSpec(Section):
    """What a live protocol switch does to the optimizer."""

    lr: Literal["linear", "keep"] | float = "linear"
    """linear: scale the learning rate by new/old effective batch; keep; or a factor f applied as f when
    the effective batch grows and 1/f when it shrinks."""
    optimizer_state: Literal["keep", "reset", "scale"] = "keep"
    """Momentum/Adam moments at a protocol switch; keeping them is what Sync-Switch found best."""
    state_scale: float = Field(1.0, ge=0)
    momentum: Literal["keep", "asynchrony"] = "keep"
    """asynchrony: entering ASP/SSP with N workers, lower the momentum by the 1 - 1/N that asynchrony itself
    adds (Mitliagkas et al., "Asynchrony begets momentum", 2016) and raise the learning rate so that
    lr / (1 - momentum) is unchanged; a round-based protocol gets the configured momentum back."""
    stale: Literal["use", "drop"] = "use"
    """Pushes from workers taken out of the barrier (elastic) that arrive stale: join a later round as
    stale contributions, or are dropped and counted."""


class PolicySpec(Section):
    name: str | None = None
    """schedule | greedy | elastic | anytime | dynamic_batching | module:Class (None: no policy)."""
    kwargs: dict[str, Any] = Field(default_factory=dict)
    every_k: int = Field(10, gt=0)
    """Under ASP/SSP the policy is consulted every k updates (every round otherwise)."""
    window: int = Field(5, gt=0)
    """Recent steps per worker in the stats snapshot."""
    on_switch: SwitchSpec = Field(default_factory=SwitchSpec)

    @model_validator(mode="after")
    def _builds(self) -> "PolicySpec":
        if self.name is not None:
            from switchps.policies.registry import make_policy

            make_policy(self.name, self.kwargs, self.every_k)
        return self


class TrainSpec(Section):
    steps: int | None = Field(None, gt=0)
    """Stop after this many model updates (versions)."""
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
    intra_op_threads: int = Field(1, ge=1)
    inter_op_threads: int = Field(1, ge=1)
    chunk_mb: float = Field(2.0, gt=0, le=32)
    """Size of raw tensor frames on the wire."""
    metrics_port: int | None = Field(None, ge=0, le=65535)
    """Expose Prometheus metrics from the PS on this port."""

    @property
    def chunk_bytes(self) -> int:
        return int(self.chunk_mb * 1024 * 1024) // 4 * 4


class RunConfig(Section):
    name: str = "run"
    seed: int = 0
    cluster: Cluster = Field(default_factory=Cluster)
    model: ModelSpec = Field(default_factory=ModelSpec)
    data: DataSpec = Field(default_factory=DataSpec)
    optimizer: OptimizerSpec = Field(default_factory=OptimizerSpec)
    protocol: ProtocolSpec = Field(default_factory=ProtocolSpec)
    train: TrainSpec = Field(default_factory=lambda: TrainSpec(epochs=10))
    eval: EvalSpec = Field(default_factory=EvalSpec)
    output: OutputSpec = Field(default_factory=OutputSpec)
    runtime: RuntimeSpec = Field(default_factory=RuntimeSpec)
    device: DeviceSpec = Field(default_factory=DeviceSpec)
    network: NetworkSpec = Field(default_factory=NetworkSpec)
    stragglers: StragglerSpec = Field(default_factory=StragglerSpec)
    policy: PolicySpec = Field(default_factory=PolicySpec)

    @model_validator(mode="after")
    def _cross_checks(self) -> "RunConfig":
        n = self.cluster.num_workers
        if self.protocol.backup_workers >= n:
            raise ValueError(f"protocol.backup_workers must be below the number of workers ({n})")
        return self

    def run_dir_name(self) -> str:
        return f"{self.name}-{datetime.now():%Y%m%d-%H%M%S}"

    def dump(self) -> str:
        return yaml.safe_dump(self.model_dump(mode="json"), sort_keys=False)


def apply_override(raw: dict[str, Any], assignment: str) -> None:
    """Apply one ``dotted.key=value`` override; the value is parsed as YAML."""
    key, sep, value = assignment.partition("=")
    if not sep or not key:
        raise ConfigError(f"--set {assignment!r}: expected key.path=value")
    *parents, leaf = key.split(".")
    node = raw
    for part in parents:
        child = node.setdefault(part, {})
        if not isinstance(child, dict):
            raise ConfigError(f"{key}: {part} is not a section")
        node = child
    node[leaf] = yaml.safe_load(value)


def _one_line(err: ValidationError) -> str:
    e = err.errors()[0]
    loc = ".".join(str(p) for p in e["loc"])
    msg = "unknown key" if e["type"] == "extra_forbidden" else e["msg"].removeprefix("Value error, ")
    return f"{loc}: {msg}" if loc else msg


def parse_config(raw: Any, overrides: list[str] = ()) -> RunConfig:
    if raw is None:
        raw = {}
    if not isinstance(raw, dict):
        raise ConfigError("config: the top level must be a mapping")
    for o in overrides:
        apply_override(raw, o)
    try:
        return RunConfig.model_validate(raw)
    except ValidationError as err:
        raise ConfigError(_one_line(err)) from None


def load_config(path: str | os.PathLike | None, overrides: list[str] = ()) -> RunConfig:
    """Load, override and validate a YAML config (``None`` = the quickstart)."""
    p = Path(path) if path else Path(str(files("switchps.configs") / "quickstart.yaml"))
    try:
        raw = yaml.safe_load(p.read_text())
    except FileNotFoundError:
        raise ConfigError(f"config: file not found: {p}") from None
    except yaml.YAMLError as e:
        mark = getattr(e, "problem_mark", None)
        where = f" at line {mark.line + 1}" if mark else ""
        raise ConfigError(f"config: invalid YAML{where}: {getattr(e, 'problem', e)}") from None
    return parse_config(raw, overrides)
