"""Anytime Mini-Batch: time-budgeted steps, device emulation, and the PS side of AMB/FMB."""

from __future__ import annotations

import time

import numpy as np
import pytest

from switchps.protos import switchps_pb2 as pb
from switchps.worker.data import load_dataset
from switchps.worker.gradients import GradientComputer
from switchps.worker.main import Sampler, StepRunner
from switchps.worker.models import build_model
from switchps.worker.stragglers import StepDelays


@pytest.fixture(scope="module")
def digits_runner_parts():
    data = load_dataset("digits")
    gc = GradientComputer(build_model("mlp", data.input_shape, data.num_classes, seed=0, hidden=[16]))
    for n in (4, 3):  # trace the tf.functions now, not inside a timed budget
        gc.accumulate(data.x_train[:n], data.y_train[:n])
    gc.finish()
    return gc, data.x_train, data.y_train


def _runner(parts, samples_per_s: float | None) -> StepRunner:
    gc, x, y = parts
    return StepRunner(gc, x, y, Sampler(len(x), seed=0), samples_per_s)


def _amb_order(budget_s: float, max_batch: int = 1000, micro: int = 4) -> pb.WorkOrder:
    return pb.WorkOrder(protocol="amb", sample_budget=max_batch, time_budget_s=budget_s, micro_batch=micro)


def test_straggler_sleep_inside_the_budget_means_fewer_samples_but_at_least_one_micro_batch(digits_runner_parts):
    runner = _runner(digits_runner_parts, samples_per_s=200)  # 4-sample micro-batches take 20 ms
    t0 = time.perf_counter()
    fast = runner.run(_amb_order(0.5), t0, StepDelays())
    t1 = time.perf_counter()
    slow = runner.run(_amb_order(0.5), t1, StepDelays(sleep_s=0.4))
    t2 = time.perf_counter()
    assert slow.samples < fast.samples / 2, (slow.samples, fast.samples)
    assert slow.samples >= 4 and slow.sleep_s == pytest.approx(0.4)
    assert 0.45 <= t1 - t0 <= 0.7 and 0.45 <= t2 - t1 <= 0.7, "a step lasts about T, sleep included"
    asleep = runner.run(_amb_order(0.5), time.perf_counter(), StepDelays(sleep_s=0.6))  # sleeps past T
    assert asleep.samples == 4, "always at least one micro-batch, never zeros"
    assert np.any(asleep.grad != 0)


def test_max_batch_exhausted_before_the_time_budget_is_flagged(digits_runner_parts):
    runner = _runner(digits_runner_parts, samples_per_s=1000)
    step = runner.run(_amb_order(0.5, max_batch=16), time.perf_counter(), StepDelays())
    assert step.samples == 16 and step.exhausted


def test_emulated_device_speed_within_10_percent(digits_runner_parts):
    runner = _runner(digits_runner_parts, samples_per_s=250)
    order = pb.WorkOrder(protocol="bsp", sample_budget=100, micro_batch=10)
    t0 = time.perf_counter()
    step = runner.run(order, t0, StepDelays())
    rate = step.samples / (time.perf_counter() - t0)
    assert step.samples == 100
    assert abs(rate - 250) / 250 < 0.10, rate


def test_slowdown_factor_stretches_compute(digits_runner_parts):
    runner = _runner(digits_runner_parts, samples_per_s=400)
    order = pb.WorkOrder(protocol="bsp", sample_budget=40, micro_batch=10)  # 0.1 s of emulated compute
    step = runner.run(order, time.perf_counter(), StepDelays(factor=3.0))
    assert step.sleep_s == pytest.approx(2 * step.compute_s, rel=0.05)


def test_amb_work_orders_and_unequal_batches_on_the_ps(cluster_factory):
    c = cluster_factory(workers=2, size=4,
                        protocol={"name": "amb", "time_budget_s": 0.25, "batch": 8, "micro_batch": 2})
    order = c.workers[0].client.pull(c.workers[0].params, worker=0).order
    assert (order.protocol, order.time_budget_s, order.sample_budget, order.micro_batch) == ("amb", 0.25, 32, 2)
    p = c.workers[0].push_async(np.full(4, 6.0, np.float32), 2)  # AMB rounds wait for every worker
    time.sleep(0.3)
    assert p.is_alive()
    c.workers[1].push(np.full(4, 2.0, np.float32), 6)
    p.result()
    # every sample counts once: ΣG/Σb = 8/8 = 1, not the mean of per-worker means (3 + 1/3)/2
    np.testing.assert_allclose(c.params, np.full(4, -1.0))
    row = c.ps_rows()[0]
    assert (row["protocol"], row["b_min"], row["b_max"], row["time_budget_s"]) == ("amb", "2", "6", "0.25")


def test_fmb_is_bsp_with_a_fixed_batch(cluster_factory):
    c = cluster_factory(workers=2, size=4, protocol={"name": "fmb", "batch": 8})
    order = c.workers[0].client.pull(c.workers[0].params, worker=0).order
    assert (order.protocol, order.time_budget_s, order.sample_budget) == ("fmb", 0.0, 8)


def test_trace_recorded_by_the_ps_replays_bit_exactly(tmp_path):
    from switchps.ps_server.records import RunRecorder
    from switchps.worker.stragglers import StragglerInjector, StragglerSpec, load_trace

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
