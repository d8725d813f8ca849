"""Refused calls, counted: each one in the run record; the first ``EVENTS_PER_REASON`` of a kind also as
an event, and the PS log gets at most one line per kind every ``LOG_EVERY_S`` (an anonymous caller must
not fill the disk).

Shard 0 (or an unsharded PS) and a follower shard refuse a call the same way (``refuse``) and count it
the same way (``RejectionCounter``), each in its own record, under one name per RPC (``rpc_name``) that
the guard and the handlers share.
"""

from __future__ import annotations

import collections
import logging
import re
from collections.abc import Callable

import grpc

from switchps.ps_server.records import RunRecorder
from switchps.refusals import Rejected

EVENTS_PER_REASON = 100
"""Rejections of one kind beyond this many are counted but no longer logged as events (a flood of bad
requests must not fill the disk)."""
LOG_EVERY_S = 60.0
"""The PS log gets at most one line per kind of rejection this often."""
log = logging.getLogger("switchps.ps")


class RejectionCounter:
    """``count(rpc, rejected)``, called on the event loop (the guard and the handlers run there): by kind
    (``rpc:reason``) in ``counts``, and a log line (prefixed ``who``) at most once a kind every
    ``LOG_EVERY_S``. With a run record (shard 0, or an unsharded PS), ``counts`` are the record's, and the
    first ``EVENTS_PER_REASON`` of a kind are also events; a follower shard keeps its own (``shard-K.json``)."""

    def __init__(self, clock: Callable[[], float], rec: RunRecorder | None = None,
                 version: Callable[[], int] = lambda: 0, who: str = "") -> None:
        self.clock, self.rec, self.version, self.who = clock, rec, version, who
        self.counts: collections.Counter[str] = rec.rejections if rec is not None else collections.Counter()
        self._logged: dict[str, float] = {}  # kind of rejection -> when a line about it was last logged

    def count(self, rpc: str, r: Rejected) -> None:
        kind = f"{rpc}:{r.reason}"
        if self.rec is None:
            self.counts[kind] += 1
        else:
            self._record(rpc, r)
        now, last = self.clock(), self._logged.get(kind)
        if last is None or now - last >= LOG_EVERY_S:
            self._logged[kind] = now
            log.warning("%s%s rejected (%s): %s [%d of this kind so far]", self.who, rpc, r.reason, r,
                        self.counts[kind])

    def _record(self, rpc: str, r: Rejected) -> None:
        assert self.rec is not None
        self.rec.reject(rpc, r.reason)  # which counts it in ``counts``
        if self.counts[f"{rpc}:{r.reason}"] <= EVENTS_PER_REASON:
            self.rec.event(f"{rpc}_rejected", reason=r.reason, message=str(r), version=self.version())


def rpc_name(method: str) -> str:
    """The name a refused call of gRPC ``method`` is counted under, by the guard and its handler alike:
    ``InitPart`` is ``init_part``; ``PushSmall`` is ``push``, as ``Push`` (one push, two transports)."""
    return "push" if method == "PushSmall" else re.sub(r"(?<!^)(?=[A-Z])", "_", method).lower()


def refuse(ctx: grpc.aio.ServicerContext, count: Callable[[str, Rejected], None], rpc: str, r: Rejected) -> None:
    """Count ``r`` under ``rpc`` and end the call with its status: the handler returns after it (a streamed
    reply yields nothing), so no exception ends the call. Not ``ctx.abort``: it keeps its exception in the
    call's state, and its traceback the frames read: a reference cycle only the cyclic collector frees,
    seldom in the PS (refused pushes held tens of MB a round; docs/security.md, bounds on what a client can cost;
    grpc/grpc#17899 is the same in the sync server)."""
    count(rpc, r)
    ctx.set_code(getattr(grpc.StatusCode, r.code))
    ctx.set_details(str(r))
