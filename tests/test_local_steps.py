"""A worker's local steps (issue 46) without sockets or sleeps, on a fake clock: the inner optimizer across
rounds, the movement payload, the round's timing under a time budget, and a worker's round (the switchps
worker's and a user's own loop's, ``torch_loop``) against a fake session; with a quadratic computer (exact
arithmetic to check) and each framework's real one (H local steps are H steps of the model)."""

from __future__ import annotations

import copy
from dataclasses import dataclass, field
from functools import cache

import numpy as np
import pytest
import torch

from conftest import FakeClock
from switchps.config.optimizer import OptimizerSpec
from switchps.config.run import parse_config
from switchps.optim.optimizers import SGD, apply_update, optimizer_factory
from switchps.protos import switchps_pb2 as pb
from switchps.protos.layout import make_layout
from switchps.protos.wire_dtype import narrowed
from switchps.straggler_trace import StepDelays
from switchps.worker.client import Reply
from switchps.worker.local_steps import Inner, LocalRunner, moved, take_steps
from switchps.worker.main import Worker
from switchps.worker.steps import Sampler, StepRunner
from switchps.worker.torch_loop import Worker as LoopWorker
from switchps.workload.frameworks import FRAMEWORKS, Computer, framework
from switchps.workload.torch.weights import FlatParams

torch.set_num_threads(1)

N, STATE = 5, 2  # the quadratic model: 5 trainable values, then 2 of state
TARGET = np.linspace(-1.0, 1.0, N).astype(np.float32)


def spec(name: str = "sgd", lr: float = 0.1, **params: float) -> OptimizerSpec:
    return OptimizerSpec(name=name, learning_rate=lr, params=params)


@dataclass
class Weights:
    trainable_size: int = N

    def layout(self) -> pb.Layout:
        return make_layout([("theta", (N,))], [("seen", (STATE,))])


@dataclass
class Quadratic:
    """A computer for the loss ½|θ - TARGET|² per sample: a step's Σ gradient is ``samples * (θ - TARGET)``;
    the state counts the samples its forward passes saw. Staged values are copied away, as a GPU's upload
    (so a round that did not stage its moved values would compute at stale ones); each micro-batch costs
    ``cost_s`` on the clock."""

    clock: FakeClock
    cost_s: float = 0.0
    size: int = N + STATE
    samples: int = 1000
    weights: Weights = field(default_factory=Weights)
    payload_to: np.ndarray | None = None
    values: np.ndarray = field(default_factory=lambda: np.zeros(N + STATE, np.float32))
    _rows: int = 0

    def stage(self, flat: np.ndarray) -> None:
        self.values = flat.copy()

    def settle(self) -> bool:
        return True

    def buffer(self) -> np.ndarray:
        return np.empty(self.size, np.float32)

    def read(self) -> np.ndarray:
        return self.values.copy()

    def accumulate(self, rows: np.ndarray) -> None:
        self.clock.t += self.cost_s
        self._rows += len(rows)

    def finish(self) -> tuple[np.ndarray, float]:
        out = np.empty(self.size, np.float32) if self.payload_to is None else self.payload_to
        b, self._rows = self._rows, 0
        d = self.values[:N] - TARGET
        out[:N] = b * d
        out[N:] = self.values[N:] + b
        return out, float(b * 0.5 * np.dot(d, d))

    def compute(self, rows: np.ndarray, micro_batch: int) -> tuple[np.ndarray, float]:
        for i in range(0, len(rows), micro_batch):
            self.accumulate(rows[i : i + micro_batch])
        return self.finish()


def order(steps: int, batch: int, micro_batch: int | None = None, time_budget_s: float = 0.0,
          inner: OptimizerSpec | None = None, reset: bool = False) -> pb.WorkOrder:
    """A work order with local steps, as the PS sends it."""
    local = pb.LocalSteps(steps=steps, batch=batch, inner_optimizer=(inner or spec()).model_dump_json(),
                          reset_inner_state=reset)
    return pb.WorkOrder(protocol="local_sgd", version=1, sample_budget=steps * batch, time_budget_s=time_budget_s,
                        micro_batch=micro_batch or batch, local=local)


