"""Straggler injection: mixture statistics, determinism, episodes, slowdowns and trace replay."""

from __future__ import annotations

import csv
from pathlib import Path

import numpy as np
import pytest
from pydantic import BaseModel, ConfigDict, ValidationError

from switchps.config.run import ConfigError, parse_config
from switchps.step_random import StepRandom, Stream
from switchps.straggler_trace import TRACE_COLUMNS, StepDelays, load_trace
from switchps.config.stragglers import (
    CommDelaySpec, MixtureSpec, ShiftedExponentialSpec, SlowdownSpec, StragglerSpec, TransientSpec,
    expected_mixture_mean,
)
from switchps.worker.episodes import Episodes
from switchps.worker.stragglers import StragglerInjector

N = 10_000


def sleeps(spec: StragglerSpec, *, seed: int = 0, worker: int = 0, n: int = N, num_workers: int = 4) -> np.ndarray:
    inj = StragglerInjector(spec, seed=seed, worker=worker, num_workers=num_workers)
    return np.array([inj.plan(k, 0.0).sleep_s for k in range(n)])


@pytest.mark.parametrize(("preset", "mean", "clip"), [("niagara", 1.0, 6.5), ("cedar", 0.07, 0.4)])
def test_preset_statistics(preset: str, mean: float, clip: float) -> None:
    spec = MixtureSpec(preset=preset)
    x = sleeps(StragglerSpec(mixture=spec))
    assert x.mean() == pytest.approx(mean, rel=0.05)
    assert x.mean() == pytest.approx(expected_mixture_mean(spec), rel=0.05)
    assert spec.clip_s == pytest.approx(clip)
    assert x.max() <= clip
    assert (x == 0).mean() == pytest.approx(0.4, abs=0.02)
    assert (x > 0).mean() > 0.55


def test_expected_mean_closed_form() -> None:
    niagara = MixtureSpec(preset="niagara")
    # rows 3 and 4 sit > 6 std from zero, so |N| adds nothing to their means
    assert expected_mixture_mean(niagara) == pytest.approx(0.3 * 0.4 * np.sqrt(2 / np.pi) + 0.2 * 2 + 0.1 * 5)
    # |N(0, 1)| has mean sqrt(2/pi); a zero-std row contributes its mean
    assert expected_mixture_mean(MixtureSpec(rows=[[0, 1, 1]])) == pytest.approx(np.sqrt(2 / np.pi))
    assert expected_mixture_mean(MixtureSpec(rows=[[3, 0, 1]])) == 3.0


def test_draws_are_clipped(monkeypatch: pytest.MonkeyPatch) -> None:
    """A 5-sigma draw is too rare to sample, so feed the injector one."""

    class Tail:
        def random(self) -> float:
            return 0.99  # picks the last row, [5, .3, .1]

        def standard_normal(self) -> float:
            return -40.0  # |5 - 40 * .3| = 7 > 6.5

    inj = StragglerInjector(StragglerSpec(mixture=MixtureSpec(preset="niagara")), seed=0, worker=0, num_workers=1)
    monkeypatch.setattr(inj._random, "_gen", Tail())
    assert inj.plan(0, 0.0).sleep_s == 6.5


def test_scale_scales_mean_and_clip() -> None:
    base, half = MixtureSpec(preset="niagara"), MixtureSpec(preset="niagara", scale=0.1)
    x = sleeps(StragglerSpec(mixture=half))
    assert expected_mixture_mean(half) == pytest.approx(0.1 * expected_mixture_mean(base))
    assert x.mean() == pytest.approx(expected_mixture_mean(half), rel=0.05)
    assert x.max() <= 0.65
    # scale multiplies draw by draw: same seed, same components, same normals
    np.testing.assert_allclose(x, 0.1 * sleeps(StragglerSpec(mixture=base)), rtol=1e-12)


