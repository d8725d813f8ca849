"""Summed-loss gradients over micro-batches with PyTorch: the twin of ``workload/tensorflow/gradients``,
whose contract (``frameworks.Computer``) it keeps.

The samples are moved to the device once; a step names its samples by row and selects them there
(``index_select``), so no step copies a batch on the host.

The model runs at the values without copying them into the module: each parameter is a view of the flat
vector, a detached leaf that requires grad, put in the module's place for the call (``Slots``:
``torch.func.functional_call``'s swap, found once; its per-call bookkeeping cost a quarter of an MLP step).
A ``stage``d vector (a push's reply) is read in place on the CPU, and copied to the device once per stage on
a GPU; without one, the leaves share the module's own parameters. The loss is the summed cross-entropy;
``torch.autograd.grad`` gives its gradients, which go into one flat accumulator: on the CPU, straight into
``payload_to`` (the segment the push sends from) when it is given, else a new vector each step; on a GPU
into a device vector, copied to the host once per step. So a CPU step copies the payload once (the
gradients into it). A GPU step copies the payload once more, device to host, and a fresh reply's values
once, host to device, both between page-locked host memory and the device on a copy stream of their own
(``copies.Copies``); the rest of what crosses is a micro-batch's row numbers (8 bytes a sample, from
pinned memory, not waited for) and the summed loss (4 bytes).

The payload is the Σ gradient, then the state after the step's forward passes. The state (BatchNorm's
running statistics) is the computer's own tensors, not the module's: loaded from a vector at ``stage`` or
``assign``, advanced in place by every training-mode forward (BatchNorm finds them as its buffers), written
after the gradients. The module's parameters and float32 buffers change only by ``assign``; its integer
buffers (``num_batches_tracked``, ``FlatParams.local``) count the forwards as usual.
"""

from __future__ import annotations

import numpy as np
import torch
import torch.nn.functional as F
from torch import nn

from switchps.protos.codec import aligned_empty
from switchps.protos.wire_dtype import narrow
from switchps.workload.torch.copies import Copies
from switchps.workload.torch.weights import FlatParams, copy_all, host_tensor


