"""The gRPC face of the parameter server.

Tensor RPCs (Push, Pull, Init) use raw frames (see ``switchps.protos.codec``)
through generic handlers, so payload bytes never pass through protobuf.
Control RPCs (Register, Status, Eval) are plain protobuf. Every push is
validated completely before it can touch the model; a rejected push gets
INVALID_ARGUMENT or FAILED_PRECONDITION and is counted in the run record.
"""

from __future__ import annotations

import time
from concurrent import futures
from typing import Iterator

import grpc
import numpy as np
from grpc_health.v1 import health, health_pb2, health_pb2_grpc
from prometheus_client import Counter, Gauge

from switchps.protos import switchps_pb2 as pb
from switchps.protos.codec import FrameError, decode_header, encode, grpc_options, receive_into, tune_allocator
from switchps.ps_server.link import DuplexLink
from switchps.ps_server.model import Snapshot, layout_size
from switchps.ps_server.sync import Push, SyncEngine

SERVICE = "switchps.ParameterServer"
PUSHES = Counter("switchps_pushes", "Pushes by outcome", ["outcome"])
VERSION = Gauge("switchps_model_version", "Current model version")


class Rejected(Exception):
    """A push or init that must not touch the model."""

    def __init__(self, code: grpc.StatusCode, reason: str, message: str) -> None:
        super().__init__(message)
        self.code, self.reason = code, reason


