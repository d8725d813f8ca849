"""Summed-loss gradients over micro-batches, kept on the TF side until the push.

The samples a computer trains on are held as tensors from the start, and a step names its samples by
row: each function gathers its batch inside the TF call, so no step copies a batch on the host or
converts it to a tensor (at 784k parameters, a 32-row batch is 10 MB, and the two cost a third of
the step's compute).

Each micro-batch's gradient is added into accumulator variables inside a
``tf.function``; nothing crosses to the host until the whole step is done,
when the accumulators and the model's non-trainable state are flattened into
one float32 vector (the push payload: Σ gradient, then state). Every function
has an input signature with a free batch dimension and is traced exactly once,
before the worker reports ready, so no step ever pays for it. A step's functions
are called as their one concrete function, which skips ``tf.function``'s
per-call dispatch (a third of the small model's gradient call).

The values a push's reply brings are ``stage``d, not assigned at once: the next
step's single-call gradient loads them in the same TF call (a call of its own
cost as much wall time as the small model's gradient), so a step's
``compute_s`` includes loading them. Anything else that reads or runs the model
loads staged values first.
"""

from __future__ import annotations

from typing import Any, Callable

import keras
import numpy as np
import tensorflow as tf

from switchps.worker.weights import FlatWeights


class GradientComputer:
    """Computes Σ per-sample gradients of the cross-entropy over a step's samples, rows of ``x``/``y``.

    ``traces`` counts how often a function was traced: after ``warm_up`` it stays put.
    """

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
        batch = [tf.TensorSpec([None], tf.int64)]  # the rows of x and y
        self.traces = 0
        self._accumulate = _concrete(self._accumulate_fn, batch)
        self._whole = _concrete(self._whole_fn, batch)
        self._drain = _concrete(self._drain_fn, [])
        self._load_whole = _concrete(self._load_whole_fn, [*batch, self.weights.spec])
        self._forward = tf.function(self._forward_fn, input_signature=batch)  # not on a worker's path: lazy
        self._staged: np.ndarray | None = None

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

    def _drain_fn(self) -> tuple[tf.Tensor, tf.Tensor]:
        self.traces += 1
        flat = tf.concat([tf.reshape(a.read_value(), [-1]) for a in self._accs] + [self.weights.state_tensor()], 0)
        loss = self._loss_acc.read_value()
        with tf.control_dependencies([flat, loss]):
            for a in self._accs:
                a.assign(tf.zeros_like(a))
            self._loss_acc.assign(0.0)
        return flat, loss

    def _whole_fn(self, rows: tf.Tensor) -> tuple[tf.Tensor, tf.Tensor]:
        self.traces += 1
        x, y = self._batch(rows)
        with tf.GradientTape() as tape:
            loss = self._loss(y, self.model(x, training=True))
        grads = tape.gradient(loss, self.variables)
        return tf.concat([tf.reshape(g, [-1]) for g in grads] + [self.weights.state_tensor()], 0), loss

    def _load_whole_fn(self, rows: tf.Tensor, flat: tf.Tensor) -> tuple[tf.Tensor, tf.Tensor]:
        self.weights.load(flat)  # automatic control dependencies: assigned before the forward pass reads
        return self._whole_fn(rows)

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
            _call(self._load_whole, rows, initial)
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
        flat, loss = self._drain()
        return flat.numpy(), float(loss)

    def compute(self, rows: np.ndarray, micro_batch: int) -> tuple[np.ndarray, float]:
        """The push payload and summed loss over the samples ``rows``, one micro-batch at a time."""
        if len(rows) <= micro_batch:  # one micro-batch: no accumulators, one call (loading staged values too)
            staged, self._staged = self._staged, None
            flat, loss = _call(self._whole, rows) if staged is None else _call(self._load_whole, rows, staged)
            return flat.numpy(), float(loss)
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
        """Load ``flat`` at the start of the next step, in its first TF call; the caller must not change
        ``flat`` until then (the worker's reply buffer is written again only by the next push's reply)."""
        self._staged = flat

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
    return fn(tf.constant(rows, tf.int64), *(tf.convert_to_tensor(a) for a in arrays))
