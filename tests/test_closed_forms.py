"""The closed forms of ``switchps.closed_forms``: known values, NumPy Monte Carlo of each rule, a Monte Carlo
that drives the real ``Core`` (the rule as switchps implements it, not as a paper states it), and the
simulator itself (``switchps.sim``) through ``bench/sim_validation.py``'s own cases, shortened."""

from __future__ import annotations

import heapq
import importlib
import math
from dataclasses import dataclass
from pathlib import Path
from types import ModuleType
from typing import Any

import numpy as np
import pytest

from harness import Harness
from switchps.closed_forms import (
    amb_mean_batch, amb_update_s, amb_update_sd, asp_mean_staleness, backup_late_finish_moments,
    backup_late_finish_update_s, backup_update_s, bsp_update_s, bsp_update_sd, harmonic, kasync_update_s,
    local_sgd_round_s, local_sgd_round_sd,
)
from switchps.config.protocol import MEMBERS
from switchps.config.run import RunConfig
from switchps.protos import switchps_pb2 as pb
from switchps.ps_server.core.events import StepReport
from switchps.sim.run import simulate
from switchps.straggler_trace import StepDelays
from switchps.worker.steps import Sampler, StepRunner


def test_harmonic_numbers() -> None:
    assert harmonic(0) == 0 and harmonic(1) == 1 and harmonic(2) == 1.5
    assert harmonic(4) == pytest.approx(25 / 12) and harmonic(8) == pytest.approx(761 / 280)
    assert harmonic(10_000) == pytest.approx(math.log(10_000) + 0.5772156649 + 1 / 20_000, abs=1e-9)
    with pytest.raises(ValueError):
        harmonic(-1)


def test_known_values() -> None:
    assert bsp_update_s(8, 0.5, 2.0) == pytest.approx(0.5 + 761 / 560)
    assert bsp_update_sd(2, 1.0) == pytest.approx(math.sqrt(1.25))
    assert backup_update_s(8, 0, 0.5, 2.0) == bsp_update_s(8, 0.5, 2.0)
    assert backup_update_s(4, 2, 0.0, 1.0) == pytest.approx(1 / 4 + 1 / 3)  # the 2nd of 4: 1/4 + 1/3
    assert kasync_update_s(64, 16, 2.0) == pytest.approx(16 / 128)
    assert kasync_update_s(10, 5, 1.0, c=1.0) == pytest.approx(1.0)
    assert asp_mean_staleness(1) == 0 and asp_mean_staleness(1024) == 1023
    for bad in (lambda: bsp_update_s(0, 0, 1), lambda: bsp_update_s(2, -1, 1), lambda: backup_update_s(4, 4, 0, 1),
                lambda: kasync_update_s(4, 0, 1), lambda: amb_update_s(4, 0, 1, 0, 0.1)):
        with pytest.raises(ValueError):
            bad()


def test_late_finish_by_hand() -> None:
    """N = 2, one backup: a fresh and a doomed step race (rate 2 mu); half the time the doomed one wins and
    the round needs one more fresh finish (rate 2 mu): E = 3/(4 mu), E[T^2] = 1/mu^2, Var = 7/(16 mu^2)."""
    mean, var = backup_late_finish_moments(2, 1, 2.0)
    assert mean == pytest.approx(3 / 8) and var == pytest.approx(7 / 64)
    mean, var = backup_late_finish_moments(8, 0, 1.0)  # no backups: BSP
    assert mean == pytest.approx(harmonic(8)) and var == pytest.approx(bsp_update_sd(8, 1.0) ** 2)
    for n, b in ((8, 2), (64, 16), (1024, 256)):  # slower than the paper's rule, faster than BSP
        assert backup_update_s(n, b, 0.0, 1.0) < backup_late_finish_update_s(n, b, 1.0) < bsp_update_s(n, 0.0, 1.0)


# ---- NumPy Monte Carlo of each rule ------------------------------------------------------------------


