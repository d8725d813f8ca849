"""Summed-loss gradients over micro-batches, kept on the TF side until the push.

The samples a computer trains on are held as tensors from the start, and a step names its samples by
row: each function gathers its batch inside the TF call, so no step copies a batch on the host or
converts it to a tensor (at 784k parameters, a 32-row batch is 10 MB, and the two cost a third of
the step's compute).

Each micro-batch's gradient is added into accumulator variables inside a
``tf.function``; nothing crosses to the host until the whole step is done,
when the Σ gradient's parts, then the model's non-trainable state, are copied once,
straight from TF's buffers, into one float32 vector: the push payload, written where
the push sends it from if it is given a place (``payload_to``: a worker's segment). Every function
has an input signature with a free batch dimension and is traced exactly once,
before the worker reports ready, so no step ever pays for it. A step's functions
are called as their one concrete function, which skips ``tf.function``'s
per-call dispatch (a third of the small model's gradient call).

The values a push's reply brings are ``stage``d, not assigned: a step of one micro-batch runs the model
statelessly at them (Keras's ``stateless_call``, the flat vector's slices standing for the variables),
and a vector of ``buffer``'s (64-byte aligned) enters TF in place, through DLPack. So no step copies the
values, into a tensor or into the variables: at 784k parameters those two 3 MB copies cost a fifth of
the gradient call alone, and a quarter with two workers at once (``bench/micro.py worker-step``).
Such a step's payload ends with the state its forward pass left (BatchNorm's moving statistics); the
model keeps running at the staged values until the next are staged. Anything else that reads or runs
the model (micro-batches, ``losses``, ``read``) loads staged values into the variables first.
"""

from __future__ import annotations

from typing import Any, Callable

import keras
import numpy as np
import tensorflow as tf

from switchps.protos.codec import ALIGN, aligned_empty
from switchps.protos.wire_dtype import narrow
from switchps.workload.tensorflow.weights import FlatWeights


