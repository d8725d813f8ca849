"""Hostile input in registrations and evaluation reports, checked before anything else sees them.

Anyone who reaches the PS port may send anything a client written from
``protos/switchps.proto`` can. These checks raise ``Rejected`` with the gRPC
status name and the reason the run record counts it under. A push is checked
where its facts live: its frames by the service (with its gradient's norm, ``check_grad_norm``), its
layout and size by the model store, its worker, budget, version and statistics by the core. Messages
name what is wrong without echoing the PS's own state (never its layout digest).
"""

from __future__ import annotations

import math

from switchps.protos import switchps_pb2 as pb
from switchps.protos.layout import layout_digest
from switchps.refusals import invalid, precondition


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


def check_eval(req: pb.EvalReport, version: int, done: bool) -> None:
    """An evaluation of a version that exists, with an accuracy in [0, 1]; the final one of the last
    version, once training is done."""
    if not 0 <= req.version <= version:
        raise invalid("version", f"version {req.version} is not in [0, {version}]")
    if not 0.0 <= req.test_accuracy <= 1.0:  # also false for NaN
        raise invalid("accuracy", "test accuracy must be a number in [0, 1]")
    if req.final and not (done and req.version == version):
        raise precondition("not_final", "a final evaluation must score the last version, once done")


def check_grad_norm(squares: float, samples: int, bound: float | None) -> None:
    """A push's gradient within ``runtime.max_grad_norm`` per sample (``bound``; None: unbounded).

    A push carries the sum of ``samples`` (>= 1, checked by the core) per-sample gradients, whose squared
    L2 norm is ``squares`` (summed as its values are checked for NaN/inf: ``codec.PayloadWriter``), so
    the mean gradient's norm is ``sqrt(squares) / samples``. This bounds what one buggy worker's push
    can do to the model: a finite but absurd gradient is refused whole, as a NaN is.
    """
    if bound is not None and (norm := math.sqrt(squares) / samples) > bound:
        raise invalid("grad_norm", f"the gradient's norm per sample, {norm:.4g}, exceeds runtime.max_grad_norm")
