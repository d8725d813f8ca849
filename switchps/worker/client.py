"""Client side of the PS protocol: register, init, pull, push, status, eval; and riding out an outage.

``Reconnect`` retries a call while the PS is unreachable (UNAVAILABLE: killed, restarting, the network
down), with exponential backoff, for ``cluster.reconnect_s``; after an outage it runs the caller's
``rejoin`` (a worker registers again) before the retry. If the PS does not come back it raises
``PSUnreachable``, which the roles report in one line. A worker the PS no longer counts (it left an elastic
run after ``cluster.leave_after_s`` of silence, e.g. a long pause) registers again and retries, once. A
worker whose index another live process holds (``refusals.index_in_use``: this one restarted while the old
one's lease runs) retries as through an outage, until that lease lapses or ``cluster.reconnect_s`` ends.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from typing import TypeVar

import grpc
import numpy as np

from switchps.security.auth import METADATA_KEY
from switchps.security.channels import ClientSecurity
from switchps.errors import PSUnreachable
from switchps.refusals import INDEX_IN_USE, UNKNOWN_WORKER
from switchps.protos import switchps_pb2 as pb
from switchps.protos.codec import (
    COPIES, DEFAULT_CHUNK_BYTES, decode_header, encode, encode_array, grpc_options, receive_into, whole_frame,
    whole_limit,
)
from switchps.protos import wire_dtype
from switchps.protos.heap import tune_allocator
from switchps.protos.wire_dtype import wire_nbytes
from switchps.protos.segment import NOT_ATTACHED, Segment, available, file_bytes
from switchps.worker.local_line import LineBroken, LocalLine, LocalRpcError

SERVICE = "/switchps.ParameterServer/"
T = TypeVar("T")
log = logging.getLogger("switchps.client")


@dataclass
class Reconnect:
    """Retry calls through outages of the PS; see the module docstring."""

    address: str
    reconnect_s: float = 60.0
    rejoin: Callable[[], None] | None = None
    outages: int = 0

    def __call__(self, call: Callable[[], T]) -> T:
        down_since: float | None = None
        delay = 0.05
        left = False
        while True:
            try:
                if (down_since is not None or left) and self.rejoin is not None:
                    self.rejoin()
                result = call()
                if down_since is not None:
                    log.info("the PS at %s is back after %.1fs", self.address, time.monotonic() - down_since)
                return result
            except grpc.RpcError as e:
                if not left and self.rejoin is not None and _left(e):
                    log.warning("the PS at %s no longer counts this worker (%s): registering again",
                                self.address, e.details())
                    left = True
                    continue
                in_use = _in_use(e)
                if e.code() != grpc.StatusCode.UNAVAILABLE and not in_use:
                    raise
                if down_since is None:
                    down_since = time.monotonic()
                    self.outages += not in_use
                    log.warning("the PS at %s %s; retrying for up to %.0fs", self.address,
                                f"refused: {e.details()}" if in_use else f"is unreachable ({e.details()})",
                                self.reconnect_s)
                if time.monotonic() - down_since > self.reconnect_s:
                    what = f"still refused: {e.details()}" if in_use else "did not come back"
                    raise PSUnreachable(f"the PS at {self.address} {what} within {self.reconnect_s:.0f}s "
                                        "(cluster.reconnect_s)") from None
                time.sleep(delay)
                delay = min(2 * delay, 1.0)


def _in_use(e: grpc.RpcError) -> bool:
    """Whether ``e`` refuses a registration at an index another live process holds (``refusals.index_in_use``)."""
    return e.code() == grpc.StatusCode.ALREADY_EXISTS and (e.details() or "").startswith(INDEX_IN_USE)


def _left(e: grpc.RpcError) -> bool:
    """Whether ``e`` refuses a worker the PS does not count (``refusals.unknown_worker``)."""
    return e.code() == grpc.StatusCode.INVALID_ARGUMENT and (e.details() or "").startswith(UNKNOWN_WORKER)


@dataclass
class Reply:
    """A push or pull reply; when ``fresh``, the new values are in ``values``: the caller's buffer, or (a
    push through shared memory) the segment's values area, which only this client's next push rewrites."""

    reply: pb.PushReply | pb.PullReply
    fresh: bool
    values: np.ndarray

    @property
    def order(self) -> pb.WorkOrder:
        return self.reply.order


class PSClient:
    """One channel to the PS, with this client's credentials on every call. ``params`` is the caller's
    flat float32 buffer that pulls fill. ``wire``: the type pushes and replies carry (``runtime.wire_dtype``):
    a float32 payload is narrowed here, a reply's values widened into ``params``."""

    def __init__(self, address: str, chunk_bytes: int = DEFAULT_CHUNK_BYTES, timeout_s: float | None = None,
                 security: ClientSecurity = ClientSecurity(), wire: str = "float32") -> None:
        tune_allocator()
        self.address, self.wire = address, wire
        self._narrow: np.ndarray | None = None  # a narrow wire's payload, reused push after push
        self.chunk_bytes = chunk_bytes
        self.timeout_s = timeout_s
        self._md = security.metadata
        self.channel = security.channel(address, grpc_options())
        raw = dict(request_serializer=None, response_deserializer=None)
        self._register = self.channel.unary_unary(
            SERVICE + "Register", pb.RegisterRequest.SerializeToString, pb.RegisterReply.FromString)
        self._status = self.channel.unary_unary(
            SERVICE + "Status", pb.StatusRequest.SerializeToString, pb.Status.FromString)
        self._eval = self.channel.unary_unary(SERVICE + "Eval", pb.EvalReport.SerializeToString, pb.Status.FromString)
        self._leave = self.channel.unary_unary(SERVICE + "Leave", pb.LeaveRequest.SerializeToString,
                                               pb.Status.FromString)
        self._init = self.channel.stream_stream(SERVICE + "Init", **raw)
        self._push = self.channel.stream_stream(SERVICE + "Push", **raw)
        self._push_small = self.channel.unary_unary(SERVICE + "PushSmall", **raw)
        self._attach = self.channel.unary_unary(
            SERVICE + "Attach", pb.AttachRequest.SerializeToString, pb.AttachReply.FromString)
        self.segment: Segment | None = None
        """Where pushes go once ``attach`` succeeded (the PS is on this host)."""
        self._line: LocalLine | None = None  # the PS's Unix socket, for the headers of those pushes
        self._pull = self.channel.unary_stream(SERVICE + "Pull", **raw)
        self._parts = {rpc: self.channel.stream_stream(SERVICE + rpc, **raw) for rpc in ("PushPart", "InitPart")}
        self._pull_part = self.channel.unary_stream(SERVICE + "PullPart", **raw)

    def wait_ready(self, timeout_s: float) -> None:
        """Return once the channel has connected (at once, or when gRPC's reconnect backoff after an outage
        ends); UNAVAILABLE if it has not within ``timeout_s``."""
        try:
            grpc.channel_ready_future(self.channel).result(timeout=timeout_s)
        except grpc.FutureTimeoutError:
            raise LocalRpcError(grpc.StatusCode.UNAVAILABLE, f"{self.address}: not connected within {timeout_s:g}s"
                                ) from None

    def close(self) -> None:
        self._open_line()
        self.channel.close()

    def register(self, worker: int, layout: pb.Layout, partition_size: int, wait: bool = True,
                 shard_partition: str = "", framework: str = "", device: str = "",
                 local_steps: bool = False, session: int = 0) -> pb.RegisterReply:
        """Register (again, after an outage: ``wait=False`` fails at once if the PS is still down), saying
        which framework computes, on which device (the PS refuses a second framework), whether the
        caller's loop can take local steps (the PS refuses one that cannot while they are in force), and
        which process this is (``session``: the PS refuses a second live one at the same index)."""
        return self._register(pb.RegisterRequest(worker=worker, layout=layout, partition_size=partition_size,
                                                 shard_partition=shard_partition, framework=framework,
                                                 device=device, local_steps=local_steps, session=session),
                              timeout=self.timeout_s, wait_for_ready=wait,
                              metadata=self._md)

    def status(self) -> pb.Status:
        return self._status(pb.StatusRequest(), timeout=self.timeout_s, metadata=self._md)

    def leave(self, worker: int, session: int = 0) -> pb.Status:
        """Say worker ``worker`` (process ``session``, as it registered) is ending (``LeaveRequest``)."""
        return self._leave(pb.LeaveRequest(worker=worker, session=session), timeout=self.timeout_s,
                           metadata=self._md)

    def report_eval(self, version: int, test_loss: float, test_accuracy: float, final: bool = False) -> pb.Status:
        return self._eval(pb.EvalReport(version=version, test_loss=test_loss, test_accuracy=test_accuracy,
                                        final=final), timeout=self.timeout_s, metadata=self._md)

    def attach(self, worker: int, nbytes: int) -> bool:
        """Push through a new shared-memory segment from now on if the PS runs on this host
        (``protos/segment``): ``Attach`` sends its nonce, the PS's socket its descriptor; returns whether
        it does. A PS without ``Attach``, or whose socket this host cannot reach, counts as another host's."""
        self.segment = None
        self._open_line()
        if not available():
            return False
        try:
            segment = Segment.create(nbytes, self.wire)
        except OSError as e:
            log.warning("no shared-memory segment of %d bytes (%s): pushing as gRPC bytes", file_bytes(nbytes), e)
            return False
        try:
            request = pb.AttachRequest(worker=worker, nonce=segment.nonce, nbytes=nbytes)
            reply = self._attach(request, timeout=self.timeout_s, metadata=self._md)
            self._open_line(reply.socket if reply.attached else "", segment)
        except grpc.RpcError as e:
            if e.code() != grpc.StatusCode.UNIMPLEMENTED:
                raise
        finally:
            segment.close_fd()  # the PS holds its own (or none)
        self.segment = segment if self._line is not None else None
        return self.segment is not None

    @property
    def socket_path(self) -> str:
        """The PS's socket this client's shared pushes go through ('' if none: gRPC calls)."""
        return self._line.path if self._line is not None else ""

    def _open_line(self, path: str = "", segment: Segment | None = None) -> None:
        """Send ``segment``'s descriptor, then the headers of shared pushes, through the PS's socket at
        ``path`` ('': close the line; the headers of shared pushes, if any, go through gRPC calls)."""
        if self._line is not None:
            self._line.close()
        self._line = None
        if path and segment is not None:
            try:
                self._line = LocalLine(path, dict(self._md or ()).get(METADATA_KEY, ""), segment.fd, self.timeout_s)
            except OSError as e:
                log.info("the PS's socket %s is out of reach (%s): pushing as gRPC bytes", path, e)

    def init(self, worker: int, layout: pb.Layout, values: np.ndarray) -> pb.WorkOrder:
        header = pb.InitHeader(worker=worker, layout_digest=layout.digest, nbytes=values.nbytes)
        frames = self._init(encode_array(header, values, self.chunk_bytes), timeout=self.timeout_s,
                            metadata=self._md)
        reply, _ = decode_header(next(frames), pb.InitReply)
        return reply.order

    def pull(self, params: np.ndarray, worker: int = -1, have_version: int = -1,
             wait_initialized: bool = False, master: bool = False) -> Reply:
        """The model's values into ``params``; ``master``: the PS's float32 values, not the wire type's (a
        client of wire float32 asks this of a PS whose wire is narrower: the evaluator)."""
        request = next(encode(pb.PullRequest(worker=worker, have_version=have_version,
                                             wait_initialized=wait_initialized, master=master)))
        return self._read_reply(self._pull(request, timeout=self.timeout_s, metadata=self._md), params,
                                pb.PullReply)

    def push(self, header: pb.PushHeader, grad_sum: np.ndarray, params: np.ndarray) -> Reply:
        """Push a summed gradient; the reply's values are in its ``values`` (``params``, or the attached
        segment). Through a segment only the header is sent; otherwise a gradient of at most
        ``codec.whole_limit`` goes as one message each way (``PushSmall``), a larger one as a stream of chunks."""
        header.nbytes, header.shared = wire_nbytes(grad_sum.size, self.wire), True
        shared = self.through_segment(header.worker, header.nbytes,
                                      lambda: self._push_shared(header, grad_sum, params))
        if shared is not None:
            return shared
        header.shared = False
        payload = self._on_wire(grad_sum)
        if payload.nbytes <= whole_limit(self.chunk_bytes):
            reply = self._push_small(whole_frame(header, payload), timeout=self.timeout_s, metadata=self._md)
            return self._read_reply(iter([reply]), params, pb.PushReply)
        frames = encode_array(header, payload, self.chunk_bytes)
        return self._read_reply(self._push(frames, timeout=self.timeout_s, metadata=self._md), params, pb.PushReply)

    def _on_wire(self, grad_sum: np.ndarray) -> np.ndarray:
        """A payload in the wire's type: as it is if it is (written in ``payload_area``), else narrowed into
        a buffer kept for the next push (and offered as the next payload's area)."""
        if grad_sum.dtype == wire_dtype.STORAGE[self.wire]:
            return grad_sum
        if self._narrow is None or self._narrow.size != grad_sum.size:
            self._narrow = wire_dtype.empty(grad_sum.size, self.wire)
        wire_dtype.narrow(grad_sum, self._narrow)
        return self._narrow

    @property
    def payload_area(self) -> np.ndarray | None:
        """Where a payload of the model's size is sent from without a copy, if anywhere: the attached
        segment's gradient area, or on a narrow wire the buffer the last push was narrowed into. A computer
        writes its payload there (``GradientComputer.payload_to``), narrowed if the area is of a narrow
        wire's type (``protos/wire_dtype``)."""
        return self.segment.grad if self.segment is not None else self._narrow

    def through_segment(self, worker: int, nbytes: int, send: Callable[[], T]) -> T | None:
        """``send()``'s result if a payload of ``nbytes`` goes through the attached segment; after a restart
        of the PS (it has no segment of ours: ``NOT_ATTACHED``), attach a new one and send again; None if
        the payload goes as gRPC bytes (no segment, or none any more)."""
        if self.segment is None or self.segment.nbytes != nbytes:
            return None
        try:
            return send()
        except grpc.RpcError as e:  # the PS restarted between two pushes: it has no segment of ours
            if e.code() != grpc.StatusCode.FAILED_PRECONDITION or NOT_ATTACHED not in (e.details() or ""):
                raise
            return send() if self.attach(worker, nbytes) else None

    def _push_shared(self, header: pb.PushHeader, grad_sum: np.ndarray, params: np.ndarray) -> Reply:
        """A push whose payload and reply values go through ``self.segment``; only the header is sent."""
        segment = self._into_segment(grad_sum)
        frame = self._send_shared(next(encode(header)))
        return self._read_reply(iter([frame]), params, pb.PushReply, segment)

    def _part_shared(self, header: pb.PartHeader, part: np.ndarray, out: np.ndarray,
                     ) -> tuple[pb.PartReply, np.ndarray]:
        """A follower shard's part of a push through ``self.segment``; only the header is sent. The reply,
        and where the reply's part is (``_shared_values``)."""
        header.nbytes = wire_nbytes(part.size, self.wire)
        segment = self._into_segment(part)
        reply, _ = decode_header(self._send_shared(next(encode(header))), pb.PartReply)
        return reply, self._shared_values(segment, reply.nbytes > 0, out)

    def _into_segment(self, payload: np.ndarray) -> Segment:
        """``self.segment``, ``payload`` in its gradient area (narrowed to the wire's type)."""
        assert self.segment is not None
        if payload.ctypes.data != self.segment.grad.ctypes.data:  # not written there already
            wire_dtype.narrow(payload, self.segment.grad)
            COPIES.add(self.segment.grad.nbytes)
        return self.segment

    def _shared_values(self, segment: Segment, fresh: bool, out: np.ndarray) -> np.ndarray:
        """Where the values of a reply through ``segment`` are: its values area on a float32 wire, else
        widened from there into ``out``."""
        if self.wire == "float32":
            return segment.values
        if fresh:
            wire_dtype.widen(segment.values, out)
            COPIES.add(segment.values.nbytes)
        return out

    def _send_shared(self, request: bytes) -> bytes:
        """A shared push's request, through the PS's socket if there is one, else a ``PushSmall`` call; its
        reply. If the socket broke, the push goes through gRPC: a PS that had it recognises it. A refusal
        the PS answered through the socket (UNAVAILABLE included: a PS shard's part missing) is raised."""
        if self._line is not None:
            try:
                return self._line.push(request)
            except LineBroken:
                self._open_line()
        return self._push_small(request, timeout=self.timeout_s, metadata=self._md)

    def part(self, rpc: str, header: pb.PartHeader, part: np.ndarray, out: np.ndarray,
             ) -> tuple[pb.PartReply, np.ndarray]:
        """A follower shard's part of a push (``PushPart``: through the attached segment if there is one)
        or of the initial values (``InitPart``, float32 whatever the wire); the reply, and where the
        reply's part of the parameters is: ``out``, or the segment's values area."""
        if rpc == "PushPart" and (shared := self.through_segment(
                header.key.worker, wire_nbytes(part.size, self.wire),
                lambda: self._part_shared(header, part, out))) is not None:
            return shared
        payload = part if rpc == "InitPart" else self._on_wire(part)
        header.nbytes = payload.nbytes
        frames = self._parts[rpc](encode_array(header, payload, self.chunk_bytes), timeout=self.timeout_s,
                                  metadata=self._md)
        return self._read_part(frames, out), out

    def pull_part(self, out: np.ndarray, worker: int, min_version: int, master: bool = False) -> pb.PartReply:
        """A follower shard's part of the parameters, at ``min_version`` (shard 0's) or newer (``master``: its
        float32 values, as ``pull``'s)."""
        request = next(encode(pb.PartPull(worker=worker, min_version=min_version, master=master)))
        return self._read_part(self._pull_part(request, timeout=self.timeout_s, metadata=self._md), out)

    def _read_part(self, frames: Iterator[bytes], out: np.ndarray) -> pb.PartReply:
        reply, first = decode_header(next(frames), pb.PartReply)
        if reply.nbytes:
            master = reply.nbytes == out.nbytes  # a part of float32 values (``pull_part``'s master), not the wire's
            receive_into(first, frames, out, wire="float32" if master else self.wire)
        return reply

    def _read_reply(self, frames: Iterator[bytes], params: np.ndarray,
                    kind: type[pb.PushReply] | type[pb.PullReply], segment: Segment | None = None) -> Reply:
        """The reply's header, and its values read into ``params`` (left in ``segment`` if the PS put them there
        in float32; widened into ``params`` from a narrow wire's)."""
        reply, first = decode_header(next(frames), kind)
        if segment is not None and isinstance(reply, pb.PushReply) and reply.shared:
            return Reply(reply, fresh=reply.nbytes > 0, values=self._shared_values(segment, reply.nbytes > 0, params))
        if reply.nbytes:
            receive_into(first, frames, params, wire=self.wire)
        return Reply(reply, fresh=reply.nbytes > 0, values=params)


def wait_for_ps(address: str, timeout_s: float, security: ClientSecurity = ClientSecurity()) -> None:
    """Block until the PS answers its health check (over TLS, if the PS speaks it)."""
    from grpc_health.v1 import health_pb2, health_pb2_grpc

    end = time.monotonic() + timeout_s
    with security.channel(address) as ch:
        stub = health_pb2_grpc.HealthStub(ch)
        while True:
            try:
                if stub.Check(health_pb2.HealthCheckRequest(), timeout=1.0).status == 1:
                    return
            except grpc.RpcError:
                pass
            if time.monotonic() > end:
                raise TimeoutError(f"no parameter server answered at {address} within {timeout_s:.0f}s")
            time.sleep(0.2)