class GradientComputer:
    """Computes Σ per-sample gradients of the cross-entropy over a step's samples, rows of ``x``/``y``.

    ``traces`` counts how often a function was traced: after ``warm_up`` it stays put.
    """

    device = "cpu"  # the tensorflow-cpu build

    def __init__(self, model: keras.Model, x: np.ndarray, y: np.ndarray) -> None:
        self.model = model
        self.samples = len(x)
        self._x, self._y = tf.constant(x, tf.float32), tf.constant(y, tf.int32)
        self.weights = FlatWeights(model)
        self.variables = self.weights.trainable
        self.size = self.weights.size
        self._accs = [tf.Variable(tf.zeros(v.shape, v.dtype), trainable=False) for v in self.variables]
        self._loss_acc = tf.Variable(0.0, trainable=False)
        self._loss = keras.losses.SparseCategoricalCrossentropy(from_logits=True, reduction="sum")
        self._losses = keras.losses.SparseCategoricalCrossentropy(from_logits=True, reduction="none")
        # state outside the flat vector, which a training call advances (seed generators' counters)
        self._held = [id(v) for v in self.weights.state]
        batch = [tf.TensorSpec([None], tf.int64)]  # the rows of x and y
        self.traces = 0
        self._accumulate = _concrete(self._accumulate_fn, batch)
        self._whole = _concrete(self._whole_fn, batch)
        self._drain = _concrete(self._drain_fn, [])
        self._at = _concrete(self._at_fn, [*batch, self.weights.spec])
        self._forward = tf.function(self._forward_fn, input_signature=batch)  # not on a worker's path: lazy
        self._staged: np.ndarray | None = None
        self.payload_to: np.ndarray | None = None
        """Where a step writes its payload (a worker's segment: the PS reads it from there); None: a new vector
        each step. The caller reads a payload there before the next step."""

    def _batch(self, rows: tf.Tensor) -> tuple[tf.Tensor, tf.Tensor]:
        return tf.gather(self._x, rows), tf.gather(self._y, rows)

    def _accumulate_fn(self, rows: tf.Tensor) -> None:
        self.traces += 1  # Python side effect: runs only while tracing
        x, y = self._batch(rows)
        with tf.GradientTape() as tape:
            loss = self._loss(y, self.model(x, training=True))
        for acc, g in zip(self._accs, tape.gradient(loss, self.variables)):
            acc.assign_add(g)
        self._loss_acc.assign_add(loss)

    def _drain_fn(self) -> tuple[list[tf.Tensor], tf.Tensor]:
        self.traces += 1
        parts = [a.read_value() for a in self._accs] + [v.value for v in self.weights.state]
        loss = self._loss_acc.read_value()
        with tf.control_dependencies([*parts, loss]):
            for a in self._accs:
                a.assign(tf.zeros_like(a))
            self._loss_acc.assign(0.0)
        return parts, loss

    def _whole_fn(self, rows: tf.Tensor) -> tuple[list[tf.Tensor], tf.Tensor]:
        """``_at_fn`` at the values the variables hold."""
        return self._at_fn(rows, self.weights.tensor())

    def _at_fn(self, rows: tf.Tensor, flat: tf.Tensor) -> tuple[list[tf.Tensor], tf.Tensor]:
        """The payload's parts and the summed loss of one call at the values ``flat``, which the model's float32
        variables need not hold (they are neither read nor written): the state is what the forward pass left."""
        self.traces += 1
        x, y = self._batch(rows)
        parts = self.weights.parts(flat)
        trainable = parts[: len(self.variables)]
        held = dict(zip(self._held, parts[len(self.variables) :]))
        others = self.model.non_trainable_variables
        with tf.GradientTape() as tape:
            tape.watch(trainable)
            given = [held.get(id(v), v.value) for v in others]
            logits, after = self.model.stateless_call(trainable, given, x, training=True)
            loss = self._loss(y, logits)
        left = {id(v): value for v, value in zip(others, after)}
        for v in others:
            if id(v) not in held:
                v.assign(left[id(v)])
        return [*tape.gradient(loss, trainable), *(left[i] for i in self._held)], loss

    def _forward_fn(self, rows: tf.Tensor) -> tf.Tensor:
        self.traces += 1
        x, y = self._batch(rows)
        return self._losses(y, self.model(x, training=True))

    def warm_up(self, batch: int, micro_batch: int) -> None:
        """Run every step function twice at the step's sizes, now rather than in the first timed step (the
        first runs at a new size set up kernels); leaves weights and state as they were."""
        initial = self.weights.read()
        rows = np.arange(min(batch, self.samples))
        for _ in range(2):
            _call(self._at, rows, initial)
            _call(self._whole, rows)
            _call(self._accumulate, rows[:micro_batch])
            self._drain()
        self.weights.assign(initial)

    def accumulate(self, rows: np.ndarray) -> None:
        """Add the Σ gradient and summed loss of one micro-batch, ``rows``, to the accumulators (no host copy)."""
        self._load_staged()
        _call(self._accumulate, rows)

    def finish(self) -> tuple[np.ndarray, float]:
        """The push payload (accumulated Σ gradient, then the model's state) and the summed loss; resets."""
        parts, loss = self._drain()
        return self._payload(parts), float(loss)

    def compute(self, rows: np.ndarray, micro_batch: int) -> tuple[np.ndarray, float]:
        """The push payload and summed loss over the samples ``rows``, one micro-batch at a time."""
        if len(rows) <= micro_batch:  # one micro-batch: no accumulators, one call at the staged values
            staged = self._staged
            parts, loss = _call(self._whole, rows) if staged is None else _call(self._at, rows, staged)
            return self._payload(parts), float(loss)
        self._load_staged()
        for i in range(0, len(rows), micro_batch):
            _call(self._accumulate, rows[i : i + micro_batch])
        return self.finish()

    def losses(self, rows: np.ndarray) -> np.ndarray:
        """Each sample's loss, as a step's forward pass computes it (their sum is a step's summed loss)."""
        self._load_staged()
        return _call(self._forward, rows).numpy()

    def assign(self, flat: np.ndarray) -> None:
        """Load a pulled vector (parameters, then state) into the model now (dropping any staged one)."""
        self._staged = None
        self.weights.assign(flat)

    def stage(self, flat: np.ndarray) -> None:
        """Run the model at ``flat`` from now on (a step of one call reads it in place; anything else loads it
        into the variables first); the caller must not change ``flat`` until it stages another or assigns
        (the worker's reply buffer is written again only by the next push's reply, then staged)."""
        self._staged = flat

    def settle(self) -> bool:
        """Staged values are read in place: the caller keeps them."""
        return False

    def close(self) -> None:
        """Nothing to release."""

    def _payload(self, parts: list[tf.Tensor]) -> np.ndarray:
        """The parts copied, in order, into ``payload_to`` (or a new vector): the one pass over the payload
        between TF's buffers and the place it is sent from (narrowed to a narrow wire's type, if
        ``payload_to`` is of one)."""
        out = np.empty(self.size, np.float32) if self.payload_to is None else self.payload_to
        start = 0
        for part in parts:
            flat = np.asarray(memoryview(part)).reshape(-1)  # TF's buffer, read in place (``.numpy()`` copies)
            narrow(flat, out[start : start + flat.size])  # a narrow wire's payload: narrowed in the same pass
            start += flat.size
        return out

    def buffer(self) -> np.ndarray:
        """A vector of the model's size that ``stage`` can hand to TF without a copy."""
        return aligned_empty(self.size)

    def read(self) -> np.ndarray:
        """The model's values (trainable, then state), staged ones loaded first."""
        self._load_staged()
        return self.weights.read()

    def _load_staged(self) -> None:
        if self._staged is not None:
            self.assign(self._staged)


def _concrete(fn: Callable[..., Any], signature: list[tf.TensorSpec]) -> Callable[..., Any]:
    """``fn`` traced now, once, for ``signature``: its concrete function."""
    return tf.function(fn, input_signature=signature).get_concrete_function()


def _call(fn: Callable[..., Any], rows: np.ndarray, *arrays: np.ndarray) -> Any:
    """A concrete function called on ``rows`` and ``arrays`` as tensors (it checks them against its signature)."""
    return fn(tf.constant(rows, tf.int64), *(_tensor(a) for a in arrays))


def _tensor(a: np.ndarray) -> tf.Tensor:
    """``a`` as a tensor: the same memory if it is aligned (through DLPack; TF aborts on a less aligned
    one), else a copy. The call it is passed to only reads it; the caller keeps it unchanged meanwhile."""
    if a.ctypes.data % ALIGN == 0 and a.flags.c_contiguous and a.flags.writeable:
        return tf.experimental.dlpack.from_dlpack(a.__dlpack__())
    return tf.convert_to_tensor(a)
