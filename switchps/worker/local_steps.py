"""A worker's local steps (issue 46): under a work order whose ``local`` is set, H steps of ``batch`` samples
with an inner optimizer on a private copy of the model, then one push of what the copy moved.

Each local step is a step of its own as ``StepRunner`` runs it (micro-batches, the emulated device, its own
straggler plan, the injected clock): H compute intervals, one push (its communication delay slept once, after
the last), as the simulator and the closed form model a round. Under a time budget (AMB's T, counted from when
the order arrived: anytime local SGD) a worker starts local steps while fewer than H were taken and T has not
ended, at least one; each runs its whole batch.

The push convention (``protos/switchps.proto``, ``LocalSteps``): the payload is ``samples * (θ_start - θ_end)``
over the trainable part, ``samples`` all samples of the round, then the model's state as the last local step
left it (what a gradient push carries in its tail), so the PS's rule for gradients (the sum over the total
samples) gives the sample-weighted mean movement, which its outer optimizer steps by.

The pure parts, with no I/O and no framework, are what the simulator reuses: ``Inner`` (the inner optimizer
across rounds), ``moved`` (the payload), ``take_steps`` (the round's timing, on any ``steps.Computer``).
"""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field, replace
from typing import Any, Protocol

import numpy as np

from switchps.config.optimizer import OptimizerSpec
from switchps.optim.optimizers import Optimizer, optimizer_factory
from switchps.protos.codec import COPIES
from switchps.protos.layout import variable_sizes
from switchps.protos.wire_dtype import narrow
from switchps.straggler_trace import StepDelays
from switchps.worker.steps import Budget, Order, Step, StepRunner
from switchps.workload.frameworks import Computer


class Steps(Protocol):
    """What a round needs of a work order's ``local`` (``pb.LocalSteps`` or the core's ``events.Local``)."""

    @property
    def steps(self) -> int: ...

    @property
    def batch(self) -> int: ...


class LocalOrder(Order, Protocol):
    """A work order with local steps: the wire's ``pb.WorkOrder`` or the simulator's ``WorkOrder``."""

    @property
    def local(self) -> Steps: ...


@dataclass(frozen=True)
class OneStep:
    """One local step's order for ``StepRunner``: its batch, in micro-batches, with no time budget of its own."""

    sample_budget: int
    micro_batch: int
    time_budget_s: float | None = None


class Inner:
    """The inner optimizer over the ``trainable`` leading values, kept across rounds: its state persists
    unless an order says ``reset`` (then it is reset at the start of each round), and it is rebuilt when an
    order names another spec (a live switch of inner hyper-parameters). Its schedule counts the worker's local
    steps: a rebuilt optimizer goes on from the count its predecessor reached."""

    def __init__(self, trainable: int, variables: Sequence[int] | None = None) -> None:
        self.trainable = trainable
        self.variables = variables  # per-variable clipping's boundaries (None: one variable)
        self.spec: OptimizerSpec | None = None
        self.optimizer: Optimizer | None = None

    def begin(self, spec: OptimizerSpec, reset: bool) -> Optimizer:
        """The optimizer for a round under ``spec``."""
        if self.optimizer is None or spec != self.spec:
            taken = self.optimizer.iterations if self.optimizer is not None else 0
            self.spec, self.optimizer = spec, optimizer_factory(spec)(self.trainable)
            if self.variables is not None:
                self.optimizer.set_variables(self.variables)
            self.optimizer.iterations = taken
        elif reset:
            self.optimizer.reset_state()
        return self.optimizer

    def step(self, theta: np.ndarray, grad: np.ndarray, samples: int) -> None:
        """One local step: ``theta``'s trainable part moved in place by the Σ gradient ``grad`` over ``samples``
        (``grad``'s trainable part is overwritten: the optimizer's scratch)."""
        assert self.optimizer is not None, "begin a round first"
        n = self.trainable
        self.optimizer.apply(theta[:n], grad[:n], grad_scale=1.0 / samples)


def moved(start: np.ndarray, end: np.ndarray, samples: int, trainable: int, out: np.ndarray) -> np.ndarray:
    """The push payload of a round, in float32 ``out`` (which may be ``end``'s or ``start``'s memory):
    ``samples * (start - end)`` over the ``trainable`` leading values, then ``end``'s state."""
    n = trainable
    np.subtract(start[:n], end[:n], out=out[:n])
    np.multiply(out[:n], np.float32(samples), out=out[:n])
    if out[n:].ctypes.data != end[n:].ctypes.data:
        np.copyto(out[n:], end[n:])
    return out