def steps(rng: np.random.Generator, shape: tuple[int, ...], c: float, mu: float) -> np.ndarray:
    return c + rng.exponential(1 / mu, shape)


def test_bsp_and_paper_backup_monte_carlo() -> None:
    rng = np.random.default_rng(0)
    x = steps(rng, (40_000, 8), 0.5, 2.0)
    rounds = x.max(axis=1)
    assert rounds.mean() == pytest.approx(bsp_update_s(8, 0.5, 2.0), rel=0.01)
    assert rounds.std() == pytest.approx(bsp_update_sd(8, 2.0), rel=0.03)
    sixth = np.sort(x, axis=1)[:, 5]  # the first 6 of 8: 2 backups, late ones start afresh
    assert sixth.mean() == pytest.approx(backup_update_s(8, 2, 0.5, 2.0), rel=0.01)


def late_finish_rounds(n: int, backup: int, c: float, mu: float, rounds: int, chains: int, seed: int) -> np.ndarray:
    """switchps's backup rule, round after round, in ``chains`` independent runs; the round times.

    ``wait`` is each worker's time from the round's start to the start of its fresh step: 0 for the
    members the last update released; for a late worker, until its doomed step ends (it is dropped)."""
    rng = np.random.default_rng(seed)
    wait = np.zeros((chains, n))
    out = np.empty((rounds, chains))
    for r in range(rounds):
        pushed = wait + steps(rng, (chains, n), c, mu)
        end = out[r] = np.partition(pushed, n - backup - 1, axis=1)[:, n - backup - 1]
        member = pushed <= end[:, None]
        # still on a doomed step: its remainder; else its fresh step is now doomed: until it ends
        wait = np.where(member, 0.0, np.where(wait > end[:, None], wait, pushed) - end[:, None])
    return out


def test_late_finish_monte_carlo_matches_the_markov_chain() -> None:
    for n, b in ((8, 2), (16, 5), (2, 1)):
        t = late_finish_rounds(n, b, 0.0, 1.0, rounds=60, chains=4000, seed=n)[5:]  # the first round is the paper's
        mean, var = backup_late_finish_moments(n, b, 1.0)
        assert t.mean() == pytest.approx(mean, rel=0.01), (n, b)
        assert t.var() == pytest.approx(var, rel=0.05), (n, b)


def test_amb_monte_carlo() -> None:
    rng = np.random.default_rng(1)
    for n, c, mu, budget, micro in ((8, 0.5, 1.0, 3.2, 0.45), (64, 0.2, 2.0, 1.0, 0.01), (16, 1.0, 1.0, 0.7, 0.1)):
        x = steps(rng, (20_000, n), c, mu)
        count = np.maximum(1, np.ceil((budget - x) / micro))
        rounds = (x + micro * count).max(axis=1)
        assert rounds.mean() == pytest.approx(amb_update_s(n, c, mu, budget, micro), rel=0.005), (n, budget)
        assert rounds.std() == pytest.approx(amb_update_sd(n, c, mu, budget, micro), rel=0.03), (n, budget)
        assert count.sum(axis=1).mean() == pytest.approx(amb_mean_batch(n, c, mu, budget, micro), rel=0.005)
    x = steps(rng, (20_000, 32), 0.5, 1.0)  # micro-batches of no time: max(T, slowest)
    assert np.maximum(2.0, x.max(axis=1)).mean() == pytest.approx(amb_update_s(32, 0.5, 1.0, 2.0, 0.0), rel=0.005)
    assert amb_update_s(32, 0.5, 1.0, 0.3, 0.0) == pytest.approx(bsp_update_s(32, 0.5, 1.0))  # T < c: BSP
    assert amb_update_sd(32, 0.5, 1.0, 0.3, 1e-9) == pytest.approx(bsp_update_sd(32, 1.0), rel=1e-4)


