"""The simulator drives the real core on virtual time: rounds, backups and SSP blocks at the times the
protocols say, byte-identical records for the same config, a time-only mode free of TensorFlow, real
gradients equal to the worker's own, and a run directory every command reads."""

from __future__ import annotations

import csv
import gc
import json
import subprocess
import sys
from collections import defaultdict
from pathlib import Path
from typing import Any

import numpy as np
import pytest

from switchps.config.run import RunConfig, parse_config
from switchps.problems import ConfigError
from switchps.sim import driver
from switchps.sim.run import simulate

SWITCHPS = str(Path(sys.executable).parent / "switchps")
RECORDS = ("ps.csv", "workers.csv", "eval.csv", "events.jsonl")


def config(**sections: Any) -> RunConfig:
    """A small run: 3 workers, batches of 10 at 100 samples/s (0.1 s a step), 4 updates; ``sections``
    replace the base's sections (``protocol`` is merged into it)."""
    raw: dict[str, Any] = {"name": "sim", "cluster": {"workers": 3}, "model": {"name": "logreg"},
                           "data": {"name": "digits"}, "train": {"steps": 4}, "device": {"samples_per_s": 100.0},
                           "optimizer": {"name": "sgd", "learning_rate": 0.1}, "eval": {"every_s": 0.5}}
    raw.update(sections)
    raw["protocol"] = {"name": "bsp", "batch": 10, **sections.get("protocol", {})}
    return parse_config(raw)


def rows(run_dir: Path, table: str = "ps.csv") -> list[dict[str, str]]:
    with (run_dir / table).open(newline="") as f:
        return list(csv.DictReader(f))


def column(run_dir: Path, name: str, table: str = "ps.csv") -> list[str]:
    return [r[name] for r in rows(run_dir, table)]


def slowdown(*factors: float) -> dict[str, Any]:
    """Stragglers that make worker i compute ``factors[i]`` times slower (a step of 0.1 s x factor)."""
    return {"slowdown": {"factors": dict(enumerate(factors))}}


# ---- protocols reproduced on virtual time -------------------------------------------------------


def test_a_bsp_round_ends_when_its_slowest_worker_pushes(tmp_path: Path) -> None:
    s = simulate(config(stragglers=slowdown(1, 2, 3)), tmp_path / "r", time_only=True)
    run = tmp_path / "r"
    assert column(run, "time_s") == ["0.3", "0.6", "0.9", "1.2"], "every round waits for the 0.3 s worker"
    assert column(run, "workers") == ["0;1;2"] * 4 and column(run, "samples") == ["30"] * 4
    assert column(run, "staleness_max") == ["0"] * 4
    assert column(run, "time_s", "workers.csv")[:3] == ["0.1", "0.2", "0.3"]
    assert [float(w) for w in column(run, "wait_s", "workers.csv")[3:6]] == pytest.approx([0.2, 0.1, 0.0])
    assert s["simulated"] and s["updates"] == 4 and s["virtual_time_s"] == pytest.approx(1.2)
    assert s["wall_time_s"] == pytest.approx(1.2) and s["samples_per_s"] == pytest.approx(100.0)


def test_backup_workers_complete_a_round_on_the_first_n_minus_k_and_drop_the_late_one(tmp_path: Path) -> None:
    cfg = config(cluster={"workers": 4}, protocol={"backup_workers": 1}, train={"steps": 9},
                 stragglers=slowdown(1, 1, 1, 2.5))
    s = simulate(cfg, tmp_path / "r", time_only=True)
    run = tmp_path / "r"
    assert [float(t) for t in column(run, "time_s")] == pytest.approx([0.1 * i for i in range(1, 10)])
    assert column(run, "workers") == ["0;1;2"] * 9, "worker 3 (0.25 s a step) is always the late one"
    # its pushes at 0.25, 0.5 and 0.75 s are stale (it finishes its old step): dropped; at 1.0 s training has ended
    assert s["push_reasons"] == {"dropped:backup": 3, "dropped:finished": 1}


