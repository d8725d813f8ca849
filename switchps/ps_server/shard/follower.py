"""A follower shard (k >= 1) of a sharded PS: part k of the model and its optimizer state, nothing else.

It decides nothing. Workers send it part k of their pushes (``PushPart``) and of the initial values
(``InitPart``); it reads and checks each part as shard 0 checks a push (its layout and size, every value
finite), keeps it by the push's name and reports a ``Verdict`` to shard 0 on its ``Follow`` stream. Shard
0 streams back the core's actions in order (``switchps.ps_server.shard.followers``, in their wire form:
``action_wire``), which this shard, an ``Executor``, carries out on its ``ModelStore`` exactly as shard
0's service does: join a part into an aggregate, free it, apply an aggregate at the version shard 0
names, change the optimizer, answer a released push with the part at the version now applied, or drop a
push another shard refused.

A worker on this shard's host sends its parts of pushes through a shared-memory segment of its own, as
it sends part 0 to shard 0 (``protos/segment.py``, ``rpc/attachments.py``: the same ``Attach``, the
same Unix socket): only the part's header crosses the socket (``push_small``), the part is copied out
of the segment before it is checked, and the reply's part is written into it. A worker on another host
sends its parts as gRPC bytes (``PushPart``). Either way a part meets the same checks and waits.

A part whose push shard 0 never names (the worker died between its calls, or sent only here) is dropped
after twice ``runtime.receive_timeout_s``; the call waiting for it is refused (ABORTED) and counted,
once, as ``push_part:orphan`` (``init_part:orphan``). Such parts cannot pile up meanwhile: a part holds
one of its worker's slots (``receiving.Slots``, at most two a worker) from its header until shard 0 names
its push or it expires, and a part refused or expired gives its pages back to the OS soon after.

A follower refuses a call as shard 0 does (``rejections``: a status, counted under the RPC's name by a
``RejectionCounter``, the guard's too), and checks the worker a call names as shard 0 does: the caller's token must be that
worker's, and the worker one of the run's ``cluster.workers`` (-1: the evaluator, pulling).

Concurrency: the handlers, the Follow stream and the actions run on the server's event loop (as in
``service``); the store's applier thread is reached only through the store. Other threads learn the end
from ``finished`` (shard 0 said stop) and ``failed`` (shard 0 is gone first).
"""

from __future__ import annotations

import asyncio
import logging
import threading
import time
from collections import Counter
from collections.abc import AsyncIterator
from functools import partial
from pathlib import Path

import grpc
import numpy as np

from switchps.security.channels import ClientSecurity
from switchps.protos import switchps_pb2 as pb
from switchps.protos.codec import PayloadWriter, aencode, encode, grpc_options
from switchps.protos.requests import decode, fill, first_frame, parse
from switchps.protos.layout import layout_size
from switchps.protos.partition import of_layout, part_layout
from switchps.protos.wire_dtype import wire_nbytes
from switchps.ps_server.rpc.attachments import Attachments, write_values
from switchps.ps_server.rpc.guard import Guard, as_worker
from switchps.ps_server.core.actions import Apply, Count, Free, Join, Record, Release, SetOptimizer, execute
from switchps.ps_server.snapshot import Snapshot
from switchps.ps_server.store import ModelStore
from switchps.optim.optimizers import adjust_optimizer
from switchps.ps_server.rejections import RejectionCounter, refuse, rpc_name
from switchps.ps_server.rpc.service import SERVICE
from switchps.ps_server.shard.action_wire import CARRIED, from_wire
from switchps.ps_server.shard.checkpoint import PartSaver, capture, restore_part
from switchps.ps_server.shard.followers import INIT_STEP, Key, key_of, part_key
from switchps.refusals import Rejected, invalid, precondition, unknown_worker

log = logging.getLogger("switchps.ps")
DROPS_KEPT = 4096
"""Refused pushes remembered, so that a part arriving after its push was refused is refused too."""


