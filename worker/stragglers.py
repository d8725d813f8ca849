"""Straggler injection: decides, per worker step, how long to sleep and how much to slow down.

Everything here is pure and seeded; the worker loop does the sleeping. Four kinds compose:

* ``mixture``: an i.i.d. sleep per worker per step drawn from an AMB-style Gaussian mixture,
  slept inside the step's time budget (so under AMB a straggler contributes fewer samples).
* ``slowdown``: a persistent per-worker compute slowdown (heterogeneous hardware).
* ``transient``: Sync-Switch style episodes during which k workers are slowed (or sleep extra).
  The episode list depends on the run seed only, so all workers agree without talking.
* ``comm_delay``: a delay before each push (tc-netem style network latency).

A run can instead replay an earlier run's ``stragglers.csv`` exactly (``trace``).

Randomness: every kind has its own stream, and a step's draw comes from a generator seeded with
``(seed, worker, stream, step)``, so delays are a pure function of those and enabling one kind
never changes another's draws.
"""

from __future__ import annotations

import bisect
import csv
import math
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Literal

import numpy as np
from pydantic import BaseModel, ConfigDict, Field, field_validator, model_validator

MIXTURES: dict[str, list[list[float]]] = {
    "niagara": [[0, 0, .4], [0, .4, .3], [2, .3, .2], [5, .3, .1]],
    "cedar": [[0, 0, .4], [.05, .04, .3], [.15, .03, .2], [.25, .03, .1]],
}
"""AMB's straggler mixtures: rows of [mean_s, std_s, weight]."""

TRACE_COLUMNS = ("worker", "step", "sleep_s", "factor", "comm_s")

# Stream ids are nonzero: SeedSequence pads short keys with zeros, so the global key
# (seed, _TRANSIENT) equals (seed, _TRANSIENT, 0, 0) and can never equal a per-step key
# (seed, worker, stream, step) whose third word is a nonzero stream id.
_MIXTURE, _COMM, _TRANSIENT = 1, 2, 3


@dataclass(frozen=True)
class StepDelays:
    """What a worker does to itself during one step."""

    sleep_s: float = 0.0
    """Slept right after the work order arrives, before computing, inside the step's time budget."""
    factor: float = 1.0
    """Compute slowdown: after each micro-batch, sleep (factor - 1) x its measured compute time."""
    comm_s: float = 0.0
    """Slept just before the push (network latency)."""

    @property
    def none(self) -> bool:
        """True when the step is not delayed at all."""
        return self.sleep_s == 0.0 and self.factor == 1.0 and self.comm_s == 0.0


class _Spec(BaseModel):
    model_config = ConfigDict(extra="forbid", allow_inf_nan=False)


def _check_indices(v: list[int] | None, what: str) -> list[int] | None:
    if v is not None:
        if not v:
            raise ValueError(f"{what} must not be empty")
        if any(i < 0 for i in v):
            raise ValueError(f"{what} must be >= 0")
        if len(set(v)) != len(v):
            raise ValueError(f"{what} must not repeat")
    return v


class MixtureSpec(_Spec):
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


class SlowdownSpec(_Spec):
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


class TransientSpec(_Spec):
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


class CommDelaySpec(_Spec):
    """A delay before each push: constant, or |N(0, sigma)| drawn per push."""

    fixed_s: float | None = Field(None, ge=0)
    sigma_s: float | None = Field(None, gt=0)

    @model_validator(mode="after")
    def _exactly_one(self) -> CommDelaySpec:
        if (self.fixed_s is None) == (self.sigma_s is None):
            raise ValueError("give exactly one of fixed_s, sigma_s")
        return self


class StragglerSpec(_Spec):
    """Which stragglers to inject; all kinds combine. ``trace`` replays a recording instead."""

    mixture: MixtureSpec | None = None
    slowdown: SlowdownSpec | None = None
    transient: TransientSpec | None = None
    comm_delay: CommDelaySpec | None = None
    trace: str | None = None
    """Path to an earlier run's stragglers.csv, replayed exactly."""

    @model_validator(mode="after")
    def _trace_alone(self) -> StragglerSpec:
        if self.trace is not None:
            others = [k for k in ("mixture", "slowdown", "transient", "comm_delay") if getattr(self, k) is not None]
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


def load_trace(path: str | Path) -> dict[tuple[int, int], StepDelays]:
    """Read a stragglers.csv into {(worker, step): StepDelays}.

    The header must contain ``TRACE_COLUMNS``; other columns (e.g. ``time_s``) are ignored.
    If a (worker, step) appears twice, the last row wins.
    """
    path = Path(path)
    if not path.is_file():
        raise FileNotFoundError(f"straggler trace not found: {path}")
    with path.open(newline="") as f:
        reader = csv.DictReader(f)
        missing = [c for c in TRACE_COLUMNS if c not in (reader.fieldnames or ())]
        if missing:
            raise ValueError(f"{path}: missing column(s) {', '.join(missing)}")
        out: dict[tuple[int, int], StepDelays] = {}
        for line, row in enumerate(reader, start=2):
            try:
                key = (int(row["worker"]), int(row["step"]))
                out[key] = StepDelays(float(row["sleep_s"]), float(row["factor"]), float(row["comm_s"]))
            except (TypeError, ValueError) as e:
                raise ValueError(f"{path}:{line}: bad row ({e})") from None
    return out


