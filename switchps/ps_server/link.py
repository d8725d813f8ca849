"""An emulated network link at the PS, for studies whose cluster is really loopback.

On loopback a push costs microseconds, so BSP pays nothing for what makes it
expensive in a cluster: the N pushes of a round, and the N replies with fresh
parameters, all cross the PS's one network link at once. ``Link`` is one
direction of that link. Transfers in flight share its rate equally, as TCP
flows share a NIC (processor sharing), and each caller blocks until its bytes
would have crossed. So the N simultaneous replies of a BSP round all finish
after N transfer times, while ASP's transfers, spread in time, mostly find the
link idle. The link is full duplex: pushes use the inbound direction, replies
with parameters the outbound one.
"""

from __future__ import annotations

import asyncio
import itertools
import time
from dataclasses import dataclass, field


class Link:
    """One direction of the PS's link, shared equally by the transfers in flight.

    Bookkeeping is in "virtual bytes": ``_sent`` is what each transfer in flight
    has received so far, and a transfer admitted at ``_sent = v`` with ``n``
    bytes finishes when ``_sent`` reaches ``v + n``. With k transfers in flight,
    ``_sent`` grows at rate / k. The arithmetic takes time as an argument; only
    ``transfer`` reads the clock and waits, on the event loop of the PS's service
    (one loop, so no lock).
    """

    def __init__(self, bytes_per_s: float) -> None:
        self.rate = bytes_per_s
        self.busy_s = 0.0       # time with at least one transfer in flight
        self.delay_s = 0.0      # time transfers took beyond crossing an idle link
        self.transfers = 0
        self._sent = 0.0
        self._at = 0.0          # when _sent was last brought up to date
        self._finish: dict[int, float] = {}  # transfer -> _sent at which it is done
        self._ids = itertools.count()
        self._waiters: list[asyncio.Future[None]] = []

    def admit(self, nbytes: int, now: float) -> int:
        """Start a transfer at ``now``; returns its key (call with the lock held, or single-threaded)."""
        self.advance(now)
        key = next(self._ids)
        self._finish[key] = self._sent + nbytes
        self.transfers += 1
        return key

    def advance(self, now: float) -> None:
        """Bring the shared progress up to ``now``, retiring transfers that have finished."""
        while self._finish:
            k = len(self._finish)
            first = min(self._finish.values())
            done_at = self._at + (first - self._sent) * k / self.rate
            if done_at > now:
                self.busy_s += now - self._at
                self._sent += (now - self._at) * self.rate / k
                break
            self.busy_s += done_at - self._at
            self._sent, self._at = first, done_at
            self._finish = {key: f for key, f in self._finish.items() if f > first}
        self._at = max(self._at, now)

    def done(self, key: int) -> bool:
        return key not in self._finish

    def finish_time(self, key: int) -> float:
        """When transfer ``key`` finishes if no other transfer starts meanwhile."""
        t, sent, k = self._at, self._sent, len(self._finish)
        mine = self._finish[key]
        for f in sorted(set(self._finish.values())):
            t += (f - sent) * k / self.rate
            if f >= mine:
                return t
            k -= sum(1 for g in self._finish.values() if g == f)
            sent = f
        return t

    async def transfer(self, nbytes: int) -> None:
        """Wait until ``nbytes`` have crossed, sharing the link with the transfers in flight.

        Every admission and completion changes everyone's finish time, so each one wakes the
        waiters to recompute theirs.
        """
        start = time.monotonic()
        key = self.admit(nbytes, start)
        self._wake()
        while not self.done(key):
            waiter = asyncio.get_running_loop().create_future()
            self._waiters.append(waiter)
            try:
                await asyncio.wait_for(waiter, max(0.0, self.finish_time(key) - time.monotonic()))
            except asyncio.TimeoutError:
                pass
            self.advance(time.monotonic())
        self._wake()
        self.note_done(start, time.monotonic(), nbytes)

    def note_done(self, started: float, now: float, nbytes: int) -> None:
        """A transfer of ``nbytes`` admitted at ``started`` is done at ``now``: count its sharing delay."""
        self.delay_s += max(0.0, now - started - nbytes / self.rate)

    def _wake(self) -> None:
        for w in self._waiters:
            if not w.done():
                w.set_result(None)
        self._waiters = []


@dataclass
class DuplexLink:
    """The PS's link: ``inbound`` carries pushes, ``outbound`` carries parameters to workers."""

    mbit_s: float
    inbound: Link = field(init=False)
    outbound: Link = field(init=False)

    def __post_init__(self) -> None:
        self.inbound = Link(self.mbit_s * 1e6 / 8)
        self.outbound = Link(self.mbit_s * 1e6 / 8)

    def summary(self, wall_s: float) -> dict[str, float]:
        """Utilization of each direction and the mean delay a transfer suffered from sharing it."""
        out: dict[str, float] = {"mbit_s": self.mbit_s}
        for name, link in (("inbound", self.inbound), ("outbound", self.outbound)):
            out[f"{name}_utilization"] = round(link.busy_s / wall_s, 4) if wall_s > 0 else 0.0
            out[f"{name}_mean_sharing_delay_s"] = round(link.delay_s / link.transfers, 4) if link.transfers else 0.0
        return out
