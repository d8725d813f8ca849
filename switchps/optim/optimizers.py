"""Server-side optimizers on flat float32 parameter vectors.

The update rules reproduce Keras 3 (``keras.optimizers.SGD``, ``RMSprop``,
``Adam``, ``Adagrad``) operation by operation in float32, with the same default
hyper-parameters, so a parameter server and a Keras model trained with the same
gradients stay numerically interchangeable. The exceptions round differently in
the last bit: plain SGD is BLAS's axpy, ``p += (-lr) * g`` in one pass (one
rounding where Keras has two), and SGD folds a sum's ``1 / samples`` into its rate
(``folds_scale``); the tests hold both to Keras within 1e-6.

All updates run in place over blocks of ``BLOCK`` elements, so the per-step
temporaries (one block-sized scratch buffer plus the gradient itself, which is
used as scratch) stay in cache and no full-size temporary is allocated. With
several threads (``lanes.Lanes``, ``runtime.ps_threads``) the same blocks are
updated on several threads, each with its own scratch buffer: every update is
elementwise and its per-step scalars (the rate, Adam's bias-corrected step) are
computed once before the blocks, so the results are bit-identical to one thread's.

Every optimizer takes ``weight_decay`` (Keras 3's, decoupled: ``p -= p*wd*lr`` before the step, as
``keras.optimizers.Optimizer`` does when ``weight_decay`` is set; AdamW is Adam with a default of 0.004), in
the same block loop, with no pass at all when it is 0; and clips the mean gradient first when its ``clip``
says so (``clipping.Clip``: Keras's ``clipnorm`` / ``global_clipnorm``).
"""

from __future__ import annotations

import ctypes
from collections.abc import Callable, Iterator, Sequence
from typing import TYPE_CHECKING, ClassVar

import numpy as np
from scipy.linalg import cython_blas
from scipy.linalg.blas import saxpy

from switchps.optim.clipping import Clip
from switchps.optim.lanes import SERIAL, Lanes
from switchps.optim.schedules import LRSchedule, make_schedule

if TYPE_CHECKING:
    from switchps.config.optimizer import OptimizerSpec

BLOCK = 131072
"""Elements per block (512 KiB per float32 array), read when an optimizer is created."""

_f32 = np.float32
Axpy = Callable[[np.ndarray, np.ndarray, np.float32], None]
"""``axpy(x, y, a)``: ``y += a * x`` in place, BLAS's one pass."""


def _axpy_holding_gil(x: np.ndarray, y: np.ndarray, a: np.float32) -> None:
    saxpy(x, y, a=a)


def _axpy_releasing_gil() -> Axpy:
    """The same BLAS ``saxpy`` as ``_axpy_holding_gil`` (scipy's, through its Cython table), called through
    ctypes, which releases the GIL for the call: scipy's wrapper holds it, so plain SGD on two threads
    ran one block at a time (2 threads: 1.16x one thread's time, 131,072 elements in cache). The ctypes
    call costs some 6 us more, so one thread keeps scipy's wrapper."""
    api = ctypes.PyDLL(None)  # Python's own C API, with function objects of our own to declare
    api.PyCapsule_GetName.restype, api.PyCapsule_GetName.argtypes = ctypes.c_char_p, [ctypes.py_object]
    api.PyCapsule_GetPointer.restype = ctypes.c_void_p
    api.PyCapsule_GetPointer.argtypes = [ctypes.py_object, ctypes.c_char_p]
    capsule = cython_blas.__pyx_capi__["saxpy"]
    int_p, float_p = ctypes.POINTER(ctypes.c_int), ctypes.POINTER(ctypes.c_float)
    kernel = ctypes.CFUNCTYPE(None, int_p, float_p, ctypes.c_void_p, int_p, ctypes.c_void_p, int_p)(
        api.PyCapsule_GetPointer(capsule, api.PyCapsule_GetName(capsule)))
    one = ctypes.c_int(1)

    def axpy(x: np.ndarray, y: np.ndarray, a: np.float32) -> None:
        assert x.size == y.size and x.flags.c_contiguous and y.flags.c_contiguous and y.flags.writeable
        kernel(ctypes.c_int(x.size), ctypes.c_float(float(a)), x.ctypes.data, one, y.ctypes.data, one)
    return axpy