def test_amb_mean_batch_by_brute_force() -> None:
    for n, c, mu, budget, micro in ((8, 0.5, 1.0, 3.2, 0.45), (4, 0.0, 3.0, 2.0, 1e-3), (4, 2.0, 1.0, 1.0, 0.1)):
        j = np.arange(1, int(budget / micro) + 2)
        x = budget - j * micro
        brute = n * (1 + np.where(x > c, -np.expm1(-mu * np.maximum(x - c, 0)), 0.0).sum())
        assert amb_mean_batch(n, c, mu, budget, micro, micro_batch=1) == pytest.approx(brute, rel=1e-9)
    assert amb_mean_batch(4, 0.0, 1.0, 1.0, 0.1, micro_batch=8) == 8 * amb_mean_batch(4, 0.0, 1.0, 1.0, 0.1)


def test_local_sgd_round_known_values() -> None:
    """H = 1 is BSP; one worker waits for its own H steps, H (c + 1/mu); two workers' max of Erlang(2) times:
    E[max] = 2 E - E[min], and P(min > s) = ((1 + mu s) e^(-mu s))^2 integrates to 5 / (4 mu)."""
    for n in (1, 8, 1024):
        assert local_sgd_round_s(n, 1, 0.5, 2.0) == pytest.approx(bsp_update_s(n, 0.5, 2.0), rel=1e-9)
        assert local_sgd_round_sd(n, 1, 2.0) == pytest.approx(bsp_update_sd(n, 2.0), rel=1e-6)
    assert local_sgd_round_s(1, 16, 0.5, 2.0) == pytest.approx(16 * (0.5 + 0.5), rel=1e-9)
    assert local_sgd_round_sd(1, 16, 2.0) == pytest.approx(4 / 2.0, rel=1e-6)
    assert local_sgd_round_s(2, 2, 0.0, 1.0) == pytest.approx(2 * 2 - 5 / 4, rel=1e-9)
    for bad in (lambda: local_sgd_round_s(8, 0, 0.5, 1.0), lambda: local_sgd_round_s(0, 4, 0.5, 1.0),
                lambda: local_sgd_round_sd(8, 4, 0.0)):
        with pytest.raises(ValueError):
            bad()