def quadratic_round(gc: Quadratic, runner: LocalRunner, o: pb.WorkOrder, start: np.ndarray,
                    plan: StepDelays = StepDelays()) -> np.ndarray:
    """A round's payload, as a copy."""
    r = runner.run(o, runner.spec(o.local.inner_optimizer), o.local.reset_inner_state, gc.clock.now(), start,
                   lambda: plan, None)
    return r.payload.copy()


def make(cost_s: float = 0.0) -> tuple[Quadratic, LocalRunner]:
    clock = FakeClock()
    gc = Quadratic(clock, cost_s)
    runner = LocalRunner(StepRunner(gc, Sampler(gc.samples, 0), None, clock), gc)  # type: ignore[arg-type]
    return gc, runner


START = np.array([3.0, -2.0, 0.5, 1.0, 0.0, 10.0, 20.0], np.float32)


def sgd_steps(theta: np.ndarray, lr: float, steps: int) -> np.ndarray:
    """``steps`` steps of gradient descent on the quadratic, in float64."""
    t = theta[:N].astype(np.float64)
    for _ in range(steps):
        t -= lr * (t - TARGET)
    return t


@pytest.mark.parametrize("micro_batch", [8, 3])
def test_one_local_step_of_sgd_pushes_lr_times_the_gradient_sum_so_averaging_is_an_sgd_step(micro_batch) -> None:
    gc, runner = make()
    payload = quadratic_round(gc, runner, order(1, 8, micro_batch, inner=spec(lr=0.1)), START)
    grad_sum = 8 * (START[:N] - TARGET)
    np.testing.assert_allclose(payload[:N], 0.1 * grad_sum, rtol=1e-6)
    np.testing.assert_array_equal(payload[N:], START[N:] + 8)  # the state the step left, as a gradient push's
    outer, plain = START.copy(), START.copy()  # the PS: outer SGD at lr 1 on the movement; plain SGD on the sum
    apply_update(SGD(N, 1.0), outer, N, payload.copy(), 8, 1)
    apply_update(SGD(N, 0.1), plain, N, np.concatenate([grad_sum, START[N:] + 8]), 8, 1)
    np.testing.assert_allclose(outer, plain, rtol=1e-6, atol=1e-6)


def test_h_local_steps_are_h_steps_at_the_moved_values_and_the_state_advances_through_them() -> None:
    gc, runner = make()
    payload = quadratic_round(gc, runner, order(4, 8, 4, inner=spec(lr=0.25)), START)
    end = sgd_steps(START, 0.25, 4)
    np.testing.assert_allclose(payload[:N], 32 * (START[:N] - end), rtol=1e-5)  # samples x the movement
    np.testing.assert_array_equal(payload[N:], START[N:] + 32)
    np.testing.assert_allclose(gc.values[:N], end, rtol=1e-6)  # the model runs at θ_end afterwards


def momentum_steps(theta: np.ndarray, lr: float, mom: float, rounds: list[int], reset: bool) -> np.ndarray:
    """Rounds of momentum SGD on the quadratic, each from where the previous ended (one worker, outer SGD at
    lr 1), the velocity kept or reset between rounds; float64."""
    t, m = theta[:N].astype(np.float64), np.zeros(N)
    for steps in rounds:
        m = np.zeros(N) if reset else m
        for _ in range(steps):
            m = mom * m - lr * (t - TARGET)
            t = t + m
    return t


@pytest.mark.parametrize("reset", [False, True])
def test_the_inner_state_carries_momentum_across_rounds_unless_reset(reset) -> None:
    gc, runner = make()
    o = order(3, 4, inner=spec("momentum", 0.1, momentum=0.9), reset=reset)
    theta = START.copy()
    for _ in range(2):
        payload = quadratic_round(gc, runner, o, theta)
        theta[:N] -= payload[:N] / 12
        theta[N:] = payload[N:]
    np.testing.assert_allclose(theta[:N], momentum_steps(START, 0.1, 0.9, [3, 3], reset), rtol=1e-5, atol=1e-6)
    other = momentum_steps(START, 0.1, 0.9, [3, 3], not reset)
    assert np.abs(theta[:N] - other).max() > 1e-2, "keep and reset differ by the carried velocity"