def test_custom_rows_normalize_weights() -> None:
    spec = MixtureSpec(rows=[[0, 0, 3], [1, 0, 1]])  # weights 3:1 -> P(sleep 1 s) = 0.25
    x = sleeps(StragglerSpec(mixture=spec))
    assert set(np.unique(x)) == {0.0, 1.0}
    assert x.mean() == pytest.approx(0.25, abs=0.02)
    assert expected_mixture_mean(spec) == pytest.approx(0.25)


def test_mixture_only_for_listed_workers() -> None:
    spec = StragglerSpec(mixture=MixtureSpec(preset="niagara", workers=[1]))
    assert not sleeps(spec, worker=0, n=200).any()
    assert sleeps(spec, worker=1, n=200).any()


class Run(BaseModel):
    """How other code embeds the spec: errors should read `stragglers.<path>: <message>`."""

    model_config = ConfigDict(extra="forbid")
    stragglers: StragglerSpec = StragglerSpec()


@pytest.mark.parametrize(("raw", "loc", "needle"), [
    ({"mixture": {"preset": "niagara", "rows": [[0, 0, 1]]}}, "stragglers.mixture", "exactly one of preset, rows"),
    ({"mixture": {}}, "stragglers.mixture", "exactly one of preset, rows"),
    ({"mixture": {"rows": [[1, -0.1, 1]]}}, "stragglers.mixture.rows", "std must be >= 0"),
    ({"mixture": {"rows": [[1, 0.1, 0]]}}, "stragglers.mixture.rows", "weight must be > 0"),
    ({"mixture": {"rows": [[1, 0.1]]}}, "stragglers.mixture.rows", "mean_s, std_s, weight"),
    ({"mixture": {"preset": "summit"}}, "stragglers.mixture.preset", ""),
    ({"mixture": {"preset": "cedar", "scale": 0}}, "stragglers.mixture.scale", ""),
    ({"mixture": {"preset": "cedar", "sigma": 1}}, "stragglers.mixture.sigma", ""),
    ({"transient": {"factor": 2, "delay_s": 0.1, "duration_s": 1, "times": [0]}},
     "stragglers.transient", "exactly one of factor, delay_s"),
    ({"transient": {"duration_s": 1}}, "stragglers.transient", "exactly one of every_s, times"),
    ({"transient": {"duration_s": 1, "every_s": 5, "times": [1]}}, "stragglers.transient", "every_s, times"),
    ({"transient": {"duration_s": 0, "times": [1]}}, "stragglers.transient.duration_s", ""),
    ({"transient": {"workers": 0, "duration_s": 1, "times": [1]}}, "stragglers.transient.workers", ""),
    ({"comm_delay": {}}, "stragglers.comm_delay", "exactly one of fixed_s, sigma_s"),
    ({"comm_delay": {"fixed_s": 0.01, "sigma_s": 0.01}}, "stragglers.comm_delay", "exactly one"),
    ({"slowdown": {"factors": {0: 0.5}}}, "stragglers.slowdown.factors", "factor must be >= 1"),
    ({"trace": "x.csv", "mixture": {"preset": "cedar"}}, "stragglers", "remove mixture"),
    ({"trace": "x.csv", "shifted_exponential": {"rate_per_s": 1}}, "stragglers", "remove shifted_exponential"),
    ({"shifted_exponential": {"shift_s": 1}}, "stragglers.shifted_exponential.rate_per_s", "Field required"),
    ({"shifted_exponential": {"rate_per_s": 0}}, "stragglers.shifted_exponential.rate_per_s", "greater than 0"),
    ({"shifted_exponential": {"rate_per_s": 1, "shift_s": -0.1}}, "stragglers.shifted_exponential.shift_s",
     "greater than or equal to 0"),
    ({"shifted_exponential": {"rate_per_s": 1, "workers": [2, 2]}}, "stragglers.shifted_exponential.workers",
     "must not repeat"),
    ({"shifted_exponential": {"rate_per_s": 1, "mean_s": 1}}, "stragglers.shifted_exponential.mean_s", "Extra"),
    ({"tail": 1}, "stragglers.tail", "Extra inputs"),
])
def test_bad_specs_raise(raw: dict, loc: str, needle: str) -> None:
    with pytest.raises(ValidationError) as info:
        Run.model_validate({"stragglers": raw})
    err = info.value.errors()[0]
    assert ".".join(map(str, err["loc"])) == loc
    assert needle in err["msg"]


