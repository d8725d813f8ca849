"""Shard 0 of a sharded PS: the followers' streams, their verdicts on each push, and the action log.

Shard 0 is the one place that decides: it hosts the ``Core`` and the policy, and holds part 0 of the
model. A follower shard k attaches with one ``Follow`` stream. On it the follower reports a ``Verdict``
for every part it receives (whole and valid, or refused, and why), and shard 0 sends, in the order it
executes them, every action the core decides that touches a part (``ShardAction``: the core's join,
free, apply, release and optimizer change in their wire form, ``action_wire``; a refusal's drop; the
end). A follower applies them in that order, so every shard applies the same pushes at the same
version, and a switch, a budget or an exclusion takes effect on every shard at the same version
boundary: they are decided once, here.

A push reaches the core only once its part 0 is valid here and every follower has accepted its part
(``verdict``); one refusal drops the push on every shard, counted once, here, as ``shardK:REASON``, and
so does a part that never arrives within the wait (UNAVAILABLE: the worker sends the push again, as
after any outage). So a push is applied on all shards or on none.

If a follower's stream ends before training does, shard 0 cannot complete any push: it stops the run
(``lost``), and the whole run is started again (see docs/ARCHITECTURE.md, *Sharded PS*).

Concurrency: the ``Follow`` handlers, the push handlers awaiting verdicts and ``broadcast`` (called by
shard 0's ``zero.Forwarding`` executor, from the service's ``_execute``) all run on the PS's event
loop, so nothing here needs a lock, but ``Saves``, which shard 0's checkpoint writer thread waits on.
"""

from __future__ import annotations

import asyncio
import logging
import threading
from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass, field

import grpc

from switchps.security.auth import Caller
from switchps.protos import switchps_pb2 as pb
from switchps.protos.requests import first_frame, parse
from switchps.refusals import Rejected, invalid, precondition

log = logging.getLogger("switchps.ps")
Key = tuple[int, int, int, int]
"""A push's name on every shard: (worker, session, step, attempt); initial values have step -1. A
resent push is a new attempt, so a part that arrives after its push was refused is never taken for it."""
INIT_STEP = -1


def key_of(k: pb.PartKey) -> Key:
    return k.worker, k.session, k.step, k.attempt


def part_key(key: Key) -> pb.PartKey:
    return pb.PartKey(worker=key[0], session=key[1], step=key[2], attempt=key[3])


