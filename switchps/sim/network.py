"""The PS's emulated link on virtual time: ``ps_server.link.Link``'s processor-sharing arithmetic, driven
by the event loop instead of ``Link.transfer``'s wall-clock waits."""

from __future__ import annotations

from collections import deque
from typing import Callable

from switchps.ps_server.link import Link
from switchps.sim.loop import Event, Loop


class Wire:
    """One direction of the link (None: no link, transfers take no time); every transfer carries the
    model's ``nbytes``, as every push and every reply with parameters does, so they finish in the order
    they started, and the earliest one's finish is the next event the wire needs."""

    def __init__(self, loop: Loop, link: Link | None, nbytes: int) -> None:
        self.loop, self.link, self.nbytes = loop, link, nbytes
        self._flying: deque[tuple[int, float, Callable[[], None]]] = deque()  # (key, admitted at, on arrival)
        self._check_at: Event | None = None

    def send(self, arrived: Callable[[], None]) -> None:
        """Start a transfer now; ``arrived()`` runs when its bytes have crossed (at once without a link)."""
        if self.link is None:
            arrived()
            return
        self._flying.append((self.link.admit(self.nbytes, self.loop.now), self.loop.now, arrived))
        self._arm()

    def _arm(self) -> None:
        """Schedule a check at the earliest finish; an admission or completion voids the one before."""
        if self._check_at is not None:
            self._check_at.cancel()
        self._check_at = None
        if self._flying and self.link is not None:
            head = self._flying[0][0]  # finished already if an admission at its finish time retired it
            at = self.loop.now if self.link.done(head) else self.link.finish_time(head)
            self._check_at = self.loop.at(at, self._check)

    def _check(self) -> None:
        link = self.link
        assert link is not None
        now = self.loop.now
        link.advance(now)
        done = []
        while self._flying and link.done(self._flying[0][0]):
            _, started, arrived = self._flying.popleft()
            link.note_done(started, now, self.nbytes)
            done.append(arrived)
        self._arm()
        for arrived in done:
            arrived()