class TorchComputer:
    """Computes Σ per-sample gradients of the cross-entropy over a step's samples, rows of ``x``/``y``."""

    def __init__(self, module: nn.Module, x: np.ndarray, y: np.ndarray, device: torch.device | str) -> None:
        self.device = torch.device(device)
        self.module = module.to(self.device).train()
        self.samples = len(x)
        self._x = torch.tensor(np.asarray(x, np.float32), device=self.device)
        self._y = torch.tensor(np.asarray(y), dtype=torch.int64, device=self.device)
        self.weights = FlatParams(self.module)
        self.size = self.weights.size
        self._n = self.weights.trainable_size
        self._k = self.weights.count
        self._slots = Slots(self.module, self.weights.tensors)
        self._state = [t.detach().clone() for t in self.weights.tensors[self._k :]]
        self._own = [t.detach().requires_grad_() for t in self.weights.tensors[: self._k]]  # the module's memory
        self._leaves = self._own
        gpu = self.device.type != "cpu"
        self._device_values = torch.empty(self.size, device=self.device) if gpu else None  # staged, on the GPU
        self._device_acc = torch.empty(self.size, device=self.device) if gpu else None
        self._copies = Copies(self.device) if gpu else None
        self._values = Cut(self.weights, leaves=True)  # the staged vector's
        self._payload = Cut(self.weights, leaves=False)  # the accumulator's
        self._out: np.ndarray | None = None  # the step's payload vector, while micro-batches accumulate
        self._acc: Cut | None = None  # its views (on a GPU the device vector's), while micro-batches accumulate
        self._loss: torch.Tensor | None = None
        self.payload_to: np.ndarray | None = None
        """Where a step writes its payload (a worker's segment: the PS reads it from there); None: a new vector
        each step. The caller reads a payload there before the next step. Of a narrow wire's type
        (``protos/wire_dtype``: bfloat16 bits, float16), the step accumulates in float32 and narrows once
        at the end: on a GPU on the device, before the copy to the host (half its bytes)."""
        self._wide: np.ndarray | None = None  # the CPU's float32 accumulator for a narrow ``payload_to``

    def _batch(self, rows: np.ndarray) -> tuple[torch.Tensor, torch.Tensor]:
        rows = np.asarray(rows, np.int64)
        index = torch.from_numpy(rows) if self._copies is None else self._copies.rows(rows)
        return self._x.index_select(0, index), self._y.index_select(0, index)

    def _forward(self, x: torch.Tensor) -> torch.Tensor:
        """The logits of a training-mode forward at the current values, advancing the state."""
        if not self.module.training:  # a scorer sharing the module (the simulator's) left it in eval mode
            self.module.train()
        return self._slots.call(self.module, [*self._leaves, *self._state], x)

    def accumulate(self, rows: np.ndarray) -> None:
        """Add the Σ gradient and summed loss of one micro-batch, ``rows``, to the accumulator."""
        x, y = self._batch(rows)
        loss = F.cross_entropy(self._forward(x), y, reduction="sum")
        grads = torch.autograd.grad(loss, self._leaves, allow_unused=True, materialize_grads=True)
        with torch.no_grad():
            if self._acc is None:  # the step's first micro-batch
                self._acc = self._start()
                copy_all(self._acc.trainable, grads)
                self._loss = loss.detach()
            else:
                assert self._loss is not None
                torch._foreach_add_(self._acc.trainable, grads)
                self._loss = self._loss + loss.detach()

    def _start(self) -> Cut:
        """A step's accumulator: the payload vector's memory on the CPU (``payload_to``'s views are kept
        from step to step), the device vector on a GPU."""
        self._out = self._vector() if self.payload_to is None else self.payload_to
        if self._device_acc is not None:
            return self._payload(self._device_acc, self._device_acc)
        if self._out.dtype != np.float32:
            if self._wide is None or self._wide.size != self.size:
                self._wide = np.empty(self.size, np.float32)
            return self._payload(self._wide, torch.from_numpy(self._wide), keep=True)
        return self._payload(self._out, torch.from_numpy(self._out), keep=self.payload_to is not None)

    def finish(self) -> tuple[np.ndarray, float]:
        """The push payload (accumulated Σ gradient, then the state) and the summed loss; resets."""
        with torch.no_grad():
            if self._acc is None:  # nothing accumulated: a zero gradient
                self._acc = self._start()
                torch._foreach_zero_(self._acc.trainable)
            acc, out, loss = self._acc, self._out, self._loss
            assert out is not None
            copy_all(acc.state, self._state)
            if self._copies is not None:
                assert self._device_acc is not None
                self._copies.download(self._device_acc, out)  # narrowed on the device, if the wire is narrow
            elif out.dtype != np.float32:
                assert self._wide is not None
                narrow(self._wide, out)
        self._acc = self._out = self._loss = None
        return out, 0.0 if loss is None else float(loss)

    def compute(self, rows: np.ndarray, micro_batch: int) -> tuple[np.ndarray, float]:
        """The push payload and summed loss over the samples ``rows``, one micro-batch at a time."""
        for i in range(0, len(rows), micro_batch):
            self.accumulate(rows[i : i + micro_batch])
        return self.finish()

    def losses(self, rows: np.ndarray) -> np.ndarray:
        """Each sample's loss, as a step's forward pass computes it (their sum is a step's summed loss)."""
        x, y = self._batch(rows)
        with torch.no_grad():
            losses = F.cross_entropy(self._forward(x), y, reduction="none")
        result: np.ndarray = losses.cpu().numpy()
        return result

    def assign(self, flat: np.ndarray) -> None:
        """Load a pulled vector (parameters, then state) into the module and the state now (dropping any
        staged one)."""
        self.weights.assign(flat)
        self._leaves = self._own
        with torch.no_grad():
            copy_all(self._state, self.weights.tensors[self._k :])

    def stage(self, flat: np.ndarray) -> None:
        """Run the model at ``flat`` from now on, read in place (its state is loaded now); the caller must not
        change ``flat`` until it stages another or assigns (the worker's reply buffer is written again only
        by the next push's reply, then staged)."""
        if self._copies is not None:  # one copy, into the vector the leaves are views of
            assert self._device_values is not None
            values = self._values(self._device_values, self._copies.upload(flat, self._device_values))
        else:  # read in place: the views are kept while the same array (its memory) is staged again
            host = host_tensor(flat)
            values = self._values(flat, host, keep=host.data_ptr() == flat.ctypes.data)
        self._leaves = values.trainable
        with torch.no_grad():
            copy_all(self._state, values.state)

    def settle(self) -> bool:
        """On a GPU, wait for the staged values' upload (then their host vector is free); on the CPU they
        are read in place (False)."""
        if self._copies is None:
            return False
        self._copies.settle()
        return True

    def warm_up(self, batch: int, micro_batch: int) -> None:
        """Run every path twice at the step's sizes, now rather than in the first timed step (the first run
        at a new size sets up kernels and allocator pools); leaves values, state and ``payload_to`` as they
        were."""
        state = [s.clone() for s in self._state]
        rows = np.arange(min(batch, self.samples))
        payload_to, self.payload_to = self.payload_to, None
        try:
            for _ in range(2):
                self.compute(rows, len(rows))
                self.compute(rows, micro_batch)
                self.losses(rows)
        finally:
            self.payload_to = payload_to
            with torch.no_grad():
                copy_all(self._state, state)

    def buffer(self) -> np.ndarray:
        """A vector of the model's size that ``stage`` reads in place (on the CPU), or copies from at the
        link's full speed (page-locked, on a GPU)."""
        return aligned_empty(self.size) if self._copies is None else self._copies.empty(self.size)

    def _vector(self) -> np.ndarray:
        """A new vector of the model's size (on a GPU in page-locked memory: the copies' ends)."""
        return np.empty(self.size, np.float32) if self._copies is None else self._copies.empty(self.size)

    def close(self) -> None:
        """Release the page-locked registrations of host memory (a GPU's; nothing on the CPU)."""
        if self._copies is not None:
            self._copies.close()

    def read(self) -> np.ndarray:
        """The values the model runs at (staged, or the module's parameters), then the state."""
        out = np.empty(self.size, np.float32)
        target = torch.from_numpy(out)
        with torch.no_grad():
            copy_all(self.weights.views(target), [t.detach().cpu() for t in [*self._leaves, *self._state]])
        return out


