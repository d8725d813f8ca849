"""The worker's gradient computer: micro-batched Σ gradients and flat parameter assignment."""

from __future__ import annotations

import numpy as np
import tensorflow as tf

from switchps.workload.data import load_dataset
from switchps.workload.tensorflow.gradients import GradientComputer
from switchps.workload.tensorflow.models import build_model

ALL = np.arange(64)  # the rows a computer is given (40 or 64 of them)


def _computer(name: str = "mlp") -> tuple[GradientComputer, np.ndarray, np.ndarray]:
    data = load_dataset("digits")
    model = build_model(name, data.input_shape, data.num_classes, seed=1, hidden=[16]) if name == "mlp" else \
        build_model(name, data.input_shape, data.num_classes, seed=1)
    return GradientComputer(model, data.x_train[:40], data.y_train[:40]), data.x_train[:40], data.y_train[:40]


def _reference_sum_gradient(gc: GradientComputer, x, y) -> np.ndarray:
    with tf.GradientTape() as tape:
        logits = gc.model(x, training=True)
        loss = tf.reduce_sum(tf.keras.losses.sparse_categorical_crossentropy(y, logits, from_logits=True))
    return np.concatenate([g.numpy().ravel() for g in tape.gradient(loss, gc.variables)])


def test_micro_batches_sum_to_the_whole_batch_gradient():
    gc, x, y = _computer()
    expected = _reference_sum_gradient(gc, x, y)
    for micro in (40, 16, 7, 1):  # one call, uneven tail, and per-sample
        grad, loss = gc.compute(ALL[:40], micro)
        assert grad.shape == (gc.size,) and grad.dtype == np.float32
        np.testing.assert_allclose(grad, expected, rtol=2e-4, atol=2e-5)
        assert loss > 0
    # the sum, not the mean: doubling the samples doubles the gradient
    grad2, _ = gc.compute(np.concatenate([ALL[:40], ALL[:40]]), 16)
    np.testing.assert_allclose(grad2, 2 * expected, rtol=2e-4, atol=4e-5)


def test_a_step_names_its_samples_by_row_in_any_order_and_with_repeats():
    gc, x, y = _computer()
    rows = np.array([3, 17, 3, 39, 0])
    grad, _ = gc.compute(rows, 2)
    np.testing.assert_allclose(grad, _reference_sum_gradient(gc, x[rows], y[rows]), rtol=2e-4, atol=2e-5)


def test_accumulators_reset_between_steps():
    gc, _, _ = _computer()
    first, _ = gc.compute(ALL[:40], 8)
    second, _ = gc.compute(ALL[:40], 8)
    np.testing.assert_allclose(first, second, rtol=1e-5, atol=1e-6)


def test_assign_round_trips_flat_parameters_without_rebuilding():
    gc, _, _ = _computer()
    model_before = gc.model
    flat = np.arange(gc.size, dtype=np.float32) / gc.size
    gc.assign(flat)
    assert gc.model is model_before
    np.testing.assert_array_equal(gc.weights.read(), flat)
    layout = gc.weights.layout()
    names = [v.name for v in (*layout.variables, *layout.state)]
    assert len(set(names)) == len(names), "variable names in the layout must be unique"


def _bn_computer() -> tuple[GradientComputer, np.ndarray, np.ndarray]:
    """A small model with BatchNorm: its moving statistics are the non-trainable state."""
    import keras

    data = load_dataset("digits")
    keras.utils.set_random_seed(0)
    x = keras.Input((64,))
    h = keras.layers.BatchNormalization(name="bn")(keras.layers.Dense(8, name="d1")(x))
    model = keras.Model(x, keras.layers.Dense(10, name="out")(keras.layers.ReLU()(h)))
    return GradientComputer(model, data.x_train[:64], data.y_train[:64]), data.x_train[:64], data.y_train[:64]


def test_the_push_payload_ends_with_the_models_state_after_the_step():
    gc, _, _ = _bn_computer()
    n = gc.weights.trainable_size
    assert gc.size == n + 16, "moving mean and variance of 8 units follow the 8*64+8+8+8+8*10+10 parameters"
    layout = gc.weights.layout()
    assert [v.name for v in layout.state] == ["bn/moving_mean", "bn/moving_variance"]
    initial_state = gc.weights.read()[n:].copy()
    payload, _ = gc.compute(ALL[:64], 16)
    after = gc.weights.read()[n:]
    assert not np.allclose(after, initial_state), "training-mode forward passes move the statistics"
    np.testing.assert_array_equal(payload[n:], after)
    flat = gc.weights.read()
    flat[n:] = np.arange(16, dtype=np.float32)
    gc.assign(flat)
    np.testing.assert_array_equal(gc.model.get_layer("bn").moving_mean.numpy(), np.arange(8))


