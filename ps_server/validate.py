"""Hostile input: every request is checked here before it can touch the model.

Anyone who can reach the PS port may send anything a client written from
``protos/switchps.proto`` can: truncated frames, wrong sizes, NaN and inf,
absurd counts, unknown ids. Each check raises ``Rejected`` with the gRPC
status and the reason under which the run record counts it. Messages name
what is wrong without echoing the PS's own state (never its layout digest).
"""

from __future__ import annotations

import math
from typing import TypeVar

import grpc

from switchps.protos import switchps_pb2 as pb
from switchps.protos.codec import FrameError, decode_header
from switchps.ps_server.model import layout_digest

MAX_SHARD_SIZE = 2**40
H = TypeVar("H", pb.InitHeader, pb.PushHeader, pb.PullRequest)


class Rejected(Exception):
    """A request that must not touch the model: its status code and the reason it is counted under."""

    def __init__(self, code: grpc.StatusCode, reason: str, message: str) -> None:
        super().__init__(message)
        self.code, self.reason = code, reason


def invalid(reason: str, message: str) -> Rejected:
    return Rejected(grpc.StatusCode.INVALID_ARGUMENT, reason, message)


def precondition(reason: str, message: str) -> Rejected:
    return Rejected(grpc.StatusCode.FAILED_PRECONDITION, reason, message)


def decode(frame0: bytes, header_type: type[H]) -> tuple[H, memoryview]:
    """Frame 0's header and inline payload; a malformed frame is rejected."""
    try:
        return decode_header(frame0, header_type)
    except FrameError as e:
        raise invalid("malformed", str(e)) from None


def check_register(req: pb.RegisterRequest, num_workers: int, max_model_bytes: int) -> None:
    """A worker index in range, a real shard, and a layout that is well formed, of bounded size and honest."""
    if not 0 <= req.worker < num_workers:
        raise invalid("worker", f"worker index {req.worker} outside [0, {num_workers})")
    if not 0 < req.shard_size <= MAX_SHARD_SIZE:
        raise invalid("shard_size", f"shard size {req.shard_size} must be in [1, {MAX_SHARD_SIZE}]")
    layout = req.layout
    shapes = [list(v.shape) for v in (*layout.variables, *layout.state)]
    if not layout.variables or any(d <= 0 for s in shapes for d in s):
        raise invalid("layout", "the layout needs variables with positive dimensions")
    if sum(math.prod(s) for s in shapes) * 4 > max_model_bytes:
        raise invalid("layout", f"the layout exceeds the PS's limit of {max_model_bytes} bytes")
    specs = [[(v.name, tuple(v.shape)) for v in vs] for vs in (layout.variables, layout.state)]
    if layout.digest != layout_digest(*specs):
        raise invalid("layout", "the layout's digest does not match its variables")


def check_push(h: pb.PushHeader, registered: bool, layout: pb.Layout | None, nbytes: int, version: int,
               budget: int) -> None:
    """A push from a registered worker, for the model's layout and size, of at most the largest sample
    budget that worker was given, based on a version that exists, with sane statistics."""
    if not registered:
        raise invalid("unknown_worker", f"unknown worker id {h.worker}")
    if layout is None:
        raise precondition("not_initialized", "the model is not initialized")
    if h.layout_digest != layout.digest:
        raise precondition("layout", "the push's variable layout is not the model's")
    if h.nbytes != nbytes:
        raise invalid("size", f"payload declares {h.nbytes} bytes, the model has {nbytes}")
    if not 0 < h.samples <= budget:
        raise invalid("samples", f"sample count {h.samples} is not in [1, {budget}], the largest budget "
                                 "this worker was given")
    if not 0 <= h.base_version <= version:
        raise invalid("version", f"base version {h.base_version} is not in [0, {version}]")
    check_stats(h.stats)


def check_stats(s: pb.StepStats) -> None:
    """Step statistics feed the run record and the policies: finite, and durations not negative."""
    durations = (s.compute_s, s.send_s, s.wait_s, s.sleep_s, s.delay_sleep_s, s.delay_comm_s, s.delay_factor)
    if s.step < 0 or not all(math.isfinite(x) and x >= 0 for x in durations) or not math.isfinite(s.loss_sum):
        raise invalid("stats", "step statistics must be finite, with durations and step >= 0")


def check_eval(req: pb.EvalReport, version: int, done: bool) -> None:
    """An evaluation of a version that exists, with an accuracy in [0, 1]; the final one of the last
    version, once training is done."""
    if not 0 <= req.version <= version:
        raise invalid("version", f"version {req.version} is not in [0, {version}]")
    if not 0.0 <= req.test_accuracy <= 1.0:  # also false for NaN
        raise invalid("accuracy", "test accuracy must be a number in [0, 1]")
    if req.final and not (done and req.version == version):
        raise precondition("not_final", "a final evaluation must score the last version, once done")
