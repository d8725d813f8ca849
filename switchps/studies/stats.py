"""Means with 95 % confidence intervals (Student's t), and paired comparisons between arms by seed."""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import asdict, dataclass
from typing import Any

from scipy import stats


@dataclass(frozen=True)
class Estimate:
    """The mean of ``n`` values with its standard deviation and 95 % confidence half-width (None if n < 2)."""

    mean: float | None
    sd: float | None
    ci95: float | None
    n: int
    missing: int = 0
    """Runs where the value did not exist (e.g. the target was never reached)."""

    def as_dict(self) -> dict[str, Any]:
        return asdict(self)

    def text(self, fmt: str = ".3f", scale: float = 1.0, missing: str = "never") -> str:
        """"mean ± ci" and how many runs had no value, called ``missing`` (e.g. "never" reached)."""
        if self.mean is None:
            return missing if self.missing else "—"
        out = format(self.mean * scale, fmt)
        if self.ci95 is not None:
            out += " ± " + format(self.ci95 * scale, fmt)
        return out + (f" ({self.missing} {missing})" if self.missing else "")

    def excludes(self, value: float) -> bool:
        """Whether the confidence interval lies entirely on one side of ``value``: significant at 5 %."""
        return self.mean is not None and self.ci95 is not None and abs(self.mean - value) > self.ci95


def estimate(values: Sequence[float | None]) -> Estimate:
    """Mean, sd and the 95 % t interval of the values that exist."""
    xs = [float(v) for v in values if v is not None and math.isfinite(v)]
    missing = len(values) - len(xs)
    if not xs:
        return Estimate(None, None, None, 0, missing)
    mean = sum(xs) / len(xs)
    if len(xs) < 2:
        return Estimate(mean, None, None, 1, missing)
    sd = math.sqrt(sum((x - mean) ** 2 for x in xs) / (len(xs) - 1))
    half = float(stats.t.ppf(0.975, len(xs) - 1)) * sd / math.sqrt(len(xs))
    return Estimate(mean, sd, half, len(xs), missing)


def paired_ratio(reference: Sequence[float | None], arm: Sequence[float | None]) -> Estimate:
    """reference_i / arm_i per seed (a speedup when the values are times), where both exist."""
    return estimate([r / a if r is not None and a else None for r, a in zip(reference, arm)])


def paired_difference(arm: Sequence[float | None], reference: Sequence[float | None]) -> Estimate:
    """arm_i - reference_i per seed, where both exist."""
    return estimate([a - r if a is not None and r is not None else None for a, r in zip(arm, reference)])
