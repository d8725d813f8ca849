"""The gRPC face of the parameter server, on grpc.aio.

Tensor RPCs (Push, Pull, Init) use raw frames (see ``switchps.protos.codec``)
through generic handlers, so payload bytes never pass through protobuf.
Control RPCs (Register, Status, Eval) are plain protobuf.

Concurrency: every handler runs on one asyncio event loop (``server.Server``
gives it a thread of its own), so a stream that sends nothing holds no thread and can
starve neither the health service nor other RPCs; each frame must also arrive
within ``receive_timeout_s``. Engine calls that may block (a BSP round, an SSP
hold, the emulated link) run on ``pool``, sized so that every worker can wait
at once. Replies stream the version's chunks as the applier publishes them.

Hostile input: a request is validated completely (``validate``), and a push
is read to the end of its stream, before anything touches the model; a push
is then applied whole or not at all. Every rejection gets an error status,
one log line, and a count in the run record (``rejections`` in summary.json).
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import AsyncIterator, Callable
from concurrent.futures import ThreadPoolExecutor
from typing import NoReturn, TypeVar

import grpc
import numpy as np
from prometheus_client import Counter, Gauge

from switchps.protos import switchps_pb2 as pb
from switchps.protos.codec import FrameError, PayloadWriter, aencode
from switchps.ps_server.link import DuplexLink
from switchps.ps_server.model import Snapshot, layout_size
from switchps.ps_server.sync import Outcome, Push, SyncEngine
from switchps.ps_server.validate import (
    Rejected, check_eval, check_push, check_register, decode, invalid, precondition,
)

SERVICE = "switchps.ParameterServer"
PUSHES = Counter("switchps_pushes", "Pushes by outcome", ["outcome"])
VERSION = Gauge("switchps_model_version", "Current model version")
log = logging.getLogger("switchps.ps")
T = TypeVar("T")


class ParameterServer:
    """Implements the RPCs on top of a ``SyncEngine``."""

    def __init__(self, engine: SyncEngine, num_workers: int, link: DuplexLink | None = None,
                 receive_timeout_s: float = 30.0, max_model_bytes: int = 2**33) -> None:
        self.engine = engine
        self.link = link  # the emulated PS link (network.ps_link_mbit_s), if any
        self.store = engine.store
        self.rec = engine.rec
        self.num_workers = num_workers
        self.receive_timeout_s = receive_timeout_s
        self.max_model_bytes = max_model_bytes
        self.pool = ThreadPoolExecutor(2 * num_workers + 8, thread_name_prefix="switchps-rpc")
        self.told_stop: set[int] = set()
        self.last_eval: pb.EvalReport | None = None
        self.final_eval: pb.EvalReport | None = None
        self._layout: pb.Layout | None = None  # set by the first Register, before Init

    async def _blocking(self, fn: Callable[..., T], *args: object) -> T:
        return await asyncio.get_running_loop().run_in_executor(self.pool, fn, *args)

    # ---- control ----------------------------------------------------------------------------

    async def register(self, req: pb.RegisterRequest, ctx: grpc.aio.ServicerContext) -> pb.RegisterReply:
        try:
            check_register(req, self.num_workers, self.max_model_bytes)
            first = self._adopt(req)
        except Rejected as r:
            await self._reject(ctx, "register", r)
        self.engine.register(req.worker, req.shard_size)
        return pb.RegisterReply(send_init=first, order=self.engine.work_order(req.worker),
                                num_workers=self.num_workers)

    def _adopt(self, req: pb.RegisterRequest) -> bool:
        """The first registration's layout becomes the model's; returns whether this was the first."""
        with self.store.lock:
            first = self._layout is None
            adopted = self._layout = self._layout or req.layout
        if req.layout.digest != adopted.digest:
            raise precondition("layout", f"worker {req.worker}: its model layout differs from the PS's "
                                         "(same model config on every worker?)")
        return first

    async def status(self, req: pb.StatusRequest, ctx: grpc.aio.ServicerContext) -> pb.Status:
        return self.current_status()

    def current_status(self) -> pb.Status:
        e = self.engine
        return pb.Status(
            version=self.store.version, protocol=e.protocol.name,
            test_accuracy=self.last_eval.test_accuracy if self.last_eval else -1.0,
            done=e.done, final_eval_done=self.final_eval is not None, samples=e.samples_applied,
            total_steps=e.train.steps or 0, progress=e.progress(), active_workers=len(e.active),
        )

    async def eval_report(self, req: pb.EvalReport, ctx: grpc.aio.ServicerContext) -> pb.Status:
        try:
            check_eval(req, self.store.version, self.engine.done)
        except Rejected as r:
            await self._reject(ctx, "eval", r)
        self.rec.evaluation(req.version, req.test_loss, req.test_accuracy)
        self.last_eval = req
        if req.final:
            self.final_eval = req
            self.engine.notify()
        return self.current_status()

    # ---- tensors ----------------------------------------------------------------------------

    async def init(self, request_iterator: object, ctx: grpc.aio.ServicerContext) -> AsyncIterator[bytes]:
        """Initial values from the first worker; frames are read with ``ctx.read`` (per-frame timeouts)."""
        try:
            header, values = await self._receive_init(ctx)
        except Rejected as r:
            await self._reject(ctx, "init", r)
        self.store.initialize(header[1], values)
        self.rec.event("model_initialized", worker=header[0], parameters=int(values.size))
        self.engine.notify()
        async for frame in aencode(pb.PushReply(order=self.engine.work_order()), _no_chunks(), 0):
            yield frame

    async def _receive_init(self, ctx: grpc.aio.ServicerContext) -> tuple[tuple[int, pb.Layout], np.ndarray]:
        frames = self._frames(ctx)
        header, first = decode(await self._first(frames), pb.InitHeader)
        layout = self._layout
        if layout is None:
            raise precondition("not_registered", "register before Init")
        if self.store.initialized:
            raise precondition("already_initialized", "the model is already initialized")
        if header.layout_digest != layout.digest:
            raise precondition("layout", "the initial values' layout differs from the registered one")
        values = np.empty(layout_size(layout), np.float32)
        if not await self._fill(PayloadWriter(values, check_finite=True), first, frames, ctx):
            raise invalid("non_finite", "initial values are not finite")
        return (header.worker, layout), values

    async def pull(self, request: bytes, ctx: grpc.aio.ServicerContext) -> AsyncIterator[bytes]:
        try:
            req, _ = decode(request, pb.PullRequest)
            if req.worker != -1 and req.worker not in self.engine.registered:
                raise invalid("unknown_worker", f"unknown worker id {req.worker}")
        except Rejected as r:
            await self._reject(ctx, "pull", r)
        if req.wait_initialized:
            while not await self._blocking(self.engine.wait_started, 1.0):
                if ctx.done():
                    return
        if not self.store.initialized:
            await self._reject(ctx, "pull", precondition("not_initialized", "the model is not initialized yet"))
        snapshot = self.store.snapshot()
        send = req.have_version != snapshot.version
        async for frame in self._reply(pb.PushReply(applied=False), snapshot if send else None, req.worker):
            yield frame

    async def push(self, request_iterator: object, ctx: grpc.aio.ServicerContext) -> AsyncIterator[bytes]:
        """A push as a stream of frames (models larger than one frame), read with ``ctx.read``."""
        async for frame in self._push(self._frames(ctx), ctx):
            yield frame

    async def push_small(self, frame: bytes, ctx: grpc.aio.ServicerContext) -> bytes:
        """A push whose payload and reply each fit in one frame (models up to INLINE_BYTES)."""
        return b"".join([f async for f in self._push(_one(frame), ctx, stream=False)])

    async def _push(self, frames: AsyncIterator[bytes], ctx: grpc.aio.ServicerContext,
                    stream: bool = True) -> AsyncIterator[bytes]:
        try:
            p, stats = await self._receive_push(frames, ctx, stream)
        except Rejected as r:
            await self._reject(ctx, "push", r)
        except asyncio.CancelledError:  # the client cancelled mid-stream: nothing was applied
            self._count_rejection("push", Rejected(grpc.StatusCode.CANCELLED, "cancelled", "cancelled by the client"))
            raise
        outcome = await self._blocking(self._apply_push, p, stats)
        PUSHES.labels("applied" if outcome.applied else "dropped").inc()
        VERSION.set(self.store.version)
        reply = pb.PushReply(applied=outcome.applied, note=outcome.note, staleness=outcome.staleness,
                             wait_s=outcome.wait_s)
        async for frame in self._reply(reply, outcome.snapshot, p.worker):
            yield frame

    def _apply_push(self, p: Push, stats: pb.StepStats) -> Outcome:
        """On ``pool``: cross the emulated link, record the step, join the protocol (which may hold it)."""
        if self.link is not None:
            self.link.inbound.transfer(self.store.nbytes)
            p.arrived = time.monotonic()  # the PS has the gradient only once it has crossed the link
        self._record_step(p, stats)
        return self.engine.push(p)

    def _record_step(self, p: Push, stats: pb.StepStats) -> None:
        now = self.rec.now()
        self.rec.worker_step(time_s=now, worker=p.worker, step=stats.step, base_version=p.base_version,
                             samples=p.samples, compute_s=stats.compute_s, send_s=stats.send_s,
                             wait_s=stats.wait_s, sleep_s=stats.sleep_s, loss=stats.loss_sum / p.samples)
        if self.rec.trace is not None:
            self.rec.straggler(time_s=now, worker=p.worker, step=stats.step, sleep_s=stats.delay_sleep_s,
                               factor=stats.delay_factor or 1.0, comm_s=stats.delay_comm_s)
        if stats.batch_exhausted:
            self.rec.count("batch_exhausted")
        self.engine.observe_step(p.worker, stats, p.samples)

    async def _reply(self, reply: pb.PushReply, snapshot: Snapshot | None, worker: int) -> AsyncIterator[bytes]:
        """Reply frames: the header with the next work order, then the values (not to a worker told to stop)."""
        reply.order.CopyFrom(self.engine.work_order(worker))
        if reply.order.stop and worker >= 0:
            self.told_stop.add(worker)
            snapshot = None
        if snapshot is None:
            async for frame in aencode(reply, _no_chunks(), 0):
                yield frame
            return
        if self.link is not None and worker >= 0:
            await self._blocking(self.link.outbound.transfer, snapshot.nbytes)
        reply.order.version, reply.nbytes = snapshot.version, snapshot.nbytes
        async for frame in aencode(reply, snapshot.achunks(), snapshot.nbytes):
            yield frame

    async def _receive_push(self, frames: AsyncIterator[bytes], ctx: grpc.aio.ServicerContext,
                            stream: bool) -> tuple[Push, pb.StepStats]:
        """Validate a push and read it to the end of its stream; the model is untouched unless this returns."""
        h, first = decode(await self._first(frames), pb.PushHeader)
        e, store = self.engine, self.store
        check_push(h, h.worker in e.registered, store.layout if store.initialized else None, store.nbytes,
                   store.version, e.issued.get(h.worker, 0))
        grad = self.store.buffers.get()
        try:
            finite = await self._fill(PayloadWriter(grad, check_finite=True), first, frames, ctx, stream)
            if not finite:
                raise invalid("non_finite", "gradient has NaN or inf values")
        except BaseException:
            self.store.buffers.put(grad)
            raise
        return Push(h.worker, h.base_version, h.samples, grad, h.stats.loss_sum), h.stats

    # ---- frames -----------------------------------------------------------------------------

    async def _frames(self, ctx: grpc.aio.ServicerContext) -> AsyncIterator[bytes]:
        """The request frames, each within ``receive_timeout_s``, until the client half-closes."""
        while True:
            try:
                frame = await asyncio.wait_for(ctx.read(), self.receive_timeout_s)
            except asyncio.TimeoutError:
                raise Rejected(grpc.StatusCode.DEADLINE_EXCEEDED, "idle",
                               f"no frame within {self.receive_timeout_s:g}s") from None
            if frame is grpc.aio.EOF:
                return
            yield frame

    @staticmethod
    async def _first(frames: AsyncIterator[bytes]) -> bytes:
        try:
            return await anext(frames)
        except StopAsyncIteration:
            raise invalid("empty", "the stream ended before its first frame") from None

    @staticmethod
    async def _fill(writer: PayloadWriter, first: memoryview, frames: AsyncIterator[bytes],
                    ctx: grpc.aio.ServicerContext, stream: bool = True) -> bool:
        """Receive the whole payload; returns whether it is finite. It counts only if the stream ended
        cleanly: grpc reports a stream that broke (a frame over the size cap, the client's deadline) as a
        plain end of stream, so the end of a ``stream`` is confirmed by sending the reply's initial
        metadata, which fails on a broken call. A unary request arrives whole or not at all."""
        try:
            if len(first):
                writer.add(first)
            async for frame in frames:
                writer.add(frame)
            finite = writer.finish()
        except FrameError as e:
            raise invalid("size", str(e)) from None
        remaining = ctx.time_remaining()
        try:
            if remaining is not None and remaining <= 0:
                raise TimeoutError
            if stream:
                await ctx.send_initial_metadata(())
        except Exception:
            raise Rejected(grpc.StatusCode.CANCELLED, "broken_stream", "the stream broke before its end") from None
        return finite

    async def _reject(self, ctx: grpc.aio.ServicerContext, rpc: str, r: Rejected) -> NoReturn:
        self._count_rejection(rpc, r)
        await ctx.abort(r.code, str(r))
        raise AssertionError("abort returned")  # pragma: no cover - grpc's abort always raises

    def _count_rejection(self, rpc: str, r: Rejected) -> None:
        self.rec.reject(rpc, r.reason)
        self.rec.event(f"{rpc}_rejected", reason=r.reason, message=str(r), version=self.store.version)
        log.warning("%s rejected (%s): %s", rpc, r.reason, r)
        if rpc == "push":
            PUSHES.labels("rejected").inc()

    # ---- wiring -----------------------------------------------------------------------------

    def handler(self) -> grpc.GenericRpcHandler:
        raw: dict = dict(request_deserializer=None, response_serializer=None)
        return grpc.method_handlers_generic_handler(SERVICE, {
            "Register": grpc.unary_unary_rpc_method_handler(
                self.register, pb.RegisterRequest.FromString, pb.RegisterReply.SerializeToString),
            "Status": grpc.unary_unary_rpc_method_handler(
                self.status, pb.StatusRequest.FromString, pb.Status.SerializeToString),
            "Eval": grpc.unary_unary_rpc_method_handler(
                self.eval_report, pb.EvalReport.FromString, pb.Status.SerializeToString),
            "Init": grpc.stream_stream_rpc_method_handler(self.init, **raw),
            "Push": grpc.stream_stream_rpc_method_handler(self.push, **raw),
            "PushSmall": grpc.unary_unary_rpc_method_handler(self.push_small, **raw),
            "Pull": grpc.unary_stream_rpc_method_handler(self.pull, **raw),
        })


async def _one(frame: bytes) -> AsyncIterator[bytes]:
    yield frame


async def _no_chunks() -> AsyncIterator[bytes]:
    return
    yield  # pragma: no cover - makes this an (empty) async generator


