"""Tests for switchps.optim.optimizers against Keras 3.

Measured ``apply`` time for a 25M-float32 vector (2-core AMD EPYC, 1 thread,
BLOCK=131072, best of 5, three runs):
    sgd 10-12 ms, momentum 16-17 ms, nesterov 22 ms, rmsprop 35-38 ms,
    adam 46-47 ms, adagrad 31-32 ms
(same code unblocked, BLOCK=25M: 12-13 / 24-31 / 35-36 / 56-57 / 74-92 / 46-53 ms).
Plain SGD as BLAS's axpy with the mean's scale folded in: 5.6-5.8 ms against 7.3-7.5 ms for numpy's two
passes, side by side on 2026-11-26 (``OMP_NUM_THREADS=1``, best of 5, two runs each).
"""

from __future__ import annotations

import copy

import os

os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")

import keras  # noqa: E402
import numpy as np  # noqa: E402
import pytest  # noqa: E402
import tensorflow as tf  # noqa: E402

from threadpoolctl import threadpool_info, threadpool_limits  # noqa: E402

from switchps.optim import optimizers as O  # noqa: E402
from switchps.optim.schedules import make_schedule, rate  # noqa: E402

pytest_plugins = ["cluster"]  # cluster_factory: a PS on loopback

tf.config.threading.set_intra_op_parallelism_threads(1)
tf.config.threading.set_inter_op_parallelism_threads(1)

SHAPES = [(7, 5), (11,), (3, 2, 4)]
SIZE = sum(int(np.prod(s)) for s in SHAPES)
STEPS = 6
KS = keras.optimizers.schedules


def _split(flat: np.ndarray) -> list[np.ndarray]:
    out, start = [], 0
    for shape in SHAPES:
        n = int(np.prod(shape))
        out.append(flat[start:start + n].reshape(shape))
        start += n
    return out


# name, hyper for make_optimizer, keras optimizer factory (learning_rate -> optimizer)
CASES = [
    ("sgd", {}, lambda lr: keras.optimizers.SGD(lr)),
    ("sgd", {"momentum": 0.5}, lambda lr: keras.optimizers.SGD(lr, momentum=0.5)),
    ("momentum", {}, lambda lr: keras.optimizers.SGD(lr, momentum=0.9)),
    ("nesterov", {}, lambda lr: keras.optimizers.SGD(lr, momentum=0.9, nesterov=True)),
    ("rmsprop", {}, lambda lr: keras.optimizers.RMSprop(lr)),
    ("rmsprop", {"momentum": 0.5, "rho": 0.8},
     lambda lr: keras.optimizers.RMSprop(lr, rho=0.8, momentum=0.5)),
    ("adam", {}, lambda lr: keras.optimizers.Adam(lr)),
    ("adam", {"beta_1": 0.8, "epsilon": 1e-3},
     lambda lr: keras.optimizers.Adam(lr, beta_1=0.8, epsilon=1e-3)),
    ("adagrad", {}, lambda lr: keras.optimizers.Adagrad(lr)),
    ("adamw", {}, lambda lr: keras.optimizers.AdamW(lr)),
    ("adamw", {"weight_decay": 0.1, "beta_2": 0.99},
     lambda lr: keras.optimizers.AdamW(lr, weight_decay=0.1, beta_2=0.99)),
    # weight decay on every optimizer: Keras's base ``Optimizer(weight_decay=...)``, decoupled
    ("sgd", {"weight_decay": 0.2}, lambda lr: keras.optimizers.SGD(lr, weight_decay=0.2)),
    ("momentum", {"weight_decay": 0.2}, lambda lr: keras.optimizers.SGD(lr, momentum=0.9, weight_decay=0.2)),
    ("nesterov", {"weight_decay": 0.2},
     lambda lr: keras.optimizers.SGD(lr, momentum=0.9, nesterov=True, weight_decay=0.2)),
    ("rmsprop", {"weight_decay": 0.2, "momentum": 0.5},
     lambda lr: keras.optimizers.RMSprop(lr, momentum=0.5, weight_decay=0.2)),
    ("adam", {"weight_decay": 0.2}, lambda lr: keras.optimizers.Adam(lr, weight_decay=0.2)),
    ("adagrad", {"weight_decay": 0.2}, lambda lr: keras.optimizers.Adagrad(lr, weight_decay=0.2)),
]


@pytest.mark.parametrize("block", [O.BLOCK, 16])  # 16: many blocks, partial last one
@pytest.mark.parametrize(("name", "hyper", "keras_factory"), CASES,
                         ids=[f"{n}-{h}" if h else n for n, h, _ in CASES])
