"""The open aggregates' gradient sums: the arrays behind the core's ``Join`` and ``Apply`` actions."""

from __future__ import annotations

import numpy as np

from switchps.optim.lanes import SERIAL, Lanes
from switchps.optim.optimizers import BLOCK


class Sums:
    """The open aggregates' gradient sums, by the aggregate ids of the core's ``Join`` actions.

    The core decides which pushes form an update; ``Sums`` holds the arrays. The first push to join an
    aggregate lends it its buffer (no copy), later ones are added into it in place, in the order the core
    joined them (bit-identical to summing as they arrived), and ``join`` hands their buffers back for
    reuse; ``take`` hands a sum to the update that consumes it. Memory: one buffer per open aggregate plus
    the pushes not yet joined. Not thread-safe: ``ModelStore`` calls it only from the one item it is running
    (see ``store``), the test harness directly.
    """

    def __init__(self) -> None:
        self.open: dict[int, np.ndarray] = {}

    def join(self, aggregate_id: int, grad: np.ndarray, lanes: Lanes = SERIAL) -> np.ndarray | None:
        """Add ``grad`` into the aggregate's sum (in blocks on ``lanes``' threads: the same sums);
        returns ``grad`` when its buffer is free again."""
        total = self.open.get(aggregate_id)
        if total is None:
            self.open[aggregate_id] = grad
            return None
        if lanes.parallel:
            for _ in lanes.run(total.size, BLOCK, lambda _, b: np.add(total[b], grad[b], out=total[b])):
                pass
        else:
            np.add(total, grad, out=total)
        return grad

    def take(self, aggregate_id: int) -> np.ndarray:
        return self.open.pop(aggregate_id)

    def state_dict(self) -> dict[str, np.ndarray]:
        """Copies of the open sums (they go on changing after a checkpoint is taken)."""
        return {str(a): total.copy() for a, total in self.open.items()}

    def load_state_dict(self, d: dict[str, np.ndarray]) -> None:
        self.open = {int(a): np.array(total, np.float32) for a, total in d.items()}
