"""Gradient clipping by norm, as Keras 3's optimizers do it (``clipnorm``, ``global_clipnorm``), on the flat
vector the PS's optimizers step: applied to the mean gradient of each update, before the optimizer's rule.

``norm``: each variable's gradient is scaled to an L2 norm of at most this (Keras's ``clipnorm``:
``g * c / max(|g|, c)``); ``global_norm``: the whole gradient is, by one factor (``global_clipnorm``,
torch's ``clip_grad_norm_``, which divides by ``|g| + 1e-6``: the same within float32's precision for norms
well above 1e-6). Keras refuses both at once; so does the config.

Cost, per update, on top of the optimizer's own passes: one read pass over the gradient for the norms
(BLAS's dot product per piece; a block's pieces run on the lane that claims the block). Global clipping then
writes nothing: its factor folds into the update's ``grad_scale``, which every optimizer applies in its block
loop already (SGD folds it into its step size). Per-variable clipping writes only the variables over the
limit (one in-place multiply each). The pieces are the blocks cut at the variables' ends, each summed by the
same call on any number of lanes and added in vector order, so the results are bit-identical on any number.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np

from switchps.optim.lanes import SERIAL, Lanes


@dataclass(frozen=True)
class Clip:
    """The configured limits (``optimizer.clip_norm``, ``optimizer.global_clip_norm``; at most one)."""

    norm: float | None = None
    global_norm: float | None = None

    def __post_init__(self) -> None:
        for key in ("norm", "global_norm"):
            value = getattr(self, key)
            if value is not None and not value > 0:
                raise ValueError(f"clip {key} must be > 0, got {value}")
        if self.norm is not None and self.global_norm is not None:
            raise ValueError("clip by norm or by global norm, not both (as Keras)")

    @property
    def on(self) -> bool:
        return self.norm is not None or self.global_norm is not None

    def apply(self, grad: np.ndarray, grad_scale: float, variables: Sequence[int], block: int,
              lanes: Lanes = SERIAL) -> tuple[float, float]:
        """Clip the mean gradient ``grad * grad_scale``: returns the ``grad_scale`` to step by (global clipping
        folded in) and the mean gradient's L2 norm before clipping; per-variable clipping scales the
        variables over the limit in place (``variables``: their sizes, in vector order)."""
        squares = variable_squares(grad, variables, block, lanes)
        norm = math.sqrt(float(squares.sum())) * grad_scale
        if self.global_norm is not None:
            return grad_scale * min(1.0, self.global_norm / norm) if norm > 0 else grad_scale, norm
        assert self.norm is not None
        start = 0
        for size, square in zip(variables, squares):
            own = math.sqrt(float(square)) * grad_scale
            if own > self.norm:
                np.multiply(grad[start:start + size], np.float32(self.norm / own), out=grad[start:start + size])
            start += size
        return grad_scale, norm


def variable_squares(grad: np.ndarray, variables: Sequence[int], block: int, lanes: Lanes = SERIAL) -> np.ndarray:
    """Σ g² of each variable (sizes ``variables``, in vector order) in float64: the float32 dot products of the
    pieces the blocks and the variables' ends cut, added in vector order (the same on any number of lanes)."""
    size = grad.size
    ends = np.cumsum(variables, dtype=np.int64)
    if size != (int(ends[-1]) if len(ends) else 0):
        raise ValueError(f"variables of {sum(variables)} elements for a gradient of {size}")
    cuts = np.union1d(np.append(ends, 0), np.arange(0, size, block, dtype=np.int64))
    pieces = np.empty(len(cuts) - 1)
    first = np.searchsorted(cuts, np.arange(0, size, block))  # each block's first piece

    def work(lane: int, b: slice) -> None:
        i = int(first[b.start // block])
        while i < len(pieces) and cuts[i] < b.stop:
            g = grad[cuts[i]:cuts[i + 1]]
            pieces[i] = float(np.dot(g, g))
            i += 1
    if lanes.parallel and size:
        for _ in lanes.run(size, block, work):
            pass
    else:
        for start in range(0, size, block):
            work(0, slice(start, min(start + block, size)))
    owner = np.searchsorted(ends, cuts[:-1], side="right")
    return np.bincount(owner, weights=pieces, minlength=len(ends))