@pytest.mark.parametrize("n", [8, 256, 1024])
def test_local_sgd_round_monte_carlo(n: int) -> None:
    rng = np.random.default_rng(n)
    for h in (1, 4, 16):
        rounds = (h * 0.5 + rng.gamma(h, 1.0, (max(2000, 400_000 // n), n))).max(axis=1)
        se = rounds.std() / math.sqrt(len(rounds))
        assert abs(rounds.mean() - local_sgd_round_s(n, h, 0.5, 1.0)) < 4 * se, (n, h)
        assert rounds.std() == pytest.approx(local_sgd_round_sd(n, h, 1.0), rel=0.05), (n, h)


@dataclass
class Clock:
    t: float = 100.0

    def now(self) -> float:
        return self.t

    def sleep(self, seconds: float) -> None:
        self.t += seconds


class Instant:
    """A gradient computer that takes no time (the emulated device's time is all there is)."""

    def accumulate(self, rows: np.ndarray) -> None:
        pass

    def finish(self) -> tuple[np.ndarray, float]:
        return np.zeros(1, np.float32), 0.0

    def compute(self, rows: np.ndarray, micro_batch: int) -> tuple[np.ndarray, float]:
        return self.finish()


@pytest.mark.parametrize("sleep_s", [0.0, 0.1, 0.3, 0.49, 0.53, 0.9])
def test_amb_rule_is_the_workers(sleep_s: float) -> None:
    """The AMB formulas' rule, X + d max(1, ceil((T - X)/d)) and that many micro-batches, is what
    ``worker.steps`` does with a straggler sleep X (d = 1/64 s: one sample at 64 samples/s)."""
    clock = Clock()
    runner = StepRunner(Instant(), Sampler(10, seed=0), 64.0, clock)
    order = pb.WorkOrder(protocol="amb", sample_budget=1000, time_budget_s=0.5, micro_batch=1)
    step = runner.run(order, clock.now(), StepDelays(sleep_s=sleep_s))
    count = max(1, math.ceil((0.5 - sleep_s) * 64))
    assert step.samples == count
    assert clock.t - 100.0 == pytest.approx(sleep_s + count / 64)


# ---- the rule as switchps implements it: the real Core on a virtual clock ------------------------------


def drive_core(protocol: dict, n: int, c: float, mu: float, updates: int, seed: int, micro_s: float = 0.0,
               run_dir: Path | None = None) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """Run ``Core`` (through the test harness) with steps of c + Exp(mu): a worker starts its next step when
    its push is released, on the version its work order names. With ``micro_s`` (AMB) a step ends as
    ``worker.steps`` ends it; with ``run_dir`` the PS's records are written there. Returns each update's
    time, mean staleness and samples."""
    never = {"deadline_s": 1e9} if "deadline_s" in MEMBERS[protocol.get("name", "bsp")].model_fields else {}
    h = Harness(workers=n, protocol={"batch": 1, **never, **protocol}, train={"steps": updates},
                run_dir=run_dir)
    rng, t0 = np.random.default_rng(seed), h.now
    budget = h.core.work_order().time_budget_s

    def step(now: float, worker: int, version: int, k: int) -> tuple[float, int, int, int, int]:
        x = c + float(rng.exponential(1 / mu))
        count = max(1, math.ceil((budget - x) / micro_s)) if budget else 1
        return now + x + micro_s * count * bool(budget), worker, version, k, count

    queue = [step(t0, w, 0, 0) for w in range(n)]
    heapq.heapify(queue)
    times: list[float] = []
    last = [0] * n
    while not h.core.done:
        h.now, worker, version, last[worker], samples = heapq.heappop(queue)
        seen, applied = len(h.releases), len(h.applied)
        h.push(worker, 1.0, samples=samples, base=version, step=last[worker], report=StepReport(step=last[worker]))
        times += [h.now - t0] * (len(h.applied) - applied)
        for r in list(h.releases.values())[seen:]:
            heapq.heappush(queue, step(h.now, r.worker, r.order.version, last[r.worker] + 1))
    if h.rec is not None:
        h.rec.close({})
    members = [a.aggregate.members for a in h.applied]
    return (np.array(times), np.array([np.mean([m.staleness for m in ms]) for ms in members]),
            np.array([sum(m.samples for m in ms) for ms in members]))


def test_core_monte_carlo_backup_workers_finish_their_late_step() -> None:
    """switchps's backup rule is not the paper's: its late workers finish (and lose) their step."""
    times, _, samples = drive_core({"backup_workers": 2}, 8, 0.0, 1.0, updates=2000, seed=3)
    per_update = np.diff(times[10:]).mean()
    assert per_update == pytest.approx(backup_late_finish_update_s(8, 2, 1.0), rel=0.035)
    assert abs(per_update / backup_update_s(8, 2, 0.0, 1.0) - 1) > 0.15  # the paper's rule is far off
    assert (samples == 6).all()


def test_core_monte_carlo_bsp_kasync_asp_amb() -> None:
    times, _, _ = drive_core({}, 8, 0.5, 1.0, updates=1500, seed=4)
    assert np.diff(times[10:]).mean() == pytest.approx(bsp_update_s(8, 0.5, 1.0), rel=0.04)
    times, _, _ = drive_core({"name": "kasync", "k": 4}, 8, 0.0, 1.0, updates=2000, seed=5)
    assert np.diff(times[10:]).mean() == pytest.approx(kasync_update_s(8, 4, 1.0), rel=0.045)
    times, _, _ = drive_core({"name": "kasync", "k": 4}, 8, 0.5, 1.0, updates=2000, seed=6)
    assert np.diff(times[20:]).mean() == pytest.approx(kasync_update_s(8, 4, 1.0, c=0.5), rel=0.045)
    _, staleness, _ = drive_core({"name": "asp"}, 8, 0.5, 1.0, updates=3000, seed=7)
    assert staleness[200:].mean() == pytest.approx(asp_mean_staleness(8), rel=0.02)
    budget, micro = 3.0, 0.2
    times, _, samples = drive_core({"name": "amb", "time_budget_s": budget, "max_batch": 100}, 8, 0.5, 1.0,
                                   updates=1000, seed=8, micro_s=micro)
    assert np.diff(times[10:]).mean() == pytest.approx(amb_update_s(8, 0.5, 1.0, budget, micro), rel=0.03)
    assert samples[10:].mean() == pytest.approx(amb_mean_batch(8, 0.5, 1.0, budget, micro), rel=0.02)


# ---- bench/sim_validation.py without the simulator ------------------------------------------------------


@pytest.fixture
def bench(monkeypatch: pytest.MonkeyPatch) -> ModuleType:
    monkeypatch.syspath_prepend(str(Path(__file__).resolve().parents[1] / "bench"))
    return importlib.import_module("sim_validation")


def core_simulator(cfg: RunConfig, run_dir: Path, *, time_only: bool, quiet: bool) -> dict[str, Any]:
    """The simulator's contract, kept by the core driven above: ps.csv in ``run_dir`` from ``cfg``."""
    assert time_only and quiet
    spec = cfg.stragglers.shifted_exponential
    assert spec is not None and cfg.device.samples_per_s is not None
    micro_s = (cfg.protocol.micro_batch or 1) / cfg.device.samples_per_s if cfg.protocol.name == "amb" else 0.0
    protocol = cfg.protocol.model_dump(exclude_none=True)
    drive_core(protocol, cfg.cluster.num_workers, spec.shift_s, spec.rate_per_s, cfg.train.steps or 0, cfg.seed,
               micro_s=micro_s, run_dir=run_dir)
    return {"simulated": True}


@pytest.mark.parametrize("case", ["bsp", "backup", "kasync", "asp", "amb", "local_sgd4"])
def test_bench_configs_validate(bench: ModuleType, case: str, tmp_path: Path) -> None:
    for n in (8, 1024):
        plan = bench.plan(case, n, 0.005)
        cfg = bench.build_config(plan, 3, tmp_path)
        assert cfg.cluster.num_workers == n and cfg.seed == 3 and cfg.train.steps == plan.warmup + plan.updates + 1
        assert cfg.stragglers.shifted_exponential.rate_per_s == bench.MU
        assert cfg.protocol.name == plan.protocol["name"] and cfg.checkpoint.every_s is None
        assert plan.updates >= bench.MIN_UPDATES and set(plan.expected) <= {"seconds_per_update", "mean_staleness",
                                                                            "mean_batch"}


def test_bench_plans_enough_updates(bench: ModuleType) -> None:
    bsp = bench.plan("bsp", 8, 0.005)  # cv = sd / mean of a round: (sd/mean / se)^2 rounds
    cv = bsp_update_sd(8, 1.0) / bsp_update_s(8, 0.5, 1.0)
    assert bsp.updates == math.ceil((cv / 0.005) ** 2) and bsp.expected["seconds_per_update"] == pytest.approx(
        bsp_update_s(8, 0.5, 1.0), abs=1e-8)
    assert bench.plan("kasync", 64, 0.005).updates == 2500  # Gamma(16, N mu): cv 1/4
    amb = bench.plan("amb", 64, 0.005)  # at most max_batch samples: never cut before T
    assert amb.protocol["max_batch"] > amb.reference["time_budget_s"] / amb.reference["micro_batch_s"] + 1
    local = bench.plan("local_sgd16", 1024, 0.005)  # H = 16 local steps a round, each 0.5 + Exp(1) s
    assert local.protocol == {"name": "local_sgd", "local_steps": 16} and local.pushes_per_update == 16 * 1024
    assert local.expected["seconds_per_update"] == pytest.approx(local_sgd_round_s(1024, 16, 0.5 + 1e-9, 1.0))
    cv = local_sgd_round_sd(1024, 16, 1.0) / local_sgd_round_s(1024, 16, 0.5, 1.0)
    assert local.updates == max(bench.MIN_UPDATES, math.ceil((cv / 0.005) ** 2)) == 200
    for bad in ("gossip", "local_sgd", "local_sgdx"):
        with pytest.raises(ValueError, match="unknown case"):
            bench.plan(bad, 8, 0.005)


def test_batch_means(bench: ModuleType) -> None:
    x = np.random.default_rng(0).normal(10.0, 2.0, 20_000)
    mean, se = bench.batch_mean(x)
    assert mean == x.mean() and se == pytest.approx(2.0 / math.sqrt(20_000), rel=0.4)
    walk = np.cumsum(np.random.default_rng(1).normal(0, 1, 20_000))  # correlated: batch means see it
    assert bench.batch_mean(walk)[1] > 10 * walk.std() / math.sqrt(20_000)
    with pytest.raises(ValueError, match="too few"):
        bench.batch_mean(np.ones(39))


def test_bench_reads_the_ps_records(bench: ModuleType, tmp_path: Path) -> None:
    """Statistics from a ps.csv the PS's recorder wrote: the same as from the updates themselves."""
    times, staleness, samples = drive_core({"name": "kasync", "k": 3}, 6, 0.2, 2.0, updates=400, seed=9,
                                           run_dir=tmp_path)
    ps = bench.read_ps(tmp_path / "ps.csv")
    np.testing.assert_allclose(ps["time_s"], times, rtol=1e-5)
    np.testing.assert_allclose(ps["staleness_mean"], staleness, rtol=1e-5)
    assert (ps["samples"] == samples).all()
    got = bench.measure(ps, 40)
    assert got["seconds_per_update"][0] == pytest.approx((times[-1] - times[40]) / (len(times) - 41), rel=1e-5)
    assert got["mean_batch"] == (3.0, 0.0)
    result = bench.compare({"seconds_per_update": kasync_update_s(6, 3, 2.0, c=0.2)}, got)["seconds_per_update"]
    assert result["pass"] and abs(result["rel_error"]) < 4 * result["rel_se"] + 1e-9


def assert_agrees(result: dict[str, Any]) -> None:
    """Each metric of a case planned for a 2 % standard error (the bench plans for 0.5 %) reached about that
    precision and lies within 4 of its standard errors of the formula."""
    for metric in result["metrics"].values():
        assert metric["rel_se"] < 0.03 and abs(metric["rel_error"]) < 4 * metric["rel_se"], result


def test_bench_end_to_end_on_the_core(bench: ModuleType, tmp_path: Path) -> None:
    """The bench's whole path, with the core driven above standing in for the simulator."""
    for case in ("backup", "amb"):
        assert_agrees(bench.run_case(bench.plan(case, 8, 0.02), 1, tmp_path, core_simulator))


@pytest.mark.parametrize("n", [8, 64])
def test_the_simulator_agrees_with_the_closed_forms(bench: ModuleType, n: int, tmp_path: Path) -> None:
    """``switchps.sim`` itself, time only, on every case of the bench at 8 and 64 workers, planned for 2 %
    and at least 60 updates (3 to a batch mean), a few seconds in all (the bench's own run plans for 0.5 %
    and passes within 2 %: see the README). The seed is fixed: the check is the same in every run."""
    for case in bench.CASES:
        assert_agrees(bench.run_case(bench.plan(case, n, 0.02, least=60), 1, tmp_path, simulate))
