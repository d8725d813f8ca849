"""Learning-rate schedules: ``step -> lr`` as Keras's schedules compute them, without TensorFlow."""

from __future__ import annotations

import bisect
import math
from collections.abc import Callable
from dataclasses import dataclass
from typing import Union

SCHEDULES: dict[str, set[str]] = {
    "constant": set(),
    "step": {"boundaries", "values", "decay_rate"},
    "exponential": {"decay_steps", "decay_rate", "staircase"},
    "cosine": {"decay_steps", "alpha"},
}
"""Every schedule kind by name, with the arguments it takes: the one list, which config validation uses."""

LRSchedule = Union[float, Callable[[int], float]]
"""A constant learning rate, or a map from the optimizer's ``iterations`` (0 before the first update) to
one, as Keras optimizers take a float or a schedule."""


def rate(schedule: LRSchedule, step: int) -> float:
    return float(schedule(step) if callable(schedule) else schedule)


@dataclass(frozen=True)
class _Piecewise:
    """``keras.optimizers.schedules.PiecewiseConstantDecay``: ``values[i]`` for
    ``boundaries[i-1] < step <= boundaries[i]``."""

    boundaries: tuple[int, ...]
    values: tuple[float, ...]

    def __call__(self, step: int) -> float:
        return self.values[bisect.bisect_left(self.boundaries, step)]


@dataclass(frozen=True)
class _Exponential:
    """``keras.optimizers.schedules.ExponentialDecay``."""

    learning_rate: float
    decay_steps: int
    decay_rate: float
    staircase: bool

    def __call__(self, step: int) -> float:
        p = step / self.decay_steps
        if self.staircase:
            p = math.floor(p)
        return self.learning_rate * self.decay_rate**p


@dataclass(frozen=True)
class _Cosine:
    """``keras.optimizers.schedules.CosineDecay`` (without Keras's own warmup)."""

    learning_rate: float
    decay_steps: int
    alpha: float

    def __call__(self, step: int) -> float:
        fraction = min(step, self.decay_steps) / self.decay_steps
        cosine = 0.5 * (1.0 + math.cos(math.pi * fraction))
        return self.learning_rate * ((1.0 - self.alpha) * cosine + self.alpha)


@dataclass(frozen=True)
class _Warmup:
    """``base(step) * min(1, (step + 1) / warmup_steps)``."""

    base: LRSchedule
    warmup_steps: int

    def __call__(self, step: int) -> float:
        return rate(self.base, step) * min(1.0, (step + 1) / self.warmup_steps)


def make_schedule(
    kind: str,
    learning_rate: float,
    *,
    boundaries: list[int] | None = None,
    values: list[float] | None = None,
    decay_steps: int | None = None,
    decay_rate: float | None = None,
    alpha: float = 0.0,
    staircase: bool = False,
    warmup_steps: int = 0,
) -> LRSchedule:
    """Build a learning-rate schedule ``step -> lr``.

    Kinds (each matches the Keras schedule of the same semantics):

    * ``"constant"``: ``learning_rate`` itself (a float).
    * ``"step"``: ``PiecewiseConstantDecay(boundaries, values)``; ``values``
      (``len(boundaries) + 1`` absolute rates) may be omitted in favour of
      ``decay_rate``, giving ``values[i] = learning_rate * decay_rate**i``.
    * ``"exponential"``: ``ExponentialDecay(learning_rate, decay_steps,
      decay_rate, staircase)``.
    * ``"cosine"``: ``CosineDecay(learning_rate, decay_steps, alpha)``.

    ``warmup_steps > 0`` multiplies any of them by a linear warmup from 0:
    ``lr(step) = base(step) * min(1, (step + 1) / warmup_steps)``, so the first
    update (step 0) uses ``base(0) / warmup_steps`` and step ``warmup_steps - 1``
    onwards uses the full ``base(step)``.

    Raises ``ValueError`` for unknown kinds, missing or out-of-range arguments,
    and arguments that the chosen kind does not use.
    """
    given = {name for name, value, default in (
        ("boundaries", boundaries, None), ("values", values, None), ("decay_steps", decay_steps, None),
        ("decay_rate", decay_rate, None), ("alpha", alpha, 0.0), ("staircase", staircase, False),
    ) if value != default}
    _check(kind, given, learning_rate, warmup_steps, decay_steps, decay_rate)
    base: LRSchedule
    if kind == "constant":
        base = float(learning_rate)
    elif kind == "step":
        base = _piecewise(learning_rate, boundaries, values, decay_rate)
    elif kind == "exponential":
        if decay_rate is None:
            raise ValueError("schedule 'exponential' needs decay_rate")
        base = _Exponential(float(learning_rate), int(decay_steps or 0), float(decay_rate), staircase)
    else:
        if not 0.0 <= alpha <= 1.0:
            raise ValueError(f"alpha must be in [0, 1], got {alpha}")
        base = _Cosine(float(learning_rate), int(decay_steps or 0), float(alpha))
    return _Warmup(base, warmup_steps) if warmup_steps > 0 else base


def _check(kind: str, given: set[str], learning_rate: float, warmup_steps: int, decay_steps: int | None,
           decay_rate: float | None) -> None:
    """What every kind requires: a known kind, only its own arguments, finite non-negative numbers."""
    if kind not in SCHEDULES:
        raise ValueError(f"unknown schedule kind {kind!r}; expected one of {sorted(SCHEDULES)}")
    if extra := sorted(given - SCHEDULES[kind]):
        raise ValueError(f"schedule {kind!r} does not take {', '.join(extra)}")
    if not (math.isfinite(learning_rate) and learning_rate >= 0):
        raise ValueError(f"learning_rate must be finite and >= 0, got {learning_rate}")
    if not (isinstance(warmup_steps, int) and warmup_steps >= 0):
        raise ValueError(f"warmup_steps must be an int >= 0, got {warmup_steps!r}")
    if kind in ("exponential", "cosine") and not (isinstance(decay_steps, int) and decay_steps > 0):
        raise ValueError(f"schedule {kind!r} needs an int decay_steps > 0, got {decay_steps!r}")
    if decay_rate is not None and not (math.isfinite(decay_rate) and decay_rate > 0):
        raise ValueError(f"decay_rate must be finite and > 0, got {decay_rate}")


def _piecewise(learning_rate: float, boundaries: list[int] | None, values: list[float] | None,
               decay_rate: float | None) -> _Piecewise:
    if not boundaries:
        raise ValueError("schedule 'step' needs a non-empty list of boundaries")
    if any(b >= c for b, c in zip(boundaries, boundaries[1:])):
        raise ValueError(f"boundaries must be strictly increasing, got {boundaries}")
    if values is None:
        if decay_rate is None:
            raise ValueError("schedule 'step' needs values or decay_rate")
        values = [learning_rate * decay_rate**i for i in range(len(boundaries) + 1)]
    elif decay_rate is not None:
        raise ValueError("schedule 'step' takes values or decay_rate, not both")
    if len(values) != len(boundaries) + 1:
        raise ValueError(f"schedule 'step' needs len(values) == len(boundaries) + 1, got "
                         f"{len(values)} values for {len(boundaries)} boundaries")
    return _Piecewise(tuple(int(b) for b in boundaries), tuple(float(v) for v in values))
