"""Switch overhead: how long a live switch delays training beyond a normal step."""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np


@dataclass
class SwitchRecord:
    """One live change of protocol, for the switch-overhead figure."""

    decided_at: float
    to: str
    step_s: float = 0.0
    """A worker's median step when the switch was decided: the step any first update must wait for."""
    first_update_at: float | None = None


def switch_overheads(switches: list[SwitchRecord], update_times: list[tuple[float, str]]) -> list[float]:
    """Per switch: decision to the first update under the new protocol, minus one normal step.

    A normal step is the longer of a worker's median step when the switch was decided (compute and
    communication, without barrier waits: no update can follow a decision sooner than one gradient
    computed and sent) and the median interval between updates under the new protocol.
    """
    out = []
    for sw in switches:
        if sw.first_update_at is None:
            continue
        after = [t for t, proto in update_times if t >= sw.first_update_at and proto == sw.to][:11]
        interval = float(np.median(np.diff(after))) if len(after) > 1 else 0.0
        out.append(max(0.0, sw.first_update_at - sw.decided_at - max(sw.step_s, interval)))
    return out
