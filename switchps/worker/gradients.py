"""Summed-loss gradients over micro-batches, kept on the TF side until the push.

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
    """Computes Σ per-sample gradients of the cross-entropy over a step's samples.

    ``traces`` counts how often a function was traced: after ``warm_up`` it stays put.
    """

    def __init__(self, model: keras.Model, input_shape: tuple[int, ...] | None = None) -> None:
        self.model = model
        self.weights = FlatWeights(model)
        self.variables = self.weights.trainable
        self.size = self.weights.size
        self._accs = [tf.Variable(tf.zeros(v.shape, v.dtype), trainable=False) for v in self.variables]
        self._loss_acc = tf.Variable(0.0, trainable=False)
        self._loss = keras.losses.SparseCategoricalCrossentropy(from_logits=True, reduction="sum")
        self._losses = keras.losses.SparseCategoricalCrossentropy(from_logits=True, reduction="none")
        shape = tuple(input_shape or model.input_shape[1:])
        batch = [tf.TensorSpec([None, *shape], tf.float32), tf.TensorSpec([None], tf.int32)]
        self.traces = 0
        self._accumulate = _concrete(self._accumulate_fn, batch)
        self._whole = _concrete(self._whole_fn, batch)
        self._drain = _concrete(self._drain_fn, [])
        self._load_whole = _concrete(self._load_whole_fn, [*batch, self.weights.spec])
        self._forward = tf.function(self._forward_fn, input_signature=batch)  # not on a worker's path: lazy
        self._staged: np.ndarray | None = None

    def _accumulate_fn(self, x: tf.Tensor, y: tf.Tensor) -> None:
        self.traces += 1  # Python side effect: runs only while tracing
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

    def _whole_fn(self, x: tf.Tensor, y: tf.Tensor) -> tuple[tf.Tensor, tf.Tensor]:
        self.traces += 1
        with tf.GradientTape() as tape:
            loss = self._loss(y, self.model(x, training=True))
        grads = tape.gradient(loss, self.variables)
        return tf.concat([tf.reshape(g, [-1]) for g in grads] + [self.weights.state_tensor()], 0), loss

    def _load_whole_fn(self, x: tf.Tensor, y: tf.Tensor, flat: tf.Tensor) -> tuple[tf.Tensor, tf.Tensor]:
        self.weights.load(flat)  # automatic control dependencies: assigned before the forward pass reads
        return self._whole_fn(x, y)

    def _forward_fn(self, x: tf.Tensor, y: tf.Tensor) -> tf.Tensor:
        self.traces += 1
        return self._losses(y, self.model(x, training=True))

    def warm_up(self, x: np.ndarray, y: np.ndarray, batch: int, micro_batch: int) -> None:
        """Run every step function twice at the step's sizes, now rather than in the first timed step (the
        first runs at a new size set up kernels); leaves weights and state as they were."""
        initial = self.weights.read()
        for _ in range(2):
            _call(self._load_whole, x[:batch], y[:batch], initial)
            _call(self._whole, x[:batch], y[:batch])
            _call(self._accumulate, x[:micro_batch], y[:micro_batch])
            self._drain()
        self.weights.assign(initial)

    def accumulate(self, x: np.ndarray, y: np.ndarray) -> None:
        """Add one micro-batch's Σ gradient and summed loss to the accumulators (no host copy)."""
        self._load_staged()
        _call(self._accumulate, x, y)

    def finish(self) -> tuple[np.ndarray, float]:
        """The push payload (accumulated Σ gradient, then the model's state) and the summed loss; resets."""
        flat, loss = self._drain()
        return flat.numpy(), float(loss)

    def compute(self, x: np.ndarray, y: np.ndarray, micro_batch: int) -> tuple[np.ndarray, float]:
        """The push payload and summed loss over all of ``x``, one micro-batch at a time."""
        if len(x) <= micro_batch:  # one micro-batch: no accumulators, one call (loading staged values too)
            staged, self._staged = self._staged, None
            flat, loss = _call(self._whole, x, y) if staged is None else _call(self._load_whole, x, y, staged)
            return flat.numpy(), float(loss)
        self._load_staged()
        for i in range(0, len(x), micro_batch):
            _call(self._accumulate, x[i : i + micro_batch], y[i : i + micro_batch])
        return self.finish()

    def losses(self, x: np.ndarray, y: np.ndarray) -> np.ndarray:
        """Each sample's loss, as a step's forward pass computes it (their sum is a step's summed loss)."""
        self._load_staged()
        return self._forward(x, y).numpy()

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


def _call(fn: Callable[..., Any], *arrays: np.ndarray | tf.Tensor) -> Any:
    """A concrete function called on ``arrays`` as tensors (it checks them against its signature)."""
    return fn(*(tf.convert_to_tensor(a) for a in arrays))
