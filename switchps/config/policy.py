"""The ``policy`` section of a run config: which policy decides switches, and what a switch does to the
optimizer (``on_switch``)."""

from __future__ import annotations

from typing import Any, Literal

from pydantic import Field, ValidationInfo, field_validator, model_validator

from switchps.problems import Problems
from switchps.config.protocol import ProtocolSpec
from switchps.config.schema import MAX_STEPS, Section, checks_of


class SwitchSpec(Section):
    """What a live protocol switch does to the optimizer."""

    lr: Literal["linear", "keep"] | float = "linear"
    """linear: scale the learning rate by new/old effective batch; keep; or a factor f applied as f when
    the effective batch grows and 1/f when it shrinks."""
    optimizer_state: Literal["keep", "reset", "scale"] = "keep"
    """Momentum/Adam moments at a protocol switch; keeping them is what Sync-Switch found best."""
    state_scale: float = Field(1.0, ge=0)
    momentum: Literal["keep", "asynchrony", "cut"] = "cut"
    """asynchrony: entering ASP/SSP with N workers, lower the momentum by the 1 - 1/N that asynchrony itself
    adds (Mitliagkas et al., "Asynchrony begets momentum", 2016) and raise the learning rate so that
    lr / (1 - momentum) is unchanged; cut: lower the momentum the same way without raising the learning
    rate (the default: in the switch-configuration study it was the one rule that neither diverged nor
    dipped in any seed); keep: the configured momentum throughout; a round-based protocol gets the
    configured momentum back."""
    restore_updates: int = Field(0, ge=0, le=MAX_STEPS)
    """asynchrony: raise the learning rate to its restored value linearly over this many updates after a
    switch, starting from the cut's (0: at once)."""
    warmup_updates: int = Field(0, ge=0, le=MAX_STEPS)
    """After a switch, the learning rate rises linearly from 1/N of its value to all of it over N updates."""


class PolicySpec(Section):
    name: str | None = None
    """schedule | greedy | elastic | anytime | dynamic_batching | module:Class (None: no policy)."""
    kwargs: dict[str, Any] = Field(default_factory=dict)
    every_k: int = Field(10, gt=0, le=MAX_STEPS)
    """Under ASP/SSP the policy is consulted every k updates (every round otherwise); at most 2**31 - 1."""
    window: int = Field(5, gt=0, le=2**20)
    """Recent steps per worker in the stats snapshot (kept in memory; at most 2**20)."""
    on_switch: SwitchSpec = Field(default_factory=SwitchSpec)
    protocols: list[ProtocolSpec] = Field(default_factory=list)
    """The fields a switch to each protocol listed puts in force, e.g. `[{name: amb, time_budget_s: 0.5}]`
    for a schedule that reaches AMB (a protocol's fields cannot sit under another's name). A switch takes
    the fields the new protocol shares with the one in force, then these (the configured protocol's own,
    for its name), then the decision's."""

    @field_validator("protocols")
    @classmethod
    def _once(cls, v: list[ProtocolSpec]) -> list[ProtocolSpec]:
        names = [p.name for p in v]
        if twice := sorted({n for n in names if names.count(n) > 1}):
            raise ValueError(f"a protocol listed twice: {', '.join(twice)}")
        return v

    @model_validator(mode="after")
    def _builds(self, info: ValidationInfo) -> "PolicySpec":
        """Policies run in the PS, so every process can build one: a bad name or kwargs fails here."""
        checks = checks_of(info)
        if checks and self.name is not None and (problems := checks.policy(self.name, self.kwargs)):
            raise Problems(problems)
        return self