def test_matches_keras(monkeypatch, block, name, hyper, keras_factory):
    monkeypatch.setattr(O, "BLOCK", block)
    rng = np.random.default_rng(0)
    init = rng.standard_normal(SIZE).astype(np.float32)
    grads = rng.standard_normal((STEPS, SIZE)).astype(np.float32)

    variables = [keras.Variable(x, dtype="float32") for x in _split(init)]
    kopt = keras_factory(KS.ExponentialDecay(0.05, decay_steps=2, decay_rate=0.7))
    opt = O.make_optimizer(name, SIZE, make_schedule(
        "exponential", 0.05, decay_steps=2, decay_rate=0.7), **hyper)
    params = init.copy()
    for g in grads:
        kopt.apply_gradients(zip([tf.constant(x) for x in _split(g)], variables))
        opt.apply(params, g.copy())
        expected = np.concatenate([np.asarray(v).ravel() for v in variables])
        np.testing.assert_allclose(params, expected, rtol=1e-6, atol=1e-6)
    assert opt.iterations == int(kopt.iterations) == STEPS


# ------------------------------------------------------------------------ schedules

STEPS_TO_CHECK = list(range(0, 160)) + [500, 10_000]


@pytest.mark.parametrize(("ours", "theirs"), [
    (make_schedule("step", 1.0, boundaries=[10, 50, 100], values=[1.0, 0.5, 0.1, 0.01]),
     KS.PiecewiseConstantDecay([10, 50, 100], [1.0, 0.5, 0.1, 0.01])),
    (make_schedule("step", 0.4, boundaries=[5, 20], decay_rate=0.5),
     KS.PiecewiseConstantDecay([5, 20], [0.4, 0.2, 0.1])),
    (make_schedule("exponential", 0.1, decay_steps=7, decay_rate=0.9),
     KS.ExponentialDecay(0.1, decay_steps=7, decay_rate=0.9)),
    (make_schedule("exponential", 0.1, decay_steps=7, decay_rate=0.9, staircase=True),
     KS.ExponentialDecay(0.1, decay_steps=7, decay_rate=0.9, staircase=True)),
    (make_schedule("cosine", 0.2, decay_steps=100),
     KS.CosineDecay(0.2, decay_steps=100)),
    (make_schedule("cosine", 0.2, decay_steps=100, alpha=0.1),
     KS.CosineDecay(0.2, decay_steps=100, alpha=0.1)),
], ids=["piecewise", "piecewise-decay-rate", "exponential", "staircase", "cosine",
        "cosine-alpha"])
def test_schedule_matches_keras(ours, theirs):
    expected = [float(theirs(step)) for step in STEPS_TO_CHECK]
    # Keras evaluates in float32 (cosine loses ~1e-8 absolute near the end); ours in float64.
    np.testing.assert_allclose([ours(s) for s in STEPS_TO_CHECK], expected,
                               rtol=1e-6, atol=1e-7)


def test_constant_schedule():
    assert rate(make_schedule("constant", 0.3), 12345) == 0.3


def test_warmup():
    sched = make_schedule("constant", 0.1, warmup_steps=4)
    np.testing.assert_allclose([sched(s) for s in range(6)],
                               [0.025, 0.05, 0.075, 0.1, 0.1, 0.1])
    base = make_schedule("cosine", 0.2, decay_steps=50)
    warm = make_schedule("cosine", 0.2, decay_steps=50, warmup_steps=10)
    for s in range(60):
        assert warm(s) == pytest.approx(base(s) * min(1.0, (s + 1) / 10))


@pytest.mark.parametrize(("kind", "kwargs", "match"), [
    ("linear", {}, "unknown schedule kind"),
    ("constant", {"decay_steps": 10}, "does not take decay_steps"),
    ("cosine", {"decay_steps": 10, "staircase": True}, "does not take staircase"),
    ("step", {"boundaries": [10], "values": [1.0], "alpha": 0.5}, "does not take alpha"),
    ("step", {"values": [1.0]}, "boundaries"),
    ("step", {"boundaries": [10, 20], "values": [1.0, 0.5]}, "len"),
    ("step", {"boundaries": [20, 10], "values": [1.0, 0.5, 0.1]}, "strictly increasing"),
    ("step", {"boundaries": [10]}, "values or decay_rate"),
    ("step", {"boundaries": [10], "values": [1.0, 0.5], "decay_rate": 0.5}, "not both"),
    ("exponential", {"decay_rate": 0.5}, "decay_steps"),
    ("exponential", {"decay_steps": 0, "decay_rate": 0.5}, "decay_steps"),
    ("exponential", {"decay_steps": 10}, "decay_rate"),
    ("exponential", {"decay_steps": 10, "decay_rate": -1.0}, "decay_rate"),
    ("cosine", {"decay_steps": 10, "alpha": 2.0}, "alpha"),
    ("constant", {"warmup_steps": -1}, "warmup_steps"),
])
def test_bad_schedule_args(kind, kwargs, match):
    with pytest.raises(ValueError, match=match):
        make_schedule(kind, 0.1, **kwargs)