class Follower:
    """Follower shard ``shard`` of ``shards``, following shard 0 at ``leader``, for ``workers`` workers."""

    def __init__(self, shard: int, shards: int, leader: str, security: ClientSecurity, store: ModelStore,
                 max_bytes: int, receive_timeout_s: float, checkpoints: Path, keep: int = 2, *,
                 workers: int) -> None:
        """``checkpoints``: where this shard saves and finds its part (``shard_checkpoint.part_dir``)."""
        self.shard, self.shards, self.leader, self.security = shard, shards, leader, security
        self.workers = workers
        self.store, self.max_bytes, self.receive_timeout_s = store, max_bytes, receive_timeout_s
        self.checkpoints, self.saver = checkpoints, PartSaver(checkpoints, keep)
        self.refused: str | None = None
        """Why this shard could not resume, if it could not."""
        self.resumed_at = 0
        """The version this shard's part was restored at (0: started afresh)."""
        self.traffic: Counter[str] = Counter()
        """Bytes of parts received (``in``) and answered (``out``)."""
        self.guard: Guard | None = None  # set by ``server.Server`` when the run has a secret
        refusals = RejectionCounter(time.monotonic, who=f"shard {shard}: ")
        self.count_rejection, self.rejections = refusals.count, refusals.counts
        self.counts: Counter[str] = Counter()
        """Shard 0's actions carried out, by kind: ``join`` counts the parts applied, ``free`` and ``drop``
        those discarded, ``apply`` the updates."""
        self.finished, self.failed = threading.Event(), threading.Event()
        self._parts: dict[Key, np.ndarray] = {}
        self._names: dict[int, Key] = {}  # shard 0's push id -> its part's name, from its join or free to its release
        self._dropped: dict[Key, str] = {}  # the latest pushes shard 0 refused, oldest first
        self._held: dict[Key, list[asyncio.Future[Snapshot]]] = {}
        self._out: asyncio.Queue[pb.FollowerMessage] | None = None
        self._layout: pb.Layout | None = None
        self._set_up: asyncio.Event | None = None
        self._applied: asyncio.Event | None = None
        self.segments = Attachments(store.wire)
        """The segments of the workers on this host, for their parts (``attach``), as shard 0's."""

    # ---- the Follow stream -----------------------------------------------------------------------

    def on_serving(self) -> None:
        """The server is up (on its loop): attach to shard 0."""
        self._out, self._set_up, self._applied = asyncio.Queue(), asyncio.Event(), asyncio.Event()
        asyncio.get_running_loop().create_task(self._follow())
        self.segments.listen(self)  # the parts of this host's workers, past gRPC

    async def _follow(self) -> None:
        assert self._out is not None
        self._out.put_nowait(pb.FollowerMessage(hello=self.shard))
        channel = self.security.aio_channel(self.leader, grpc_options())
        call = channel.stream_stream(f"/{SERVICE}/Follow", request_serializer=pb.FollowerMessage.SerializeToString,
                                     response_deserializer=pb.ShardAction.FromString)
        try:
            async for msg in call(self._outgoing(), metadata=self.security.metadata, wait_for_ready=True):
                self._carry(msg)
        except grpc.aio.AioRpcError as e:
            log.error("shard %d: the stream from shard 0 at %s broke: %s", self.shard, self.leader, e.details())
        finally:
            await channel.close()
            if not self.finished.is_set():
                self.failed.set()

    async def _outgoing(self) -> AsyncIterator[pb.FollowerMessage]:
        assert self._out is not None
        while True:
            yield await self._out.get()

    def _carry(self, msg: pb.ShardAction) -> None:
        """Carry out one of shard 0's messages (they arrive in the order shard 0 carried them out): a core
        action (``action_wire``), or shard 0's own word on the parts and the run."""
        kind = msg.WhichOneof("kind")
        self.counts[kind] += 1
        if kind in CARRIED:
            execute([from_wire(msg, self._names)], self)
        elif kind == "setup":
            self._setup(msg.setup)
        elif kind == "initialize":
            key = key_of(msg.initialize)
            self.store.initialize(self._part_layout(), self._take(key))
            self._answer(key, self.store.snapshot())
            self._note_applied()
        elif kind == "drop":
            key = key_of(msg.drop.key)
            if key in self._parts:  # a dropped (refused) push's part gives its pages back to the OS
                self.store.buffers.discard(self._take(key))
            self._drop(key, msg.drop.reason)
        elif kind == "checkpoint":
            self._save(msg.checkpoint)
        elif kind == "restore":
            self._restore(msg.restore)
        elif kind == "stop":
            self.finished.set()

    # ---- the core's actions, as shard 0 carried them out (``actions.Executor``) --------------------------

    def join(self, a: Join) -> None:
        self.store.join(a.aggregate_id, self._take(self._names[a.push_id]))

    def free(self, a: Free) -> None:
        key = self._names[a.push_id]
        if key in self._parts:
            self.store.recycle(self._take(key))

    def apply(self, a: Apply) -> None:
        agg = a.aggregate
        snap = self.store.submit(agg.id, agg.samples, len(agg.members), a.lr_factor, outer=a.outer)
        assert snap.version == a.version, "every shard counts versions alike"
        self._note_applied()

    def release(self, a: Release) -> None:
        """Answer the push's part with the version now applied (a push restored by shard 0 has no part here)."""
        key = self._names.pop(a.push_id, None)
        if key is not None:
            self._answer(key, self.store.snapshot())

    def set_optimizer(self, a: SetOptimizer) -> None:
        self.store.control(partial(adjust_optimizer, lr_scale=a.lr_scale, state=a.state,
                                   state_scale=a.state_scale, momentum=a.momentum))

    def record(self, a: Record) -> None:
        """Never sent (``action_wire``): the run record is shard 0's."""

    def count(self, a: Count) -> None:
        """Never sent (``action_wire``): the run record is shard 0's."""

    def _save(self, version: int) -> None:
        """Save the part at ``version`` (captured on the applier, here in the action order, written in
        the background), then tell shard 0 the file's digest."""
        loop, out = asyncio.get_running_loop(), self._out
        assert out is not None

        def tell(saved: pb.ShardSaved) -> None:
            loop.call_soon_threadsafe(out.put_nowait, pb.FollowerMessage(saved=saved))

        self.store.control(lambda _: self.saver.save(version, capture(self.store), tell))

    def _restore(self, at: pb.ShardSaved) -> None:
        """Load the part shard 0's checkpoint names; refuse (and end) if it is not here as named."""
        assert self._out is not None and self._set_up is not None
        try:
            self._layout = restore_part(self.store, self.checkpoints, at.version, at.digest)
        except ValueError as e:
            self.refused = f"PS shard {self.shard} cannot resume: {e}"
            self._out.put_nowait(pb.FollowerMessage(restored=pb.ShardSaved(version=at.version, error=self.refused)))
            log.error("%s", self.refused)
            return
        self._set_up.set()
        self.resumed_at = at.version
        self._out.put_nowait(pb.FollowerMessage(restored=pb.ShardSaved(version=at.version, digest=at.digest)))
        log.info("shard %d: resumed its part at version %d", self.shard, at.version)

    def _drop(self, key: Key, reason: str) -> None:
        """Answer the push's part with shard 0's refusal, and refuse it if it has yet to arrive."""
        self._dropped[key] = reason
        while len(self._dropped) > DROPS_KEPT:
            del self._dropped[next(iter(self._dropped))]
        self._answer(key, Rejected("ABORTED", "dropped", f"refused by another PS shard: {reason}"))

    def _setup(self, layout: pb.Layout) -> None:
        self._layout = part_layout(layout, of_layout(layout, self.shards, self.max_bytes), self.shard)
        assert self._set_up is not None
        self._set_up.set()

    def _part_layout(self) -> pb.Layout:
        assert self._layout is not None
        return self._layout

    def _note_applied(self) -> None:
        """Wake the pulls waiting for a version (each waits on the event set here, then on the next one)."""
        assert self._applied is not None
        self._applied.set()
        self._applied = asyncio.Event()

    def _answer(self, key: Key, result: Snapshot | Rejected) -> None:
        for fut in self._held.pop(key, []):
            if fut.done():
                continue
            if isinstance(result, Rejected):
                fut.set_exception(result)
            else:
                fut.set_result(result)

    # ---- parts from workers ----------------------------------------------------------------------

    async def push_part(self, request_iterator: object, ctx: grpc.aio.ServicerContext) -> AsyncIterator[bytes]:
        async for frame in self._part(ctx, "PushPart"):
            yield frame

    async def init_part(self, request_iterator: object, ctx: grpc.aio.ServicerContext) -> AsyncIterator[bytes]:
        async for frame in self._part(ctx, "InitPart"):
            yield frame

    async def _part(self, ctx: grpc.aio.ServicerContext, rpc: str) -> AsyncIterator[bytes]:
        """Part k of a push (or, step -1, of the initial values) as gRPC bytes: answered once shard 0
        releases it, with the part at the version then applied."""
        try:
            h, first = decode(await first_frame(ctx, self.receive_timeout_s), pb.PartHeader)
            self._as_worker(ctx, h.key.worker, rpc)
            snapshot = await self._settle(ctx, h, first, shared=False)
        except Rejected as r:
            refuse(ctx, self.count_rejection, rpc_name(rpc), r)
            return
        async for frame in self._reply(snapshot):
            yield frame

    async def push_small(self, frame: bytes, ctx: grpc.aio.ServicerContext) -> bytes:
        """Part k of a push through its worker's segment (``attach``): ``frame`` is its header alone, from
        the socket (``LocalPushes``, ``ctx`` a ``LocalContext``) or a ``PushSmall`` call; the reply's part
        goes into the segment, its header is answered. Counted and refused as ``PushPart`` is."""
        try:
            h, inline = decode(frame, pb.PartHeader)
            self._as_worker(ctx, h.key.worker, "PushPart")
            segment, first = self.segments.payload(h.key.worker, inline)
            snapshot = await self._settle(ctx, h, first, shared=True)
        except Rejected as r:
            refuse(ctx, self.count_rejection, "push_part", r)
            return b""
        await write_values(segment, snapshot)
        self.traffic["out"] += snapshot.nbytes
        self.traffic["out_shared"] += snapshot.nbytes
        return next(encode(pb.PartReply(version=snapshot.version, nbytes=snapshot.nbytes)))

    async def _settle(self, ctx: grpc.aio.ServicerContext, h: pb.PartHeader, first: memoryview,
                      shared: bool) -> Snapshot:
        """The part ``h`` names, received (``first``: its segment's area if ``shared``, else frame 0's
        inline bytes, the stream's frames following), checked, kept and reported; then the part at the
        version applied once shard 0 releases its push. ``Rejected`` if refused here, by another shard,
        or as an orphan."""
        try:
            key, part = await self._receive(ctx, h, first, shared)
        except Rejected:
            self.store.buffers.discard()  # what was buffered for the refused call leaves no resident pages
            raise
        loop = asyncio.get_running_loop()
        held = loop.create_future()
        self._held.setdefault(key, []).append(held)
        loop.call_later(2 * self.receive_timeout_s, self._expire, key, part)
        return await held  # Rejected if dropped: refused by another shard, or an orphan

    async def _reply(self, snapshot: Snapshot) -> AsyncIterator[bytes]:
        self.traffic["out"] += snapshot.nbytes
        async for frame in aencode(pb.PartReply(version=snapshot.version, nbytes=snapshot.nbytes),
                                   snapshot.achunks(), snapshot.nbytes):
            yield frame

    async def _receive(self, ctx: grpc.aio.ServicerContext, h: pb.PartHeader, first: memoryview,
                       shared: bool) -> tuple[Key, np.ndarray]:
        """A part read whole (through a segment: copied out of it by ``fill``, then checked, so the worker
        cannot race the checks) and kept; shard 0 told either way."""
        key = key_of(h.key)
        try:
            await self._until_set_up()
            init, size = key[2] == INIT_STEP, layout_size(self._part_layout())
            if init and h.layout_digest != self._part_layout().digest:
                raise precondition("layout", "the part's layout is not this shard's part of the model")
            if init and h.nbytes != size * 4:
                raise invalid("size", f"the part declares {h.nbytes} bytes, this shard holds {size * 4}")
            if not init:  # a push's part: checked as shard 0 checks a push
                self.store.check(h.layout_digest, h.nbytes)
            with self.store.slots.holding(key[0]):
                async with self.store.buffers.receiving(size if init else None) as part:
                    payload = PayloadWriter(part, check_finite=True, wire="float32" if init else self.store.wire)
                    if not await fill(payload, first, ctx, None if shared else self.receive_timeout_s):
                        raise invalid("non_finite", "the part has NaN or inf values")
        except Rejected as r:
            self._tell(key, r)
            raise
        if key in self._dropped:  # shard 0 refused the push before its part arrived here
            self.store.buffers.discard(part)
            raise Rejected("ABORTED", "dropped", f"refused by another PS shard: {self._dropped[key]}")
        self._keep(key, part)
        self.traffic["in"] += h.nbytes
        if shared:
            self.traffic["in_shared"] += h.nbytes
        self._tell(key, None, payload.squares)
        return key, part

    def _keep(self, key: Key, part: np.ndarray) -> None:
        """Keep ``part`` until shard 0 names its push (``_take``), holding a slot of its worker's meanwhile:
        the one it was received in, released with nothing run since, so it is still free."""
        if key in self._parts:  # a resent push replaces the copy kept
            self.store.recycle(self._take(key))
        self.store.slots.take(key[0])
        self._parts[key] = part

    def _take(self, key: Key) -> np.ndarray:
        """The part kept for ``key``, no longer kept: its worker's slot is free again."""
        part = self._parts.pop(key)
        self.store.slots.release(key[0])
        return part

    def _tell(self, key: Key, refusal: Rejected | None, squares: float = 0.0) -> None:
        """Shard 0's verdict on a part: refused, or accepted with its squared norm (``squares``), which
        shard 0 bounds with the other parts'."""
        assert self._out is not None
        verdict = pb.Verdict(key=part_key(key), squares=squares)
        if refusal is not None:
            verdict.reason, verdict.message = refusal.reason, str(refusal)
        self._out.put_nowait(pb.FollowerMessage(verdict=verdict))

    async def _until_set_up(self) -> None:
        assert self._set_up is not None
        try:
            await asyncio.wait_for(self._set_up.wait(), self.receive_timeout_s)
        except TimeoutError:
            raise precondition("not_initialized", "shard 0 has not named the model yet") from None

    def _expire(self, key: Key, part: np.ndarray) -> None:
        """Drop a part shard 0 never named (see the module docstring); the calls waiting for it count it."""
        if self._parts.get(key) is part:
            self._take(key)
            self.store.buffers.discard(part)
            self._answer(key, Rejected("ABORTED", "orphan", "shard 0 never named this push"))

    async def attach(self, body: bytes, ctx: grpc.aio.ServicerContext) -> pb.AttachReply:
        """Expect a worker's segment for its parts through this shard's socket, as shard 0 does
        (``ParameterServer.attach``); its areas hold this shard's part."""
        try:
            req = parse(body, pb.AttachRequest)
            self._as_worker(ctx, req.worker, "Attach")
            await self._until_set_up()
            return self.segments.attach(req, True, wire_nbytes(layout_size(self._part_layout()), self.store.wire))
        except Rejected as r:
            self.count_rejection("attach", r)
            await ctx.abort(getattr(grpc.StatusCode, r.code), str(r))
            raise AssertionError("abort returned") from None  # pragma: no cover - grpc's abort always raises

    def adopt_segment(self, fds: list[int], ctx: grpc.aio.ServicerContext) -> None:
        """Map the segment that came with a connection's first frame on this shard's socket, for the worker
        whose ``Attach`` it answers, if the connection's token is that worker's; else ``Rejected``."""
        self.segments.adopt(fds, lambda worker: as_worker(self.guard, ctx, worker, "Attach"))

    async def pull_part(self, request: bytes, ctx: grpc.aio.ServicerContext) -> AsyncIterator[bytes]:
        """Part k once the version shard 0 named is applied here (or a newer one)."""
        try:
            req, _ = decode(request, pb.PartPull)
            self._as_worker(ctx, req.worker, "PullPart")
            await self._until_version(req.min_version)
        except Rejected as r:
            refuse(ctx, self.count_rejection, "pull_part", r)
            return
        master = req.master and self.store.wire != "float32"  # the evaluator's, on a narrow wire
        async for frame in self._reply(self.store.master() if master else self.store.snapshot()):
            yield frame

    async def _until_version(self, version: int) -> None:
        assert self._applied is not None
        try:
            async with asyncio.timeout(self.receive_timeout_s):
                while not (self.store.initialized and self.store.version >= version):
                    await self._applied.wait()
        except TimeoutError:
            raise precondition("not_initialized", f"version {version} is not applied on this shard") from None

    # ---- refusals --------------------------------------------------------------------------------

    def _as_worker(self, ctx: grpc.aio.ServicerContext, worker: int, rpc: str) -> None:
        """``Rejected`` unless the caller may act as ``worker`` (``guard.as_worker``) and the worker is one
        of the run's (-1: the evaluator, which only pulls), as shard 0 refuses an unknown worker's calls."""
        as_worker(self.guard, ctx, worker, rpc)
        if not (0 <= worker < self.workers or (worker == -1 and rpc == "PullPart")):
            raise unknown_worker(worker)

    def summary(self) -> dict[str, object]:
        """This shard's record (``shard-K.json``): what this process applied, discarded and refused (after
        a resume, ``resumed_at + updates == final_version``)."""
        c, t = self.counts, self.traffic
        return {"shard": self.shard, "final_version": self.store.version, "resumed_at": self.resumed_at,
                "updates": c["apply"], "parts_applied": c["join"], "parts_freed": c["free"],
                "parts_dropped": c["drop"], "rejections": dict(self.rejections),
                "parameters": int(self.store.values.size), "bytes_in": t["in"], "bytes_out": t["out"],
                "bytes_in_shared": t["in_shared"], "bytes_out_shared": t["out_shared"],
                "mean_apply_ms": self.store.mean_apply_ms,
                "parts_waiting": len(self._parts), "replies_held": sum(map(len, self._held.values()))}

    def methods(self) -> dict[str, grpc.RpcMethodHandler]:
        raw: dict = dict(request_deserializer=None, response_serializer=None)
        return {"PushPart": grpc.stream_stream_rpc_method_handler(self.push_part, **raw),
                "InitPart": grpc.stream_stream_rpc_method_handler(self.init_part, **raw),
                "PullPart": grpc.unary_stream_rpc_method_handler(self.pull_part, **raw),
                "Attach": grpc.unary_unary_rpc_method_handler(self.attach, None, pb.AttachReply.SerializeToString),
                "PushSmall": grpc.unary_unary_rpc_method_handler(self.push_small, **raw)}
