"""Local steps in the simulator (issue 46): an order's H local steps are H compute intervals, each drawn as a
step is, then one push of all their samples; the real learner's payload is the worker's own inner trajectory;
synchronous local SGD's rounds match the closed form at 1,024 workers; every local-steps protocol runs there."""

from __future__ import annotations

import csv
import importlib
from pathlib import Path
from types import ModuleType
from typing import Any

import numpy as np
import pytest

from switchps.config.optimizer import OptimizerSpec
from switchps.config.run import RunConfig, parse_config
from switchps.optim.optimizers import optimizer_factory
from switchps.ps_server.core.actions import Apply
from switchps.ps_server.core.events import Local, WorkOrder
from switchps.sim import driver
from switchps.sim.run import simulate
from switchps.sim.workers import SimWorker
from switchps.worker.stragglers import StragglerInjector


def config(workers: int = 3, steps: int = 4, **sections: Any) -> RunConfig:
    """``workers`` workers, local steps of 10 samples at 100 samples/s (0.1 s each), H = 4, ``steps`` updates;
    ``protocol`` is merged into the base's (a field given as None: left unset)."""
    raw: dict[str, Any] = {"name": "local", "cluster": {"workers": workers}, "model": {"name": "logreg"},
                           "data": {"name": "digits", "sampling": "replacement"}, "train": {"steps": steps},
                           "device": {"samples_per_s": 100.0}, "eval": {"every_s": 1e9},
                           "optimizer": {"name": "sgd", "learning_rate": 0.1}}
    raw.update(sections)
    protocol = {"name": "local_sgd", "batch": 10, "local_steps": 4, **sections.get("protocol", {})}
    raw["protocol"] = {k: v for k, v in protocol.items() if v is not None}
    return parse_config(raw, role="simulate")


def rows(run: Path, table: str = "ps.csv") -> list[dict[str, str]]:
    with (run / table).open(newline="") as f:
        return list(csv.DictReader(f))


def applied_local_steps(monkeypatch: pytest.MonkeyPatch) -> list[int]:
    """The local steps behind each update the simulator applies, as the core's ``Apply`` names them."""
    seen: list[int] = []
    apply = driver.Simulator.apply

    def spy(self: driver.Simulator, a: Apply) -> None:
        seen.append(a.aggregate.local_steps)
        apply(self, a)
    monkeypatch.setattr(driver.Simulator, "apply", spy)
    return seen


def slowdown(*factors: float) -> dict[str, Any]:
    return {"slowdown": {"factors": dict(enumerate(factors))}}


def test_a_round_is_h_local_steps_of_each_worker_then_one_push(tmp_path: Path,
                                                               monkeypatch: pytest.MonkeyPatch) -> None:
    seen = applied_local_steps(monkeypatch)
    s = simulate(config(stragglers=slowdown(1, 2, 3)), tmp_path / "r", time_only=True)
    ps, workers = rows(tmp_path / "r"), rows(tmp_path / "r", "workers.csv")
    assert [float(r["time_s"]) for r in ps] == pytest.approx([1.2, 2.4, 3.6, 4.8]), "4 local steps of 0.3 s"
    assert [r["samples"] for r in ps] == ["120"] * 4 and [r["workers"] for r in ps] == ["0;1;2"] * 4
    assert len(workers) == 12, "one push per worker and round"
    assert [(r["samples"], float(r["compute_s"])) for r in workers[:3]] == [("40", 0.4)] * 3
    assert [float(r["sleep_s"]) for r in workers[:3]] == pytest.approx([0.0, 0.4, 0.8]), "slowed per local step"
    assert seen == [12] * 4, "each push says its 4 local steps"
    assert s["updates"] == 4 and s["samples"] == 480