_axpy_threaded = _axpy_releasing_gil()


class Optimizer:
    """Base: holds flat float32 state arrays sized like the flat parameter vector.

    Public attributes: ``name``, ``size``, ``schedule``, ``hyper`` (all
    hyper-parameters, defaults filled in), ``iterations`` (applied updates, as
    Keras's ``iterations``), ``lr_scale`` (multiplier on the schedule, 1.0),
    ``state`` (slot name -> float32 array of ``size``), ``clip`` (``optimizer_factory``
    sets it from the config; no checkpoint holds it), ``variables`` (see ``set_variables``) and ``last_grad_norm``
    (the last update's mean gradient's L2 norm before clipping; None without
    clipping, which computes no norm). Not thread-safe: callers serialise ``apply``
    and the state methods.

    Subclasses declare ``defaults`` (accepted hyper-parameters), ``first_moments``
    (state rescaled by :meth:`scale_state`) and implement ``_slots`` (state
    arrays and their initial values) and ``_update`` (one block), optionally
    ``_step_size`` (per-step scalar derived from the learning rate). ``_update`` runs on
    several threads at once for disjoint blocks (see ``steps``): it touches nothing but
    its blocks, its scratch and read-only attributes.
    """

    name: ClassVar[str]
    defaults: ClassVar[dict[str, float]]
    first_moments: ClassVar[tuple[str, ...]] = ()
    folds_scale: ClassVar[bool] = False
    """``_update`` uses ``g`` only as ``lr * g``: ``grad_scale`` folds into the step size (a pass less)."""

    def __init__(self, size: int, schedule: LRSchedule, **hyper: float) -> None:
        if size < 0:
            raise ValueError(f"size must be >= 0, got {size}")
        for key in hyper:
            if key not in self.defaults:
                raise ValueError(
                    f"{self.name}: unknown hyper-parameter {key!r}; "
                    f"accepted: {', '.join(sorted(self.defaults)) or 'none'}"
                )
        self.size = size
        self.schedule = schedule
        self.hyper = {key: float(hyper.get(key, default)) for key, default in self.defaults.items()}
        self._validate()
        self.iterations = 0
        self.lr_scale = 1.0
        self.last_lr = 0.0
        self.clip = Clip()
        self.variables: tuple[int, ...] = (size,)
        self.last_grad_norm: float | None = None
        self.state = {key: np.full(size, init, np.float32) for key, init in self._slots().items()}
        self._block = BLOCK
        self._scratch = [np.empty(min(size, BLOCK), np.float32)]  # one per lane
        self._axpy: Axpy = _axpy_holding_gil

    def _validate(self) -> None:
        for key in ("momentum", "rho"):
            if key in self.hyper and not 0.0 <= self.hyper[key] <= 1.0:
                raise ValueError(f"{self.name}: {key} must be in [0, 1], got {self.hyper[key]}")
        for key in ("beta_1", "beta_2"):
            if key in self.hyper and not 0.0 <= self.hyper[key] < 1.0:
                raise ValueError(f"{self.name}: {key} must be in [0, 1), got {self.hyper[key]}")
        for key in ("epsilon", "initial_accumulator_value", "weight_decay"):
            if key in self.hyper and not self.hyper[key] >= 0.0:
                raise ValueError(f"{self.name}: {key} must be >= 0, got {self.hyper[key]}")

    def set_variables(self, sizes: Sequence[int]) -> None:
        """The sizes of the variables the vector holds, in order: per-variable clipping's boundaries (the PS's
        store sets them from the layout a model registers). Unset, the vector is one variable."""
        if sum(sizes) != self.size or min(sizes, default=0) < 0:
            raise ValueError(f"{self.name}: variables of sizes summing to {self.size} expected, got {sum(sizes)}")
        self.variables = tuple(sizes)

    def _slots(self) -> dict[str, float]:
        """State arrays to allocate, with their initial (reset) values."""
        return {}

    def _step_size(self, lr: np.float32) -> np.float32:
        """Per-step scalar handed to ``_update`` (the learning rate unless overridden)."""
        return lr

    def _update(self, p: np.ndarray, g: np.ndarray, tmp: np.ndarray, lr: np.float32,
                block: slice) -> None:
        """Update the block ``p`` (``= params[block]``) in place from gradient ``g``.

        ``g`` and ``tmp`` are scratch; state arrays are accessed as
        ``self.state[key][block]``.
        """
        raise NotImplementedError

    def learning_rate(self) -> float:
        """``schedule(iterations) * lr_scale`` (a constant schedule is its float)."""
        s = self.schedule
        return float(s(self.iterations) if callable(s) else s) * self.lr_scale

    def apply(self, params: np.ndarray, grad: np.ndarray, lr_factor: float = 1.0, grad_scale: float = 1.0) -> float:
        """Apply one update in place to ``params`` and return the effective learning rate (see ``steps``)."""
        for _ in self.steps(params, grad, lr_factor, grad_scale):
            pass
        return self.last_lr

    def steps(self, params: np.ndarray, grad: np.ndarray, lr_factor: float = 1.0, grad_scale: float = 1.0,
              lanes: Lanes = SERIAL, done: Callable[[int, int], None] | None = None) -> Iterator[int]:
        """Apply one update in place to ``params`` block by block, yielding increasing ends once
        ``params[:end]`` holds its final values (a caller can publish finished parts meanwhile).

        ``params`` must be a C-contiguous 1-D float32 array of ``size`` elements.
        ``grad`` (the mean gradient, same shape) is OVERWRITTEN: it serves as
        scratch space; a non-float32 or non-contiguous ``grad`` is copied first.
        The effective rate, ``learning_rate() * lr_factor`` (``lr_factor`` e.g.
        ``1 / (1 + staleness)``), is kept as ``last_lr``; ``iterations`` is incremented
        afterwards. ``grad_scale`` multiplies the gradient block by block first (or folds
        into the step size, ``folds_scale``), so a summed gradient becomes a mean without a
        separate pass over memory. ``clip`` first clips the mean gradient ``grad * grad_scale``
        (``Clip.apply``); a ``weight_decay`` decays each block of ``params`` before its step. ``lanes``: the
        threads the blocks run on (``Lanes.run``; the same results on any number); ``done(start, stop)``
        runs on the thread that finished a block, right after it, e.g. to copy it out while it is in that
        core's cache (a caller whose lanes are not ``parallel`` publishes from the yielded ends instead,
        with no ``done``).
        """
        if params.dtype != np.float32 or params.shape != (self.size,) or not params.flags.c_contiguous:
            raise ValueError(
                f"{self.name}: params must be C-contiguous float32 of shape ({self.size},), "
                f"got {params.dtype} {params.shape}"
            )
        if grad.shape != (self.size,):
            raise ValueError(f"{self.name}: grad must have shape ({self.size},), got {grad.shape}")
        if grad.dtype != np.float32 or not grad.flags.c_contiguous or not grad.flags.writeable:
            grad = np.array(grad, dtype=np.float32)
        self.last_lr = lr = self.learning_rate() * lr_factor
        if self.clip.on:
            grad_scale, self.last_grad_norm = self.clip.apply(grad, grad_scale, self.variables, self._block, lanes)
        wd, decay_lr = _f32(self.hyper.get("weight_decay", 0.0)), _f32(lr)
        step_size = self._step_size(_f32(lr * grad_scale if self.folds_scale else lr))
        scale = _f32(grad_scale) if grad_scale != 1.0 and not self.folds_scale else None
        while len(self._scratch) < lanes.threads:
            self._scratch.append(np.empty_like(self._scratch[0]))
        self._axpy = _axpy_holding_gil if lanes.threads == 1 else _axpy_threaded

        def work(lane: int, block: slice) -> None:
            tmp = self._scratch[lane][:block.stop - block.start]
            if wd:
                _decay(params[block], tmp, wd, decay_lr)
            if scale is not None:
                np.multiply(grad[block], scale, out=grad[block])
            self._update(params[block], grad[block], tmp, step_size, block)
            if done is not None:
                done(block.start, block.stop)
        if lanes.parallel:
            yield from lanes.run(self.size, self._block, work)
        else:  # the caller's thread, block by block
            for start in range(0, self.size, self._block):
                work(0, slice(start, min(start + self._block, self.size)))
                yield min(start + self._block, self.size)
        self.iterations += 1

    def reset_state(self) -> None:
        """Reset every state array to its initial value; ``iterations`` is kept."""
        for key, init in self._slots().items():
            self.state[key].fill(init)

    def scale_state(self, factor: float) -> None:
        """Multiply the first-moment / velocity state by ``factor``: SGD's momentum
        velocity, RMSprop's momentum buffer (not its ``velocity`` = mean square),
        Adam's first moment; nothing for plain SGD and Adagrad."""
        for key in self.first_moments:
            if key in self.state:
                np.multiply(self.state[key], _f32(factor), out=self.state[key])

    def state_dict(self, copy: bool = True) -> dict[str, np.ndarray | int | float]:
        """Checkpoint: the state arrays (keyed by slot name; copies unless ``copy`` is False),
        ``iterations``, ``lr_scale`` and the hyper-parameters (keyed ``hyper.<name>``)."""
        d: dict[str, np.ndarray | int | float] = {key: arr.copy() if copy else arr for key, arr in self.state.items()}
        d.update({f"hyper.{key}": value for key, value in self.hyper.items()})
        d.update(iterations=self.iterations, lr_scale=self.lr_scale)
        return d

    def load_state_dict(self, d: dict[str, np.ndarray | int | float]) -> None:
        """Restore a :meth:`state_dict`, hyper-parameters included (a switch may have changed momentum). A
        checkpoint from before every optimizer took ``weight_decay`` has none but AdamW's: the configured
        one stays."""
        expected = {*self.state, *(f"hyper.{key}" for key in self.hyper), "iterations", "lr_scale"}
        if set(d) != expected and set(d) != expected - {"hyper.weight_decay"}:
            raise ValueError(f"{self.name}: state keys {sorted(d)} != expected {sorted(expected)}")
        for key in self.hyper:
            self.hyper[key] = float(d.get(f"hyper.{key}", self.hyper[key]))
        self._validate()
        for key, arr in self.state.items():
            src = np.asarray(d[key])
            if src.shape != arr.shape:
                raise ValueError(f"{self.name}: state {key!r} has shape {src.shape}, expected {arr.shape}")
            np.copyto(arr, src, casting="same_kind")
        self.iterations = int(d["iterations"])
        self.lr_scale = float(d["lr_scale"])