def test_negative_learning_rate():
    with pytest.raises(ValueError, match="learning_rate"):
        make_schedule("constant", -0.1)


# ------------------------------------------------------------------------ optimizer API

CONST = make_schedule("constant", 0.1)


def test_lr_factor_halves_sgd_step():
    rng = np.random.default_rng(1)
    p0 = rng.standard_normal(100).astype(np.float32)
    g = rng.standard_normal(100).astype(np.float32)
    full, half = p0.copy(), p0.copy()
    assert O.make_optimizer("sgd", 100, CONST).apply(full, g.copy()) == pytest.approx(0.1)
    assert O.make_optimizer("sgd", 100, CONST).apply(half, g.copy(), 0.5) == pytest.approx(0.05)
    np.testing.assert_allclose(half - p0, 0.5 * (full - p0), rtol=1e-5, atol=1e-7)


@pytest.mark.parametrize("name", ["sgd", "momentum", "nesterov"])
def test_sgd_folds_a_sums_scale_into_its_step(monkeypatch, name):
    """``grad_scale`` (a summed gradient made a mean) folds into SGD's step size, with no pass of its own:
    the steps are those at the mean gradient; plain SGD's block-wise axpy writes ``params`` in place."""
    monkeypatch.setattr(O, "BLOCK", 16)
    rng = np.random.default_rng(2)
    p0 = rng.standard_normal(100).astype(np.float32)
    grads = rng.standard_normal((3, 100)).astype(np.float32)
    folded, mean = p0.copy(), p0.copy()
    a, b = O.make_optimizer(name, 100, CONST), O.make_optimizer(name, 100, CONST)
    assert a.folds_scale
    for g in grads:
        a.apply(folded, g * np.float32(3), grad_scale=1 / 3)
        b.apply(mean, g.copy())
    np.testing.assert_allclose(folded, mean, rtol=1e-6, atol=1e-6)
    assert not np.allclose(folded, p0)


def test_the_ps_runs_its_blas_passes_on_one_thread(cluster_factory):
    """OpenBLAS's own threads for the check and the update fought the PS's on 2 cores (transport.py)."""
    with threadpool_limits(2, user_api="blas"):
        cluster_factory(workers=1, size=4)
        blas = [lib for lib in threadpool_info() if lib["user_api"] == "blas"]
        assert blas and all(lib["num_threads"] == 1 for lib in blas), blas


def test_learning_rate_schedule_and_scale():
    opt = O.make_optimizer("sgd", 1, make_schedule(
        "step", 1.0, boundaries=[0], values=[1.0, 0.5]))
    params = np.zeros(1, np.float32)
    assert opt.iterations == 0 and opt.learning_rate() == 1.0
    assert opt.apply(params, np.ones(1, np.float32)) == 1.0
    assert opt.iterations == 1 and params[0] == -1.0
    opt.lr_scale = 0.5
    assert opt.learning_rate() == 0.25
    assert opt.apply(params, np.ones(1, np.float32), lr_factor=0.5) == 0.125
    assert opt.iterations == 2 and params[0] == -1.125


def _stepped(name: str, steps: int = 3, **hyper) -> O.Optimizer:
    rng = np.random.default_rng(2)
    opt = O.make_optimizer(name, 50, CONST, **hyper)
    params = rng.standard_normal(50).astype(np.float32)
    for _ in range(steps):
        opt.apply(params, rng.standard_normal(50).astype(np.float32))
    return opt


@pytest.mark.parametrize("name", sorted(O.OPTIMIZERS))
def test_reset_state(name):
    opt = _stepped(name)
    opt.reset_state()
    assert opt.iterations == 3
    for key, arr in opt.state.items():
        expected = np.float32(0.1) if key == "accumulator" else 0.0
        assert arr.dtype == np.float32 and np.all(arr == expected), key


