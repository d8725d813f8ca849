"""The gRPC face of the parameter server: one driver of the protocol core, on grpc.aio.

Tensor RPCs (Push, Pull, Init) use raw frames (see ``switchps.protos.codec``) through generic handlers, so
payload bytes never pass through protobuf. Control RPCs (Register, Status, Eval) are plain protobuf.

A push: read and check its frames, hand it to the ``Core`` with the time, execute the actions it
returns in order (apply an update through the ``ModelStore``, release held replies, record), and await
this push's own release; the reply streams the version's chunks as the applier publishes them, or, for
a model updated inline (``store.py``), is copied straight from its values. Between events, a due
checkpoint is taken (``checkpointer``).

Concurrency: every handler, the core and the link emulation run on one asyncio event loop
(``server.Server`` gives it a thread of its own), so none of them needs a lock, and a stream that sends
nothing holds no thread: it cannot starve the health service or other RPCs, and is cut after
``receive_timeout_s``. Other threads (the store's applier, the only writer of the parameters, which a
small model's updates skip: ``store.py``; the recorder's flusher; the checkpoint writer) are reached
only through their own locks and queues, and learn of progress through threading events.

Hostile input: a push is read to the end of its stream and validated before it reaches the core, and
then applied whole or not at all. Every rejection gets an error status, a log line and a count. A worker
holds at most two payloads at once (``receiving.Slots``), so its streams never hold another worker's pushes off.
"""

from __future__ import annotations

import asyncio
import itertools
import threading
import time
from collections import Counter
from collections.abc import AsyncIterator, Callable
from functools import partial
from typing import NoReturn

import grpc
import numpy as np
from prometheus_client import Gauge

from switchps.protos import switchps_pb2 as pb
from switchps.protos.codec import PayloadWriter, aencode, encode, joined, whole_frame
from switchps.protos.requests import decode, fill, first_frame, parse
from switchps.protos.layout import layout_size
from switchps.protos.segment import Segment
from switchps.protos.wire_dtype import narrowed, wire_nbytes
from switchps.ps_server.rpc.admission import Admission, Alone, same_framework, same_wire
from switchps.ps_server.rpc.attachments import Attachments, write_values
from switchps.ps_server.rpc.executor import StoreExecutor
from switchps.ps_server import work_orders
from switchps.ps_server.checkpointer import Checkpointer
from switchps.ps_server.core.machine import Core
from switchps.ps_server.rpc.guard import Guard, as_worker
from switchps.ps_server.core.actions import Action, Executor, Release, execute
from switchps.ps_server.core.events import Push, StepReport
from switchps.ps_server.link import DuplexLink
from switchps.ps_server.snapshot import Snapshot
from switchps.ps_server.store import ModelStore
from switchps.ps_server.records import RunRecorder
from switchps.ps_server.metrics import RunSeries, Tally
from switchps.ps_server.rejections import RejectionCounter, refuse
from switchps.ps_server.validate import check_eval, check_grad_norm, check_layout
from switchps.refusals import Rejected, invalid, precondition, unknown_worker

SERVICE = "switchps.ParameterServer"
PUSH_STREAMS = Gauge("switchps_push_streams", "Push streams open on the PS: being read or awaiting their reply")