@dataclass
class Leader:
    """Shard 0's view of its ``followers`` followers (shards 1..followers)."""

    followers: int
    wait_s: float
    """How long a push waits for every follower's verdict before it is dropped (and a Follow for its hello)."""
    queues: dict[int, asyncio.Queue[pb.ShardAction | Rejected]] = field(default_factory=dict)
    """Each attached follower's stream: the actions to send it, in order (or the refusal that ends it)."""
    verdicts: dict[Key, dict[int, pb.Verdict]] = field(default_factory=dict)
    waiting: dict[Key, asyncio.Future[None]] = field(default_factory=dict)
    keys: dict[int, Key] = field(default_factory=dict)
    """Push id -> its name, from the push until its release."""
    setup: pb.Layout | None = None
    resume: tuple[int, dict[str, str]] | None = None
    """Shard 0 resumed: the version and each follower's part digest (by shard) in its manifest."""
    ready: set[int] = field(default_factory=set)
    """Followers attached (and, after a resume, restored): workers are let in once all are."""
    lost: str | None = None
    """Why the run cannot go on (a follower left, or could not resume), once it cannot."""
    on_lost: Callable[[str, bool], None] = lambda why, resumable: None
    saves: Saves = field(default_factory=lambda: Saves())

    @property
    def attached(self) -> bool:
        return len(self.ready) == self.followers

    def check_attached(self) -> None:
        """``Rejected`` (UNAVAILABLE: a worker retries) until every follower is attached and restored."""
        if not self.attached:
            missing = sorted(set(range(1, self.followers + 1)) - self.ready)
            raise Rejected("UNAVAILABLE", "shards", f"waiting for PS shards {missing} to attach")

    # ---- the action log ------------------------------------------------------------------------

    def broadcast(self, action: pb.ShardAction) -> None:
        for q in self.queues.values():
            q.put_nowait(action)

    def adopt(self, layout: pb.Layout) -> None:
        """The model's layout, adopted at the first registration: every follower derives its part."""
        self.setup = layout
        self.broadcast(pb.ShardAction(setup=layout))

    def drop(self, key: Key, reason: str) -> None:
        self.broadcast(pb.ShardAction(drop=pb.DropPart(key=part_key(key), reason=reason)))

    def stop(self) -> None:
        self.broadcast(pb.ShardAction(stop=True))

    # ---- verdicts --------------------------------------------------------------------------------

    async def verdict(self, key: Key) -> float:
        """Once every follower has accepted its part of ``key``, the sum of their parts' squared norms;
        ``Rejected`` naming the shard and its reason if one refused it, or if a part did not arrive within
        ``wait_s``."""
        got = self.verdicts.setdefault(key, {})
        if not self._decided(got):
            fut = self.waiting[key] = asyncio.get_running_loop().create_future()
            try:
                await asyncio.wait_for(fut, self.wait_s)
            except TimeoutError:
                pass
            finally:
                self.waiting.pop(key, None)
        got = self.verdicts.pop(key, {})
        for shard, v in sorted(got.items()):
            if v.reason:
                raise Rejected(_code(v.reason), f"shard{shard}:{v.reason}", f"PS shard {shard}: {v.message}")
        for shard in range(1, self.followers + 1):  # a shard restarting, or out of reach: the worker retries
            if shard not in got:
                raise Rejected("UNAVAILABLE", f"shard{shard}:no_part", f"PS shard {shard} got no part of this "
                                                                       f"push within {self.wait_s:g}s")
        return sum(v.squares for v in got.values())

    def _decided(self, got: dict[int, pb.Verdict]) -> bool:
        return len(got) == self.followers or any(v.reason for v in got.values())

    def _heard(self, shard: int, v: pb.Verdict) -> None:
        key = key_of(v.key)
        got = self.verdicts.setdefault(key, {})
        got[shard] = v
        fut = self.waiting.get(key)
        if fut is not None and not fut.done() and self._decided(got):
            fut.set_result(None)
        if len(self.verdicts) > 64 * (self.followers + 1) + 1024:  # parts whose push never came here
            for stale in list(self.verdicts)[:len(self.verdicts) // 2]:
                if stale not in self.waiting:
                    del self.verdicts[stale]

    # ---- the Follow stream -----------------------------------------------------------------------

    async def follow(self, ctx: grpc.aio.ServicerContext, caller: Caller | None) -> AsyncIterator[pb.ShardAction]:
        """A follower's stream: its hello, then its verdicts; back, the action log from now on. Its messages
        are read from ``ctx`` and parsed here (``requests.parse``): bytes that are no message are the caller's
        error, not shard 0's. ``Rejected`` for a stream refused before any action is sent, and for a
        malformed message on an attached one (which ends it: the follower has left)."""
        hello = parse(await first_frame(ctx, self.wait_s), pb.FollowerMessage)
        if hello.WhichOneof("kind") != "hello":
            raise invalid("hello", "a follower's first message must be its hello (its shard index)")
        shard = hello.hello
        self._admit(shard, caller)
        queue: asyncio.Queue[pb.ShardAction | Rejected] = asyncio.Queue()
        self.queues[shard] = queue
        if self.resume is not None:  # ready once restored
            version, digests = self.resume
            queue.put_nowait(pb.ShardAction(restore=pb.ShardSaved(version=version, digest=digests[str(shard)])))
        else:
            self.ready.add(shard)
        if self.setup is not None:
            queue.put_nowait(pb.ShardAction(setup=self.setup))
        log.info("PS shard %d attached (%d of %d)", shard, len(self.queues), self.followers)
        reader = asyncio.get_running_loop().create_task(self._read(shard, ctx, queue))
        stopped = False
        try:
            while not stopped:
                action = await queue.get()
                if isinstance(action, Rejected):
                    raise action
                yield action
                stopped = action.stop
        finally:
            reader.cancel()
            if not stopped:
                self._left(shard)
            if self.queues.get(shard) is queue:
                del self.queues[shard]

    def _admit(self, shard: int, caller: Caller | None) -> None:
        """``Rejected`` unless ``caller`` may follow as ``shard``, a follower not yet attached."""
        if not 1 <= shard <= self.followers:
            raise invalid("shard", f"not a follower shard index: {shard} (this run has shards 1..{self.followers})")
        if caller is not None and caller.index != shard:
            raise Rejected("PERMISSION_DENIED", "identity", f"{caller} may not follow as shard {shard}")
        if shard in self.queues:
            raise precondition("attached", f"PS shard {shard} is attached already")

    async def _read(self, shard: int, ctx: grpc.aio.ServicerContext,
                    queue: asyncio.Queue[pb.ShardAction | Rejected]) -> None:
        """The follower's messages after its hello, until its stream ends; a malformed one goes to ``queue``,
        whose reader (``follow``) ends the stream with it."""
        try:
            while isinstance(body := await ctx.read(), bytes):  # grpc.aio.EOF once the follower half-closed
                msg = parse(body, pb.FollowerMessage)
                kind = msg.WhichOneof("kind")
                if kind == "verdict":
                    self._heard(shard, msg.verdict)
                elif kind == "saved":
                    self.saves.add(shard, msg.saved)
                elif kind == "restored":
                    self._restored(shard, msg.restored)
        except Rejected as r:
            queue.put_nowait(r)
        except (grpc.RpcError, asyncio.CancelledError):
            pass
        finally:
            self._left(shard)

    def _restored(self, shard: int, r: pb.ShardSaved) -> None:
        if not r.error:
            self.ready.add(shard)
            log.info("PS shard %d resumed at version %d", shard, r.version)
        elif self.lost is None:
            self.lost = r.error
            self.on_lost(r.error, False)

    def _left(self, shard: int) -> None:
        self.ready.discard(shard)
        if self.lost is None and shard in self.queues:
            self.lost = f"PS shard {shard} left the run"
            log.error("%s: no push can complete; stopping (resume the run to go on)", self.lost)
            self.on_lost(self.lost, True)

    # ---- checkpoints -----------------------------------------------------------------------------

    def checkpoint(self, version: int) -> None:
        """Shard 0 is taking its checkpoint of ``version`` (on the loop, between events): every follower
        saves its part at the same point of the action order."""
        self.broadcast(pb.ShardAction(checkpoint=version))

    def manifest(self, version: int, timeout_s: float) -> dict[str, str]:
        """Every follower's part digest at ``version``, once all are saved (on shard 0's checkpoint
        writer: its file, which holds them, is the commit point); ``OSError`` if one is not in time."""
        return self.saves.wait(version, self.followers, timeout_s)


class Saves:
    """The followers' reports of their saved parts, by version: filled on the loop, awaited by shard 0's
    checkpoint writer thread (one condition, "a report arrived")."""

    def __init__(self) -> None:
        self._by_version: dict[int, dict[int, pb.ShardSaved]] = {}
        self._arrived = threading.Condition()

    def add(self, shard: int, saved: pb.ShardSaved) -> None:
        with self._arrived:
            self._by_version.setdefault(saved.version, {})[shard] = saved
            self._arrived.notify_all()

    def wait(self, version: int, followers: int, timeout_s: float) -> dict[str, str]:
        with self._arrived:
            done = self._arrived.wait_for(lambda: len(self._by_version.get(version, {})) == followers or any(
                s.error for s in self._by_version.get(version, {}).values()), timeout_s)
            got = self._by_version.pop(version, {})
            for old in [v for v in self._by_version if v < version]:
                del self._by_version[old]
        errors = [f"shard {k}: {s.error}" for k, s in sorted(got.items()) if s.error]
        if not done or errors:
            raise OSError(f"the followers' parts of version {version} were not saved: "
                          f"{'; '.join(errors) or f'{len(got)} of {followers} in {timeout_s:g}s'}")
        return {str(k): s.digest for k, s in sorted(got.items())}


def _code(reason: str) -> str:
    """The status a push refused by a follower gets: the follower's, for the reasons it gives."""
    return {"layout": "FAILED_PRECONDITION", "not_initialized": "FAILED_PRECONDITION",
            "busy": "RESOURCE_EXHAUSTED"}.get(reason, "INVALID_ARGUMENT")