def test_anytime_local_sgd_starts_local_steps_while_t_lasts(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """amb + local_steps, T = 0.5 s: local steps of 0.1, 0.2 and 0.3 s start at 0, 0.1, ... while T lasts, at
    most H = 4: 4, 3 (the last from 0.4 to 0.6) and 2 (0.3 to 0.6) of them."""
    seen = applied_local_steps(monkeypatch)
    cfg = config(protocol={"name": "amb", "time_budget_s": 0.5, "max_batch": 1000}, stragglers=slowdown(1, 2, 3))
    simulate(cfg, tmp_path / "r", time_only=True)
    ps, workers = rows(tmp_path / "r"), rows(tmp_path / "r", "workers.csv")
    assert [float(r["time_s"]) for r in ps] == pytest.approx([0.6, 1.2, 1.8, 2.4])
    assert [r["samples"] for r in workers[:3]] == ["40", "30", "20"] and seen == [9] * 4


def test_each_local_step_draws_its_own_straggler_sleep_and_the_push_its_one_comm_delay(tmp_path: Path) -> None:
    stragglers = {"shifted_exponential": {"shift_s": 0.05, "rate_per_s": 10.0}, "comm_delay": {"fixed_s": 0.25}}
    cfg = config(workers=1, steps=2, protocol={"local_steps": 3}, stragglers=stragglers)
    simulate(cfg, tmp_path / "r", time_only=True)
    plan = StragglerInjector(cfg.stragglers, seed=cfg.seed, worker=0, num_workers=1)
    sleeps = [plan.plan(i, 0.0).sleep_s for i in range(6)]  # compute intervals 0..5, two rounds of 3
    assert len(set(sleeps)) == 6, "a fresh draw per local step"
    expected = np.cumsum([sum(sleeps[:3]) + 0.3 + 0.25, sum(sleeps[3:]) + 0.3 + 0.25])
    assert [float(r["time_s"]) for r in rows(tmp_path / "r")] == pytest.approx(expected, abs=1e-5)  # 6 digits


def test_a_switch_between_gradients_and_local_steps_keeps_each_push_s_kind(tmp_path: Path,
                                                                          monkeypatch: pytest.MonkeyPatch) -> None:
    """bsp, then (a policy's switch halfway) local_sgd with H = 4: the gradients' pushes say no local steps,
    the movements' 4 each; every round still forms."""
    seen = applied_local_steps(monkeypatch)
    cfg = config(steps=8, protocol={"name": "bsp", "local_steps": None},
                 policy={"name": "schedule", "kwargs": {"phases": [{"bsp": 0.5}, {"local_sgd": 0.5}]},
                         "protocols": [{"name": "local_sgd", "local_steps": 4}]})
    simulate(cfg, tmp_path / "r", time_only=True)
    assert seen[:4] == [0] * 4 and seen[-2:] == [12, 12] and len(seen) == 8


# ---- the real learner ------------------------------------------------------------------------------


@pytest.fixture(scope="module", params=["tensorflow", "torch"])
def real(request: pytest.FixtureRequest) -> Any:
    """The real learner of a small MLP, in either framework (their computers stage values differently)."""
    from switchps.sim.gradients import real_learner

    return real_learner(config(model={"name": "mlp", "framework": request.param, "kwargs": {"hidden": [16]}}))


def local_order(steps: int, inner: OptimizerSpec, reset: bool = False) -> WorkOrder:
    return WorkOrder("local_sgd", 0, steps * 10, None, 10, False, local=Local(steps, 10, inner, reset))


def test_a_local_steps_payload_is_samples_times_the_inner_trajectory_s_movement(real: Any) -> None:
    """Each local step is one SGD step at the values the last one left, on that local step's own rows; the
    push carries samples x (start - end) and each local step's summed loss."""
    cfg, n = config(), real.trainable
    work = SimWorker(cfg, 0, np.arange(real.gc.samples)).begin(local_order(3, OptimizerSpec(learning_rate=0.1)), 0.0)
    real.sent(0)
    real.started(work)
    loss = real.loss(work)
    theta, losses = real.params[0].copy(), []
    for rows_ in work.rows.reshape(3, 10):  # by hand: assign, gradient, p -= lr * g / b
        real.gc.assign(theta)
        grad, step_loss = real.gc.compute(rows_, 10)
        theta[:n] -= np.float32(0.1) * grad[:n] / np.float32(10)
        losses.append(step_loss)
    assert work.local_steps == 3 and work.report().local_steps == 3 and work.grad is not None
    assert work.local_losses == pytest.approx(losses, rel=1e-5) and loss == pytest.approx(sum(losses), rel=1e-5)
    np.testing.assert_allclose(work.grad[:n], 30 * (real.params[0][:n] - theta[:n]), atol=1e-4)
    assert np.abs(work.grad[:n]).max() > 1e-2, "the model moved"
    np.testing.assert_array_equal(real.gradient([work]), work.grad)
    real.done(work)


@pytest.mark.parametrize("reset", [False, True])
def test_a_worker_s_inner_optimizer_state_is_kept_across_rounds_unless_reset(real: Any, reset: bool) -> None:
    """Momentum's velocity from a worker's first round moves its second unless the order resets it."""
    cfg, n = config(), real.trainable
    inner = OptimizerSpec(name="momentum", learning_rate=0.05, params={"momentum": 0.9})
    worker = SimWorker(cfg, 1 + reset, np.arange(real.gc.samples))  # a worker of its own in the shared learner
    reference = optimizer_factory(inner)(n)
    for round_ in range(2):
        work = worker.begin(local_order(2, inner, reset), 0.0)
        real.sent(0)
        real.started(work)
        real.loss(work)
        if reset:
            reference.reset_state()
        theta = real.params[0].copy()
        for rows_ in work.rows.reshape(2, 10):
            real.gc.assign(theta)
            grad, _ = real.gc.compute(rows_, 10)
            reference.apply(theta[:n], grad[:n], grad_scale=0.1)
        assert work.grad is not None
        np.testing.assert_allclose(work.grad[:n], 20 * (real.params[0][:n] - theta[:n]), atol=1e-4)
        real.done(work)
    assert reference.iterations == 4 and real.inner[worker.index].optimizer.iterations == 4


def test_local_sgd_and_diloco_train_deterministically_and_push_the_model_once_a_round(tmp_path: Path) -> None:
    """Real gradients: a local-steps run learns, twice the same bytes; on a link, a round of 4 local steps
    costs one pull and one push (0.1 s each for logreg's 650 parameters at 0.208 Mbit/s, two at a time)."""
    link = config(workers=2, steps=3, network={"ps_link_mbit_s": 0.208})
    simulate(link, tmp_path / "link")
    # 0.2 s: both pulls share the outbound side; 4 x 0.1 s of local steps; 0.2 s: both pushes share inbound
    assert [float(r["time_s"]) for r in rows(tmp_path / "link")] == pytest.approx([0.8, 1.6, 2.4])
    for name, inner, lr in (("local_sgd", "sgd", 0.1), ("diloco", "adamw", 0.01)):  # the run's SGD at lr 1 averages
        cfg = config(steps=30, protocol={"name": name, "inner_optimizer": {"name": inner, "learning_rate": lr}},
                     optimizer={"name": "sgd", "learning_rate": 1.0})
        for run in ("a", "b"):
            simulate(cfg, tmp_path / name / run)
        loss = [float(r["train_loss"]) for r in rows(tmp_path / name / "a")]
        assert np.mean(loss[-5:]) < 0.6 * np.mean(loss[:3]), (name, loss)
        for table in ("ps.csv", "workers.csv"):
            assert (tmp_path / name / "a" / table).read_bytes() == (tmp_path / name / "b" / table).read_bytes()


# ---- 1,024 workers -------------------------------------------------------------------------------------


@pytest.mark.parametrize("protocol", [{"name": "local_sgd"}, {"name": "diloco"}, {"name": "async_local_sgd"},
                                      {"name": "async_diloco"}, {"name": "amb", "time_budget_s": 0.25}])
def test_every_local_steps_protocol_runs_1024_time_only_workers(tmp_path: Path, protocol: dict[str, Any]) -> None:
    rounds = protocol["name"] in ("local_sgd", "diloco", "amb")
    cfg = config(workers=1024, steps=3 if rounds else 2048, protocol=protocol,
                 stragglers={"shifted_exponential": {"shift_s": 0.01, "rate_per_s": 20.0}})
    s = simulate(cfg, tmp_path / "r", time_only=True)
    assert s["updates"] == cfg.train.steps
    ps = rows(tmp_path / "r")
    if rounds:
        assert [len(r["workers"].split(";")) for r in ps] == [1024] * 3
    if protocol["name"] == "amb":  # T = 0.25 s: 2 or 3 local steps of 0.1 s + a sleep start within it
        assert all(20 <= int(r["samples"]) / 1024 <= 30 for r in ps)
    else:
        assert {int(r["samples"]) for r in ps} == ({40 * 1024} if rounds else {40})


def test_a_round_of_1024_real_local_trajectories(tmp_path: Path) -> None:
    """Real gradients at 1,024 workers: one round of 2 local steps each (2,048 trajectory steps, one computer
    call each); every worker's losses reach the record and the averaged movement lowers the test loss."""
    s = simulate(config(workers=1024, steps=1, protocol={"local_steps": 2}), tmp_path / "r")
    (update,) = rows(tmp_path / "r")
    assert update["workers"].count(";") == 1023 and update["samples"] == str(1024 * 20) and s["updates"] == 1
    losses = [float(r["loss"]) for r in rows(tmp_path / "r", "workers.csv")]
    assert len(losses) == 1024 and all(1.0 < x < 5.0 for x in losses)
    first, last = (float(e["test_loss"]) for e in rows(tmp_path / "r", "eval.csv"))
    assert last < first


@pytest.fixture
def bench(monkeypatch: pytest.MonkeyPatch) -> ModuleType:
    monkeypatch.syspath_prepend(str(Path(__file__).resolve().parents[1] / "bench"))
    return importlib.import_module("sim_validation")


def test_1024_workers_under_local_sgd_match_the_closed_form(bench: ModuleType, tmp_path: Path) -> None:
    """``bench/sim_validation.py``'s local_sgd4 case at 1,024 workers (rounds of 4 local steps of
    0.5 + Exp(1) s), planned for a 2 % standard error and 40 rounds: within 2 % of the formula and 4 of its
    standard errors."""
    result = bench.run_case(bench.plan("local_sgd4", 1024, 0.02, least=40), 1, tmp_path, simulate)
    metric = result["metrics"]["seconds_per_update"]
    assert result["pass"] and metric["rel_se"] < 0.03 and abs(metric["rel_error"]) < 4 * metric["rel_se"], result
