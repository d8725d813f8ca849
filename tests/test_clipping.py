"""Gradient clipping (``optim.clipping``) and weight decay against Keras 3 and torch, on one and two lanes.

Keras: ``clipnorm`` / ``global_clipnorm`` on the same variables, within 1e-6 (float32, the roundings of
``g * c / max(|g|, c)`` against our one multiply by ``c / |g|``). torch: ``clip_grad_norm_`` divides by
``|g| + 1e-6``, a relative 1e-6 / |g| on the factor; the norms here are above 1, so 1e-6 holds. torch's
SGD ``weight_decay`` is L2 added to the gradient, ``p -= lr * (g + wd * p)``: the same math as Keras's
decoupled ``p -= p * wd * lr; p -= lr * g`` without momentum only (with momentum the decay term enters the
velocity). torch's Adam puts epsilon outside the bias correction (``m_hat / (sqrt(v_hat) + eps)``) where
Keras puts it inside (``alpha * m / (sqrt(v) + eps)``): the denominators differ by ``eps * (1 - sqrt(1 -
b2^t))``, a relative ``eps / sqrt(v)`` that torch's default 1e-8 makes 6e-5 here (``sqrt(v)`` of a gradient of
1e-2 after one step is 3e-4); the comparison takes eps = 1e-12, where it is nothing in float32. Keras also
computes ``1 - beta_2^t`` in float32, where 0.999's cancels to a relative 6e-5 (torch: in float64): betas of 0.5
and 0.75, whose powers float32 holds exactly, take that away too, and 1e-6 holds.
"""

from __future__ import annotations

import os

os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")

import keras  # noqa: E402
import numpy as np  # noqa: E402
import pytest  # noqa: E402
import tensorflow as tf  # noqa: E402
import torch  # noqa: E402

from switchps.config.optimizer import OptimizerSpec  # noqa: E402
from switchps.optim import optimizers as O  # noqa: E402
from switchps.optim.clipping import Clip, variable_squares  # noqa: E402
from switchps.optim.lanes import Lanes  # noqa: E402
from switchps.optim.schedules import make_schedule  # noqa: E402
from switchps.protos.layout import make_layout  # noqa: E402
from switchps.ps_server.outer import OuterOptimizers  # noqa: E402
from switchps.ps_server.store import ModelStore  # noqa: E402
from switchps.worker.local_steps import Inner  # noqa: E402

from test_launch import rows, run  # noqa: E402

torch.set_num_threads(1)
tf.config.threading.set_intra_op_parallelism_threads(1)
tf.config.threading.set_inter_op_parallelism_threads(1)

SHAPES = [(7, 5), (11,), (3, 2, 4), (40,)]
SIZES = [int(np.prod(s)) for s in SHAPES]
SIZE = sum(SIZES)
STEPS = 5
LR = 0.05
SCALES = np.array([3.0, 0.05, 1.0, 0.4], np.float32)
"""Each variable's gradient scale: some variables above the per-variable limit, some below."""


def _split(flat: np.ndarray) -> list[np.ndarray]:
    return [part.reshape(shape) for part, shape in zip(np.split(flat, np.cumsum(SIZES)[:-1]), SHAPES)]


def _grads(seed: int = 0) -> tuple[np.ndarray, np.ndarray]:
    rng = np.random.default_rng(seed)
    init = rng.standard_normal(SIZE).astype(np.float32)
    grads = rng.standard_normal((STEPS, SIZE)).astype(np.float32) * np.repeat(SCALES, SIZES)
    return init, grads


def _ours(name: str, clip: Clip, **hyper: float) -> O.Optimizer:
    opt = O.make_optimizer(name, SIZE, make_schedule("constant", LR), **hyper)
    opt.clip = clip
    opt.set_variables(SIZES)
    return opt


CLIPS = [("clipnorm", Clip(norm=1.0)), ("global_clipnorm", Clip(global_norm=2.0))]
KERAS = [("sgd", {}, keras.optimizers.SGD), ("momentum", {}, lambda lr, **kw: keras.optimizers.SGD(lr, 0.9, **kw)),
         ("adam", {}, keras.optimizers.Adam), ("adamw", {}, keras.optimizers.AdamW),
         ("rmsprop", {"weight_decay": 0.1}, lambda lr, **kw: keras.optimizers.RMSprop(lr, weight_decay=0.1, **kw))]


