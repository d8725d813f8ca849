"""The ``stragglers`` section of a run config: which delays to inject, and the mixtures' arithmetic.

The worker's ``StragglerInjector`` (``worker.stragglers``) turns these specs into per-step delays.
"""

from __future__ import annotations

import math
from typing import Any, Literal

import numpy as np
from pydantic import Field, field_validator, model_validator

from switchps.config.schema import Section

MIXTURES: dict[str, list[list[float]]] = {
    "niagara": [[0, 0, .4], [0, .4, .3], [2, .3, .2], [5, .3, .1]],
    "cedar": [[0, 0, .4], [.05, .04, .3], [.15, .03, .2], [.25, .03, .1]],
}
"""AMB's straggler mixtures: rows of [mean_s, std_s, weight]."""


def _check_indices(v: list[int] | None, what: str) -> list[int] | None:
    if v is not None:
        if not v:
            raise ValueError(f"{what} must not be empty")
        if any(i < 0 for i in v):
            raise ValueError(f"{what} must be >= 0")
        if len(set(v)) != len(v):
            raise ValueError(f"{what} must not repeat")
    return v


class MixtureSpec(Section):
    """An i.i.d. sleep per worker per step: pick a row by weight, draw |N(mean, std)|, clip."""

    preset: Literal["niagara", "cedar"] | None = None
    rows: list[list[float]] | None = None
    """[[mean_s, std_s, weight], ...]; weights are normalized."""
    scale: float = Field(1.0, gt=0)
    """Multiplies every mean and std (keeps AMB/FMB ratios while shortening a study)."""
    workers: list[int] | None = None
    """Only these workers straggle (default: all)."""

    @field_validator("rows")
    @classmethod
    def _rows(cls, v: list[list[float]] | None) -> list[list[float]] | None:
        if v is None:
            return v
        if not v:
            raise ValueError("give at least one row")
        for i, row in enumerate(v):
            if len(row) != 3:
                raise ValueError(f"row {i}: expected [mean_s, std_s, weight], got {row}")
            mean, std, weight = row
            if mean < 0:
                raise ValueError(f"row {i}: mean must be >= 0, got {mean}")
            if std < 0:
                raise ValueError(f"row {i}: std must be >= 0, got {std}")
            if weight <= 0:
                raise ValueError(f"row {i}: weight must be > 0, got {weight}")
        return v

    @field_validator("workers")
    @classmethod
    def _workers(cls, v: list[int] | None) -> list[int] | None:
        return _check_indices(v, "workers")

    @model_validator(mode="after")
    def _one_source(self) -> MixtureSpec:
        if (self.preset is None) == (self.rows is None):
            raise ValueError("give exactly one of preset, rows")
        return self

    def components(self) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
        """(means_s, stds_s, probabilities), with ``scale`` applied and weights normalized."""
        rows = self.rows if self.rows is not None else MIXTURES[self.preset or ""]
        table = np.asarray(rows, dtype=np.float64)
        return table[:, 0] * self.scale, table[:, 1] * self.scale, table[:, 2] / table[:, 2].sum()

    @property
    def clip_s(self) -> float:
        """No draw exceeds max over rows of (mean + 5 std), as in AMB."""
        means, stds, _ = self.components()
        return float(np.max(means + 5 * stds))


class SlowdownSpec(Section):
    """Persistent heterogeneous hardware: worker index -> compute slowdown factor."""

    factors: dict[int, float]

    @field_validator("factors")
    @classmethod
    def _factors(cls, v: dict[int, float]) -> dict[int, float]:
        for w, f in v.items():
            if w < 0:
                raise ValueError(f"worker index must be >= 0, got {w}")
            if f < 1:
                raise ValueError(f"worker {w}: factor must be >= 1, got {f}")
        return v