def test_ssp_holds_the_fast_worker_s_plus_one_ahead_until_the_slow_one_pushes(tmp_path: Path) -> None:
    cfg = config(cluster={"workers": 2}, protocol={"name": "ssp", "staleness": 1}, train={"steps": 6},
                 stragglers=slowdown(1, 3))
    simulate(cfg, tmp_path / "r", time_only=True)
    run = tmp_path / "r"
    # worker 0 pushes at 0.1 (1 ahead: free), at 0.2 (2 ahead: held until worker 1 pushes at 0.3), ...
    assert [float(t) for t in column(run, "time_s")] == pytest.approx([0.1, 0.2, 0.3, 0.4, 0.6, 0.7])
    assert column(run, "workers") == ["0", "0", "1", "0", "1", "0"]
    assert column(run, "staleness_max") == ["0", "0", "2", "0", "1", "0"]
    waits = {(r["worker"], r["step"]): float(r["wait_s"]) for r in rows(run, "workers.csv")}
    assert waits[("0", "2")] == pytest.approx(0.1), "its step 1 was held 0.1 s, reported with step 2"


def test_a_policy_switches_at_the_version_the_core_decides(tmp_path: Path) -> None:
    cfg = config(train={"steps": 8}, policy={"name": "schedule", "kwargs": {"phases": [{"bsp": 0.5}, {"asp": 0.5}]}})
    s = simulate(cfg, tmp_path / "r", time_only=True)
    run = tmp_path / "r"
    events = [json.loads(line) for line in (run / "events.jsonl").read_text().splitlines()]
    (switch,) = [e for e in events if e["event"] == "switch"]
    assert (switch["version"], switch["from"], switch["to"]) == (4, "bsp", "asp")
    protocols = column(run, "protocol")
    assert protocols[:4] == ["bsp"] * 4 and set(protocols[4:]) == {"asp"} and s["switches"] == 1
    assert switch["time_s"] == pytest.approx(0.4)


@pytest.mark.parametrize("time_only", [True, False], ids=["time-only", "gradients"])
def test_the_same_config_gives_byte_identical_records(tmp_path: Path, time_only: bool) -> None:
    cfg = config(cluster={"workers": 5}, protocol={"name": "ssp", "staleness": 2}, train={"steps": 60},
                 stragglers={"mixture": {"preset": "cedar"}, "comm_delay": {"sigma_s": 0.01}},
                 data={"name": "digits", "sampling": "replacement"})
    for name in ("a", "b"):
        simulate(cfg, tmp_path / name, time_only=time_only)
    for table in (*RECORDS, "stragglers.csv"):
        assert (tmp_path / "a" / table).read_bytes() == (tmp_path / "b" / table).read_bytes(), table
    assert len(rows(tmp_path / "a")) == 60 and len(rows(tmp_path / "a", "stragglers.csv")) >= 60
    assert bool(rows(tmp_path / "a", "eval.csv")) is not time_only, "evaluated with a model only"
    s = json.loads((tmp_path / "a" / "summary.json").read_text())
    assert (s["framework"], s["device"], s["ps_shards"], s["hosts"]) == (
        None if time_only else "tensorflow", "simulated", 1, None), "no TensorFlow without a model; no host"


def test_a_recorded_straggler_trace_replays_the_same_run(tmp_path: Path) -> None:
    base = {"cluster": {"workers": 4}, "protocol": {"name": "asp"}, "train": {"steps": 40}}
    simulate(config(**base, stragglers={"mixture": {"preset": "niagara", "scale": 0.1}}), tmp_path / "a",
             time_only=True)
    simulate(config(**base, stragglers={"trace": str(tmp_path / "a" / "stragglers.csv")}), tmp_path / "b",
             time_only=True)
    for table in ("ps.csv", "workers.csv", "stragglers.csv"):
        assert (tmp_path / "a" / table).read_bytes() == (tmp_path / "b" / table).read_bytes(), table


# ---- modes, data and the command line -----------------------------------------------------------


def test_time_only_never_imports_tensorflow(tmp_path: Path) -> None:
    probe = ("import sys; from pathlib import Path; from switchps.config.run import parse_config; "
             "from switchps.sim.run import simulate; "
             "cfg = parse_config({'cluster': {'workers': 2}, 'train': {'steps': 3}, 'device': {'samples_per_s': 50}}); "
             f"simulate(cfg, Path({str(tmp_path / 'r')!r}), time_only=True); "
             "print('tensorflow' in sys.modules or 'keras' in sys.modules)")
    out = subprocess.run([sys.executable, "-c", probe], capture_output=True, text=True, timeout=120)
    assert out.stdout.strip() == "False", out.stderr[-2000:]