def test_an_inner_spec_change_rebuilds_the_optimizer_and_its_schedule_counts_on() -> None:
    inner = Inner(N)
    a = inner.begin(spec(lr=0.1), reset=False)
    a.apply(START[:N].copy(), np.ones(N, np.float32))
    assert inner.begin(spec(lr=0.1), reset=False) is a, "the same spec: the same optimizer"
    b = inner.begin(spec("momentum", 0.05, momentum=0.5), reset=False)
    assert b is not a and b.name == "momentum" and b.hyper["momentum"] == 0.5 and b.learning_rate() == 0.05
    assert b.iterations == 1, "the schedule goes on counting the worker's local steps"
    b.apply(START[:N].copy(), np.ones(N, np.float32))
    assert np.abs(b.state["momentum"]).max() > 0
    assert inner.begin(spec("momentum", 0.05, momentum=0.5), reset=True) is b
    assert not b.state["momentum"].any() and b.iterations == 2, "reset: the state afresh, the count kept"


def test_the_worker_parses_an_inner_spec_once_while_orders_repeat_it() -> None:
    _, runner = make()
    o, p = order(2, 4, inner=spec(lr=0.3)), order(2, 4, inner=spec(lr=0.4))
    first = runner.spec(o.local.inner_optimizer)
    assert runner.spec(o.local.inner_optimizer) is first and first.learning_rate == 0.3
    assert runner.spec(p.local.inner_optimizer).learning_rate == 0.4


@pytest.mark.parametrize(("steps", "budget", "taken", "exhausted"),
                         [(5, 2.5, 3, False), (2, 2.5, 2, True), (5, 0.1, 1, False), (5, 3.0, 3, False)])
def test_a_time_budget_takes_the_local_steps_that_start_within_it(steps, budget, taken, exhausted) -> None:
    gc, runner = make(cost_s=1.0)  # one micro-batch per local step: 1 s each
    r = runner.run(order(steps, 4, time_budget_s=budget), spec(), False, gc.clock.now(), START,
                   lambda: StepDelays(), None)
    assert (r.taken.count, r.samples, r.taken.exhausted) == (taken, taken * 4, exhausted)
    assert gc.clock.t == 100.0 + taken and r.taken.compute_s == taken


def test_a_time_budget_over_before_the_round_starts_still_takes_one_local_step() -> None:
    gc, runner = make(cost_s=1.0)
    r = runner.run(order(5, 4, time_budget_s=1.0), spec(), False, gc.clock.now() - 2.0, START,
                   lambda: StepDelays(), None)
    assert r.taken.count == 1 and r.samples == 4


def test_each_local_step_has_its_straggler_plan_and_the_push_one_communication_delay() -> None:
    gc, runner = make(cost_s=1.0)
    plans = iter([StepDelays(0.5, 2.0, 7.0), StepDelays(0.0, 1.0, 9.0)])
    r = runner.run(order(2, 4, time_budget_s=10.0), spec(), False, gc.clock.now(), START, lambda: next(plans),
                   None)
    # step 1: sleeps 0.5, computes 1 s, slowed to 2 s (1 s more); step 2: computes 1 s; then the push's 9 s
    assert r.taken.compute_s == 2.0 and r.taken.sleep_s == 0.5 + 1.0 + 9.0 and gc.clock.t == 100.0 + 12.5
    assert r.taken.report() == StepDelays(0.5, 1.5, 9.0)


def test_the_loss_of_each_local_step_is_kept_and_summed() -> None:
    gc, runner = make()
    r = runner.run(order(3, 4, inner=spec(lr=0.5)), spec(lr=0.5), False, gc.clock.now(), START,
                   lambda: StepDelays(), None)
    t = START[:N].astype(np.float64)
    expected = []
    for _ in range(3):
        expected.append(4 * 0.5 * np.dot(t - TARGET, t - TARGET))
        t -= 0.5 * (t - TARGET)
    np.testing.assert_allclose(r.taken.loss_sums, expected, rtol=1e-5)