@dataclass
class Taken:
    """What a round's local steps took (their payloads are not kept: each is the next one's scratch)."""

    samples: list[int] = field(default_factory=list)
    loss_sums: list[float] = field(default_factory=list)
    delays: list[StepDelays] = field(default_factory=list)
    compute_s: float = 0.0
    sleep_s: float = 0.0
    """Straggler sleeps, slowdowns' sleeps, and the communication delay before the push."""
    exhausted: bool = False
    """Under a time budget: all H local steps ended before T did."""

    @property
    def count(self) -> int:
        return len(self.samples)

    def more(self, steps: int, now: float, end: float) -> bool:
        """Whether the round takes another local step at ``now``: fewer than ``steps`` (H) were taken, and
        either none was or T (ending at ``end``) has not ended. Once it takes no more, ``exhausted`` is set.
        The one rule of a round, whoever takes its steps (``take_steps``, a user's loop)."""
        if self.count < steps and (not self.count or now < end):
            return True
        self.exhausted = self.count == steps and now < end < math.inf
        return False

    def report(self) -> StepDelays:
        """The round's delays as one push reports them: the straggler sleeps summed, the mean slowdown, the
        communication delay (slept once, before the push); none for steps with no delays injected."""
        d = self.delays
        if not d:
            return StepDelays()
        return StepDelays(sum(x.sleep_s for x in d), sum(x.factor for x in d) / len(d), d[-1].comm_s)


def local_stats(t: Taken) -> dict[str, Any]:
    """A round of local steps' statistics, as its push reports them (``pb.StepStats``)."""
    d = t.report()
    return dict(compute_s=t.compute_s, sleep_s=t.sleep_s, loss_sum=sum(t.loss_sums), delay_sleep_s=d.sleep_s,
                delay_factor=d.factor, delay_comm_s=d.comm_s, batch_exhausted=t.exhausted, overlapped=False,
                local_steps=t.count, local_loss_sums=t.loss_sums)


def take_steps(runner: StepRunner, order: LocalOrder, received_at: float, plan: Callable[[], StepDelays],
               after: Callable[[Step], None]) -> Taken:
    """A round of local steps under ``order``, received at ``received_at``: each one ``runner``'s step of
    ``order.local.batch`` samples under the straggler delays ``plan()`` gives it (its communication delay
    aside), then ``after(step)`` (the inner optimizer's step); then the last plan's communication delay."""
    one = OneStep(order.local.batch, order.micro_batch)
    end = Budget.of(order, received_at).end
    taken = Taken()
    clock = runner.clock
    while taken.more(order.local.steps, clock.now(), end):
        delays = plan()
        s = runner.run(one, clock.now(), replace(delays, comm_s=0.0))
        after(s)
        taken.samples.append(s.samples)
        taken.loss_sums.append(s.loss_sum)
        taken.delays.append(delays)
        taken.compute_s += s.compute_s
        taken.sleep_s += s.sleep_s
    taken.sleep_s += runner.sleep(taken.delays[-1].comm_s)
    return taken


@dataclass
class Round:
    """A round's push: its payload (``samples * (θ_start - θ_end)``, then the state) and what it took."""

    payload: np.ndarray
    taken: Taken

    @property
    def samples(self) -> int:
        return sum(self.taken.samples)


class LocalRunner:
    """A worker's rounds of local steps with the computer ``gc`` (whose steps ``runner`` runs): the inner
    optimizer across rounds, a private float32 copy θ of the values the model runs at, staged after each
    local step so that the next one's gradient is at the moved values, and a private float32 gradient vector
    the local steps write their payloads into (the optimizer's scratch; the round's payload, when the push
    has no area of its own)."""

    def __init__(self, runner: StepRunner, gc: Computer) -> None:
        self.runner, self.gc = runner, gc
        self.inner = Inner(gc.weights.trainable_size, variable_sizes(gc.weights.layout()))
        self._json = ""
        self._spec: OptimizerSpec | None = None
        self.theta: np.ndarray | None = None
        self.grad: np.ndarray | None = None

    def spec(self, inner_optimizer: str) -> OptimizerSpec:
        """An order's inner optimizer (JSON), parsed once while orders repeat it."""
        if self._spec is None or inner_optimizer != self._json:
            self._json, self._spec = inner_optimizer, OptimizerSpec.model_validate_json(inner_optimizer)
        return self._spec

    def run(self, order: LocalOrder, spec: OptimizerSpec, reset: bool, received_at: float, start: np.ndarray,
            plan: Callable[[], StepDelays], out: np.ndarray | None) -> Round:
        """A round under ``order`` from the values ``start`` (the model runs at them; left unchanged), with the
        inner optimizer ``spec`` (``reset``: its state afresh); the payload in ``out`` (the push's area, of the
        wire's type) if given. The model runs at θ_end afterwards: the caller stages the next values."""
        gc, n = self.gc, self.inner.trainable
        if self.theta is None or self.grad is None:
            self.theta, self.grad = gc.buffer(), gc.buffer()
        theta, grad = self.theta, self.grad
        np.copyto(theta, start)
        COPIES.add(theta.nbytes)
        self.inner.begin(spec, reset)
        gc.payload_to = grad
        gc.stage(theta)

        def after(s: Step) -> None:
            gc.settle()  # θ may be rewritten once the computer has it (a GPU's upload)
            self.inner.step(theta, s.grad, s.samples)
            theta[n:] = s.grad[n:]  # the state the step's forward passes left
            gc.stage(theta)

        taken = take_steps(self.runner, order, received_at, plan, after)
        samples = sum(taken.samples)
        if out is None or out.dtype == np.float32:
            return Round(moved(start, theta, samples, n, grad if out is None else out), taken)
        narrow(moved(start, theta, samples, n, grad), out)
        COPIES.add(out.nbytes)
        return Round(out, taken)
