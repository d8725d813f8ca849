"""Means with 95 % confidence intervals (Student's t), and paired comparisons between arms by seed.

A ratio (a speedup) is estimated on the log scale: the geometric mean of the per-seed ratios, with the t
interval of their logarithms taken back (``RatioEstimate``). Its interval is asymmetric and never below
0, and 0.5× is as far from 1× as 2× is; an arithmetic mean of ratios gives neither."""

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


@dataclass(frozen=True)
class RatioEstimate:
    """The geometric mean of ``n`` positive ratios and its 95 % confidence interval ``low``–``high`` (the t
    interval of the logarithms, taken back; None if n < 2)."""

    geomean: float | None
    low: float | None
    high: float | None
    n: int
    missing: int = 0
    """Pairs without a ratio: a value missing on either side (e.g. the target never reached), or not > 0."""

    def as_dict(self) -> dict[str, Any]:
        return asdict(self)

    def text(self, digits: int = 3, missing: str = "never") -> str:
        """"geomean× (low–high)" to ``digits`` significant digits (a low bound near 0 keeps its own, never
        shown as 0), and how many pairs had no ratio, called ``missing``."""
        if self.geomean is None:
            return missing if self.missing else "—"
        out = _significant(self.geomean, digits) + "×"
        if self.low is not None and self.high is not None:
            out += f" ({_significant(self.low, digits)}–{_significant(self.high, digits)})"
        return out + (f" ({self.missing} {missing})" if self.missing else "")

    def excludes(self, value: float) -> bool:
        """Whether the interval lies entirely on one side of ``value`` (> 0): significant at 5 % on the log
        scale (1.0: the ratios differ from no change)."""
        return self.low is not None and self.high is not None and not self.low <= value <= self.high


def _significant(x: float, digits: int) -> str:
    """``x`` to ``digits`` significant digits, trailing zeros kept (1.50, 0.00329, 116)."""
    return format(x, f"#.{digits}g").rstrip(".")


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


def ratio_estimate(ratios: Sequence[float | None]) -> RatioEstimate:
    """The geometric mean of the ratios that exist and are > 0, with the 95 % t interval of their logarithms
    taken back to ratios."""
    logs = estimate([math.log(r) if r is not None and r > 0 else None for r in ratios])
    if logs.mean is None:
        return RatioEstimate(None, None, None, 0, logs.missing)
    half = logs.ci95
    return RatioEstimate(math.exp(logs.mean), None if half is None else math.exp(logs.mean - half),
                         None if half is None else math.exp(logs.mean + half), logs.n, logs.missing)


def paired_ratio(reference: Sequence[float | None], arm: Sequence[float | None]) -> RatioEstimate:
    """reference_i / arm_i per seed (a speedup when the values are times), where both exist, on the log
    scale (``ratio_estimate``)."""
    return ratio_estimate([r / a if r is not None and a else None for r, a in zip(reference, arm)])


def paired_difference(arm: Sequence[float | None], reference: Sequence[float | None]) -> Estimate:
    """arm_i - reference_i per seed, where both exist."""
    return estimate([a - r if a is not None and r is not None else None for a, r in zip(arm, reference)])
