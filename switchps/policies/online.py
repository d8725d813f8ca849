"""Online policies: react to stragglers and heterogeneity while training runs.

Greedy and Elastic are Sync-Switch's online policies (Li et al., ICDCS 2021), Anytime rides out
stragglers with Anytime Mini-Batch, and DynamicBatching is Tyagi & Sharma's controller (ACSOS 2020).
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field, fields
from statistics import median
from typing import Any, ClassVar

from switchps.policies.base import ClusterView, Decision, Policy
from switchps.policies.detector import StragglerDetector


class _Stateful(Policy):
    """A dataclass policy whose state is its fields that are not settings (``init=False``)."""

    def state_dict(self) -> dict[str, Any]:
        own = {f.name: getattr(self, f.name) for f in fields(self) if not f.init and f.name != "detector"}  # type: ignore[arg-type]
        return {**own, **({"detector": self.detector.state_dict()} if hasattr(self, "detector") else {})}

    def load_state_dict(self, d: dict[str, Any]) -> None:
        for key, value in d.items():
            if key == "detector":
                getattr(self, "detector").load_state_dict(value)
            else:
                setattr(self, key, value)


@dataclass(kw_only=True)
class _Detecting(_Stateful):
    """A policy that watches for stragglers with a ``StragglerDetector(threshold, patience)``."""

    threshold: float = 1.5
    patience: int = 3
    detector: StragglerDetector = field(init=False, repr=False)

    def __post_init__(self) -> None:
        self.detector = StragglerDetector(self.threshold, self.patience)

    def observe(self, s: ClusterView) -> tuple[set[int], set[int]]:
        """Feed each worker's recent step time to the detector."""
        return self.detector.observe({w: ws.step_time_s for w, ws in s.workers.items()})


ROUNDS = ("bsp", "fmb", "local_sgd", "diloco")
"""The round protocols ``Greedy`` leaves and ``Anytime`` gives a time budget while stragglers last."""
ASYNC = ("asp", "ssp", "async_local_sgd", "async_diloco")
"""The asynchronous protocols ``Greedy`` rides stragglers out with."""


@dataclass(kw_only=True)
class Greedy(_Detecting):
    """Sync-Switch's greedy policy: BSP until its quota is done, ``async_protocol`` while a straggler lasts.

    The quota ``bsp_fraction`` counts progress made under BSP only: as in Sync-Switch, where the
    BSP phase is a fixed number of steps, training done in ASP while riding out a straggler does
    not count towards it. Once the quota is met it switches to ``async_protocol`` for good. With local
    steps: ``sync_protocol: local_sgd`` (or diloco) and ``async_protocol: async_local_sgd`` (or async_diloco),
    the local steps and optimizers in force carried across each switch.
    """

    name: ClassVar[str] = "greedy"
    bsp_fraction: float
    async_protocol: str = "asp"
    sync_protocol: str = "bsp"
    _bsp_done: float = field(default=0.0, init=False, repr=False)
    _last_progress: float = field(default=0.0, init=False, repr=False)

    def __post_init__(self) -> None:
        super().__post_init__()
        if not 0.0 <= self.bsp_fraction <= 1.0:
            raise ValueError(f"bsp_fraction must be in [0, 1], got {self.bsp_fraction}")
        if self.async_protocol not in ASYNC:
            raise ValueError(f"async_protocol must be one of {', '.join(ASYNC)}, got {self.async_protocol!r}")
        if self.sync_protocol not in ROUNDS:
            raise ValueError(f"sync_protocol must be one of {', '.join(ROUNDS)}, got {self.sync_protocol!r}")

    def decide(self, s: ClusterView) -> Decision | None:
        if s.protocol == self.sync_protocol:   # decisions apply at once, so s.protocol ran since the last call
            self._bsp_done += max(0.0, s.progress - self._last_progress)
        self._last_progress = s.progress
        _, recovered = self.observe(s)
        quota = f"{self.sync_protocol} quota {self._bsp_done:.1%} of {self.bsp_fraction:.1%} done"
        if self._bsp_done >= self.bsp_fraction:
            want, reason = self.async_protocol, f"{quota}: {self.async_protocol} for the rest"
        elif self.detector.stragglers:
            want, reason = self.async_protocol, f"stragglers {sorted(self.detector.stragglers)} detected; {quota}"
        else:
            want, reason = self.sync_protocol, f"no stragglers (recovered: {sorted(recovered)}); {quota}"
        return None if s.protocol == want else Decision(reason, protocol=want)


@dataclass(kw_only=True)
class Elastic(_Detecting):
    """Sync-Switch's elastic policy: keep the protocol, take stragglers out of the barrier while slow.

    The slowest are excluded first, and never so many that no active worker is left in the barrier.
    """

    name: ClassVar[str] = "elastic"

    def decide(self, s: ClusterView) -> Decision | None:
        self.observe(s)
        slow = self.detector.stragglers
        readmit = s.excluded - slow
        room = len(s.active - (s.excluded - readmit)) - 1
        candidates = sorted(slow & (s.active - s.excluded),
                            key=lambda w: -s.workers[w].step_time_s if w in s.workers else 0.0)
        exclude = frozenset(candidates[:max(room, 0)])
        if not exclude and not readmit:
            return None
        return Decision(f"stragglers out of the barrier: {sorted(exclude)}; recovered: {sorted(readmit)}",
                        exclude=exclude, readmit=frozenset(readmit))