@pytest.mark.parametrize("block", [O.BLOCK, 16])  # 16: variables cut by blocks, blocks by variables
@pytest.mark.parametrize(("keyword", "clip"), CLIPS, ids=[c[0] for c in CLIPS])
@pytest.mark.parametrize(("name", "hyper", "keras_factory"), KERAS, ids=[k[0] for k in KERAS])
def test_clipping_matches_keras(monkeypatch, block, keyword, clip, name, hyper, keras_factory):
    """The mean gradient (a sum over 4 samples, scaled by 1/4) clipped as Keras clips the same gradient."""
    monkeypatch.setattr(O, "BLOCK", block)
    init, grads = _grads()
    variables = [keras.Variable(x, dtype="float32") for x in _split(init)]
    kopt = keras_factory(LR, **{keyword: getattr(clip, "norm" if keyword == "clipnorm" else "global_norm")})
    opt, params = _ours(name, clip, **hyper), init.copy()
    for g in grads:
        kopt.apply_gradients(zip([tf.constant(x) for x in _split(g)], variables))
        opt.apply(params, g * np.float32(4), grad_scale=0.25)
        assert opt.last_grad_norm == pytest.approx(float(np.linalg.norm(g.astype(np.float64))), rel=1e-5)
        norms = [float(np.linalg.norm(x)) for x in _split(g)]
        assert (max(norms) > clip.norm) if clip.norm else (opt.last_grad_norm > clip.global_norm), "the limit binds"
        assert clip.global_norm or min(norms) < clip.norm, "and some variables are below it"
        np.testing.assert_allclose(params, np.concatenate([np.asarray(v).ravel() for v in variables]),
                                   rtol=1e-6, atol=1e-6)


def test_a_clip_limits_the_step_and_leaves_small_gradients_alone():
    """Plain SGD's step is ``lr`` times the clipped gradient: per variable, the variables above the limit
    come out at exactly the limit's norm and the others unchanged; globally, the whole step at the limit."""
    init, grads = _grads()
    for clip in (Clip(norm=1.0), Clip(global_norm=2.0)):
        opt, params = _ours("sgd", clip), init.copy()
        opt.apply(params, grads[0].copy())
        steps = _split((init - params) / np.float32(LR))
        norms = [float(np.linalg.norm(s)) for s in steps]
        if clip.norm:
            for norm, g in zip(norms, _split(grads[0])):
                assert norm == pytest.approx(min(1.0, float(np.linalg.norm(g))), rel=1e-4)
        else:
            assert float(np.linalg.norm(np.concatenate([s.ravel() for s in steps]))) == pytest.approx(2.0, rel=1e-4)


@pytest.mark.parametrize("spec", [{"clip_norm": 1.0}, {"global_clip_norm": 2.0}, {"params": {"weight_decay": 0.3}},
                                  {"clip_norm": 0.5, "params": {"weight_decay": 0.1}}],
                         ids=["clip_norm", "global_clip_norm", "weight_decay", "clip_norm_and_decay"])
@pytest.mark.parametrize("name", ["sgd", "momentum", "adam", "adagrad"])
def test_one_and_two_lanes_are_bit_identical(monkeypatch, name, spec):
    monkeypatch.setattr(O, "BLOCK", 16)
    init, grads = _grads(1)
    make = O.optimizer_factory(OptimizerSpec(name=name, learning_rate=LR, **spec))
    lanes = Lanes(2)
    try:
        results = []
        for on in (O.SERIAL, lanes):
            opt, params = make(SIZE), init.copy()
            opt.set_variables(SIZES)
            for g in grads:
                for _ in opt.steps(params, g * np.float32(3), grad_scale=1 / 3, lanes=on):
                    pass
            results.append(params)
    finally:
        lanes.close()
    np.testing.assert_array_equal(results[0], results[1])
    assert not np.array_equal(results[0], init)


def test_the_norms_pieces_are_the_same_on_any_lanes():
    g = np.random.default_rng(2).standard_normal(SIZE).astype(np.float32)
    lanes = Lanes(2)
    try:
        two = variable_squares(g, SIZES, 16, lanes)
    finally:
        lanes.close()
    one = variable_squares(g, SIZES, 16)
    np.testing.assert_array_equal(one, two)
    np.testing.assert_allclose(one, [float(np.dot(p.ravel(), p.ravel())) for p in _split(g)], rtol=1e-6)
    assert list(variable_squares(np.zeros(0, np.float32), [0, 0], 16)) == [0.0, 0.0]


# ------------------------------------------------------------------------ torch


def _torch_run(opt_factory, init: np.ndarray, grads: np.ndarray, max_norm: float | None = None) -> np.ndarray:
    p = torch.nn.Parameter(torch.tensor(init))
    opt = opt_factory([p])
    for g in grads:
        p.grad = torch.tensor(g)
        if max_norm is not None:
            torch.nn.utils.clip_grad_norm_([p], max_norm)
        opt.step()
    return p.detach().numpy()


def _our_run(name: str, init: np.ndarray, grads: np.ndarray, clip: Clip = Clip(), **hyper: float) -> np.ndarray:
    opt, params = _ours(name, clip, **hyper), init.copy()
    for g in grads:
        opt.apply(params, g.copy())
    return params


