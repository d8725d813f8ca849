"""Hostile input at the wire: frames, layouts, sizes and numbers, checked before anything else sees them.

Anyone who reaches the PS port may send anything a client written from
``protos/switchps.proto`` can: truncated frames, wrong sizes, NaN and inf,
forged layouts. These checks raise ``Rejected`` with the gRPC status name and
the reason the run record counts it under; what a request means for training
(unknown workers, sample budgets, versions) the core checks. Messages name
what is wrong without echoing the PS's own state (never its layout digest).
"""

from __future__ import annotations

import math
from typing import TypeVar

from switchps.protos import switchps_pb2 as pb
from switchps.protos.codec import FrameError, decode_header
from switchps.protos.layout import layout_digest
from switchps.ps_server.events import invalid, precondition

H = TypeVar("H", pb.InitHeader, pb.PushHeader, pb.PullRequest)


def decode(frame0: bytes, header_type: type[H]) -> tuple[H, memoryview]:
    """Frame 0's header and inline payload; a malformed frame is rejected."""
    try:
        return decode_header(frame0, header_type)
    except FrameError as e:
        raise invalid("malformed", str(e)) from None


def check_layout(layout: pb.Layout, max_model_bytes: int) -> None:
    """A layout that is well formed, of bounded size and honest about its digest."""
    shapes = [list(v.shape) for v in (*layout.variables, *layout.state)]
    if not layout.variables or any(d <= 0 for s in shapes for d in s):
        raise invalid("layout", "the layout needs variables with positive dimensions")
    if sum(math.prod(s) for s in shapes) * 4 > max_model_bytes:
        raise invalid("layout", f"the layout exceeds the PS's limit of {max_model_bytes} bytes")
    specs = [[(v.name, tuple(v.shape)) for v in vs] for vs in (layout.variables, layout.state)]
    if layout.digest != layout_digest(*specs):
        raise invalid("layout", "the layout's digest does not match its variables")


def check_push_header(h: pb.PushHeader, layout: pb.Layout | None, nbytes: int) -> None:
    """A push for the model's layout and size, with sane statistics."""
    if layout is None:
        raise precondition("not_initialized", "the model is not initialized")
    if h.layout_digest != layout.digest:
        raise precondition("layout", "the push's variable layout is not the model's")
    if h.nbytes != nbytes:
        raise invalid("size", f"payload declares {h.nbytes} bytes, the model has {nbytes}")
    s = h.stats
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