@pytest.mark.parametrize(("name", "scaled"), [
    ("sgd", set()), ("momentum", {"momentum"}), ("nesterov", {"momentum"}),
    ("rmsprop", set()), ("adam", {"momentum"}), ("adagrad", set()),
])
def test_scale_state(name, scaled):
    opt = _stepped(name)
    twin = copy.deepcopy(opt)
    before = {k: v.copy() for k, v in opt.state.items()}
    opt.scale_state(0.5)
    assert scaled <= set(opt.state), "every state slot the rule scales exists"
    for key, arr in opt.state.items():
        factor = np.float32(0.5) if key in scaled else np.float32(1.0)
        np.testing.assert_array_equal(arr, before[key] * factor, err_msg=key)
    params, grad = np.ones(50, np.float32), np.full(50, 0.5, np.float32)
    twin_params = params.copy()
    opt.apply(params, grad.copy())  # ``apply`` uses the gradient as scratch space
    twin.apply(twin_params, grad.copy())
    if scaled:
        assert not np.array_equal(params, twin_params), "scaling the first moment changes the next step"
    else:  # plain SGD, RMSprop without momentum and Adagrad: nothing to scale, the next step is unchanged
        np.testing.assert_array_equal(params, twin_params)


def test_scale_state_rmsprop_momentum_only():
    opt = _stepped("rmsprop", momentum=0.5)
    velocity, momentum = opt.state["velocity"].copy(), opt.state["momentum"].copy()
    opt.scale_state(2.0)
    np.testing.assert_array_equal(opt.state["velocity"], velocity)
    np.testing.assert_array_equal(opt.state["momentum"], momentum * 2)


@pytest.mark.parametrize("name", sorted(O.OPTIMIZERS))
def test_state_dict_roundtrip(name):
    src = _stepped(name)
    src.lr_scale = 0.7
    d = src.state_dict()
    assert d["iterations"] == 3 and d["lr_scale"] == 0.7
    assert all(d[f"hyper.{k}"] == v for k, v in src.hyper.items())
    for key, arr in src.state.items():
        assert d[key] is not arr  # copies
    dst = O.make_optimizer(name, 50, CONST)
    dst.load_state_dict(d)
    rng = np.random.default_rng(3)
    p, g = rng.standard_normal(50).astype(np.float32), rng.standard_normal(50).astype(np.float32)
    p_src, p_dst = p.copy(), p.copy()
    assert src.apply(p_src, g.copy()) == dst.apply(p_dst, g.copy())
    np.testing.assert_array_equal(p_src, p_dst)
    assert dst.iterations == 4


def test_load_state_dict_takes_the_saved_hyper_parameters_and_rejects_mismatches():
    src = _stepped("momentum")
    src.hyper["momentum"] = 0.025  # as the asynchrony rule leaves it after a switch
    dst = O.make_optimizer("momentum", 50, CONST, momentum=0.9)
    dst.load_state_dict(src.state_dict())
    assert dst.hyper["momentum"] == 0.025
    d = _stepped("adam").state_dict()
    with pytest.raises(ValueError, match="beta_1"):
        O.make_optimizer("adam", 50, CONST).load_state_dict({**d, "hyper.beta_1": 1.5})
    with pytest.raises(ValueError, match="shape"):
        O.make_optimizer("adam", 49, CONST).load_state_dict(d)
    with pytest.raises(ValueError, match="keys"):
        O.make_optimizer("adagrad", 50, CONST).load_state_dict(d)


def test_unknown_names():
    with pytest.raises(ValueError, match="'lamb'"):
        O.make_optimizer("lamb", 10, CONST)
    with pytest.raises(ValueError, match="'beta_1'"):
        O.make_optimizer("sgd", 10, CONST, beta_1=0.9)
    with pytest.raises(ValueError, match="rho"):
        O.make_optimizer("rmsprop", 10, CONST, rho=1.5)


def test_apply_validates_inputs_and_converts_grad():
    opt = O.make_optimizer("sgd", 4, CONST)
    with pytest.raises(ValueError, match="params"):
        opt.apply(np.zeros(4, np.float64), np.zeros(4, np.float32))
    with pytest.raises(ValueError, match="grad"):
        opt.apply(np.zeros(4, np.float32), np.zeros(5, np.float32))
    params, grad = np.zeros(4, np.float32), np.ones(4, np.float64)
    opt.apply(params, grad)
    np.testing.assert_allclose(params, -0.1)
    np.testing.assert_array_equal(grad, 1.0)  # non-float32 grad is copied, not overwritten


def test_empty_vector():
    opt = O.make_optimizer("adam", 0, CONST)
    opt.apply(np.zeros(0, np.float32), np.zeros(0, np.float32))
    assert opt.iterations == 1