def test_warm_up_traces_every_function_once_and_leaves_the_model_as_it_was():
    gc, _, _ = _bn_computer()
    before = gc.weights.read()
    gc.warm_up(batch=16, micro_batch=4)
    np.testing.assert_array_equal(gc.weights.read(), before)
    traced = gc.traces
    assert traced == 4, "whole-batch (with and without staged values), micro-batch and drain functions"
    for batch, micro in ((16, 16), (16, 4), (7, 3), (1, 1), (40, 16)):  # every size a step can have
        gc.compute(ALL[:batch], micro)
    gc.accumulate(ALL[:5])
    gc.finish()
    for batch, micro in ((16, 16), (16, 4)):
        gc.stage(before)
        gc.compute(ALL[:batch], micro)
    assert gc.traces == traced, "no step may pay for tracing"


def test_staged_values_are_loaded_before_the_next_gradient_and_every_read():
    gc, _, _ = _bn_computer()
    start = gc.weights.read()
    values = start + np.float32(0.01) * np.arange(gc.size, dtype=np.float32) / gc.size
    expected = {}
    for micro in (64, 16):  # one call; micro-batches (each moves BatchNorm's statistics: the payload's tail)
        gc.assign(values)
        expected[micro] = gc.compute(ALL[:64], micro)[0]
    for micro in (64, 16):
        gc.assign(start)
        gc.stage(values)
        np.testing.assert_array_equal(gc.weights.read(), start)  # staged, not yet loaded
        np.testing.assert_allclose(gc.compute(ALL[:64], micro)[0], expected[micro], rtol=1e-6, atol=1e-7)
    gc.assign(start)
    gc.stage(values)
    np.testing.assert_array_equal(gc.read(), values)
    gc.stage(start)
    gc.assign(values)
    gc.compute(ALL[:64], 64)
    assert not np.array_equal(gc.read()[:gc.weights.trainable_size], start[:gc.weights.trainable_size]), \
        "an assign drops what was staged before it"


def test_a_one_call_step_runs_at_the_staged_values_without_touching_the_variables():
    gc, x, y = _bn_computer()
    start = gc.weights.read()
    values = gc.buffer()
    values[:] = start + np.float32(0.01)
    gc.stage(values)
    payload, _ = gc.compute(ALL[:64], 64)
    np.testing.assert_array_equal(gc.weights.read(), start)  # neither read nor written: the step ran at `values`
    gc.assign(values)
    n = gc.weights.trainable_size
    np.testing.assert_allclose(payload[:n], _reference_sum_gradient(gc, x, y), rtol=2e-4, atol=2e-5)
    np.testing.assert_allclose(payload[n:], gc.weights.read()[n:], rtol=1e-6), \
        "the payload's state is what the training forward pass (the reference's) left"
    np.testing.assert_array_equal(values, start + np.float32(0.01)), "TF only reads the staged vector"


def test_a_one_call_step_advances_the_models_other_state():
    """Dropout's seed generator is state outside the flat vector: each step draws a new mask."""
    import keras

    data = load_dataset("digits")
    keras.utils.set_random_seed(0)
    x = keras.Input((64,))
    model = keras.Model(x, keras.layers.Dense(10)(keras.layers.Dropout(0.5)(keras.layers.Dense(16)(x))))
    gc = GradientComputer(model, data.x_train[:32], data.y_train[:32])
    values = gc.buffer()
    values[:] = gc.weights.read()
    gc.stage(values)
    first, _ = gc.compute(ALL[:32], 32)
    second, _ = gc.compute(ALL[:32], 32)
    assert gc.size == gc.weights.trainable_size and not np.array_equal(first, second)


def test_an_aligned_vector_enters_tf_in_place_and_any_other_as_a_copy():
    from switchps.workload.tensorflow.gradients import _tensor

    gc, _, _ = _computer()
    aligned = gc.buffer()
    aligned[:] = np.arange(gc.size)
    unaligned = np.empty(gc.size + 1, np.float32)[1:]
    unaligned[:] = aligned
    assert aligned.ctypes.data % 64 == 0 and unaligned.ctypes.data % 64
    in_place, copied = _tensor(aligned), _tensor(unaligned)
    aligned[0] = unaligned[0] = -1
    assert in_place.numpy()[0] == -1, "the same memory"
    assert copied.numpy()[0] == 0, "a copy"
    np.testing.assert_array_equal(copied.numpy()[1:], aligned[1:])


def test_a_step_writes_its_payload_where_it_is_sent_from():
    gc, _, _ = _computer()
    expected, _ = gc.compute(ALL[:40], 40)
    area = gc.buffer()
    gc.payload_to = area
    for micro in (40, 16):  # one call; micro-batches
        payload, _ = gc.compute(ALL[:40], micro)
        assert payload is area
        np.testing.assert_allclose(area, expected, rtol=2e-4, atol=2e-5)


def test_limiting_tfs_threads_after_tf_ran_leaves_them_as_they_are():
    """The simulator prepares TF in-process: a session (or a test) that already ran TF must not break it."""
    from switchps.workload.tensorflow.setup import configure_threads

    tf.constant(1.0) + 1.0  # TF has run
    before = tf.config.threading.get_intra_op_parallelism_threads()
    configure_threads(before + 1, 1)
    assert tf.config.threading.get_intra_op_parallelism_threads() == before
