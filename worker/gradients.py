"""Summed-loss gradients over micro-batches, kept on the TF side until the push.

Each micro-batch's gradient is added into accumulator variables inside a
``tf.function``; nothing crosses to the host until the whole step is done,
when the accumulators are flattened into one float32 vector (the push
payload). Pulled parameters are assigned back into the model's variables
with one call, without rebuilding the model.
"""

from __future__ import annotations

import math

import numpy as np
import tensorflow as tf
import keras


def configure_threads(intra_op: int, inter_op: int) -> None:
    """Limit TF's thread pools (must run before TF executes any op)."""
    tf.config.threading.set_intra_op_parallelism_threads(intra_op)
    tf.config.threading.set_inter_op_parallelism_threads(inter_op)


class GradientComputer:
    """Computes Σ per-sample gradients of the cross-entropy over a step's samples."""

    def __init__(self, model: keras.Model) -> None:
        self.model = model
        self.variables = list(model.trainable_variables)
        self.shapes = [tuple(v.shape) for v in self.variables]
        self.sizes = [math.prod(s) for s in self.shapes]
        self.size = sum(self.sizes)
        self._accs = [tf.Variable(tf.zeros(s, v.dtype), trainable=False) for s, v in zip(self.shapes, self.variables)]
        self._loss_acc = tf.Variable(0.0, trainable=False)
        self._loss = keras.losses.SparseCategoricalCrossentropy(from_logits=True, reduction="sum")

    def specs(self) -> list[tuple[str, tuple[int, ...]]]:
        """(name, shape) per variable, in wire order; unique names via their paths."""
        return [(getattr(v, "path", v.name), s) for v, s in zip(self.variables, self.shapes)]

    @tf.function(reduce_retracing=True)
    def _accumulate(self, x: tf.Tensor, y: tf.Tensor) -> None:
        with tf.GradientTape() as tape:
            loss = self._loss(y, self.model(x, training=True))
        for acc, g in zip(self._accs, tape.gradient(loss, self.variables)):
            acc.assign_add(g)
        self._loss_acc.assign_add(loss)

    @tf.function
    def _drain(self) -> tuple[tf.Tensor, tf.Tensor]:
        flat = tf.concat([tf.reshape(a.read_value(), [-1]) for a in self._accs], axis=0)
        loss = self._loss_acc.read_value()
        with tf.control_dependencies([flat, loss]):
            for a in self._accs:
                a.assign(tf.zeros_like(a))
            self._loss_acc.assign(0.0)
        return flat, loss

    def finish(self) -> tuple[np.ndarray, float]:
        """The accumulated Σ gradient as one flat float32 array, and the summed loss; resets."""
        flat, loss = self._drain()
        return flat.numpy(), float(loss)

    @tf.function(reduce_retracing=True)
    def _whole(self, x: tf.Tensor, y: tf.Tensor) -> tuple[tf.Tensor, tf.Tensor]:
        with tf.GradientTape() as tape:
            loss = self._loss(y, self.model(x, training=True))
        grads = tape.gradient(loss, self.variables)
        return tf.concat([tf.reshape(g, [-1]) for g in grads], axis=0), loss

    def accumulate(self, x: np.ndarray, y: np.ndarray) -> None:
        """Add one micro-batch's Σ gradient and summed loss to the accumulators (no host copy)."""
        self._accumulate(x, y)

    def compute(self, x: np.ndarray, y: np.ndarray, micro_batch: int) -> tuple[np.ndarray, float]:
        """Σ gradient and summed loss over all of ``x``, one micro-batch at a time."""
        if len(x) <= micro_batch:  # one micro-batch: no accumulators, one call
            flat, loss = self._whole(x, y)
            return flat.numpy(), float(loss)
        for i in range(0, len(x), micro_batch):
            self._accumulate(x[i : i + micro_batch], y[i : i + micro_batch])
        return self.finish()

    @tf.function
    def _assign(self, flat: tf.Tensor) -> None:
        for v, part, shape in zip(self.variables, tf.split(flat, self.sizes), self.shapes):
            v.assign(tf.reshape(part, shape))

    def assign(self, flat: np.ndarray) -> None:
        """Load a flat parameter vector into the model's variables."""
        self._assign(tf.convert_to_tensor(flat))

    def flat_params(self) -> np.ndarray:
        return np.concatenate([v.numpy().ravel() for v in self.variables]).astype(np.float32, copy=False)