def _decay(p: np.ndarray, tmp: np.ndarray, wd: np.float32, lr: np.float32) -> None:
    """Keras's decoupled weight decay of a block, ``p -= p*wd*lr``, in its order (float32, two roundings)."""
    np.multiply(p, wd, out=tmp)
    np.multiply(tmp, lr, out=tmp)
    np.subtract(p, tmp, out=p)


class SGD(Optimizer):
    """``keras.optimizers.SGD``: ``m = momentum*m - lr*g``; ``p += m`` (or, with
    Nesterov, ``p += momentum*m - lr*g``); plain ``p -= lr*g`` when momentum is 0."""

    name = "sgd"
    defaults = {"momentum": 0.0, "weight_decay": 0.0}
    first_moments = ("momentum",)
    folds_scale = True
    nesterov: ClassVar[bool] = False

    def _slots(self) -> dict[str, float]:
        return {"momentum": 0.0} if self.hyper["momentum"] != 0.0 else {}

    def _update(self, p: np.ndarray, g: np.ndarray, tmp: np.ndarray, lr: np.float32,
                block: slice) -> None:
        if not self.state:  # BLAS's p += (-lr) g: one pass, not numpy's two (g *= lr; p -= g)
            self._axpy(g, p, -lr)
            return
        np.multiply(g, lr, out=g)
        mom = _f32(self.hyper["momentum"])
        m = self.state["momentum"][block]
        np.multiply(m, mom, out=m)
        np.subtract(m, g, out=m)
        if self.nesterov:
            np.multiply(m, mom, out=tmp)
            np.subtract(tmp, g, out=tmp)
            np.add(p, tmp, out=p)
        else:
            np.add(p, m, out=p)