def test_the_movement_is_written_into_a_narrow_push_area_and_start_is_left_alone() -> None:
    gc, runner = make()
    start = START.copy()
    out = np.empty(N + STATE, np.float16)
    r = runner.run(order(2, 4), spec(), False, gc.clock.now(), start, lambda: StepDelays(), out)
    assert r.payload is out
    np.testing.assert_array_equal(start, START)
    wide = moved(START, gc.values, 8, N, np.empty(N + STATE, np.float32))
    np.testing.assert_array_equal(out, narrowed(wide, "float16"))


def test_moved_is_samples_times_start_minus_end_then_the_end_state() -> None:
    end = START + np.float32(0.5)
    out = moved(START, end, 10, N, np.empty_like(START))
    np.testing.assert_allclose(out, [*([-5.0] * N), *end[N:]])
    in_place = end.copy()
    moved(START, in_place, 10, N, in_place)
    np.testing.assert_array_equal(in_place, out)  # written over θ_end itself


def test_take_steps_needs_only_a_step_runner_and_its_computer() -> None:
    """The simulator's use: the timing of a round on a computer that computes nothing."""
    clock = FakeClock()
    gc = Quadratic(clock, cost_s=0.25)
    seen: list[int] = []
    taken = take_steps(StepRunner(gc, Sampler(100, 0), None, clock), order(6, 5, time_budget_s=1.0), clock.now(),
                       StepDelays, lambda s: seen.append(s.samples))
    assert seen == [5] * 4 and taken.count == 4 and clock.t == 101.0


# ---- each framework's real computer -----------------------------------------------------------------------

@cache
def real(name: str) -> Computer:
    cfg = parse_config({"model": {"name": "mlp", "framework": name, "kwargs": {"hidden": [8]}},
                        "data": {"name": "digits"}})
    fw = framework(name)
    data, model = fw.prepare(cfg)
    return fw.computer(cfg, model, data.x_train, data.y_train)


@pytest.mark.parametrize("micro_batch", [16, 6])
@pytest.mark.parametrize("name", FRAMEWORKS)
def test_a_frameworks_local_steps_are_its_sgd_steps_one_after_another(name, micro_batch) -> None:
    gc = real(name)
    start = gc.read()
    n = gc.weights.trainable_size
    clock = FakeClock()
    runner = LocalRunner(StepRunner(gc, Sampler(gc.samples, 3), None, clock), gc)
    o = order(3, 16, micro_batch, inner=spec(lr=0.2))
    r = runner.run(o, spec(lr=0.2), False, clock.now(), start, lambda: StepDelays(), None)
    payload, losses = r.payload.copy(), list(r.taken.loss_sums)
    sampler, theta, expected = Sampler(gc.samples, 3), start.copy(), []
    gc.payload_to = None
    for _ in range(3):  # the model's own steps: assigned values, a gradient, an SGD step
        gc.assign(theta)
        grad, loss = gc.compute(sampler.take(16), micro_batch)
        theta[:n] -= np.float32(0.2 / 16) * grad[:n]
        theta[n:] = grad[n:]
        expected.append(loss)
    np.testing.assert_allclose(payload[:n] / 48, start[:n] - theta[:n], atol=2e-6)
    np.testing.assert_allclose(payload[n:], theta[n:], atol=1e-6)
    np.testing.assert_allclose(losses, expected, rtol=1e-5)
    assert np.abs(payload[:n]).max() > 1e-3
    gc.assign(start)


# ---- a worker's rounds against a fake session --------------------------------------------------------------

