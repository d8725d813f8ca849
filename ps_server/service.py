"""The gRPC face of the parameter server, on grpc.aio.

Tensor RPCs (Push, Pull, Init) use raw frames (see ``switchps.protos.codec``)
through generic handlers, so payload bytes never pass through protobuf.
Control RPCs (Register, Status, Eval) are plain protobuf.

Concurrency: every handler runs on one asyncio event loop (``Server`` gives it
a thread of its own), so a stream that sends nothing holds no thread and can
starve neither the health service nor other RPCs; each frame must also arrive
within ``receive_timeout_s``. Engine calls that may block (a BSP round, an SSP
hold, the emulated link) run on ``pool``, sized so that every worker can wait
at once. Replies stream the version's chunks as the applier publishes them.

Hostile input: a request is validated completely, and a push is read to the
end of its stream, before anything touches the model; a push is then applied
whole or not at all. Every rejection gets an error status, one log line, and a
count in the run record (``rejections`` in summary.json).
"""

from __future__ import annotations

import asyncio
import logging
import math
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from typing import AsyncIterator, Callable, Coroutine, NoReturn, TypeVar

import grpc
import numpy as np
from grpc_health.v1 import health, health_pb2, health_pb2_grpc
from prometheus_client import Counter, Gauge

from switchps.protos import switchps_pb2 as pb
from switchps.protos.codec import FrameError, PayloadWriter, aencode, decode_header, grpc_options, tune_allocator
from switchps.ps_server.link import DuplexLink
from switchps.ps_server.model import Snapshot, layout_digest, layout_size
from switchps.ps_server.sync import Outcome, Push, SyncEngine

SERVICE = "switchps.ParameterServer"
PUSHES = Counter("switchps_pushes", "Pushes by outcome", ["outcome"])
VERSION = Gauge("switchps_model_version", "Current model version")
MAX_SHARD_SIZE = 2**40
log = logging.getLogger("switchps.ps")
T = TypeVar("T")
H = TypeVar("H", pb.InitHeader, pb.PushHeader, pb.PullRequest)


class Rejected(Exception):
    """A request that must not touch the model."""

    def __init__(self, code: grpc.StatusCode, reason: str, message: str) -> None:
        super().__init__(message)
        self.code, self.reason = code, reason


def _invalid(reason: str, message: str) -> Rejected:
    return Rejected(grpc.StatusCode.INVALID_ARGUMENT, reason, message)


