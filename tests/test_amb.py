"""Anytime Mini-Batch: time-budgeted steps, device emulation, and the PS side of AMB/FMB.

The step's budget logic runs on a fake clock, with a stub computer and with each framework's real one
through the ``Computer`` seam: the same samples, sleeps and times, and a payload that is the Σ gradient of
exactly the samples the step took."""

from __future__ import annotations

from dataclasses import dataclass, field
from functools import cache

import numpy as np
import pytest

from switchps.config.run import parse_config
from switchps.protos import switchps_pb2 as pb
from switchps.worker.steps import Sampler, StepRunner, Step
from switchps.straggler_trace import StepDelays
from switchps.workload.frameworks import FRAMEWORKS, Computer, framework
from conftest import FakeClock


@dataclass
class StubComputer:
    """Counts samples; each micro-batch costs ``cost_s`` of (fake) compute time."""

    clock: FakeClock
    cost_s: float = 0.0
    samples: int = 0

    def accumulate(self, rows: np.ndarray) -> None:
        self.clock.t += self.cost_s
        self.samples += len(rows)

    def finish(self) -> tuple[np.ndarray, float]:
        grad, self.samples = np.full(2, float(self.samples), np.float32), 0
        return grad, 0.0

    def compute(self, rows: np.ndarray, micro_batch: int) -> tuple[np.ndarray, float]:
        for i in range(0, len(rows), micro_batch):
            self.accumulate(rows[i : i + micro_batch])
        return self.finish()


@dataclass
class Timed:
    """A framework's real computer on the fake clock: each micro-batch costs ``cost_s`` of fake time after
    the real accumulate (whose own time the fake clock does not see); the rows the step took are kept."""

    clock: FakeClock
    gc: Computer
    cost_s: float = 0.0
    taken: list[np.ndarray] = field(default_factory=list)

    def accumulate(self, rows: np.ndarray) -> None:
        self.gc.accumulate(rows)
        self.clock.t += self.cost_s
        self.taken.append(rows)

    def finish(self) -> tuple[np.ndarray, float]:
        return self.gc.finish()

    def compute(self, rows: np.ndarray, micro_batch: int) -> tuple[np.ndarray, float]:
        for i in range(0, len(rows), micro_batch):
            self.accumulate(rows[i : i + micro_batch])
        return self.finish()


@cache
def real_computer(name: str) -> Computer:
    """Framework ``name``'s computer for logistic regression on digits (built once per module run)."""
    cfg = parse_config({"model": {"name": "logreg", "framework": name}, "data": {"name": "digits"}})
    fw = framework(name)
    data, model = fw.prepare(cfg)
    return fw.computer(cfg, model, data.x_train, data.y_train)


@pytest.fixture(params=["stub", *FRAMEWORKS])
def kind(request: pytest.FixtureRequest) -> str:
    """Which computer the steps run: the stub, or a framework's real one behind ``Timed``."""
    return str(request.param)


def _runner(kind: str, samples_per_s: float | None, cost_s: float = 0.0) -> tuple[StepRunner, FakeClock]:
    clock = FakeClock()
    gc = StubComputer(clock, cost_s) if kind == "stub" else Timed(clock, real_computer(kind), cost_s)
    return StepRunner(gc, Sampler(100, seed=0), samples_per_s, clock), clock


def check_payload(runner: StepRunner, step: Step) -> None:
    """The step's payload sums exactly the samples it took: the stub counts them; a real computer's payload
    equals the gradient of the summed loss over those samples, computed in one call at the same values."""
    gc = runner.gc
    if isinstance(gc, StubComputer):
        assert step.grad[0] == step.samples
        return
    assert isinstance(gc, Timed)
    rows, gc.taken = np.concatenate(gc.taken), []
    assert len(rows) == step.samples
    whole, _ = gc.gc.compute(rows, len(rows))
    assert np.any(step.grad != 0), "never zeros"
    np.testing.assert_allclose(step.grad, whole, rtol=1e-4, atol=1e-5)