def test_delay_s_replaces_default_factor() -> None:
    tr = TransientSpec(delay_s=0.03, duration_s=1, times=[0])
    assert tr.factor is None and tr.delay_s == 0.03
    assert TransientSpec(duration_s=1, times=[0]).factor == 3.0


def test_injector_rejects_workers_outside_the_run() -> None:
    with pytest.raises(ValueError, match=r"worker\(s\) \[4\]"):
        StragglerInjector(StragglerSpec(slowdown=SlowdownSpec(factors={4: 2})), seed=0, worker=0, num_workers=4)
    with pytest.raises(ValueError, match="transient.workers=5"):
        StragglerInjector(StragglerSpec(transient=TransientSpec(workers=5, duration_s=1, every_s=1)),
                          seed=0, worker=0, num_workers=4)


def test_active() -> None:
    assert not StragglerSpec().active
    assert StragglerSpec(comm_delay=CommDelaySpec(fixed_s=0.01)).active
    assert StepDelays().none and not StepDelays(factor=2).none


def plans(spec: StragglerSpec, *, seed: int = 7, worker: int = 0, n: int = 300) -> list[StepDelays]:
    inj = StragglerInjector(spec, seed=seed, worker=worker, num_workers=4)
    return [inj.plan(k, 0.5 * k) for k in range(n)]


def test_determinism_and_independent_streams() -> None:
    mix = StragglerSpec(mixture=MixtureSpec(preset="niagara"))
    assert plans(mix) == plans(mix)
    assert [p.sleep_s for p in plans(mix, worker=0)] != [p.sleep_s for p in plans(mix, worker=1)]
    assert [p.sleep_s for p in plans(mix, seed=7)] != [p.sleep_s for p in plans(mix, seed=8)]

    with_comm = StragglerSpec(mixture=MixtureSpec(preset="niagara"), comm_delay=CommDelaySpec(sigma_s=0.03))
    a, b = plans(mix), plans(with_comm)
    assert [p.sleep_s for p in a] == [p.sleep_s for p in b]
    comm = np.array([p.comm_s for p in b])
    assert (comm > 0).all() and comm.mean() == pytest.approx(0.03 * np.sqrt(2 / np.pi), rel=0.15)
    assert all(p.comm_s == 0.01 for p in plans(StragglerSpec(comm_delay=CommDelaySpec(fixed_s=0.01))))


def test_a_step_is_a_pure_function_of_seed_worker_step() -> None:
    spec = StragglerSpec(mixture=MixtureSpec(preset="niagara"), comm_delay=CommDelaySpec(sigma_s=0.03))
    seq = plans(spec, n=50)
    inj = StragglerInjector(spec, seed=7, worker=0, num_workers=4)
    assert [inj.plan(k, 0.0) for k in (40, 3, 3, 17)] == [seq[40], seq[3], seq[3], seq[17]]


def test_fixed_transient_episode() -> None:
    spec = StragglerSpec(transient=TransientSpec(workers=[1], factor=3, duration_s=2, times=[5]))
    w1 = StragglerInjector(spec, seed=0, worker=1, num_workers=2)
    w0 = StragglerInjector(spec, seed=0, worker=0, num_workers=2)
    assert w1.episodes() == [(5.0, 7.0, (1,))]
    assert [w1.plan(0, t).factor for t in (4.9, 5.0, 6.0, 6.99, 7.0, 7.5)] == [1, 3, 3, 3, 1, 1]
    assert all(w0.plan(0, t).none for t in np.arange(0, 10, 0.25))