class Slots:
    """Every place in a module where one of ``tensors`` sits (a submodule's ``_parameters`` or ``_buffers``
    entry; a tensor tied under two names sits in both), so that a call can run the module at other tensors:
    ``torch.func.functional_call``'s swap, found once rather than per call."""

    def __init__(self, module: nn.Module, tensors: list[torch.Tensor]) -> None:
        index = {id(t): i for i, t in enumerate(tensors)}
        self.places = [(entries, key, index[id(t)]) for _, owner in module.named_modules()
                       for entries in (owner._parameters, owner._buffers)
                       for key, t in entries.items() if t is not None and id(t) in index]

    def call(self, module: nn.Module, given: list[torch.Tensor], x: torch.Tensor) -> torch.Tensor:
        """``module(x)`` with ``given[i]`` in place of ``tensors[i]``; the module's own are back on return."""
        saved = [entries[key] for entries, key, _ in self.places]
        try:
            for entries, key, i in self.places:
                entries[key] = given[i]
            out: torch.Tensor = module(x)
        finally:
            for (entries, key, _), t in zip(self.places, saved):
                entries[key] = t
        return out


class Cut:
    """A flat vector cut into one view per tensor (the trainable ones as leaves that require grad, if asked),
    kept while the same source is cut again: building them costs µs per tensor, 0.7 ms for ResNet-20's 107,
    and a worker stages the same reply buffer, and writes the same segment, every step."""

    def __init__(self, weights: FlatParams, leaves: bool) -> None:
        self.weights, self.leaves = weights, leaves
        self.source: object = None
        self.trainable: list[torch.Tensor] = []
        self.state: list[torch.Tensor] = []

    def __call__(self, source: object, flat: torch.Tensor, keep: bool = True) -> Cut:
        """``flat``'s views. ``keep``: ``flat`` is ``source``'s own memory, so they serve again while the same
        ``source`` comes back (not so a copy of it, or a vector used once)."""
        if source is not self.source or not keep:
            views = self.weights.views(flat)
            k = self.weights.count
            self.trainable = [v.detach().requires_grad_() for v in views[:k]] if self.leaves else views[:k]
            self.state = views[k:]
        self.source = source if keep else None
        return self