class Momentum(SGD):
    """SGD with (heavy-ball) momentum, default 0.9."""

    name = "momentum"
    defaults = {"momentum": 0.9, "weight_decay": 0.0}


class Nesterov(SGD):
    """SGD with Nesterov momentum, default 0.9."""

    name = "nesterov"
    defaults = {"momentum": 0.9, "weight_decay": 0.0}
    nesterov = True


class RMSprop(Optimizer):
    """``keras.optimizers.RMSprop`` (uncentered): ``v = rho*v + (1-rho)*g^2``;
    ``inc = lr*g / sqrt(v + eps)``; ``p -= inc`` or, with momentum,
    ``mom = momentum*mom + inc; p -= mom``."""

    name = "rmsprop"
    defaults = {"rho": 0.9, "momentum": 0.0, "epsilon": 1e-7, "weight_decay": 0.0}
    first_moments = ("momentum",)

    def _slots(self) -> dict[str, float]:
        return {"velocity": 0.0} | ({"momentum": 0.0} if self.hyper["momentum"] > 0 else {})

    def _update(self, p: np.ndarray, g: np.ndarray, tmp: np.ndarray, lr: np.float32,
                block: slice) -> None:
        h = self.hyper
        v = self.state["velocity"][block]
        np.multiply(v, _f32(h["rho"]), out=v)
        np.square(g, out=tmp)
        np.multiply(tmp, _f32(1 - h["rho"]), out=tmp)
        np.add(v, tmp, out=v)
        np.add(v, _f32(h["epsilon"]), out=tmp)
        np.sqrt(tmp, out=tmp)
        np.multiply(g, lr, out=g)
        np.divide(g, tmp, out=g)
        if "momentum" in self.state:
            m = self.state["momentum"][block]
            np.multiply(m, _f32(h["momentum"]), out=m)
            np.add(m, g, out=m)
            g = m
        np.subtract(p, g, out=p)