class ParameterServer:
    """Implements the RPCs by driving a ``Core``; see the module docstring for who runs where."""

    def __init__(self, core: Core, store: ModelStore, rec: RunRecorder, link: DuplexLink | None = None,
                 receive_timeout_s: float = 30.0, max_model_bytes: int = 2**33,
                 clock: Callable[[], float] = time.monotonic, max_grad_norm: float | None = None,
                 admission: Admission | None = None) -> None:
        """``admission``: shard 0's of a sharded PS (``shard.zero.ShardZero``); by default, unsharded."""
        self.core, self.store, self.rec, self.link, self.clock = core, store, rec, link, clock
        self.receive_timeout_s, self.max_model_bytes = receive_timeout_s, max_model_bytes
        self.max_grad_norm = max_grad_norm  # ``runtime.max_grad_norm``: a push's bound per sample (``validate``)
        self.told_stop: set[int] = set()
        self.last_eval: pb.EvalReport | None = None
        self.final_eval: pb.EvalReport | None = None
        self.started, self.finished = threading.Event(), threading.Event()
        self.final_evaluated, self.all_told_stop = threading.Event(), threading.Event()
        self.layout: pb.Layout | None = None  # adopted from the first Register (or a checkpoint)
        self.framework = ""  # the first registrant's model.framework (``same_framework``); empty: unknown
        self.devices: set[str] = set()  # where the registered workers compute (cpu, cuda:K), as they said
        self._ids = itertools.count()
        self._held: dict[int, asyncio.Future[tuple[Release, Snapshot]]] = {}
        self._grads: dict[int, np.ndarray] = {}  # push id -> its gradient buffer, until the core joins or frees it
        self.tally = Tally(clock)  # what the push path and the applier note for the Prometheus series
        self.traffic: Counter[str] = Counter()
        """Payload bytes received (``in``) and sent (``out``), and of them through shared memory (``*_shared``)."""
        self.admission = admission or Alone()
        self.executor: Executor = self.admission.executor(StoreExecutor(store, rec, self._grads, self._held,
                                                                        self.tally))
        self.failed: Exception | None = None
        """Why the run stopped before training was over (``end``)."""
        self.admission.bind(self.end)
        self._timer: asyncio.TimerHandle | None = None
        self._timer_at: float | None = None
        self._started_async: asyncio.Event | None = None
        self.count_rejection = RejectionCounter(clock, rec, lambda: self.core.version).count
        self.segments = Attachments(store.wire)
        self.checkpointer: Checkpointer | None = None  # set by ``main.build_ps`` when checkpoints are on
        self._checkpoint_soon = False
        self.guard: Guard | None = None  # set by ``server.Server`` when the PS has a secret

    def series(self) -> RunSeries:
        """This PS's Prometheus series, read at scrape time (``metrics``)."""
        return RunSeries(self.core, self.tally, self.traffic, self.rec.rejections)

    # ---- driving the core -----------------------------------------------------------------------

    def _execute(self, actions: list[Action]) -> None:
        """Carry out the core's actions in order, then note what changed and re-arm its timer."""
        execute(actions, self.executor)
        self._note_progress()

    def on_serving(self) -> None:
        self._note_progress()  # the server is up: publish a restored core's progress, arm its timer
        self.segments.listen(self)  # the pushes of this host's workers, past gRPC

    def _note_progress(self) -> None:
        core = self.core
        if core.started_at is not None and not self.started.is_set():
            self.rec.start(core.started_at)
            self.started.set()
            if self._started_async is not None:
                self._started_async.set()
        if core.done:
            self.finished.set()
        elif self.checkpointer is not None and core.started_at is not None and not self._checkpoint_soon:
            self._checkpoint_soon = True  # once per turn of the loop, after the event's handler
            asyncio.get_running_loop().call_soon(self._maybe_checkpoint)
        self._arm(core.next_timer())

    def _maybe_checkpoint(self) -> None:
        """Take a checkpoint if one is due: between events, in a callback of its own, not in a handler."""
        self._checkpoint_soon = False
        if self.checkpointer is not None and not self.core.done and \
                self.checkpointer.due(self.core.version, self.clock()):
            self.checkpointer.take(self.clock())

    def _arm(self, at: float | None) -> None:
        if at == self._timer_at:
            return
        if self._timer is not None:
            self._timer.cancel()
        self._timer_at, self._timer = at, None
        if at is not None:
            self._timer = asyncio.get_running_loop().call_later(max(0.0, at - self.clock()), self._fire)

    def _fire(self) -> None:
        self._timer_at = self._timer = None
        self._execute(self.core.timer(self.clock()))

    def end(self, why: Exception) -> None:
        """Stop the run before training is over (a PS shard left, or could not resume): every wait on the
        run returns, and ``failed`` says why."""
        self.failed = why
        for ended in (self.finished, self.final_evaluated, self.all_told_stop):
            ended.set()

    async def _until_started(self) -> None:
        if self._started_async is None:
            self._started_async = asyncio.Event()
            if self.started.is_set():
                self._started_async.set()
        await self._started_async.wait()

    # ---- control ----------------------------------------------------------------------------

    async def register(self, body: bytes, ctx: grpc.aio.ServicerContext) -> pb.RegisterReply:
        try:
            req = parse(body, pb.RegisterRequest)
            as_worker(self.guard, ctx, req.worker, "Register")
            check_layout(req.layout, self.max_model_bytes)
            self.core.check_register(req.worker, req.partition_size, req.local_steps, req.session, self.clock())
            first = self.layout is None
            framework = same_framework(req, self.framework)
            same_wire(req, self.store.wire)
            self.layout = self.admission.adopt(req, self.layout)
            actions = self.core.register(req.worker, req.partition_size, self.clock(), req.local_steps, req.session)
        except Rejected as r:
            await self._reject(ctx, "register", r)
        self.framework = framework
        self.devices.add(req.device or "cpu")
        self._execute(actions)
        order = work_orders.to_wire(self.core.issue(req.worker, self.clock()))
        return pb.RegisterReply(send_init=first, order=order, num_workers=self.core.members.num_workers)

    async def leave(self, body: bytes, ctx: grpc.aio.ServicerContext) -> pb.Status:
        """A worker ending before the run does (``Core.leave``)."""
        try:
            req = parse(body, pb.LeaveRequest)
            as_worker(self.guard, ctx, req.worker, "Leave")
            actions = self.core.leave(req.worker, self.clock(), req.session)
        except Rejected as r:
            await self._reject(ctx, "leave", r)
        self._execute(actions)
        return self._status()

    async def status(self, body: bytes, ctx: grpc.aio.ServicerContext) -> pb.Status:
        try:
            parse(body, pb.StatusRequest)
        except Rejected as r:
            await self._reject(ctx, "status", r)
        return self._status()

    def _status(self) -> pb.Status:
        core = self.core
        return pb.Status(version=core.version, protocol=core.spec.name, done=core.done, samples=core.samples,
                         test_accuracy=self.last_eval.test_accuracy if self.last_eval else -1.0,
                         final_eval_done=self.final_eval is not None, total_steps=core.train.steps or 0,
                         progress=core.progress(self.clock()), active_workers=len(core.members.active),
                         members=core.members.num_workers, paused=core.members.paused)

    async def eval_report(self, body: bytes, ctx: grpc.aio.ServicerContext) -> pb.Status:
        try:
            req = parse(body, pb.EvalReport)
            check_eval(req, self.core.version, self.core.done)
        except Rejected as r:
            await self._reject(ctx, "eval", r)
        self.rec.evaluation(req.version, req.test_loss, req.test_accuracy)
        self.last_eval = req
        if req.final:
            self.final_eval = req
            self.final_evaluated.set()
        return self._status()

    async def attach(self, body: bytes, ctx: grpc.aio.ServicerContext) -> pb.AttachReply:
        """Expect a worker's shared-memory segment for its pushes through the PS's socket, where its
        descriptor comes if the worker is on this host (``protos/segment``, ``adopt_segment``)."""
        try:
            req = parse(body, pb.AttachRequest)
            as_worker(self.guard, ctx, req.worker, "Attach")
            nbytes = wire_nbytes(layout_size(self.layout), self.store.wire) if self.layout is not None else 0
            return self.segments.attach(req, req.worker in self.core.members.registered, nbytes)
        except Rejected as r:
            await self._reject(ctx, "attach", r)

    def adopt_segment(self, fds: list[int], ctx: grpc.aio.ServicerContext) -> None:
        """Map the segment whose descriptor came with a connection's first frame on the PS's socket (``ctx``:
        its ``LocalContext``), for the worker whose ``Attach`` it answers, if the connection's token is that
        worker's; else ``Rejected``."""
        self.segments.adopt(fds, lambda worker: as_worker(self.guard, ctx, worker, "Attach"))

    # ---- tensors ----------------------------------------------------------------------------

    async def init(self, request_iterator: object, ctx: grpc.aio.ServicerContext) -> AsyncIterator[bytes]:
        """The first worker's initial values; frames are read with ``ctx.read`` (per-frame timeouts)."""
        try:
            worker, layout, values = await self._receive_init(ctx)
        except Rejected as r:
            refuse(ctx, self.count_rejection, "init", r)
            self.store.buffers.discard()  # what gRPC buffered for the refused call leaves no resident pages
            return
        self.traffic["in"] += values.nbytes
        self.store.initialize(layout, values)
        self.rec.event("model_initialized", worker=worker, parameters=int(values.size))
        self._execute(self.core.initialized_at(self.clock()))
        yield next(encode(pb.InitReply(order=work_orders.to_wire(self.core.work_order()))))

    async def _receive_init(self, ctx: grpc.aio.ServicerContext) -> tuple[int, pb.Layout, np.ndarray]:
        header, first = decode(await first_frame(ctx, self.receive_timeout_s), pb.InitHeader)
        as_worker(self.guard, ctx, header.worker, "Init")
        layout = self.layout
        if layout is None:
            raise precondition("not_registered", "register before Init")
        if self.store.initialized:
            raise precondition("already_initialized", "the model is already initialized")
        if header.layout_digest != layout.digest:
            raise precondition("layout", "the initial values' layout differs from the registered one")
        if header.nbytes != layout_size(layout) * 4:
            raise invalid("size", f"initial values declare {header.nbytes} bytes, the layout has "
                                  f"{layout_size(layout) * 4}")
        with self.store.slots.holding(header.worker):
            async with self.store.buffers.receiving(layout_size(layout)) as values:
                if not await fill(PayloadWriter(values, check_finite=True), first, ctx, self.receive_timeout_s):
                    raise invalid("non_finite", "initial values are not finite")
                await self.admission.accepted(header)
        self.admission.admitted(header, None)
        return header.worker, layout, values

    async def pull(self, request: bytes, ctx: grpc.aio.ServicerContext) -> AsyncIterator[bytes]:
        try:
            self.admission.check_ready()
            req, _ = decode(request, pb.PullRequest)
            as_worker(self.guard, ctx, req.worker, "Pull")
            if req.worker != -1 and req.worker not in self.core.members.registered:
                raise unknown_worker(req.worker)
        except Rejected as r:
            await self._reject(ctx, "pull", r)
        if req.wait_initialized:
            await self._until_started()
        if not self.store.initialized:
            await self._reject(ctx, "pull", precondition("not_initialized", "the model is not initialized yet"))
        snapshot = self.store.snapshot()
        reply = pb.PullReply(order=work_orders.to_wire(self.core.issue(req.worker, self.clock())))
        if req.master and self.store.wire != "float32" and req.have_version != snapshot.version:
            snapshot = self.store.master()
        async for frame in self._send(reply, snapshot if req.have_version != snapshot.version else None, req.worker):
            yield frame

    async def push(self, request_iterator: object, ctx: grpc.aio.ServicerContext) -> AsyncIterator[bytes]:
        """A push as a stream of frames (models larger than one frame), read with ``ctx.read``."""
        with PUSH_STREAMS.track_inprogress():
            async for frame in self._push(ctx):
                yield frame

    async def push_small(self, frame: bytes, ctx: grpc.aio.ServicerContext) -> bytes:
        """A push in one message, answered with one (a payload of at most ``codec.whole_limit``)."""
        return joined([f async for f in self._push(ctx, frame)])

    async def _push(self, ctx: grpc.aio.ServicerContext, whole: bytes | None = None) -> AsyncIterator[bytes]:
        """A push read from ``ctx`` (streamed), or ``whole`` in one frame (``PushSmall``)."""
        try:
            p, report, grad, segment = await self._receive_push(ctx, whole)
        except Rejected as r:
            refuse(ctx, self.count_rejection, "push", r)
            self.store.buffers.discard()  # what gRPC buffered for the refused call leaves no resident pages
            return
        except asyncio.CancelledError:  # the client cancelled mid-stream: nothing was applied
            self.count_rejection("push", Rejected("CANCELLED", "cancelled", "cancelled by the client"))
            raise
        if self.link is not None:
            await self.link.inbound.transfer(self.store.nbytes)
            p.arrived = self.clock()  # the PS has the gradient only once it has crossed the link
        retry = self.core.is_retry(p)
        if not retry:  # a retry's step is recorded once
            self.rec.step(p.worker, p.base_version, p.samples, report)
        released = self._held[p.id] = asyncio.get_running_loop().create_future()
        self._grads[p.id] = grad
        self._execute(self.core.push(p, report, p.arrived))
        if not retry:  # its staleness is the core's, set by ``push``
            self.tally.pushed(p.worker, p.samples, report.compute_s, p.staleness, p.arrived)
        release, snapshot = await released
        o = release.outcome
        self.tally.outcomes["applied" if o.applied else "dropped"] += 1
        reply = pb.PushReply(applied=o.applied, note=o.note, staleness=o.staleness, wait_s=o.wait_s,
                             order=work_orders.to_wire(release.order))
        async for frame in self._send(reply, snapshot, p.worker, segment, whole is not None):
            yield frame

    async def _receive_push(self, ctx: grpc.aio.ServicerContext, whole: bytes | None,
                            ) -> tuple[Push, StepReport, np.ndarray, Segment | None]:
        """Validate a push and read it to the end of its stream; the core sees it only if this returns (and
        the admission has admitted it: a refusal after its header is the admission's to hear of too)."""
        h, first = decode(whole if whole is not None else await first_frame(ctx, self.receive_timeout_s),
                          pb.PushHeader)
        try:
            report, grad, segment, squares = await self._read_push(ctx, h, first, whole is not None)
        except BaseException as e:
            self.admission.refused(h, str(e))
            raise
        self.traffic["in"] += h.nbytes
        if h.shared:
            self.traffic["in_shared"] += h.nbytes
        p = Push(next(self._ids), h.worker, h.base_version, h.samples, report.loss_sum, self.clock(),
                 step=report.step, session=h.session, squares=squares)
        self.admission.admitted(h, p.id)
        return p, report, grad, segment

    async def _read_push(self, ctx: grpc.aio.ServicerContext, h: pb.PushHeader, first: memoryview, whole: bool,
                         ) -> tuple[StepReport, np.ndarray, Segment | None, float]:
        """The checks on ``h``, then its payload: the step report, the gradient, the segment it came
        through (if shared) and its squared norm (this PS's part's)."""
        as_worker(self.guard, ctx, h.worker, "Push")
        self.store.check(h.layout_digest, h.nbytes)
        report = _report(h.stats)
        self.core.check_push(h.worker, h.samples, h.base_version, report, self.clock(), h.session)
        segment = None
        if h.shared:  # copied out of the segment by ``fill``, then checked: the worker cannot race it
            segment, first = self.segments.payload(h.worker, first)
        with self.store.slots.holding(h.worker):  # one worker's stalled pushes hold no other worker's slots
            async with self.store.buffers.receiving() as grad:
                payload = PayloadWriter(grad, check_finite=True, wire=self.store.wire)
                if not await fill(payload, first, ctx, None if whole else self.receive_timeout_s):
                    raise invalid("non_finite", "gradient has NaN or inf values")
                check_grad_norm(payload.squares, h.samples, self.max_grad_norm)  # before any wait
                others = await self.admission.accepted(h)  # the whole push's bound: every part's squares
                check_grad_norm(payload.squares + others, h.samples, self.max_grad_norm)
        return report, grad, segment, payload.squares

    async def _send(self, reply: pb.PushReply | pb.PullReply, snapshot: Snapshot | None, worker: int,
                    segment: Segment | None = None, whole: bool = False) -> AsyncIterator[bytes]:
        """Reply frames: the header, then the values (a stop's too: the run's final values, which a user's own
        loop ends with; into a shared push's ``segment``; ``whole``: a ``PushSmall``'s reply, one message
        anyway, made in one copy from a deferred snapshot)."""
        if reply.order.stop and worker >= 0:
            self.told_stop.add(worker)
            if self.told_stop >= set(self.core.members.registered):
                self.all_told_stop.set()
        if snapshot is None:
            yield next(encode(reply))
            return
        if self.link is not None and worker >= 0:
            await self.link.outbound.transfer(snapshot.nbytes)
        reply.order.version, reply.nbytes = snapshot.version, snapshot.nbytes
        self.traffic["out"] += snapshot.nbytes
        if segment is not None and isinstance(reply, pb.PushReply):
            self.traffic["out_shared"] += snapshot.nbytes
            await write_values(segment, snapshot)
            reply.shared = True
            yield next(encode(reply))
            return
        if whole and (frame := snapshot.deferred(partial(_whole_frame, reply, self.store.wire))) is not None:
            yield frame
            return
        async for frame in aencode(reply, snapshot.achunks(), snapshot.nbytes):
            yield frame

    # ---- frames and rejections ----------------------------------------------------------------

    async def _reject(self, ctx: grpc.aio.ServicerContext, rpc: str, r: Rejected) -> NoReturn:
        """Count ``r`` and end the call by raising (``ctx.abort``), from a handler that read no payload
        frames; after payload frames, ``rejections.refuse``."""
        self.count_rejection(rpc, r)
        await ctx.abort(getattr(grpc.StatusCode, r.code), str(r))
        raise AssertionError("abort returned")  # pragma: no cover - grpc's abort always raises

    def methods(self) -> dict[str, grpc.RpcMethodHandler]:
        raw: dict = dict(request_deserializer=None, response_serializer=None)
        return {
            # control requests are parsed by their handlers (``requests.parse``), so garbage is refused, counted
            "Register": grpc.unary_unary_rpc_method_handler(
                self.register, None, pb.RegisterReply.SerializeToString),
            "Status": grpc.unary_unary_rpc_method_handler(self.status, None, pb.Status.SerializeToString),
            "Leave": grpc.unary_unary_rpc_method_handler(self.leave, None, pb.Status.SerializeToString),
            "Eval": grpc.unary_unary_rpc_method_handler(self.eval_report, None, pb.Status.SerializeToString),
            "Init": grpc.stream_stream_rpc_method_handler(self.init, **raw),
            "Push": grpc.stream_stream_rpc_method_handler(self.push, **raw),
            "PushSmall": grpc.unary_unary_rpc_method_handler(self.push_small, **raw),
            "Attach": grpc.unary_unary_rpc_method_handler(self.attach, None, pb.AttachReply.SerializeToString),
            "Pull": grpc.unary_stream_rpc_method_handler(self.pull, **raw),
            **self.admission.methods(self),
        }


def _whole_frame(reply: pb.PushReply, wire: str, values: np.ndarray) -> bytes:
    """A ``PushSmall``'s reply from a deferred snapshot's float32 values, narrowed to the wire's type."""
    return whole_frame(reply, narrowed(values, wire))


def _report(s: pb.StepStats) -> StepReport:
    return StepReport(s.compute_s, s.sleep_s, s.send_s, s.wait_s, s.step, s.loss_sum, s.delay_sleep_s,
                      s.delay_factor, s.delay_comm_s, s.batch_exhausted, s.local_steps, s.overlapped,
                      tuple(s.local_loss_sums))
