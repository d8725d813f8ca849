"""The model the PS holds: flat float32 parameters, optimizer, version.

Parameters live in one contiguous float32 vector; the layout maps it back to
named variables. Pulls are served from an immutable per-version snapshot of
pre-cut byte chunks, built once per version and shared by every reader, so no
lock is held while parameters stream out.
"""

from __future__ import annotations

import hashlib
import math
import threading
from dataclasses import dataclass
from typing import Callable

import numpy as np

from switchps.protos import switchps_pb2 as pb
from switchps.protos.codec import DEFAULT_CHUNK_BYTES, Payload
from switchps.ps_server.optimizers import Optimizer


def layout_digest(variables: list[tuple[str, tuple[int, ...]]]) -> str:
    text = ";".join(f"{name}:{'x'.join(map(str, shape))}" for name, shape in variables)
    return hashlib.sha1(text.encode()).hexdigest()


def make_layout(variables: list[tuple[str, tuple[int, ...]]]) -> pb.Layout:
    return pb.Layout(
        variables=[pb.Variable(name=n, shape=list(s)) for n, s in variables],
        digest=layout_digest(variables),
    )


def layout_size(layout: pb.Layout) -> int:
    return sum(math.prod(v.shape) for v in layout.variables)


class BufferPool:
    """Reuses large gradient buffers so pushes don't page-fault fresh memory each time."""

    def __init__(self, size: int) -> None:
        self.size = size
        self._free: list[np.ndarray] = []
        self._lock = threading.Lock()

    def get(self) -> np.ndarray:
        with self._lock:
            if self._free:
                return self._free.pop()
        return np.empty(self.size, np.float32)

    def put(self, buf: np.ndarray) -> None:
        with self._lock:
            if len(self._free) < 8:
                self._free.append(buf)


@dataclass
class Applied:
    version: int
    lr: float


class ModelStore:
    """Holds parameters and optimizer state; ``apply`` is the only writer."""

    def __init__(self, make_optimizer: Callable[[int], Optimizer], chunk_bytes: int = DEFAULT_CHUNK_BYTES) -> None:
        self._make_optimizer = make_optimizer
        self.chunk_bytes = chunk_bytes
        self.lock = threading.Lock()
        self.layout: pb.Layout | None = None
        self.params: np.ndarray | None = None
        self.optimizer: Optimizer | None = None
        self.buffers: BufferPool | None = None
        self.version = 0
        self._snapshot: tuple[int, Payload] | None = None

    @property
    def initialized(self) -> bool:
        return self.params is not None

    @property
    def nbytes(self) -> int:
        return 0 if self.params is None else self.params.nbytes

    def initialize(self, layout: pb.Layout, values: np.ndarray) -> None:
        with self.lock:
            self.layout = layout
            self.params = values
            self.optimizer = self._make_optimizer(values.size)
            self.buffers = BufferPool(values.size)

    def apply(self, grad_sum: np.ndarray, samples: int, lr_factor: float = 1.0) -> Applied:
        """Apply the mean gradient ``grad_sum / samples``; ``grad_sum`` is consumed."""
        with self.lock:
            lr = self.optimizer.apply(self.params, grad_sum, lr_factor, grad_scale=1.0 / samples)
            self.version += 1
            return Applied(self.version, lr)

    def snapshot(self) -> tuple[int, Payload]:
        """The current version and its parameters as wire chunks (built once per version)."""
        with self.lock:
            if self._snapshot is None or self._snapshot[0] != self.version:
                self._snapshot = (self.version, Payload.of(self.params, self.chunk_bytes))
            return self._snapshot