def test_workers_in_one_process_share_one_schedule_that_a_process_of_its_own_draws_alike() -> None:
    spec = StragglerSpec(transient=TransientSpec(workers=2, factor=4, duration_s=3, every_s=10))
    injs = [StragglerInjector(spec, seed=7, worker=w, num_workers=5) for w in range(5)]
    assert all(inj._episodes is injs[0]._episodes for inj in injs), "drawn once per process, not per worker"
    injs[3].plan(0, 500.0)  # one worker's question extends the schedule for all
    alone = Episodes(TransientSpec(workers=2, factor=4, duration_s=3, every_s=10), 7, 5)
    alone.effect(0, 500.0)
    assert alone.known() == injs[0].episodes() and len(alone.known()) > 20, "another process draws the same"


def test_poisson_episodes_are_global_and_bounded() -> None:
    spec = StragglerSpec(transient=TransientSpec(workers=2, factor=4, duration_s=3, every_s=10),
                         slowdown=SlowdownSpec(factors={0: 1.5}))
    injs = [StragglerInjector(spec, seed=3, worker=w, num_workers=5) for w in range(5)]
    times = np.arange(0, 2000, 0.5)
    factors = np.array([[inj.plan(k, t).factor for k, t in enumerate(times)] for inj in injs])
    eps = injs[0].episodes()
    assert all(inj.episodes() == eps for inj in injs)
    assert 150 <= len(eps) <= 260  # ~200 expected over 2000 s
    assert all(len(ws) == 2 and len(set(ws)) == 2 and 0 <= min(ws) and max(ws) < 5 for _, _, ws in eps)
    assert len({ws for _, _, ws in eps}) > 5  # chosen per episode, not fixed
    for w in range(5):
        base = 1.5 if w == 0 else 1.0
        inside = np.array([any(s <= t < e and w in ws for s, e, ws in eps) for t in times])
        assert inside.any()
        np.testing.assert_array_equal(factors[w], np.where(inside, base * 4, base))
    # a different seed gives different episodes
    other = StragglerInjector(spec, seed=4, worker=0, num_workers=5)
    other.plan(0, 2000.0)
    assert other.episodes()[:10] != eps[:10]


def test_delay_episodes_add_up_when_overlapping() -> None:
    spec = StragglerSpec(transient=TransientSpec(workers=[0], delay_s=0.5, duration_s=2, times=[1, 2]),
                         mixture=MixtureSpec(rows=[[0.25, 0, 1]]))
    inj = StragglerInjector(spec, seed=0, worker=0, num_workers=1)
    got = [inj.plan(k, t) for k, t in enumerate([0.5, 1.5, 2.5, 3.5, 4.5])]  # episodes [1, 3) and [2, 4)
    assert [p.sleep_s for p in got] == [0.25, 0.75, 1.25, 0.75, 0.25]
    assert all(p.factor == 1.0 for p in got)


def test_slowdown_factors_per_worker() -> None:
    spec = StragglerSpec(slowdown=SlowdownSpec(factors={1: 2.0, 3: 1.25}))
    got = [StragglerInjector(spec, seed=0, worker=w, num_workers=4).plan(0, 0.0).factor for w in range(4)]
    assert got == [1.0, 2.0, 1.0, 1.25]


def write_trace(path: Path, spec: StragglerSpec, steps: int, num_workers: int) -> dict[tuple[int, int], StepDelays]:
    """Write a stragglers.csv the way the PS does (a time_s column first)."""
    recorded = {}
    with path.open("w", newline="") as f:
        out = csv.writer(f)
        out.writerow(("time_s", *TRACE_COLUMNS))
        for w in range(num_workers):
            inj = StragglerInjector(spec, seed=11, worker=w, num_workers=num_workers)
            for k in range(steps):
                t = 0.37 * k
                d = recorded[w, k] = inj.plan(k, t)
                out.writerow((t, w, k, d.sleep_s, d.factor, d.comm_s))
    return recorded


