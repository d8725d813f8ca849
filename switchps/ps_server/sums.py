"""The driver's half of an aggregate: the gradient sums the core's ``Join`` actions describe.

The core decides which pushes form an update and names each open aggregate by id; ``Sums`` holds the
arrays. The first push to join an aggregate lends it its buffer (no copy), later ones are added into it
in place, in the order the core joined them (so results are bit-identical to summing as they arrived),
and go back to the pool; ``take`` hands an aggregate's sum to the update that consumes it. Memory is one
buffer per open aggregate plus the pushes not yet joined.

Concurrency: not thread-safe. The gRPC driver calls it only from its applier thread, in queue order;
the test harness and a simulator call it directly.
"""

from __future__ import annotations

from typing import Callable

import numpy as np


class Sums:
    """Open aggregates' gradient sums by aggregate id; ``free`` returns a buffer to its pool."""

    def __init__(self, free: Callable[[np.ndarray], None]) -> None:
        self.open: dict[int, np.ndarray] = {}
        self._free = free

    def join(self, aggregate_id: int, grad: np.ndarray) -> None:
        total = self.open.get(aggregate_id)
        if total is None:
            self.open[aggregate_id] = grad
        else:
            np.add(total, grad, out=total)
            self._free(grad)

    def take(self, aggregate_id: int) -> np.ndarray:
        return self.open.pop(aggregate_id)

    def state_dict(self) -> dict[str, np.ndarray]:
        """Copies of the open sums (they go on changing after a checkpoint is taken)."""
        return {str(a): total.copy() for a, total in self.open.items()}

    def load_state_dict(self, d: dict[str, np.ndarray]) -> None:
        self.open = {int(a): np.array(total, np.float32) for a, total in d.items()}
