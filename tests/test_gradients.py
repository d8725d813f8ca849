"""The worker's gradient computer: micro-batched Σ gradients and flat parameter assignment."""

from __future__ import annotations

import numpy as np
import tensorflow as tf

from switchps.worker.data import load_dataset
from switchps.worker.gradients import GradientComputer
from switchps.worker.models import build_model


def _computer(name: str = "mlp") -> tuple[GradientComputer, np.ndarray, np.ndarray]:
    data = load_dataset("digits")
    model = build_model(name, data.input_shape, data.num_classes, seed=1, hidden=[16]) if name == "mlp" else \
        build_model(name, data.input_shape, data.num_classes, seed=1)
    return GradientComputer(model), data.x_train[:40], data.y_train[:40]


def _reference_sum_gradient(gc: GradientComputer, x, y) -> np.ndarray:
    with tf.GradientTape() as tape:
        logits = gc.model(x, training=True)
        loss = tf.reduce_sum(tf.keras.losses.sparse_categorical_crossentropy(y, logits, from_logits=True))
    return np.concatenate([g.numpy().ravel() for g in tape.gradient(loss, gc.variables)])


def test_micro_batches_sum_to_the_whole_batch_gradient():
    gc, x, y = _computer()
    expected = _reference_sum_gradient(gc, x, y)
    for micro in (40, 16, 7, 1):  # one call, uneven tail, and per-sample
        grad, loss = gc.compute(x, y, micro)
        assert grad.shape == (gc.size,) and grad.dtype == np.float32
        np.testing.assert_allclose(grad, expected, rtol=2e-4, atol=2e-5)
        assert loss > 0
    # the sum, not the mean: doubling the samples doubles the gradient
    grad2, _ = gc.compute(np.concatenate([x, x]), np.concatenate([y, y]), 16)
    np.testing.assert_allclose(grad2, 2 * expected, rtol=2e-4, atol=4e-5)


def test_accumulators_reset_between_steps():
    gc, x, y = _computer()
    first, _ = gc.compute(x, y, 8)
    second, _ = gc.compute(x, y, 8)
    np.testing.assert_allclose(first, second, rtol=1e-5, atol=1e-6)


def test_assign_round_trips_flat_parameters_without_rebuilding():
    gc, x, _ = _computer()
    model_before = gc.model
    flat = np.arange(gc.size, dtype=np.float32) / gc.size
    gc.assign(flat)
    assert gc.model is model_before
    np.testing.assert_array_equal(gc.flat_params(), flat)
    names = [n for n, _ in gc.specs()]
    assert len(set(names)) == len(names), "variable names in the layout must be unique"