def test_more_workers_than_a_partition_can_feed_sample_with_replacement(tmp_path: Path) -> None:
    many, data = {"workers": 1024}, {"name": "synthetic", "num_samples": 1000}  # 800 to train on
    with pytest.raises(ConfigError, match="data.sampling"):
        simulate(config(cluster=many, data=data), tmp_path / "p", time_only=True)
    s = simulate(config(cluster=many, train={"steps": 2}, data={**data, "sampling": "replacement"}),
                 tmp_path / "r", time_only=True)
    assert s["updates"] == 2 and column(tmp_path / "r", "workers")[0].count(";") == 1023


def test_a_simulation_needs_a_device_model(tmp_path: Path) -> None:
    with pytest.raises(ConfigError, match="device.samples_per_s"):
        simulate(config(device={}), tmp_path / "r", time_only=True)
    assert not (tmp_path / "r").exists(), "refused before anything is written"


def test_the_command_simulates_and_refuses_a_config_without_a_device_model(tmp_path: Path) -> None:
    cfg = tmp_path / "cfg.yaml"
    cfg.write_text("cluster: {workers: 2}\ntrain: {steps: 3}\n")
    bad = subprocess.run([SWITCHPS, "simulate", str(cfg), "--time-only", "--run-dir", str(tmp_path / "bad")],
                         capture_output=True, text=True, timeout=120)
    assert bad.returncode == 2 and bad.stderr.count("\n") == 1 and "device.samples_per_s" in bad.stderr
    good = subprocess.run([SWITCHPS, "simulate", str(cfg), "--time-only", "--quiet", "--set",
                           "device.samples_per_s=100", "--run-dir", str(tmp_path / "good")],
                          capture_output=True, text=True, timeout=120)
    assert good.returncode == 0, good.stderr[-2000:]
    assert good.stdout.strip() == str(tmp_path / "good")
    assert json.loads((tmp_path / "good" / "summary.json").read_text())["updates"] == 3
    again = subprocess.run([SWITCHPS, "simulate", str(cfg), "--time-only", "--quiet", "--set",
                            "device.samples_per_s=100", "--run-dir", str(tmp_path / "good")],
                           capture_output=True, text=True, timeout=120)
    assert again.returncode == 2 and "already holds a run" in again.stderr