def test_trace_replays_exactly(tmp_path: Path) -> None:
    spec = StragglerSpec(mixture=MixtureSpec(preset="niagara", scale=0.013),
                         transient=TransientSpec(workers=1, factor=2.7, duration_s=1.1, every_s=3),
                         slowdown=SlowdownSpec(factors={1: 1.3}),
                         comm_delay=CommDelaySpec(sigma_s=0.017))
    path = tmp_path / "stragglers.csv"
    recorded = write_trace(path, spec, steps=50, num_workers=2)
    assert load_trace(path) == recorded
    assert any(d.factor != 1.0 for d in recorded.values())

    for w in range(2):
        replay = StragglerInjector(StragglerSpec(trace=str(path)), seed=999, worker=w, num_workers=2)
        assert [replay.plan(k, 123.0) for k in range(50)] == [recorded[w, k] for k in range(50)]
        assert replay.beyond_trace == 0
        assert replay.plan(50, 0.0) == StepDelays()
        assert replay.beyond_trace == 1


def test_trace_is_read_once_for_all_workers(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """A simulated run builds one injector per worker: they share one reading of the file, until it changes."""
    import switchps.straggler_trace as trace_module

    spec = StragglerSpec(mixture=MixtureSpec(preset="niagara", scale=0.1))
    path = tmp_path / "stragglers.csv"
    recorded = write_trace(path, spec, steps=5, num_workers=8)
    reads: list[Path] = []
    real_rows = trace_module.csvfile.rows

    def counted(p: Path, columns: tuple[str, ...]) -> object:
        reads.append(p)
        return real_rows(p, columns)

    monkeypatch.setattr(trace_module.csvfile, "rows", counted)
    trace_module._by_worker.cache_clear()
    replays = [StragglerInjector(StragglerSpec(trace=str(path)), seed=0, worker=w, num_workers=8) for w in range(8)]
    assert len(reads) == 1
    assert [[r.plan(k, 0.0) for k in range(5)] for r in replays] == [[recorded[w, k] for k in range(5)] for w in range(8)]

    write_trace(path, StragglerSpec(slowdown=SlowdownSpec(factors={3: 2.0})), steps=6, num_workers=8)
    again = StragglerInjector(StragglerSpec(trace=str(path)), seed=0, worker=3, num_workers=8)
    assert len(reads) == 2
    assert again.plan(5, 0.0).factor == 2.0


def test_trace_errors(tmp_path: Path) -> None:
    missing = tmp_path / "nope.csv"
    with pytest.raises(FileNotFoundError, match="nope.csv"):
        StragglerInjector(StragglerSpec(trace=str(missing)), seed=0, worker=0, num_workers=1)
    bad = tmp_path / "bad.csv"
    bad.write_text("worker,step,sleep_s\n0,0,1.0\n")
    with pytest.raises(ValueError, match="factor, comm_s"):
        load_trace(bad)


# ---- shifted exponential: c + Exp(mu) per worker per step -----------------------------------------------

SHIFTED = ShiftedExponentialSpec(shift_s=0.25, rate_per_s=4.0)


def test_shifted_exponential_statistics() -> None:
    """Over N steps the mean of Exp(mu) has sd 1/(mu sqrt N) (1 %) and the variance about sqrt(8/N) (3 %)."""
    x = sleeps(StragglerSpec(shifted_exponential=SHIFTED)) - 0.25
    assert (x > 0).all()
    assert x.mean() == pytest.approx(1 / 4.0, rel=0.04)
    assert x.var() == pytest.approx(1 / 4.0**2, rel=0.12)
    assert np.median(x) == pytest.approx(np.log(2) / 4.0, rel=0.05)  # the shape, not only two moments


def test_shifted_exponential_is_a_pure_function_of_seed_worker_step() -> None:
    spec = StragglerSpec(shifted_exponential=SHIFTED)
    seq = plans(spec, n=50)
    assert seq == plans(spec, n=50)
    inj = StragglerInjector(spec, seed=7, worker=0, num_workers=4)
    assert [inj.plan(k, 99.0) for k in (40, 3, 3, 17)] == [seq[40], seq[3], seq[3], seq[17]]
    assert [p.sleep_s for p in plans(spec, worker=1, n=50)] != [p.sleep_s for p in seq]
    assert [p.sleep_s for p in plans(spec, seed=8, n=50)] != [p.sleep_s for p in seq]
    assert all(p.factor == 1.0 and p.comm_s == 0.0 for p in seq)


def test_shifted_exponential_leaves_other_draws_alone() -> None:
    """Its own stream: enabling it changes no other kind's draws, and they change none of its."""
    mix, comm = MixtureSpec(preset="niagara"), CommDelaySpec(sigma_s=0.03)
    alone = [p.sleep_s for p in plans(StragglerSpec(shifted_exponential=SHIFTED))]
    before = plans(StragglerSpec(mixture=mix, comm_delay=comm))
    after = plans(StragglerSpec(mixture=mix, comm_delay=comm, shifted_exponential=SHIFTED))
    assert [p.comm_s for p in after] == [p.comm_s for p in before]
    assert [p.sleep_s for p in after] == [m.sleep_s + e for m, e in zip(before, alone)]


def test_shifted_exponential_only_for_listed_workers() -> None:
    spec = StragglerSpec(shifted_exponential=ShiftedExponentialSpec(rate_per_s=1.0, workers=[2]))
    assert not sleeps(spec, worker=0, n=100).any()
    assert (sleeps(spec, worker=2, n=100) > 0).all()
    with pytest.raises(ValueError, match=r"worker\(s\) \[2\]"):
        StragglerInjector(spec, seed=0, worker=0, num_workers=2)
    assert ShiftedExponentialSpec(rate_per_s=2.0).shift_s == 0.0


def test_shifted_exponential_trace_replays_exactly(tmp_path: Path) -> None:
    spec = StragglerSpec(shifted_exponential=SHIFTED, mixture=MixtureSpec(preset="cedar"))
    path = tmp_path / "stragglers.csv"
    recorded = write_trace(path, spec, steps=30, num_workers=3)
    for w in range(3):
        replay = StragglerInjector(StragglerSpec(trace=str(path)), seed=0, worker=w, num_workers=3)
        assert [replay.plan(k, 0.0) for k in range(30)] == [recorded[w, k] for k in range(30)]


def test_shifted_exponential_config_errors_name_the_field() -> None:
    with pytest.raises(ConfigError) as info:
        parse_config({"stragglers": {"shifted_exponential": {"shift_s": -1, "rate_per_s": 0}}})
    assert [p.split(":")[0] for p in info.value.problems] == [
        "stragglers.shifted_exponential.shift_s", "stragglers.shifted_exponential.rate_per_s"]
    cfg = parse_config({"stragglers": {"shifted_exponential": {"shift_s": 0.5, "rate_per_s": 2}}})
    assert cfg.stragglers.active and cfg.stragglers.shifted_exponential == ShiftedExponentialSpec(shift_s=0.5,
                                                                                                   rate_per_s=2)


def test_a_step_s_draws_are_its_own_and_do_not_run_into_the_next_step_s() -> None:
    rnd = StepRandom(3)
    steps = [rnd.at(1, Stream.SHIFTED_EXP, k).random(8) for k in range(50)]
    rnd.at(0, Stream.MIXTURE, 7).random(3)  # another worker and stream in between change nothing
    assert np.array_equal(rnd.at(1, Stream.SHIFTED_EXP, 7).random(8), steps[7]), "a step's draws are a pure function of it"
    assert len({float(v) for s in steps for v in s}) == 50 * 8, "no draw of one step reappears in another"
    assert not np.array_equal(rnd.at(0, Stream.SHIFTED_EXP, 7).random(8), steps[7]), "each worker has its own key"
    assert not np.array_equal(rnd.at(1, Stream.PUSH_JITTER, 7).random(8), steps[7]), "each stream has its own key"
    assert np.array_equal(StepRandom(3).at(1, Stream.SHIFTED_EXP, 7).random(8), steps[7]), "a fresh generator of the same seed draws the same"