class Adam(Optimizer):
    """``keras.optimizers.Adam`` (no AMSGrad): ``m += (g-m)*(1-b1)``;
    ``v += (g^2-v)*(1-b2)``; ``p -= m*alpha / (sqrt(v) + eps)`` with
    ``alpha = lr*sqrt(1-b2^t)/(1-b1^t)``, ``t = iterations + 1``."""

    name = "adam"
    defaults = {"beta_1": 0.9, "beta_2": 0.999, "epsilon": 1e-7, "weight_decay": 0.0}
    first_moments = ("momentum",)

    def _slots(self) -> dict[str, float]:
        return {"momentum": 0.0, "velocity": 0.0}

    def _step_size(self, lr: np.float32) -> np.float32:
        """Bias-corrected ``alpha``, in float32 exactly as Keras computes it."""
        t = _f32(self.iterations + 1)
        b1_power = _f32(self.hyper["beta_1"]) ** t
        b2_power = _f32(self.hyper["beta_2"]) ** t
        return lr * np.sqrt(_f32(1) - b2_power) / (_f32(1) - b1_power)

    def _update(self, p: np.ndarray, g: np.ndarray, tmp: np.ndarray, alpha: np.float32,
                block: slice) -> None:
        h = self.hyper
        m = self.state["momentum"][block]
        v = self.state["velocity"][block]
        np.subtract(g, m, out=tmp)
        np.multiply(tmp, _f32(1 - h["beta_1"]), out=tmp)
        np.add(m, tmp, out=m)
        np.square(g, out=g)
        np.subtract(g, v, out=g)
        np.multiply(g, _f32(1 - h["beta_2"]), out=g)
        np.add(v, g, out=v)
        np.multiply(m, alpha, out=tmp)
        np.sqrt(v, out=g)
        np.add(g, _f32(h["epsilon"]), out=g)
        np.divide(tmp, g, out=tmp)
        np.subtract(p, tmp, out=p)


class AdamW(Adam):
    """``keras.optimizers.AdamW``: Adam with the decoupled weight decay on by default, Keras's 0.004
    (torch's is 0.01)."""

    name = "adamw"
    defaults = {"beta_1": 0.9, "beta_2": 0.999, "epsilon": 1e-7, "weight_decay": 0.004}