def test_adamw_matches_torch():
    init, grads = _grads(3)
    theirs = _torch_run(lambda ps: torch.optim.AdamW(ps, LR, (0.5, 0.75), 1e-12, weight_decay=0.1), init, grads)
    ours = _our_run("adamw", init, grads, beta_1=0.5, beta_2=0.75, epsilon=1e-12, weight_decay=0.1)
    np.testing.assert_allclose(ours, theirs,
                               rtol=1e-6, atol=1e-6)


def test_sgd_weight_decay_matches_torch_without_momentum_only():
    init, grads = _grads(4)
    theirs = _torch_run(lambda ps: torch.optim.SGD(ps, LR, weight_decay=0.3), init, grads)
    np.testing.assert_allclose(_our_run("sgd", init, grads, weight_decay=0.3), theirs, rtol=1e-6, atol=1e-6)
    coupled = _torch_run(lambda ps: torch.optim.SGD(ps, LR, momentum=0.9, weight_decay=0.3), init, grads)
    assert not np.allclose(_our_run("momentum", init, grads, weight_decay=0.3), coupled, rtol=1e-4, atol=1e-4), \
        "with momentum torch's L2 term enters the velocity: not Keras's decoupled decay"


@pytest.mark.parametrize("name", ["sgd", "momentum"])
def test_global_clipping_matches_torch_clip_grad_norm(name):
    init, grads = _grads(5)
    momentum = 0.9 if name == "momentum" else 0.0
    theirs = _torch_run(lambda ps: torch.optim.SGD(ps, LR, momentum=momentum), init, grads, max_norm=2.0)
    ours = _our_run(name, init, grads, Clip(global_norm=2.0))
    # torch's SGD with momentum: m = mu*m + g; p -= lr*m, Keras's m = mu*m - lr*g; p += m: equal math
    np.testing.assert_allclose(ours, theirs, rtol=1e-6, atol=1e-6)


# ------------------------------------------------------------------------ state, layout


def test_weight_decay_travels_in_the_state_dict_and_an_older_checkpoint_still_loads():
    src = _ours("momentum", Clip(), weight_decay=0.25)
    d = src.state_dict()
    assert d["hyper.weight_decay"] == 0.25
    dst = _ours("momentum", Clip())
    dst.load_state_dict(d)
    assert dst.hyper["weight_decay"] == 0.25
    older = {k: v for k, v in d.items() if k != "hyper.weight_decay"}  # before every optimizer took one
    again = _ours("momentum", Clip(), weight_decay=0.5)
    again.load_state_dict(older)
    assert again.hyper["weight_decay"] == 0.5, "the configured decay stays"
    with pytest.raises(ValueError, match="keys"):
        again.load_state_dict({k: v for k, v in d.items() if k != "hyper.momentum"})


def test_the_store_gives_its_optimizer_the_registered_variables():
    store = ModelStore(O.optimizer_factory(OptimizerSpec(clip_norm=1.0)))
    store.initialize(make_layout([(f"v{i}", s) for i, s in enumerate(SHAPES)], [("bn", (3,))]),
                     np.zeros(SIZE + 3, np.float32))
    assert store.optimizer.variables == tuple(SIZES) and store.optimizer.clip == Clip(norm=1.0)
    with pytest.raises(ValueError, match="summing"):
        store.optimizer.set_variables(SIZES[:-1])


def test_the_outer_and_inner_optimizers_of_local_steps_clip_over_the_variables():
    spec = OptimizerSpec(name="nesterov", clip_norm=1.0)
    assert OuterOptimizers(SIZE, SIZES).get(spec).variables == tuple(SIZES)
    assert Inner(SIZE, SIZES).begin(spec, reset=False).variables == tuple(SIZES)
    assert OuterOptimizers(SIZE).get(spec).variables == (SIZE,), "no layout given: one variable"


@pytest.mark.parametrize("clip", [{"norm": 0.0}, {"global_norm": -1.0}, {"norm": 1.0, "global_norm": 1.0}])
def test_a_bad_clip_is_refused(clip):
    with pytest.raises(ValueError, match="clip"):
        Clip(**clip)


# ------------------------------------------------------------------------ end to end


@pytest.mark.integration
def test_the_quickstart_trains_with_a_global_clip_and_weight_decay(tmp_path):
    """A real ``switchps run`` (PS, 4 workers, evaluator) with both on: accuracy rises from chance (0.1 on
    digits' 10 classes) to 0.8 within 3 epochs."""
    proc, run_dir = run(tmp_path, "--set", "optimizer.global_clip_norm=0.5", "--set",
                        "optimizer.params={weight_decay: 0.01}", "--set", "train.epochs=3",
                        "--set", "eval.target_accuracy=null")
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert run_dir is not None
    saved = (run_dir / "config.yaml").read_text()
    assert "global_clip_norm: 0.5" in saved and "weight_decay: 0.01" in saved
    evals = rows(run_dir / "eval.csv")
    assert float(evals[-1]["test_accuracy"]) >= 0.8, evals