class ParameterServer:
    """Implements the RPCs on top of a ``SyncEngine``."""

    def __init__(self, engine: SyncEngine, num_workers: int, link: DuplexLink | None = None) -> None:
        self.engine = engine
        self.link = link  # the emulated PS link (network.ps_link_mbit_s), if any
        self.store = engine.store
        self.rec = engine.rec
        self.num_workers = num_workers
        self.told_stop: set[int] = set()
        self.last_eval: pb.EvalReport | None = None
        self.final_eval_done = False
        self._layout: pb.Layout | None = None  # set by the first Register, before Init

    # ---- control ----------------------------------------------------------------------------

    def register(self, req: pb.RegisterRequest, ctx: grpc.ServicerContext) -> pb.RegisterReply:
        if not 0 <= req.worker < self.num_workers:
            ctx.abort(grpc.StatusCode.INVALID_ARGUMENT,
                      f"worker index {req.worker} outside [0, {self.num_workers})")
        with self.store.lock:
            first = self._layout is None
            if first:
                self._layout = req.layout
        if req.layout.digest != self._layout.digest:
            ctx.abort(grpc.StatusCode.FAILED_PRECONDITION,
                      f"worker {req.worker}: model layout {req.layout.digest[:8]} differs from the PS's "
                      f"{self._layout.digest[:8]} (same model config on every worker?)")
        self.engine.register(req.worker, req.shard_size)
        return pb.RegisterReply(send_init=first, order=self.engine.work_order(), num_workers=self.num_workers)

    def status(self, req: pb.StatusRequest | None = None, ctx=None) -> pb.Status:
        e = self.engine
        return pb.Status(
            version=self.store.version, protocol=e.protocol.name,
            test_accuracy=self.last_eval.test_accuracy if self.last_eval else -1.0,
            done=e.done, final_eval_done=self.final_eval_done, samples=e.samples_applied,
            total_steps=e.train.steps or 0, progress=e.progress(), active_workers=len(e.active),
        )

    def eval_report(self, req: pb.EvalReport, ctx) -> pb.Status:
        self.rec.evaluation(req.version, req.test_loss, req.test_accuracy)
        self.last_eval = req
        if req.final:
            self.final_eval_done = True
            self.engine.notify()
        return self.status()

    # ---- tensors ----------------------------------------------------------------------------

    def init(self, frames: Iterator[bytes], ctx: grpc.ServicerContext) -> Iterator[bytes]:
        try:
            header, first = decode_header(next(frames), pb.InitHeader)
            layout = self._layout
            if layout is None:
                raise Rejected(grpc.StatusCode.FAILED_PRECONDITION, "not_registered", "register before Init")
            if self.store.initialized:
                raise Rejected(grpc.StatusCode.FAILED_PRECONDITION, "already_initialized",
                               "the model is already initialized")
            if header.layout_digest != layout.digest:
                raise Rejected(grpc.StatusCode.FAILED_PRECONDITION, "layout", "init layout differs")
            values = np.empty(layout_size(layout), np.float32)
            if not receive_into(first, frames, values, check_finite=True):
                raise Rejected(grpc.StatusCode.INVALID_ARGUMENT, "non_finite", "initial values are not finite")
        except FrameError as e:
            self._reject(ctx, Rejected(grpc.StatusCode.INVALID_ARGUMENT, "malformed", str(e)), kind="init")
        except Rejected as r:
            self._reject(ctx, r, kind="init")
        self.store.initialize(layout, values)
        self.rec.event("model_initialized", worker=header.worker, parameters=int(values.size))
        self.engine.notify()
        yield from encode(pb.PushReply(order=self.engine.work_order()))

    def pull(self, frames: bytes, ctx: grpc.ServicerContext) -> Iterator[bytes]:
        try:
            req, _ = decode_header(frames, pb.PullRequest)
        except FrameError as e:
            ctx.abort(grpc.StatusCode.INVALID_ARGUMENT, str(e))
        if req.wait_initialized:
            while not self.engine.wait_started(timeout=1.0):
                if not ctx.is_active():
                    return
        if not self.store.initialized:
            ctx.abort(grpc.StatusCode.FAILED_PRECONDITION, "the model is not initialized yet")
        snapshot = self.store.snapshot()
        send = req.have_version != snapshot.version
        yield from self._reply(pb.PushReply(applied=False), snapshot if send else None, req.worker)

    def push(self, frames: Iterator[bytes], ctx: grpc.ServicerContext) -> Iterator[bytes]:
        try:
            p, stats = self._receive_push(frames)
        except FrameError as e:
            self._reject(ctx, Rejected(grpc.StatusCode.INVALID_ARGUMENT, "malformed", str(e)))
        except Rejected as r:
            self._reject(ctx, r)
        if self.link is not None:
            self.link.inbound.transfer(self.store.nbytes)
            p.arrived = time.monotonic()  # the PS has the gradient only once it has crossed the link
        self._record_step(p, stats)
        outcome = self.engine.push(p)
        PUSHES.labels("applied" if outcome.applied else "dropped").inc()
        VERSION.set(self.store.version)
        reply = pb.PushReply(applied=outcome.applied, note=outcome.note, staleness=outcome.staleness,
                             wait_s=outcome.wait_s)
        yield from self._reply(reply, outcome.snapshot, p.worker)

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

    def push_small(self, frame: bytes, ctx: grpc.ServicerContext) -> bytes:
        """A push whose payload and reply each fit in one frame (models up to INLINE_BYTES)."""
        (reply,) = self.push(iter([frame]), ctx)
        return reply

    def _reply(self, reply: pb.PushReply, snapshot: Snapshot | None, worker: int) -> Iterator[bytes]:
        """Reply frames: the header with the next work order, then the parameters (unless stopping)."""
        reply.order.CopyFrom(self.engine.work_order(worker))
        if reply.order.stop:
            self.told_stop.add(worker)
            snapshot = None
        if snapshot is None:
            return encode(reply)
        if self.link is not None and worker >= 0:
            self.link.outbound.transfer(snapshot.nbytes)
        reply.order.version, reply.nbytes = snapshot.version, snapshot.nbytes
        return encode(reply, snapshot.chunks(), snapshot.nbytes)

    def _receive_push(self, frames: Iterator[bytes]) -> tuple[Push, pb.StepStats]:
        """Validate a push completely; the model is untouched unless this returns."""
        h, first = decode_header(next(frames), pb.PushHeader)
        store = self.store
        if h.worker not in self.engine.registered:
            raise Rejected(grpc.StatusCode.INVALID_ARGUMENT, "unknown_worker", f"unknown worker id {h.worker}")
        if not store.initialized:
            raise Rejected(grpc.StatusCode.FAILED_PRECONDITION, "not_initialized", "the model is not initialized")
        if h.layout_digest != store.layout.digest:
            raise Rejected(grpc.StatusCode.FAILED_PRECONDITION, "layout",
                           f"unknown variable layout {h.layout_digest[:8]!r}")
        if h.nbytes != store.nbytes:
            raise Rejected(grpc.StatusCode.INVALID_ARGUMENT, "size",
                           f"payload declares {h.nbytes} bytes, the model has {store.nbytes}")
        if h.samples <= 0:
            raise Rejected(grpc.StatusCode.INVALID_ARGUMENT, "samples", f"sample count {h.samples} must be positive")
        if not 0 <= h.base_version <= store.version:
            raise Rejected(grpc.StatusCode.INVALID_ARGUMENT, "version",
                           f"base version {h.base_version} is not in [0, {store.version}]")
        grad = store.buffers.get()
        try:
            finite = receive_into(first, frames, grad, check_finite=True)
        except FrameError as e:
            store.buffers.put(grad)
            raise Rejected(grpc.StatusCode.INVALID_ARGUMENT, "size", str(e)) from None
        if not finite:
            store.buffers.put(grad)
            raise Rejected(grpc.StatusCode.INVALID_ARGUMENT, "non_finite", "gradient has NaN or inf values")
        return Push(h.worker, h.base_version, h.samples, grad, h.stats.loss_sum), h.stats

    def _reject(self, ctx: grpc.ServicerContext, r: Rejected, kind: str = "push") -> None:
        self.rec.count("rejected", r.reason)
        self.rec.event(f"{kind}_rejected", reason=r.reason, message=str(r), version=self.store.version)
        PUSHES.labels("rejected").inc()
        ctx.abort(r.code, str(r))

    # ---- wiring -----------------------------------------------------------------------------

    def handler(self) -> grpc.GenericRpcHandler:
        raw = dict(request_deserializer=None, response_serializer=None)
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


def start_server(ps: ParameterServer, address: str, max_workers: int) -> tuple[grpc.Server, int, health.HealthServicer]:
    """Start serving on ``address``; returns the server, the bound port and the health servicer."""
    tune_allocator()
    server = grpc.server(futures.ThreadPoolExecutor(max_workers=max_workers), options=grpc_options())
    server.add_generic_rpc_handlers([ps.handler()])
    health_servicer = health.HealthServicer()
    health_pb2_grpc.add_HealthServicer_to_server(health_servicer, server)
    port = server.add_insecure_port(address)
    if port == 0:
        raise OSError(f"cannot bind the PS to {address}")
    server.start()
    health_servicer.set(SERVICE, health_pb2.HealthCheckResponse.SERVING)
    health_servicer.set("", health_pb2.HealthCheckResponse.SERVING)
    return server, port, health_servicer


def wait_until(cond, timeout: float, poll: float = 0.05) -> bool:
    end = time.monotonic() + timeout
    while not cond():
        if time.monotonic() >= end:
            return False
        time.sleep(poll)
    return True
