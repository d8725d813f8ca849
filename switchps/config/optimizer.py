"""The PS's optimizer and its learning-rate schedule, checked by building them as the PS does."""

from __future__ import annotations

from typing import Annotated

from pydantic import Field, ValidationInfo, field_validator, model_validator

from switchps import names
from switchps.config.schema import MAX_STEPS, Section, checks_of, one_of
from switchps.problems import Problems


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
    as the optimizer named accepts them, and weight_decay, which every one takes (Keras 3's decoupled decay,
    ``p -= p * weight_decay * lr`` before each step; default 0, adamw's 0.004)."""
    clip_norm: float | None = Field(None, gt=0)
    """Scale each variable's mean gradient of an update to an L2 norm of at most this before the optimizer's
    rule (Keras's ``clipnorm``). None: off. One PS process only (a shard may hold part of a variable)."""
    global_clip_norm: float | None = Field(None, gt=0)
    """Scale the whole mean gradient of an update to an L2 norm of at most this (Keras's ``global_clipnorm``,
    torch's ``clip_grad_norm_``). None: off; not with ``clip_norm`` (as Keras), nor over several PS shards
    (none sees the whole gradient)."""

    @field_validator("name")
    @classmethod
    def _known(cls, v: str) -> str:
        return one_of(v, names.OPTIMIZERS, "optimizer")

    @model_validator(mode="after")
    def _one_clip(self) -> "OptimizerSpec":
        if self.clip_norm is not None and self.global_clip_norm is not None:
            raise Problems([("global_clip_norm", "clip by clip_norm or by global_clip_norm, not both (as Keras)")])
        return self

    @field_validator("params")
    @classmethod
    def _builds(cls, v: dict[str, float], info: ValidationInfo) -> dict[str, float]:
        checks = checks_of(info)
        if checks and "name" in info.data and (problems := checks.optimizer(info.data["name"], v)):
            raise Problems(problems)
        return v
