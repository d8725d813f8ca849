"""Who takes part: registered workers, the active ones, and those a policy took out of the barrier."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any


@dataclass
class Membership:
    """Registered workers (with their shard sizes), the active ones, and the excluded ones.

    A worker is inactive after missing a deadline, until its next push; an excluded worker (elastic)
    still pushes, but a round does not wait for it.
    """

    num_workers: int
    registered: dict[int, int] = field(default_factory=dict)
    active: set[int] = field(default_factory=set)
    excluded: set[int] = field(default_factory=set)
    last_seen: dict[int, float] = field(default_factory=dict)
    """When each worker last registered or pushed (an SSP laggard's deadline counts from it)."""

    def required(self) -> set[int]:
        """The workers a round waits for."""
        return self.active - self.excluded

    @property
    def train_size(self) -> int:
        return sum(self.registered.values())

    def state_dict(self) -> dict[str, Any]:
        return {"registered": dict(self.registered), "active": sorted(self.active),
                "excluded": sorted(self.excluded)}

    def load_state_dict(self, d: dict[str, Any]) -> None:
        self.registered = {int(w): int(n) for w, n in d["registered"].items()}
        self.active, self.excluded = set(d["active"]), set(d["excluded"])