class TransientSpec(Section):
    """Sync-Switch style episodes: for ``duration_s``, some workers are slowed or sleep extra."""

    workers: int | list[int] = 1
    """k workers chosen per episode (seeded, from all workers), or a fixed list."""
    factor: float | None = Field(3.0, ge=1)
    """Slowdown factor during an episode (the default unless delay_s is given) ..."""
    delay_s: float | None = Field(None, gt=0)
    """... or a sleep added to every step that starts during an episode."""
    duration_s: float = Field(gt=0)
    every_s: float | None = Field(None, gt=0)
    """Episodes start as a Poisson process with this mean gap ..."""
    times: list[float] | None = None
    """... or at these times (seconds since training start)."""

    @model_validator(mode="before")
    @classmethod
    def _delay_replaces_default_factor(cls, data: Any) -> Any:
        if isinstance(data, dict) and data.get("delay_s") is not None and "factor" not in data:
            return {**data, "factor": None}
        return data

    @field_validator("workers")
    @classmethod
    def _workers(cls, v: int | list[int]) -> int | list[int]:
        if isinstance(v, int):
            if v < 1:
                raise ValueError(f"need at least one worker, got {v}")
            return v
        _check_indices(v, "workers")
        return v

    @field_validator("times")
    @classmethod
    def _times(cls, v: list[float] | None) -> list[float] | None:
        if v is not None and (not v or min(v) < 0):
            raise ValueError("times must be a non-empty list of seconds >= 0")
        return v

    @model_validator(mode="after")
    def _exactly_one(self) -> TransientSpec:
        if (self.factor is None) == (self.delay_s is None):
            raise ValueError("give exactly one of factor, delay_s")
        if (self.every_s is None) == (self.times is None):
            raise ValueError("give exactly one of every_s, times")
        return self


class CommDelaySpec(Section):
    """A delay before each push: constant, or |N(0, sigma)| drawn per push."""

    fixed_s: float | None = Field(None, ge=0)
    sigma_s: float | None = Field(None, gt=0)

    @model_validator(mode="after")
    def _exactly_one(self) -> CommDelaySpec:
        if (self.fixed_s is None) == (self.sigma_s is None):
            raise ValueError("give exactly one of fixed_s, sigma_s")
        return self


class ShiftedExponentialSpec(Section):
    """The AMB paper's compute-time model: a sleep of c + Exp(mu) per worker per step, before computing.

    With a device of negligible compute (a huge ``device.samples_per_s``) a step takes c + Exp(mu).
    """

    shift_s: float = Field(0.0, ge=0)
    """c, the deterministic part of every draw."""
    rate_per_s: float = Field(gt=0)
    """mu, the exponential part's rate: its mean is 1 / mu seconds."""
    workers: list[int] | None = None
    """Only these workers straggle (default: all)."""

    @field_validator("workers")
    @classmethod
    def _workers(cls, v: list[int] | None) -> list[int] | None:
        return _check_indices(v, "workers")


KINDS = ("mixture", "shifted_exponential", "slowdown", "transient", "comm_delay")
"""The straggler kinds a run can combine (``trace`` replaces them all)."""


class StragglerSpec(Section):
    """Which stragglers to inject; all kinds combine. ``trace`` replays a recording instead."""

    mixture: MixtureSpec | None = None
    shifted_exponential: ShiftedExponentialSpec | None = None
    slowdown: SlowdownSpec | None = None
    transient: TransientSpec | None = None
    comm_delay: CommDelaySpec | None = None
    trace: str | None = None
    """Path to an earlier run's stragglers.csv, replayed exactly."""

    @model_validator(mode="after")
    def _trace_alone(self) -> StragglerSpec:
        if self.trace is not None:
            others = [k for k in KINDS if getattr(self, k) is not None]
            if others:
                raise ValueError(f"trace replays a recording; remove {', '.join(others)}")
        return self

    @property
    def active(self) -> bool:
        """True when any straggler is configured."""
        return any(getattr(self, k) is not None for k in type(self).model_fields)


def expected_mixture_mean(spec: MixtureSpec) -> float:
    """Analytic E[sleep] of a mixture, with ``scale`` applied.

    Uses E|N(m, s)| = s sqrt(2/pi) exp(-m^2 / 2s^2) + m (1 - 2 Phi(-m/s)) per row. The clip at
    mean + 5 std is ignored: it removes under 3e-7 of any row's mass.
    """
    total = 0.0
    for m, s, p in zip(*spec.components()):
        if s == 0:
            total += p * abs(m)
        else:
            phi = 0.5 * (1 + math.erf(-m / s / math.sqrt(2)))
            total += p * (s * math.sqrt(2 / math.pi) * math.exp(-m * m / (2 * s * s)) + m * (1 - 2 * phi))
    return float(total)