class Adagrad(Optimizer):
    """``keras.optimizers.Adagrad``: ``acc += g^2``; ``p -= lr*g / sqrt(acc + eps)``;
    ``acc`` starts (and resets) at ``initial_accumulator_value``."""

    name = "adagrad"
    defaults = {"initial_accumulator_value": 0.1, "epsilon": 1e-7, "weight_decay": 0.0}

    def _slots(self) -> dict[str, float]:
        return {"accumulator": self.hyper["initial_accumulator_value"]}

    def _update(self, p: np.ndarray, g: np.ndarray, tmp: np.ndarray, lr: np.float32,
                block: slice) -> None:
        acc = self.state["accumulator"][block]
        np.square(g, out=tmp)
        np.add(acc, tmp, out=acc)
        np.add(acc, _f32(self.hyper["epsilon"]), out=tmp)
        np.sqrt(tmp, out=tmp)
        np.multiply(g, lr, out=g)
        np.divide(g, tmp, out=g)
        np.subtract(p, g, out=p)


OPTIMIZERS: dict[str, type[Optimizer]] = {
    cls.name: cls for cls in (SGD, Momentum, Nesterov, RMSprop, Adam, Adagrad, AdamW)
}


def configured_momentum(name: str, hyper: dict[str, float]) -> float:
    """The momentum an optimizer named ``name`` runs with (0 for those without one)."""
    return hyper.get("momentum", OPTIMIZERS[name].defaults.get("momentum", 0.0))


def make_optimizer(name: str, size: int, schedule: LRSchedule, **hyper: float) -> Optimizer:
    """Instantiate ``OPTIMIZERS[name]``; unknown names or hyper-parameters raise ``ValueError``."""
    if name not in OPTIMIZERS:
        raise ValueError(f"unknown optimizer {name!r}; expected one of {sorted(OPTIMIZERS)}")
    return OPTIMIZERS[name](size, schedule, **hyper)


def optimizer_factory(o: OptimizerSpec) -> Callable[[int], Optimizer]:
    """Builds the configured optimizer, with its schedule, for a model of the size given."""
    schedule = make_schedule(o.schedule.kind, o.learning_rate,
                             **o.schedule.model_dump(exclude={"kind"}, exclude_none=True))
    clip = Clip(o.clip_norm, o.global_clip_norm)

    def make(size: int) -> Optimizer:
        optimizer = make_optimizer(o.name, size, schedule, **o.params)
        optimizer.clip = clip
        return optimizer
    return make


def adjust_optimizer(opt: Optimizer, lr_scale: float, state: str, state_scale: float,
                     momentum: float | None) -> None:
    """Put a scale and momentum in force, and keep, reset or scale the optimizer's state. Runs on the
    applier thread, in order with the updates around it."""
    opt.lr_scale = lr_scale
    if momentum is not None:
        opt.hyper["momentum"] = momentum
    if state == "reset":
        opt.reset_state()
    elif state == "scale":
        opt.scale_state(state_scale)


def apply_update(optimizer: Optimizer, values: np.ndarray, trainable: int, grad: np.ndarray, samples: int,
                 contributors: int, lr_factor: float = 1.0, lanes: Lanes = SERIAL,
                 done: Callable[[int, int], None] | None = None) -> Iterator[int]:
    """The update rule of every driver: ``grad`` is an aggregate's sum (Σ gradient over ``samples``, then the
    sum of ``contributors`` workers' non-trainable state); the optimizer steps the ``trainable`` parameters
    by the mean gradient, block by block on ``lanes``, yielding the ends of the finished prefix and calling
    ``done`` per block (``Optimizer.steps``), and the state becomes the contributors' mean (on the
    caller's thread, after the blocks). ``grad`` is overwritten (scratch)."""
    n = trainable
    yield from optimizer.steps(values[:n], grad[:n], lr_factor, 1.0 / samples, lanes, done)
    if n < values.size:
        np.multiply(grad[n:], np.float32(1.0 / contributors), out=values[n:])
