"""What the event in hand tells the driver: its actions, the replies it releases (a push joins an
aggregate, is dropped, or, resent, takes its original's place), and the ids the core gives aggregates.
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import Any

from switchps.ps_server.core.actions import Action, Count, Free, Join, Record
from switchps.ps_server.core.events import Effect, Outcome, Push


class Outbox:
    """The actions of the event in hand, the replies it releases, and the next aggregate's id."""

    def __init__(self) -> None:
        self.actions: list[Action] = []
        self.replies: list[tuple[Push, Outcome]] = []  # released this event; their orders come last
        self.aggregates = 0  # aggregates named so far: the next one's id

    def add(self, actions: Iterable[Action]) -> None:
        self.actions += actions

    def admitted(self, p: Push, effect: Effect, version: int) -> None:
        """What the protocol in force made of ``p``: it joins an aggregate, or it is dropped."""
        if effect.drop:
            self.drop(p, effect.drop, version)
            return
        a = effect.joined
        assert a is not None, "a protocol names the aggregate every push it keeps joins"
        if a.id < 0:
            a.id, self.aggregates = self.aggregates, self.aggregates + 1
        self.actions += [Join(p.id, a.id), Count("accepted")]

    def drop(self, p: Push, reason: str, version: int) -> None:
        self.actions += [Count("dropped", reason), Free(p.id),
                         Record("push_dropped", {"worker": p.worker, "base_version": p.base_version,
                                                 "version": version, "reason": reason})]
        self.replies.append((p, Outcome(False, p.staleness, 0.0, f"dropped: {reason}")))

    def retried(self, p: Push, waiting: list[Push], version: int) -> None:
        """A push sent again: it takes the original's place if that still waits (``waiting``: the pushes
        the protocol in force holds), else it is a duplicate."""
        original = next((w for w in waiting if (w.worker, w.step) == (p.worker, p.step)), None)
        if original is None:
            self.drop(p, "repeated", version)
        else:
            original.id = p.id
            self.actions += [Free(p.id), Record("push_retried", {"worker": p.worker, "step": p.step,
                                                                 "version": version})]

    def release(self, pushes: list[Push], now: float) -> None:
        """Pushes whose updates are applied (or that no update waits for): their replies are due."""
        self.replies += [(p, Outcome(True, p.staleness, now - p.arrived)) for p in pushes]

    def take(self) -> tuple[list[Action], list[tuple[Push, Outcome]]]:
        """The event's actions and replies; the outbox is empty for the next event."""
        out, self.actions, self.replies = (self.actions, self.replies), [], []
        return out

    def state_dict(self, now: float) -> dict[str, Any]:  # no times
        return {"aggregates": self.aggregates}

    def load_state_dict(self, d: dict[str, Any], now: float) -> None:
        self.aggregates = d["aggregates"]