def _amb_order(budget_s: float, max_batch: int = 1000, micro: int = 4) -> pb.WorkOrder:
    return pb.WorkOrder(protocol="amb", sample_budget=max_batch, time_budget_s=budget_s, micro_batch=micro)


def test_straggler_sleep_inside_the_budget_means_fewer_samples_but_at_least_one_micro_batch(kind: str) -> None:
    runner, clock = _runner(kind, samples_per_s=256)  # a 4-sample micro-batch takes 1/64 s (exact in binary)
    t0 = clock.now()
    fast = runner.run(_amb_order(0.5), t0, StepDelays())
    assert (fast.samples, clock.now() - t0) == (128, 0.5), "T / (1/64 s) = 32 micro-batches"
    check_payload(runner, fast)
    t1 = clock.now()
    slow = runner.run(_amb_order(0.5), t1, StepDelays(sleep_s=0.375))
    assert (slow.samples, slow.sleep_s, clock.now() - t1) == (32, 0.375, 0.5), "the sleep is inside T"
    check_payload(runner, slow)
    asleep = runner.run(_amb_order(0.5), clock.now(), StepDelays(sleep_s=0.625))  # sleeps past T
    assert asleep.samples == 4, "always at least one micro-batch"
    check_payload(runner, asleep)


def test_max_batch_exhausted_before_the_time_budget_is_flagged(kind: str) -> None:
    runner, clock = _runner(kind, samples_per_s=1000)
    step = runner.run(_amb_order(0.5, max_batch=16), clock.now(), StepDelays())
    assert step.samples == 16 and step.exhausted
    check_payload(runner, step)


def test_an_emulated_device_takes_its_time_and_never_less_than_the_real_compute(kind: str) -> None:
    order = pb.WorkOrder(protocol="bsp", sample_budget=100, micro_batch=10)
    for cost_s, per_batch in ((0.01, 0.04), (0.06, 0.06)):  # emulated 10 / 250 = 40 ms per micro-batch
        runner, clock = _runner(kind, samples_per_s=250, cost_s=cost_s)
        t0 = clock.now()
        step = runner.run(order, t0, StepDelays())
        assert step.samples == 100 and clock.now() - t0 == pytest.approx(10 * per_batch)
        assert step.compute_s == pytest.approx(10 * per_batch)
        check_payload(runner, step)


def test_slowdown_factor_stretches_compute_and_comm_delay_comes_last(kind: str) -> None:
    runner, clock = _runner(kind, samples_per_s=400)
    order = pb.WorkOrder(protocol="bsp", sample_budget=40, micro_batch=10)  # 0.1 s of emulated compute
    t0 = clock.now()
    step = runner.run(order, t0, StepDelays(factor=3.0, comm_s=0.05))
    assert step.compute_s == pytest.approx(0.1) and step.sleep_s == pytest.approx(0.2 + 0.05)
    assert clock.now() - t0 == pytest.approx(0.35)
    check_payload(runner, step)


def test_trace_recorded_by_the_ps_replays_bit_exactly(tmp_path):
    from switchps.ps_server.records import RunRecorder
    from switchps.straggler_trace import load_trace
    from switchps.config.stragglers import StragglerSpec
    from switchps.worker.stragglers import StragglerInjector

    spec = StragglerSpec(mixture={"preset": "niagara", "scale": 0.37}, comm_delay={"sigma_s": 0.013},
                         transient={"workers": 1, "factor": 2.5, "duration_s": 1.0, "every_s": 3.0})
    rec = RunRecorder(tmp_path, trace=True)
    planned = {}
    for w in range(3):
        inj = StragglerInjector(spec, seed=4, worker=w, num_workers=3)
        for step in range(40):
            d = planned[w, step] = inj.plan(step, step * 0.3)
            rec.straggler(time_s=rec.now(), worker=w, step=step, sleep_s=d.sleep_s, factor=d.factor, comm_s=d.comm_s)
    rec.close({})
    replay = load_trace(tmp_path / "stragglers.csv")
    assert replay == planned  # exact float equality, not approximate
