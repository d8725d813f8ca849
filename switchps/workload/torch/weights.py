"""A module's float32 tensors as one flat vector: the trainable parameters, then the state.

The flat vector is what crosses the wire. Its first ``trainable_size`` elements are the parameters that
require grad, in ``named_parameters`` order; the rest are the module's other float32 ``state_dict`` entries
in ``state_dict`` order: BatchNorm's running mean and variance (and any frozen parameter), which the PS keeps
per version so that evaluation and the exported model use real statistics. Every name is a ``state_dict`` key.
"""

from __future__ import annotations

import math

import numpy as np
import torch
from torch import nn

from switchps.protos import switchps_pb2 as pb
from switchps.protos.layout import make_layout


class FlatParams:
    """Reads and assigns a module's float32 tensors as one float32 vector (trainable first).

    ``local`` holds the ``state_dict``'s integer buffers (BatchNorm's ``num_batches_tracked``), which are not
    on the wire: they count training forwards, which matters only to a BatchNorm with ``momentum=None`` (a
    cumulative average), and ``build_model`` refuses those. Each process keeps its own count; they stay in
    the saved files so that a plain ``load_state_dict`` finds every key.
    """

    def __init__(self, module: nn.Module) -> None:
        self.module = module
        trainable = [(n, p) for n, p in module.named_parameters() if p.requires_grad]
        seen = {id(p) for _, p in trainable}
        state: list[tuple[str, torch.Tensor]] = []
        self.local: dict[str, torch.Tensor] = {}
        for name, tensor in module.state_dict(keep_vars=True).items():
            if id(tensor) in seen:  # a trainable parameter, or a tensor shared under a second name
                continue
            seen.add(id(tensor))
            if tensor.dtype == torch.float32:
                state.append((name, tensor))
            elif tensor.is_floating_point():
                raise TypeError(f"{name} is {tensor.dtype}; the wire carries float32 only")
            else:
                self.local[name] = tensor
        self.names = [n for n, _ in trainable] + [n for n, _ in state]
        self.tensors: list[torch.Tensor] = [t for _, t in trainable] + [t for _, t in state]
        self.count = len(trainable)
        """How many of ``tensors`` are trainable (they lead)."""
        self.shapes = [tuple(int(d) for d in t.shape) for t in self.tensors]
        self.sizes = [math.prod(s) for s in self.shapes]
        self.offsets = [int(o) for o in np.cumsum([0, *self.sizes])]
        self.trainable_size = self.offsets[self.count]
        self.size = self.offsets[-1]

    def layout(self) -> pb.Layout:
        """The wire layout: (name, shape) per tensor, trainable then state."""
        specs = list(zip(self.names, self.shapes))
        return make_layout(specs[: self.count], specs[self.count :])

    def views(self, flat: torch.Tensor, first: int = 0, last: int | None = None) -> list[torch.Tensor]:
        """Tensors ``first`` to ``last`` as views of the flat vector ``flat`` (a tensor of ``size``)."""
        last = len(self.tensors) if last is None else last
        return [flat[self.offsets[i] : self.offsets[i + 1]].view(self.shapes[i]) for i in range(first, last)]

    def read(self) -> np.ndarray:
        out = np.empty(self.size, np.float32)
        with torch.no_grad():
            copy_all(self.views(torch.from_numpy(out)), [t.detach().cpu() for t in self.tensors])
        return out

    def assign(self, flat: np.ndarray) -> None:
        """Copy a flat vector (trainable then state) into the module's tensors (moved to their device first, in
        one copy)."""
        device = self.tensors[0].device if self.tensors else torch.device("cpu")
        with torch.no_grad():
            copy_all([t.detach() for t in self.tensors], self.views(host_tensor(flat).to(device)))


def host_tensor(flat: np.ndarray) -> torch.Tensor:
    """A float32 vector as a CPU tensor: the same memory where torch can take it (writable; the caller
    keeps it unchanged while torch reads it), else a copy."""
    flat = np.ascontiguousarray(flat, np.float32)
    return torch.from_numpy(flat if flat.flags.writeable else flat.copy())


def copy_all(targets: list[torch.Tensor], sources: list[torch.Tensor] | tuple[torch.Tensor, ...]) -> None:
    """Copy each source into its target (one fused call; none for a model without state)."""
    if targets:
        torch._foreach_copy_(targets, sources)