class StragglerInjector:
    """Decides one worker's delays, step by step. Build one per worker with the run's seed."""

    def __init__(self, spec: StragglerSpec, *, seed: int, worker: int, num_workers: int) -> None:
        if not 0 <= worker < num_workers:
            raise ValueError(f"worker {worker} is not in range({num_workers})")
        self.spec = spec
        self.seed = seed
        self.worker = worker
        self.num_workers = num_workers
        self.beyond_trace = 0
        """How many plan() calls asked for a step after the end of the replayed trace."""
        self._check_workers()

        self._trace: dict[int, StepDelays] | None = None
        if spec.trace is not None:
            self._trace = {s: d for (w, s), d in load_trace(spec.trace).items() if w == worker}
            self._trace_end = max(self._trace, default=-1)

        m = spec.mixture
        self._mixture = m if m is not None and (m.workers is None or worker in m.workers) else None
        if self._mixture is not None:
            self._means, self._stds, probs = self._mixture.components()
            self._cum = np.cumsum(probs)
            self._cum[-1] = 1.0
            self._clip = self._mixture.clip_s
        self._slowdown = spec.slowdown.factors.get(worker, 1.0) if spec.slowdown is not None else 1.0

        self._episodes: list[tuple[float, float, tuple[int, ...]]] = []
        self._starts: list[float] = []
        if spec.transient is not None:
            self._episode_rng = np.random.default_rng([seed, _TRANSIENT])
            if spec.transient.times is not None:
                for start in sorted(spec.transient.times):
                    self._add_episode(spec.transient, start)

    def _check_workers(self) -> None:
        n, s = self.num_workers, self.spec
        named = [*(s.mixture.workers or ())] if s.mixture else []
        named += list(s.slowdown.factors) if s.slowdown else []
        if s.transient is not None:
            k = s.transient.workers
            if isinstance(k, int):
                if k > n:
                    raise ValueError(f"transient.workers={k} but the run has {n} workers")
            else:
                named += k
        bad = sorted({w for w in named if w >= n})
        if bad:
            raise ValueError(f"stragglers name worker(s) {bad} but the run has {n} workers")

    def _add_episode(self, tr: TransientSpec, start: float) -> None:
        if isinstance(tr.workers, int):
            chosen = tuple(sorted(int(w) for w in self._episode_rng.choice(self.num_workers, tr.workers, replace=False)))
        else:
            chosen = tuple(sorted(tr.workers))
        self._episodes.append((start, start + tr.duration_s, chosen))
        self._starts.append(start)

    def _extend_episodes(self, tr: TransientSpec, every_s: float, t: float) -> None:
        """Poisson mode: generate episodes until one starts after ``t``."""
        while not self._starts or self._starts[-1] <= t:
            last = self._starts[-1] if self._starts else 0.0
            self._add_episode(tr, last + float(self._episode_rng.exponential(every_s)))

    def episodes(self) -> list[tuple[float, float, tuple[int, ...]]]:
        """Episodes known so far as (start_s, end_s, workers); the same on every worker."""
        return list(self._episodes)

    def _transient(self, t: float) -> tuple[float, float]:
        """(factor, added sleep) at time ``t``: the max factor / sum of delays over overlapping episodes."""
        tr = self.spec.transient
        if tr is None:
            return 1.0, 0.0
        if tr.every_s is not None:
            self._extend_episodes(tr, tr.every_s, t)
        factor, delay = 1.0, 0.0
        # Starts are sorted and durations equal, so ends are sorted too: walk back until one ended.
        for start, end, chosen in reversed(self._episodes[: bisect.bisect_right(self._starts, t)]):
            if end <= t:
                break
            if self.worker in chosen:
                if tr.factor is not None:
                    factor = max(factor, tr.factor)
                elif tr.delay_s is not None:
                    delay += tr.delay_s
        return factor, delay

    def _rng(self, stream: int, step: int) -> np.random.Generator:
        return np.random.default_rng([self.seed, self.worker, stream, step])

    def _mixture_sleep(self, step: int) -> float:
        if self._mixture is None:
            return 0.0
        g = self._rng(_MIXTURE, step)
        i = int(np.searchsorted(self._cum, g.random(), side="right"))
        return float(min(abs(self._means[i] + self._stds[i] * g.standard_normal()), self._clip))

    def _comm(self, step: int) -> float:
        c = self.spec.comm_delay
        if c is None:
            return 0.0
        if c.fixed_s is not None:
            return float(c.fixed_s)
        return float(abs((c.sigma_s or 0.0) * self._rng(_COMM, step).standard_normal()))

    def plan(self, step: int, t: float) -> StepDelays:
        """Delays for ``step``, which starts ``t`` seconds after training started.

        When replaying, a step after the last recorded one counts in ``beyond_trace`` and gets no
        delay; a gap inside the recording (a row the writer skipped) also gets no delay.
        """
        if self._trace is not None:
            if step > self._trace_end:
                self.beyond_trace += 1
                return StepDelays()
            return self._trace.get(step, StepDelays())
        factor, delay = self._transient(t)
        return StepDelays(sleep_s=self._mixture_sleep(step) + delay,
                          factor=self._slowdown * factor,
                          comm_s=self._comm(step))