@dataclass
class FakeSession:
    """A session without a PS: replies with the orders queued in ``orders`` and the values ``answer``
    (``fresh`` False: none), keeping what each push sent."""

    orders: list[pb.WorkOrder]
    answer: np.ndarray
    fresh: bool = True
    clock: FakeClock = field(default_factory=FakeClock)
    received_at: float = 100.0
    payload_area: np.ndarray | None = None
    step: int = 0
    pushed: list[tuple[np.ndarray, int, dict]] = field(default_factory=list)

    @property
    def order(self) -> pb.WorkOrder:
        return self.orders[0]

    def push(self, grad: np.ndarray, samples: int, params: np.ndarray, **stats: object) -> Reply:
        self.pushed.append((grad.copy(), samples, stats))
        self.step += 1
        self.orders.pop(0)
        self.received_at = self.clock.now()
        return Reply(pb.PushReply(order=self.orders[0]), fresh=self.fresh, values=self.answer)

    def close(self) -> None:
        pass


def worker(session: FakeSession) -> tuple[Worker, Quadratic]:
    cfg = parse_config({"model": {"name": "logreg"}, "data": {"name": "digits"}, "cluster": {"workers": 1}})
    gc = Quadratic(session.clock)
    gc.stage(START)
    return Worker(cfg, 0, gc, session, START.copy()), gc  # type: ignore[arg-type]


def test_a_worker_reports_its_local_steps_and_their_losses_then_runs_at_the_reply() -> None:
    answer = START + np.float32(1.0)
    session = FakeSession([order(3, 4, inner=spec(lr=0.5)), pb.WorkOrder(stop=True)], answer)
    w, gc = worker(session)
    w.local_round()
    payload, samples, stats = session.pushed[0]
    assert samples == 12 and stats["local_steps"] == 3 and len(stats["local_loss_sums"]) == 3
    assert stats["loss_sum"] == pytest.approx(sum(stats["local_loss_sums"]))
    np.testing.assert_allclose(payload[:N], 12 * (START[:N] - sgd_steps(START, 0.5, 3)), rtol=1e-5)
    np.testing.assert_array_equal(gc.values, answer)  # the model runs at the reply's values


def test_a_worker_whose_reply_brings_no_values_runs_at_the_start_again() -> None:
    session = FakeSession([order(2, 4), pb.WorkOrder(stop=True)], START, fresh=False)
    w, gc = worker(session)
    w.staged = START.copy()
    w.local_round()
    np.testing.assert_array_equal(gc.values, START)  # not at its own moved copy


def test_a_worker_switches_between_gradients_and_local_steps_at_any_step() -> None:
    grad_order = pb.WorkOrder(protocol="bsp", version=1, sample_budget=4, micro_batch=4)
    session = FakeSession([grad_order, order(2, 4), grad_order, pb.WorkOrder(stop=True)], START)
    w, _ = worker(session)
    for _ in range(3):  # a gradient, local steps, a gradient
        (w.local_round if session.order.HasField("local") else w.step)()
    assert [s.get("local_steps", 0) for _, _, s in session.pushed] == [0, 2, 0]
    assert [n for _, n, _ in session.pushed] == [4, 8, 4]
    assert w.intervals == 4, "each local step is a compute interval of the straggler plan"


def users_loop(session: FakeSession, model: torch.nn.Module, loader: list, cost_s: float = 0.0) -> list[int]:
    """The README's loop, unchanged, against ``session`` (its pull answers with the model's own values), each
    micro-batch costing ``cost_s`` on the session's clock; ``ps.steps`` after each ``ps.step()``."""
    flat = FlatParams(model)
    session.pull = lambda params: Reply(pb.PullReply(order=session.order), fresh=True,  # type: ignore[attr-defined]
                                        values=flat.read())
    ps, steps = LoopWorker(session, model, flat), []  # type: ignore[arg-type]
    while not ps.stop:
        for x, y in ps.batches(loader):
            ps.backward(torch.nn.functional.cross_entropy(model(x), y, reduction="sum"))
            session.clock.sleep(cost_s)
        ps.step()
        steps.append(ps.steps)
    return steps


def bn_model() -> torch.nn.Module:
    torch.manual_seed(0)
    return torch.nn.Sequential(torch.nn.Linear(3, 4), torch.nn.BatchNorm1d(4), torch.nn.Linear(4, 2))


