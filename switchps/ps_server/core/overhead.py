"""Switch overhead: how long a live switch delays training beyond a normal step."""

from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np


INTERVALS = 10
"""Update intervals under the new protocol that a switch's normal step is the median of."""


@dataclass
class SwitchRecord:
    """One live change of protocol, for the switch-overhead figure."""

    decided_at: float
    to: str
    step_s: float = 0.0
    """A worker's median step when the switch was decided: the step any first update must wait for."""
    updates: list[float] = field(default_factory=list)
    """When the first ``INTERVALS + 1`` updates under ``to`` from the first on were applied (so a record stays
    small however long the run)."""

    @property
    def first_update_at(self) -> float | None:
        return self.updates[0] if self.updates else None

    def applied(self, protocol: str, now: float) -> None:
        """An update under ``protocol`` was applied ``now``."""
        if protocol == self.to and len(self.updates) <= INTERVALS:
            self.updates.append(now)


def switch_overheads(switches: list[SwitchRecord]) -> list[float]:
    """Per switch: decision to the first update under the new protocol, minus one normal step.

    A normal step is the longer of a worker's median step when the switch was decided (compute and
    communication, without barrier waits: no update can follow a decision sooner than one gradient
    computed and sent) and the median interval between updates under the new protocol.
    """
    out = []
    for sw in switches:
        if sw.first_update_at is None:
            continue
        interval = float(np.median(np.diff(sw.updates))) if len(sw.updates) > 1 else 0.0
        out.append(max(0.0, sw.first_update_at - sw.decided_at - max(sw.step_s, interval)))
    return out