@dataclass(kw_only=True)
class Anytime(_Detecting):
    """Switch bsp/fmb to AMB while stragglers last, and back to the protocol it left once all recover;
    local_sgd/diloco to anytime local SGD (AMB with their local steps, which a switch keeps: each worker takes
    as many of its H local steps as fit in T).

    T = ``factor`` x median(compute_s of the non-straggling workers): the time a fast worker takes
    for its batch (or its H local steps), so fast workers keep about the same batch while stragglers
    contribute what they can within T instead of holding up every round. ``micro_batch``, if given, is set with the switch.

    Stragglers are judged on time per sample (step_time_s / samples) rather than step time: under
    AMB every worker is busy for about T, so only the time per sample still tells a straggler apart.
    With equal batches it is step time over a constant, so detection under bsp/fmb is unchanged.
    """

    name: ClassVar[str] = "anytime"
    factor: float = 1.0
    micro_batch: int | None = None
    _left: str | None = field(default=None, init=False, repr=False)

    def __post_init__(self) -> None:
        super().__post_init__()
        if self.factor <= 0:
            raise ValueError(f"factor must be > 0, got {self.factor}")

    def observe(self, s: ClusterView) -> tuple[set[int], set[int]]:
        per_sample = {w: ws.step_time_s / ws.samples for w, ws in s.workers.items() if ws.samples > 0}
        return self.detector.observe(per_sample)

    def decide(self, s: ClusterView) -> Decision | None:
        self.observe(s)
        slow = self.detector.stragglers
        if slow and s.protocol in ROUNDS:
            fast = [ws.compute_s for w, ws in s.workers.items() if w not in slow and ws.compute_s > 0]
            if not fast:
                return None
            budget = self.factor * median(fast)
            self._left = s.protocol
            params = ({} if self.micro_batch is None else {"micro_batch": self.micro_batch}) \
                | ({} if s.local_steps is None else {"local_steps": s.local_steps})
            return Decision(f"stragglers {sorted(slow)}: {s.protocol} -> amb, T = {budget:.3g}s "
                            f"({self.factor:g} x median fast compute)", protocol="amb", params=params,
                            time_budget_s=budget)
        if not slow and s.protocol == "amb" and self._left is not None:
            left, self._left = self._left, None
            return Decision(f"stragglers recovered: amb -> {left}", protocol=left)
        return None


@dataclass(kw_only=True)
class DynamicBatching(_Stateful):
    """Tyagi & Sharma's dynamic batching: per-worker batches proportional to measured throughput.

    Every ``every_rounds`` calls, b_i <- B x thr_i / sum(thr) over the workers with stats, their
    total B held exactly, each within [min_batch, max_batch]; applied only if some worker's batch
    changes by at least ``deadband`` (relative). Idle under AMB, where T sizes the batches.
    """

    name: ClassVar[str] = "dynamic_batching"
    every_rounds: int = 5
    deadband: float = 0.2
    min_batch: int = 1
    max_batch: int = 1024
    _calls: int = field(default=0, init=False, repr=False)

    def __post_init__(self) -> None:
        if self.every_rounds < 1 or self.deadband < 0 or not 1 <= self.min_batch <= self.max_batch:
            raise ValueError("need every_rounds >= 1, deadband >= 0 and 1 <= min_batch <= max_batch")

    def decide(self, s: ClusterView) -> Decision | None:
        self._calls += 1
        if self._calls % self.every_rounds or s.protocol == "amb":
            return None
        workers = [w for w in sorted(s.batches) if w in s.workers and s.workers[w].throughput > 0]
        if len(workers) < 2:
            return None
        old = {w: s.batches[w] for w in workers}
        new = apportion(sum(old.values()), {w: s.workers[w].throughput for w in workers},
                        self.min_batch, self.max_batch)
        if all(abs(new[w] - old[w]) < self.deadband * old[w] for w in workers):
            return None
        return Decision(f"batches proportional to throughput, total {sum(new.values())}: {old} -> {new}",
                        batches=new)


def apportion(total: int, weights: dict[int, float], lo: int, hi: int) -> dict[int, int]:
    """Split ``total`` into integers proportional to positive ``weights``, each in [lo, hi], summing to ``total``.

    Shares are clamp(lam x w_i, lo, hi) with lam solved exactly (water-filling), then rounded by
    largest remainder (ties to the lower key). When the bounds cannot hold ``total`` they are
    widened just enough to.
    """
    n = len(weights)
    lo, hi = min(lo, total // n), max(hi, -(-total // n))

    def filled(lam: float) -> float:
        return sum(min(max(lam * v, lo), hi) for v in weights.values())

    prev = 0.0
    for lam in sorted({b / v for v in weights.values() for b in (lo, hi)}):
        if filled(lam) >= total:
            break
        prev = lam
    if filled(lam) > filled(prev):   # filled is linear between consecutive breakpoints
        lam = prev + (total - filled(prev)) * (lam - prev) / (filled(lam) - filled(prev))
    shares = {w: min(max(lam * v, lo), hi) for w, v in weights.items()}
    out = {w: math.floor(x + 1e-9) for w, x in shares.items()}
    by_remainder = sorted(out, key=lambda w: (out[w] - shares[w], w))
    for w in by_remainder[:total - sum(out.values())]:
        out[w] += 1
    return out