def test_ctrl_c_leaves_a_valid_partial_run(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    apply = driver.Simulator.apply

    def interrupted_at_version_3(self: driver.Simulator, a: Any) -> None:
        if a.version == 3:
            raise KeyboardInterrupt
        apply(self, a)

    monkeypatch.setattr(driver.Simulator, "apply", interrupted_at_version_3)
    with pytest.raises(KeyboardInterrupt):
        simulate(config(train={"steps": 10}), tmp_path / "r", time_only=True)
    summary = json.loads((tmp_path / "r" / "summary.json").read_text(), parse_constant=_no_constants)
    assert summary["interrupted"] and summary["updates"] == 3 and len(rows(tmp_path / "r")) == 2
    assert gc.get_freeze_count() == 0, "an interrupted run unfreezes what it froze"


def test_a_run_freezes_the_collector_only_while_it_runs(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    frozen: list[int] = []
    start = driver.Simulator.start

    def start_and_look(self: driver.Simulator) -> None:
        frozen.append(gc.get_freeze_count())
        start(self)

    monkeypatch.setattr(driver.Simulator, "start", start_and_look)
    simulate(config(), tmp_path / "r", time_only=True)
    assert frozen[0] > 0 and gc.get_freeze_count() == 0
    gc.freeze()  # a caller's own freeze is its own: the run neither adds to it nor undoes it
    try:
        before = gc.get_freeze_count()
        simulate(config(), tmp_path / "again", time_only=True)
        assert 0 < frozen[1] <= before and gc.get_freeze_count() > 0  # (objects freed leave the count)
    finally:
        gc.unfreeze()


def _no_constants(name: str) -> None:
    raise ValueError(f"{name} is not JSON")


# ---- real gradients ------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def trained(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, dict[str, Any]]:
    """A BSP run on digits with real gradients: 4 workers, 150 updates."""
    run = tmp_path_factory.mktemp("sim") / "bsp"
    cfg = config(cluster={"workers": 4}, protocol={"batch": 16}, train={"steps": 150},
                 eval={"every_s": 2.0, "target_accuracy": 0.8}, optimizer={"name": "momentum", "learning_rate": 0.1})
    return run, simulate(cfg, run)


def test_real_gradients_train_the_model(trained: tuple[Path, dict[str, Any]]) -> None:
    run, s = trained
    assert s["final_test_accuracy"] > 0.9 and s["final_version"] == 150 and not s["time_only"]
    assert json.loads((run / "summary.json").read_text(), parse_constant=_no_constants) == s
    for line in (run / "events.jsonl").read_text().splitlines():
        json.loads(line, parse_constant=_no_constants)
    evals = rows(run, "eval.csv")
    # every 2 s of virtual time, then the last version when training ends (150 rounds of 0.16 s)
    assert [float(e["time_s"]) for e in evals[:-1]] == pytest.approx(list(range(0, 25, 2)))
    assert evals[-1]["version"] == "150" and float(evals[-1]["time_s"]) == pytest.approx(s["virtual_time_s"]) == 24
    assert s["time_to_target_s"] == next(float(e["time_s"]) for e in evals if float(e["test_accuracy"]) >= 0.8)
    losses = [float(x) for x in column(run, "train_loss")]
    assert losses[0] > 2.0 > 0.5 > np.mean(losses[-10:])


def test_plot_compare_and_status_read_a_simulated_run(trained: tuple[Path, dict[str, Any]], tmp_path: Path) -> None:
    from switchps.runs.compare import compare_runs
    from switchps.runs.plots import plot_run
    from switchps.runs.status import status_table

    run, s = trained
    assert plot_run(run, tmp_path / "plots")
    (result,) = compare_runs([run], 0.8, tmp_path / "compare.png")
    assert result.time_to_target_s == s["time_to_target_s"] and (tmp_path / "compare.png").is_file()
    assert (result.framework, result.device, result.ps_shards, result.hosts) == (
        "tensorflow", f"simulated, {s['emulated_device']['samples_per_s']:g} samples/s", 1, None)
    status_table(str(run))


def test_a_rounds_gradient_is_the_sum_of_its_workers_gradients() -> None:
    from switchps.sim.gradients import real_learner
    from switchps.sim.workers import SimWorker
    from switchps.ps_server.core.events import WorkOrder

    cfg = config(model={"name": "mlp", "kwargs": {"hidden": [16]}}, protocol={"batch": 24, "micro_batch": 8})
    real = real_learner(cfg)
    order = WorkOrder("bsp", 0, 24, None, 8, False)
    works = [SimWorker(cfg, i, np.arange(real.gc.samples)).begin(order, 0.0) for i in range(3)]
    for w in works:
        real.started(w)
    losses = [real.loss(w) for w in works]
    total = real.gradient(works)
    real.gc.assign(real.params[0])
    for w, loss in zip(works, losses):  # each worker's step as the worker computes it, micro-batch by micro-batch
        grad, expected = real.gc.compute(w.rows, 8)
        total[:real.trainable] -= grad[:real.trainable]
        assert loss == pytest.approx(expected, rel=1e-5)
    np.testing.assert_allclose(total[:real.trainable], 0.0, atol=1e-4)


def test_pushes_and_replies_share_the_ps_link(tmp_path: Path) -> None:
    # logreg on digits: 650 parameters, 2,600 bytes; at 0.208 Mbit/s one transfer alone takes 0.1 s
    cfg = config(cluster={"workers": 2}, train={"steps": 3}, network={"ps_link_mbit_s": 0.208})
    s = simulate(cfg, tmp_path / "r")
    # 0.2 s: both initial pulls share the outbound side; 0.1 s compute; 0.2 s: both pushes share inbound
    assert [float(t) for t in column(tmp_path / "r", "time_s")] == pytest.approx([0.5, 1.0, 1.5])
    assert s["emulated_link"]["inbound_utilization"] == pytest.approx(3 * 0.2 / 1.5, abs=1e-3)


def test_a_push_overhead_delays_every_push_s_arrival_by_its_seconds(tmp_path: Path) -> None:
    simulate(config(network={"push_overhead_s": 0.05}), tmp_path / "r", time_only=True)
    assert column(tmp_path / "r", "time_s") == ["0.15", "0.3", "0.45", "0.6"], "0.1 s of compute, 0.05 s in transit"


def test_push_jitter_breaks_the_lockstep_of_identical_workers_and_is_drawn_per_worker_and_step(
        tmp_path: Path) -> None:
    """Identical ASP workers on a shared link finish their transfers together and stay in lockstep
    forever; a jitter of mean 10 ms on each push spreads them, the same way in every run."""
    base = {"protocol": {"name": "asp"}, "train": {"steps": 60}, "network": {"ps_link_mbit_s": 0.208}}
    simulate(config(**base), tmp_path / "still")
    jittered = config(**{**base, "network": {"ps_link_mbit_s": 0.208, "push_jitter_s": 0.01}})
    for run in ("a", "b"):
        simulate(jittered, tmp_path / run)

    def gaps(run: str) -> np.ndarray:
        return np.diff(np.sort([float(t) for t in column(tmp_path / run, "time_s", "workers.csv")]))

    assert np.mean(gaps("still") < 1e-9) >= 0.6, "without jitter the 3 workers' pushes arrive together"
    assert np.mean(gaps("a") < 1e-9) < 0.05, "with it they spread out"
    assert (tmp_path / "a" / "workers.csv").read_bytes() == (tmp_path / "b" / "workers.csv").read_bytes()


def test_parameters_crossing_a_slow_link_are_kept_while_newer_versions_are_applied(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """Under ASP a reply's parameters take time to cross the link while other pushes are applied: the
    step they start must still be computed at the version they carry (and a transfer admitted at the
    instant another finishes must not lose that one's arrival). Each step's push names the version its
    order named; its loss, and the update its push makes, are those of its rows at that version's
    parameters, recomputed here."""
    from switchps.sim.gradients import Real
    from switchps.sim.workers import SimWorker

    sent: defaultdict[int, list[int]] = defaultdict(list)  # worker -> the versions its orders named, as sent
    drawn: dict[tuple[int, int], np.ndarray] = {}  # (worker, step) -> the sample rows it drew
    at: dict[int, np.ndarray] = {}  # version -> the store's parameters at it
    learners: list[Real] = []
    pulled, reply, begin = driver.Simulator._pulled, driver.Simulator.release, SimWorker.begin
    init, applied = Real.__init__, Real.applied

    def first(self: driver.Simulator, w: SimWorker, order: Any, life: int) -> None:
        sent[w.index].append(order.version)
        pulled(self, w, order, life)

    def replying(self: driver.Simulator, r: Any) -> None:
        sent[r.worker] += [] if r.order.stop else [r.order.version]
        reply(self, r)

    def begun(self: SimWorker, order: Any, now: float) -> Any:
        work = begin(self, order, now)
        drawn[work.worker, work.step] = work.rows
        return work

    def made(self: Real, *args: Any) -> None:
        init(self, *args)
        learners.append(self)
        at[0] = self.values.copy()

    def stored(self: Real, version: int) -> None:
        applied(self, version)
        at[version] = self.values.copy()

    for cls, name, spy in ((driver.Simulator, "_pulled", first), (driver.Simulator, "release", replying),
                           (SimWorker, "begin", begun), (Real, "__init__", made), (Real, "applied", stored)):
        monkeypatch.setattr(cls, name, spy)
    cfg = config(protocol={"name": "asp"}, train={"steps": 30}, network={"ps_link_mbit_s": 0.5},
                 stragglers=slowdown(1, 1.3, 1.7))
    s = simulate(cfg, tmp_path / "r")
    assert s["updates"] == 30 and max(int(v) for v in column(tmp_path / "r", "staleness_max")) >= 1
    (real,) = learners
    steps, updates = rows(tmp_path / "r", "workers.csv"), rows(tmp_path / "r")
    for step in steps:  # step k of a worker starts on its k-th order (its pull, then the replies to its pushes)
        worker, k = int(step["worker"]), int(step["step"])
        assert int(step["base_version"]) == sent[worker][k]
        real.gc.assign(at[sent[worker][k]])
        assert float(step["loss"]) == pytest.approx(float(real.gc.losses(drawn[worker, k]).mean()), rel=1e-4)
    for update, step in zip(updates, steps):  # ASP: the k-th push to arrive makes update k
        assert update["workers"] == step["worker"]
        sample_rows = drawn[int(step["worker"]), int(step["step"])]
        real.gc.assign(at[int(step["base_version"])])
        grad, _ = real.gc.compute(sample_rows, len(sample_rows))
        v = int(update["version"])
        np.testing.assert_allclose(at[v - 1] - at[v], float(update["lr"]) * grad / len(sample_rows), rtol=1e-3,
                                   atol=1e-6)
