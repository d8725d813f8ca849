"""Straggler detection with hysteresis: slow relative to the others, for long enough."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any


@dataclass
class StragglerDetector:
    """Flags a worker whose step time exceeds ``threshold`` x the median of the other workers'.

    A worker is detected after ``patience`` consecutive slow observations and
    recovers after ``patience`` consecutive observations under the threshold.
    A worker absent from an observation, or alone in it (no others to compare
    with), keeps its counters unchanged.
    """

    threshold: float = 1.5
    patience: int = 3
    stragglers: set[int] = field(default_factory=set, init=False)
    _slow: dict[int, int] = field(default_factory=dict, init=False, repr=False)   # consecutive slow
    _fast: dict[int, int] = field(default_factory=dict, init=False, repr=False)   # consecutive fast

    def __post_init__(self) -> None:
        if self.threshold <= 0 or self.patience < 1:
            raise ValueError(f"need threshold > 0 and patience >= 1, got {self.threshold}, {self.patience}")

    def observe(self, step_times: dict[int, float]) -> tuple[set[int], set[int]]:
        """Feed one observation {worker: recent step time}; return (newly detected, newly recovered)."""
        detected: set[int] = set()
        recovered: set[int] = set()
        if len(step_times) < 2:
            return detected, recovered
        others = medians_of_others(step_times)
        for w, t in step_times.items():
            if t > self.threshold * others[w]:
                self._slow[w], self._fast[w] = self._slow.get(w, 0) + 1, 0
                if w not in self.stragglers and self._slow[w] >= self.patience:
                    detected.add(w)
            else:
                self._slow[w], self._fast[w] = 0, self._fast.get(w, 0) + 1
                if w in self.stragglers and self._fast[w] >= self.patience:
                    recovered.add(w)
        self.stragglers |= detected
        self.stragglers -= recovered
        return detected, recovered

    def state_dict(self) -> dict[str, Any]:
        return {"stragglers": sorted(self.stragglers), "slow": {str(w): n for w, n in self._slow.items()},
                "fast": {str(w): n for w, n in self._fast.items()}}

    def load_state_dict(self, d: dict[str, Any]) -> None:
        self.stragglers = set(d["stragglers"])
        self._slow = {int(w): n for w, n in d["slow"].items()}
        self._fast = {int(w): n for w, n in d["fast"].items()}


def medians_of_others(values: dict[int, float]) -> dict[int, float]:
    """Each key's median of the other keys' values (``statistics.median``'s, bit for bit), from one sort: in
    the sorted values without position i, the k-th is the sorted k-th below i and the (k+1)-th from i on.
    At least two values."""
    order = sorted(values, key=values.__getitem__)
    ranked = [values[k] for k in order]
    m = len(ranked) - 1  # how many others each key has

    def kth(k: int, i: int) -> float:
        return ranked[k if k < i else k + 1]

    out = {}
    for i, key in enumerate(order):
        if m % 2:
            out[key] = kth(m // 2, i)
        else:
            out[key] = (kth(m // 2 - 1, i) + kth(m // 2, i)) / 2
    return out
