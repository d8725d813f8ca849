"""The model's layout on the wire: variable names and shapes, trainable then state, and their digest."""

from __future__ import annotations

import hashlib
import math
from collections.abc import Sequence

from switchps.protos import switchps_pb2 as pb

Specs = Sequence[tuple[str, tuple[int, ...]]]


def layout_digest(variables: Specs, state: Specs = ()) -> str:
    text = ";".join(f"{name}:{'x'.join(map(str, shape))}" for name, shape in variables)
    if state:
        text += "|" + ";".join(f"{name}:{'x'.join(map(str, shape))}" for name, shape in state)
    return hashlib.sha1(text.encode()).hexdigest()


def make_layout(variables: Specs, state: Specs = ()) -> pb.Layout:
    """The wire layout of trainable ``variables`` followed by non-trainable ``state``."""
    return pb.Layout(
        variables=[pb.Variable(name=n, shape=list(s)) for n, s in variables],
        state=[pb.Variable(name=n, shape=list(s)) for n, s in state],
        digest=layout_digest(variables, state),
    )


def with_wire(layout: pb.Layout, wire: str) -> pb.Layout:
    """A copy of ``layout`` saying the type its values cross the wire in (float32 says nothing: the field
    unset, so a float32 run's messages are byte for byte what they were before the field existed)."""
    out = pb.Layout()
    out.CopyFrom(layout)
    out.wire_dtype = "" if wire == "float32" else wire
    return out


def layout_wire(layout: pb.Layout) -> str:
    """The type ``layout``'s values cross the wire in (unset: float32)."""
    return layout.wire_dtype or "float32"


def variable_sizes(layout: pb.Layout) -> list[int]:
    """Elements of each trainable variable, in vector order."""
    return [math.prod(v.shape) for v in layout.variables]


def trainable_size(layout: pb.Layout) -> int:
    return sum(variable_sizes(layout))


def layout_size(layout: pb.Layout) -> int:
    """Elements of the whole vector: trainable parameters and non-trainable state."""
    return trainable_size(layout) + sum(math.prod(v.shape) for v in layout.state)