def _precondition(reason: str, message: str) -> Rejected:
    return Rejected(grpc.StatusCode.FAILED_PRECONDITION, reason, message)


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
            first = self._check_register(req)
        except Rejected as r:
            await self._reject(ctx, "register", r)
        self.engine.register(req.worker, req.shard_size)
        return pb.RegisterReply(send_init=first, order=self.engine.work_order(req.worker),
                                num_workers=self.num_workers)

    def _check_register(self, req: pb.RegisterRequest) -> bool:
        """Validate a registration; returns whether it is the first (whose layout the PS adopts)."""
        if not 0 <= req.worker < self.num_workers:
            raise _invalid("worker", f"worker index {req.worker} outside [0, {self.num_workers})")
        if not 0 < req.shard_size <= MAX_SHARD_SIZE:
            raise _invalid("shard_size", f"shard size {req.shard_size} must be in [1, {MAX_SHARD_SIZE}]")
        layout = req.layout
        shapes = [list(v.shape) for v in (*layout.variables, *layout.state)]
        if not layout.variables or any(d <= 0 for s in shapes for d in s):
            raise _invalid("layout", "the layout needs variables with positive dimensions")
        if sum(math.prod(s) for s in shapes) * 4 > self.max_model_bytes:
            raise _invalid("layout", f"the layout exceeds the PS's limit of {self.max_model_bytes} bytes")
        specs = [[(v.name, tuple(v.shape)) for v in vs] for vs in (layout.variables, layout.state)]
        if layout.digest != layout_digest(*specs):
            raise _invalid("layout", "the layout's digest does not match its variables")
        with self.store.lock:
            first = self._layout is None
            adopted = self._layout = self._layout or layout
        if layout.digest != adopted.digest:
            raise _precondition("layout", f"worker {req.worker}: its model layout differs from the PS's "
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
            if not 0 <= req.version <= self.store.version:
                raise _invalid("version", f"version {req.version} is not in [0, {self.store.version}]")
            if not 0.0 <= req.test_accuracy <= 1.0:  # also false for NaN
                raise _invalid("accuracy", "test accuracy must be a number in [0, 1]")
            if req.final and not (self.engine.done and req.version == self.store.version):
                raise _precondition("not_final", "a final evaluation must score the last version, once done")
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
        header, first = _decode(await self._first(frames), pb.InitHeader)
        layout = self._layout
        if layout is None:
            raise _precondition("not_registered", "register before Init")
        if self.store.initialized:
            raise _precondition("already_initialized", "the model is already initialized")
        if header.layout_digest != layout.digest:
            raise _precondition("layout", "the initial values' layout differs from the registered one")
        values = np.empty(layout_size(layout), np.float32)
        if not await self._fill(PayloadWriter(values, check_finite=True), first, frames, ctx):
            raise _invalid("non_finite", "initial values are not finite")
        return (header.worker, layout), values

    async def pull(self, request: bytes, ctx: grpc.aio.ServicerContext) -> AsyncIterator[bytes]:
        try:
            req, _ = _decode(request, pb.PullRequest)
            if req.worker != -1 and req.worker not in self.engine.registered:
                raise _invalid("unknown_worker", f"unknown worker id {req.worker}")
        except Rejected as r:
            await self._reject(ctx, "pull", r)
        if req.wait_initialized:
            while not await self._blocking(self.engine.wait_started, 1.0):
                if ctx.done():
                    return
        if not self.store.initialized:
            await self._reject(ctx, "pull", _precondition("not_initialized", "the model is not initialized yet"))
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
        return b"".join([f async for f in self._push(_one(frame), ctx)])

    async def _push(self, frames: AsyncIterator[bytes], ctx: grpc.aio.ServicerContext) -> AsyncIterator[bytes]:
        try:
            p, stats = await self._receive_push(frames, ctx)
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

    async def _receive_push(self, frames: AsyncIterator[bytes], ctx: grpc.aio.ServicerContext
                            ) -> tuple[Push, pb.StepStats]:
        """Validate a push and read it to the end of its stream; the model is untouched unless this returns."""
        h, first = _decode(await self._first(frames), pb.PushHeader)
        self._check_push(h)
        grad = self.store.buffers.get()
        try:
            finite = await self._fill(PayloadWriter(grad, check_finite=True), first, frames, ctx)
            if not finite:
                raise _invalid("non_finite", "gradient has NaN or inf values")
        except BaseException:
            self.store.buffers.put(grad)
            raise
        return Push(h.worker, h.base_version, h.samples, grad, h.stats.loss_sum), h.stats

    def _check_push(self, h: pb.PushHeader) -> None:
        store, engine = self.store, self.engine
        if h.worker not in engine.registered:
            raise _invalid("unknown_worker", f"unknown worker id {h.worker}")
        if not store.initialized:
            raise _precondition("not_initialized", "the model is not initialized")
        if h.layout_digest != store.layout.digest:
            raise _precondition("layout", "the push's variable layout is not the model's")
        if h.nbytes != store.nbytes:
            raise _invalid("size", f"payload declares {h.nbytes} bytes, the model has {store.nbytes}")
        if not 0 < h.samples <= engine.issued.get(h.worker, 0):
            raise _invalid("samples", f"sample count {h.samples} is not in [1, {engine.issued.get(h.worker, 0)}], "
                                      "the largest budget this worker was given")
        if not 0 <= h.base_version <= store.version:
            raise _invalid("version", f"base version {h.base_version} is not in [0, {store.version}]")
        _check_stats(h.stats)

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
            raise _invalid("empty", "the stream ended before its first frame") from None

    @staticmethod
    async def _fill(writer: PayloadWriter, first: memoryview, frames: AsyncIterator[bytes],
                    ctx: grpc.aio.ServicerContext) -> bool:
        """Receive the whole payload; returns whether it is finite. It counts only if the stream ended
        cleanly: grpc reports a stream that broke (a frame over the size cap, the client's deadline) as a
        plain end of stream, so the end is confirmed by sending the reply's initial metadata, which fails
        on a broken call."""
        try:
            if len(first):
                writer.add(first)
            async for frame in frames:
                writer.add(frame)
            finite = writer.finish()
        except FrameError as e:
            raise _invalid("size", str(e)) from None
        remaining = ctx.time_remaining()
        try:
            if remaining is not None and remaining <= 0:
                raise TimeoutError
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


def _decode(frame0: bytes, header_type: type[H]) -> tuple[H, memoryview]:
    try:
        return decode_header(frame0, header_type)
    except FrameError as e:
        raise _invalid("malformed", str(e)) from None


def _check_stats(s: pb.StepStats) -> None:
    """Step statistics feed the run record and the policies: finite, and durations not negative."""
    durations = (s.compute_s, s.send_s, s.wait_s, s.sleep_s, s.delay_sleep_s, s.delay_comm_s, s.delay_factor)
    if s.step < 0 or not all(math.isfinite(x) and x >= 0 for x in durations) or not math.isfinite(s.loss_sum):
        raise _invalid("stats", "step statistics must be finite, with durations and step >= 0")


async def _one(frame: bytes) -> AsyncIterator[bytes]:
    yield frame


async def _no_chunks() -> AsyncIterator[bytes]:
    return
    yield  # pragma: no cover - makes this an (empty) async generator


class Server:
    """A running PS: grpc.aio with the health service, on an event-loop thread of its own.

    Callers stay synchronous: the training loop in ``ps_server.main`` and the tests
    start and stop it from their own threads.
    """

    def __init__(self, ps: ParameterServer, address: str) -> None:
        self.ps = ps
        self._loop = asyncio.new_event_loop()
        self._thread = threading.Thread(target=self._loop.run_forever, name="switchps-grpc", daemon=True)
        self._thread.start()
        self.port = self._call(self._start(address))

    def _call(self, coro: Coroutine[object, object, T], timeout: float | None = None) -> T:
        return asyncio.run_coroutine_threadsafe(coro, self._loop).result(timeout)

    async def _start(self, address: str) -> int:
        tune_allocator()
        self._server = grpc.aio.server(options=grpc_options())
        self._server.add_generic_rpc_handlers([self.ps.handler()])
        self.health = health.aio.HealthServicer()
        health_pb2_grpc.add_HealthServicer_to_server(self.health, self._server)
        port = self._server.add_insecure_port(address)
        if port == 0:
            raise OSError(f"cannot bind the PS to {address}")
        await self._server.start()
        for service in (SERVICE, ""):
            await self.health.set(service, health_pb2.HealthCheckResponse.SERVING)
        return port

    def stop(self, grace: float | None = 1.0) -> None:
        """Stop serving (in-flight RPCs get ``grace`` seconds), then the loop and the RPC pool."""
        self._call(self._stop(grace))
        self._loop.call_soon_threadsafe(self._loop.stop)
        self._thread.join(5.0)
        self.ps.pool.shutdown(wait=False, cancel_futures=True)

    async def _stop(self, grace: float | None) -> None:
        await self.health.enter_graceful_shutdown()
        await self._server.stop(grace)


def wait_until(cond: Callable[[], bool], timeout: float, poll: float = 0.05) -> bool:
    end = time.monotonic() + timeout
    while not cond():
        if time.monotonic() >= end:
            return False
        time.sleep(poll)
    return True