LOADER = [(torch.randn(4, 3, generator=torch.Generator().manual_seed(i)), torch.tensor([0, 1, 1, i % 2]))
          for i in range(3)]


@pytest.mark.parametrize("fresh", [True, False])
def test_a_users_own_loop_takes_h_local_steps_then_pushes_what_its_model_moved(fresh) -> None:
    model = bn_model()
    twin, flat = copy.deepcopy(model), FlatParams(model)
    start = flat.read()
    answer = start + np.float32(1.0)
    session = FakeSession([order(3, 4, inner=spec(lr=0.1)), pb.WorkOrder(stop=True)], answer, fresh=fresh)
    assert users_loop(session, model, LOADER) == [0, 0, 1], "one push, at the round's end"
    sgd, losses = torch.optim.SGD(twin.parameters(), lr=0.1), []  # the model's own steps: mean-loss SGD
    for x, y in LOADER:
        sgd.zero_grad()
        loss = torch.nn.functional.cross_entropy(twin(x), y)
        loss.backward()
        sgd.step()
        losses.append(4 * loss.item())
    end, n = FlatParams(twin).read(), flat.trainable_size
    (payload, samples, stats), = session.pushed
    assert samples == 12 and stats["local_steps"] == 3 and not stats["batch_exhausted"]
    np.testing.assert_allclose(payload[:n], 12 * (start[:n] - end[:n]), atol=1e-5)
    np.testing.assert_allclose(payload[n:], end[n:], rtol=1e-6)  # BatchNorm's running statistics
    np.testing.assert_allclose(stats["local_loss_sums"], losses, rtol=1e-5)
    assert stats["loss_sum"] == pytest.approx(sum(losses), rel=1e-5)
    np.testing.assert_array_equal(flat.read(), answer if fresh else start)  # the reply's values, or the start's
    assert all(p.grad is None for p in model.parameters())


@pytest.mark.parametrize("reset", [False, True])
def test_a_users_own_loop_keeps_its_inner_state_across_rounds_unless_an_order_resets_it(reset) -> None:
    torch.manual_seed(0)
    model = torch.nn.Linear(3, 2)
    twin, flat = copy.deepcopy(model), FlatParams(model)
    start = flat.read()
    inner = spec(lr=0.1, momentum=0.9)
    session = FakeSession([order(2, 4, inner=inner, reset=reset)] * 2 + [pb.WorkOrder(stop=True)], start)
    assert users_loop(session, model, LOADER) == [0, 1, 1, 2]
    batches, sgd = iter(LOADER * 2), torch.optim.SGD(twin.parameters(), lr=0.1, momentum=0.9)
    for payload, _, _ in session.pushed:  # each round from the reply's values (the start's), as torch would
        FlatParams(twin).assign(start)
        sgd = torch.optim.SGD(twin.parameters(), lr=0.1, momentum=0.9) if reset else sgd
        for _ in range(2):
            x, y = next(batches)
            sgd.zero_grad()
            torch.nn.functional.cross_entropy(twin(x), y).backward()
            sgd.step()
        np.testing.assert_allclose(payload, 8 * (start - FlatParams(twin).read()), atol=1e-5)


def test_a_users_own_loop_ends_a_round_when_the_time_budget_does_after_whole_local_steps() -> None:
    clock = FakeClock()  # T = 25 ms from the order's arrival; each local step (one micro-batch) costs 10
    session = FakeSession([order(5, 4, time_budget_s=0.025), order(2, 4, time_budget_s=0.025),
                           pb.WorkOrder(stop=True)], FlatParams(bn_model()).read(), clock=clock,
                          received_at=clock.now())
    assert users_loop(session, bn_model(), LOADER, cost_s=0.01) == [0, 0, 1, 1, 2]
    assert [(s["local_steps"], s["batch_exhausted"]) for _, _, s in session.pushed] == [(3, False), (2, True)]
    assert [n for _, n, _ in session.pushed] == [12, 8]