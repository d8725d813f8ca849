"""The study runner: statistics, study files, metrics from a run directory, resuming, and a real study."""

from __future__ import annotations

import io
import json
import math
import re
import subprocess
import sys
from pathlib import Path

import matplotlib.colors
import numpy as np
import pytest
from rich.console import Console

from switchps.config.run import ConfigError
from switchps.straggler_trace import load_trace
from switchps.studies import runner
from switchps.studies.metrics import run_metrics
from switchps.runs.colors import PROTOCOL_COLORS
from switchps.studies.report import compare, plot_study, study_table
from switchps.studies.runner import PACKAGED, finished_runs, packaged, run_study
from switchps.studies.spec import StudySpec, load_study
from switchps.studies.sweep import plot_sweep
from switchps.studies.stats import estimate, paired_difference, paired_ratio, ratio_estimate

from test_launch import SWITCHPS


def test_a_mean_gets_its_student_t_interval():
    e = estimate([1.0, 2.0, 3.0])
    assert e.mean == 2.0 and e.sd == 1.0 and e.n == 3
    assert e.ci95 == pytest.approx(4.302653 / 3**0.5, rel=1e-6)  # t(0.975, 2) * sd / sqrt(n)
    assert e.text(".2f") == "2.00 ± 2.48"
    assert estimate([5.0]).ci95 is None and estimate([None, None]).text() == "never"
    assert estimate([1.0, None]).missing == 1


def test_paired_comparisons_are_by_seed_and_significance_is_the_interval_excluding_no_difference():
    ratio = paired_ratio([10.0, 20.0, 30.0], [5.0, 10.0, 15.0])  # twice as fast on every seed
    assert ratio.geomean == pytest.approx(2.0) and ratio.low == ratio.high == ratio.geomean and ratio.excludes(1.0)
    assert ratio.text() == "2.00× (2.00–2.00)"
    noisy = paired_difference([0.95, 0.97, 0.96], [0.96, 0.95, 0.97])
    assert not noisy.excludes(0.0)
    one = paired_ratio([10.0, None], [5.0, 4.0])
    assert (one.n, one.missing, one.low, one.text()) == (1, 1, None, "2.00× (1 never)")


def test_a_speedup_is_the_geometric_mean_of_the_ratios_with_an_interval_that_never_reaches_zero():
    wide = ratio_estimate([0.1, 10.0])  # as much slower on one seed as faster on the other: no change
    assert wide.geomean == pytest.approx(1.0) and 0 < wide.low < 1 < wide.high and not wide.excludes(1.0)
    assert wide.low * wide.high == pytest.approx(1.0), "symmetric on the log scale: 1/x as far as x"
    assert estimate([0.1, 10.0]).mean - estimate([0.1, 10.0]).ci95 < 0, "what the arithmetic mean gave"
    e = ratio_estimate([1.2, 1.5, 1.3, 1.6])
    logs = estimate([math.log(r) for r in (1.2, 1.5, 1.3, 1.6)])
    assert e.geomean == pytest.approx((1.2 * 1.5 * 1.3 * 1.6) ** 0.25)
    assert (e.low, e.high) == pytest.approx((math.exp(logs.mean - logs.ci95), math.exp(logs.mean + logs.ci95)))
    assert e.excludes(1.0) and not e.excludes(1.3) and e.excludes(2.0), "significant: the interval is above 1"
    assert e.high - e.geomean > e.geomean - e.low, "asymmetric: wider above"
    assert e.text() == "1.39× (1.13–1.71)"
    assert wide.text() == "1.00× (1.97e-13–5.08e+12)", "a low bound near 0 is never shown as 0"
    assert ratio_estimate([2.0, 0.0, None]).missing == 2, "a ratio of 0 has no logarithm"


def test_a_study_reports_speedups_on_the_log_scale_and_marks_those_whose_interval_excludes_1x():
    spec = StudySpec(study="s", base={"train": {"steps": 5}}, arms={"slow": {}, "fast": {}, "mixed": {}}, repeats=3,
                     reference="slow", target={"absolute": 0.7}, metrics=["total_time_s"])
    series = {"slow": {"total_time_s": [10.0, 20.0, 30.0]}, "fast": {"total_time_s": [6.0, 13.0, 21.0]},
              "mixed": {"total_time_s": [100.0, 2.0, 30.0]}}
    comparisons = compare(spec, series)
    fast, mixed = (comparisons[f"{a} vs slow"]["total_time_s_speedup"] for a in ("fast", "mixed"))
    assert fast["geomean"] == pytest.approx((10 / 6 * 20 / 13 * 30 / 21) ** (1 / 3)) and fast["significant"]
    assert 0 < mixed["low"] < 1 < mixed["high"] and not mixed["significant"], "0.1x, 10x, 1x: no difference"
    arms = {a: {"total_time_s": estimate(v["total_time_s"]).as_dict()} for a, v in series.items()}
    console = Console(file=io.StringIO(), width=200, record=True)
    console.print(study_table(spec, arms, comparisons, 0.7))
    text = console.export_text()
    rows = {line.split("│")[1].strip(): line.split("│")[-2].strip() for line in text.splitlines() if "│" in line}
    assert rows["fast"] == "1.54× (1.27–1.87) *" and rows["slow"] == "1×"
    assert rows["mixed"] == "1.00× (0.00328–305)", "its low bound is not shown as 0"
    assert "geometric mean of the ratios paired by seed" in text and "excludes 1×" in text


def test_the_packaged_studies_load_and_their_arms_are_valid_run_configs():
    for name in PACKAGED:
        spec = load_study(packaged(name))
        assert spec.repeats >= 3 and spec.reference in spec.arms
        for arm in spec.arms:
            cfg = spec.run_config(arm, 2, Path("/tmp/x"), None)
            assert cfg.seed == spec.base.get("seed", 0) + 2 and cfg.name == arm
    spec = load_study(packaged("sync-switch"))
    asp = spec.run_config("asp", 0, Path("/tmp/x"), None)
    assert asp.optimizer.learning_rate == pytest.approx(0.2 / 16 * (1 - 0.025) / (1 - 0.9))  # what the hybrid gets
    assert asp.optimizer.params["momentum"] == pytest.approx(0.025)
    replay = spec.run_config("hybrid", 1, Path("/tmp/x"), Path("/tmp/bsp/stragglers.csv"))
    assert replay.stragglers.trace == "/tmp/bsp/stragglers.csv" and replay.stragglers.transient is None


def test_the_scale_study_trains_every_arm_at_every_n_by_its_stated_rules():
    """Issue 46: BSP gets 256 updates or more at every N, the rates follow the header's rules, and the hybrid
    and greedy switch to exactly the ASP arm's rate and momentum."""
    from switchps.ps_server.core.rescale import asynchrony_momentum, restore_factor

    for point, spec in load_study(packaged("scale")).points():
        cfg = {arm: spec.run_config(arm, 0, Path("/tmp/x"), None) for arm in spec.arms}
        n, bsp, asp = cfg["bsp"].cluster.num_workers, cfg["bsp"], cfg["asp"]
        train = bsp.data.num_samples - math.ceil(bsp.data.test_fraction * bsp.data.num_samples)
        assert train >= n and bsp.data.sampling == "partition", point
        assert bsp.train.epochs * train / (bsp.protocol.batch * n) >= 256, point
        assert bsp.optimizer.learning_rate == pytest.approx(0.2 * math.sqrt(n / 8), rel=1e-5), point
        mu = asynchrony_momentum(0.9, n)
        assert asp.optimizer.learning_rate == pytest.approx(1.28 / n) and asp.optimizer.params["momentum"] == pytest.approx(mu)
        assert cfg["ssp"].optimizer == asp.optimizer, point
        k = cfg["kasync"].protocol.k
        assert k == n // 4 and cfg["kasync"].optimizer.learning_rate == pytest.approx(1.28 * k / n), point
        for switching in ("hybrid", "greedy"):
            rule = cfg[switching].policy.on_switch
            assert rule.momentum == "asynchrony"
            switched = bsp.optimizer.learning_rate / float(rule.lr) * restore_factor(mu, 0.9)
            assert switched == pytest.approx(asp.optimizer.learning_rate, rel=1e-4), (point, switching)


def test_a_packaged_study_simulates_with_the_readmes_fitted_push_cost_and_a_users_set_wins():
    page = (Path(__file__).resolve().parent.parent / "docs" / "simulation.md").read_text()
    fit = re.search(r"sim_vs_real\.py compare .* --overhead ([0-9.]+) --jitter ([0-9.]+)", page)
    assert fit is not None, "the fitted values in docs/simulation.md"
    fitted = (float(fit[1]), float(fit[2]))
    for name in ("amb-vs-fmb", "dynamic-batching", "switch-config", "sync-switch"):
        spec = load_study(packaged(name), simulate=True)
        assert "bench/sim_vs_real.py fit" in spec.simulation.source, "it says where the values come from"
        for arm in spec.arms:
            net = spec.run_config(arm, 0, Path("/tmp/x"), None).network
            assert (net.push_overhead_s, net.push_jitter_s) == fitted, f"{name}: {arm}"
        real = load_study(packaged(name)).run_config(next(iter(spec.arms)), 0, Path("/tmp/x"), None).network
        assert real.push_overhead_s == real.push_jitter_s == 0, "a real run pays its own"
    user = load_study(packaged("sync-switch"), ["network.push_overhead_s=0"], simulate=True)
    net = user.run_config("hybrid", 0, Path("/tmp/x"), None).network
    assert (net.push_overhead_s, net.push_jitter_s) == (0, fitted[1]), "the user's --set wins, the rest stays"


@pytest.mark.parametrize("edit, problem", [
    ({"arms": {"a": {"protocol.batchsize": 3}}}, "arms.a: protocol.batchsize: unknown key (did you mean batch?)"),
    ({"metrics": ["speed"]}, "unknown metric(s) ['speed']"),
    ({"reference": "zzz"}, "reference 'zzz' is not an arm"),
    ({"target": {"reference_minus_points": 0.5}}, "needs a reference arm"),
])
def test_a_bad_study_file_names_the_problem(tmp_path, edit, problem):
    raw = {"study": "s", "base": {"train": {"steps": 5}}, "arms": {"a": {}}, **edit}
    path = tmp_path / "study.yaml"
    path.write_text(json.dumps(raw))
    with pytest.raises(ConfigError) as e:
        load_study(path)
    assert any(problem in p for p in e.value.problems), e.value.problems


def fake_run(run_dir: Path, accuracies: list[float], switch_at: float | None = None) -> Path:
    run_dir.mkdir(parents=True)
    (run_dir / "config.yaml").write_text("train: {epochs: 2}\n")
    (run_dir / "eval.csv").write_text("time_s,version,test_loss,test_accuracy\n" + "".join(
        f"{t},{10 * t},0.1,{a}\n" for t, a in enumerate(accuracies, start=1)))
    (run_dir / "ps.csv").write_text("time_s,version,protocol,samples,b_mean\n" + "".join(
        f"{v / 10},{v},bsp,10,10\n" for v in range(1, 10 * len(accuracies) + 1)))
    events = [{"event": "switch", "time_s": switch_at}] if switch_at is not None else []
    (run_dir / "events.jsonl").write_text("".join(json.dumps(e) + "\n" for e in events))
    (run_dir / "summary.json").write_text(json.dumps({
        "samples": 10 * 10 * len(accuracies), "samples_per_s": 100.0, "worker_utilization": 0.5, "wall_time_s": 9.0,
        "updates": 10 * len(accuracies), "switches": int(switch_at is not None), "switch_overhead_s": None}))
    return run_dir


def test_metrics_smooth_the_accuracy_and_measure_the_dip_after_a_switch(tmp_path):
    run = fake_run(tmp_path / "r", [0.5, 0.9, 0.9, 0.6, 0.7, 0.95, 0.95, 0.95], switch_at=3.5)
    m = run_metrics(run, target=0.9, smooth=2, last=3)
    assert m["time_to_target_s"] == 3.0  # (0.9 + 0.9) / 2 at t=3; t=2 is (0.5 + 0.9) / 2
    assert m["epochs_to_target"] == pytest.approx(300 / 400)  # 30 versions x 10 samples of 400 per epoch
    assert m["final_accuracy"] == pytest.approx(0.95)
    assert m["dip_points"] == pytest.approx(100 * (0.9 - 0.65))  # smoothed: 0.9 before, 0.65 at its lowest
    assert m["recovery_s"] == pytest.approx(7.0 - 3.5)  # back to 0.9 after its low, at t=7 ((0.95 + 0.95) / 2)


def test_recovery_is_counted_from_after_the_dip_not_from_a_high_evaluation_before_it(tmp_path):
    run = fake_run(tmp_path / "r", [0.9, 0.9, 0.9, 0.9, 0.5, 0.5, 0.95, 0.95], switch_at=2.5)
    m = run_metrics(run, target=0.99, smooth=1, last=1)
    assert m["dip_points"] == pytest.approx(40.0) and m["recovery_s"] == pytest.approx(7.0 - 2.5)
    flat = run_metrics(fake_run(tmp_path / "f", [0.9, 0.9, 0.95], switch_at=1.5), target=0.99, smooth=1, last=1)
    assert flat["dip_points"] == 0.0 and flat["recovery_s"] == 0.0


def test_bytes_sent_is_a_model_vector_in_the_wire_s_type_per_push_taken_in_dropped_ones_too(tmp_path):
    run = fake_run(tmp_path / "r", [0.5, 0.9])
    assert run_metrics(run, target=0.9, smooth=1, last=1)["bytes_sent"] is None, "no model size recorded"
    (run / "events.jsonl").write_text(json.dumps({"event": "model_initialized", "worker": 0, "parameters": 1000}) + "\n")
    summary = json.loads((run / "summary.json").read_text())
    (run / "summary.json").write_text(json.dumps({**summary, "pushes_accepted": 30, "pushes_rejected": 2,
                                                  "pushes_dropped": 5}))
    assert run_metrics(run, target=0.9, smooth=1, last=1)["bytes_sent"] == 35 * 1000 * 4
    (run / "config.yaml").write_text("train: {epochs: 2}\nruntime: {wire_dtype: bfloat16}\n")
    assert run_metrics(run, target=0.9, smooth=1, last=1)["bytes_sent"] == 35 * 1000 * 2


def test_the_study_figure_is_each_arm_s_mean_accuracy_with_its_band_over_its_protocol_timeline(tmp_path):
    spec = StudySpec(study="s", base={"train": {"steps": 5}}, arms={"a": {}, "b": {}}, repeats=2,
                     target={"absolute": 0.7}, metrics=["final_accuracy"], smooth_evals=1)
    accuracies = {("a", 0): [0.5, 0.7, 0.9], ("a", 1): [0.3, 0.5, 0.7, 0.8], ("b", 0): [0.6, 0.6, 0.6],
                  ("b", 1): [0.6, 0.8, 1.0]}
    runs = {(arm, r): fake_run(tmp_path / f"{arm}{r}", acc) for (arm, r), acc in accuracies.items()}
    (runs["b", 0] / "ps.csv").write_text("time_s,version,protocol\n" + "".join(  # b's first seed switches at 1.5 s
        f"{v / 10},{v},{'bsp' if v <= 15 else 'asp'}\n" for v in range(1, 31)))
    curves, lane_a, lane_b = plot_study(spec, runs, 0.7, tmp_path / "study.png").axes
    (a, b), target = [ln for ln in curves.lines if ln.get_label() in spec.arms], curves.lines[-1]
    assert [ln.get_label() for ln in (a, b)] == ["a", "b"] and list(target.get_ydata()) == [0.7, 0.7]
    for line, at_0, at_2, at_3 in ((a, 0.4, 0.6, 0.8), (b, 0.6, 0.7, 0.8)):  # seed means; each run flat before 1 s
        x, y = line.get_xdata(), line.get_ydata()
        assert x[0] == 0.0 and x[-1] == 3.0, "until the shortest run of the arm ends"
        assert np.interp([0.0, 2.0, 3.0], x, y) == pytest.approx([at_0, at_2, at_3])
    for band, line, seeds in zip(curves.collections, (a, b), ([0.9, 0.7], [0.6, 1.0])):  # at 3 s
        top = max(yv for xv, yv in band.get_paths()[0].vertices if xv == 3.0)
        assert top == pytest.approx(line.get_ydata()[-1] + estimate(seeds).ci95)
    rgb = {p: matplotlib.colors.to_rgb(c) for p, c in PROTOCOL_COLORS.items()}
    spans = {lane: [(p.get_x(), p.get_x() + p.get_width(), p.get_facecolor()[:3]) for p in lane.patches]
             for lane in (lane_a, lane_b)}
    assert spans[lane_a] == [(0.0, 3.0, rgb["bsp"])]
    assert spans[lane_b] == [(0.0, 1.5, rgb["bsp"]), (1.5, 3.0, rgb["asp"])], "the first seed's protocols"


def test_an_interrupted_study_runs_only_what_is_missing(tmp_path, monkeypatch):
    spec = StudySpec(study="s", base={"train": {"steps": 5}}, arms={"a": {}, "b": {}}, repeats=2, reference="a",
                     target={"absolute": 0.7}, metrics=["time_to_target_s", "final_accuracy"])
    launched: list[tuple[str, int]] = []

    def launch(cfg, quiet=True):
        launched.append((cfg.name, cfg.seed))
        return fake_run(tmp_path / "runs" / f"{cfg.name}-{cfg.seed}", [0.5, 0.85, 0.9]), {}

    monkeypatch.setattr(runner, "launch", launch)
    (tmp_path / "out").mkdir()
    first = fake_run(tmp_path / "runs" / "done", [0.5, 0.85, 0.9])
    (tmp_path / "out" / "runs.jsonl").write_text(json.dumps({"arm": "a", "repeat": 0, "run_dir": str(first)}) + "\n")
    result = run_study(spec, tmp_path / "out")
    assert launched == [("b", 0), ("a", 1), ("b", 1)], "the finished run is not run again"
    assert len(finished_runs(tmp_path / "out")) == 4
    assert result["arms"]["b"]["final_accuracy"]["n"] == 2
    assert result["comparisons"]["b vs a"]["time_to_target_s_speedup"]["geomean"] == 1.0
    json.loads((tmp_path / "out" / "study.json").read_text(), parse_constant=pytest.fail)
    assert (tmp_path / "out" / "study.png").stat().st_size > 10_000


@pytest.mark.integration
def test_a_real_study_replays_the_first_arms_straggler_trace_in_every_repeat(tmp_path):
    study = tmp_path / "mini.yaml"
    study.write_text(json.dumps({
        "study": "mini", "repeats": 2, "reference": "fmb", "target": {"absolute": 0.3},
        "metrics": ["time_to_target_s", "final_accuracy", "samples_per_worker_step"],
        "base": {"cluster": {"workers": 3}, "model": {"name": "logreg"}, "data": {"name": "digits"},
                 "protocol": {"name": "fmb", "batch": 16, "micro_batch": 4}, "train": {"steps": 12},
                 "eval": {"every_s": 0.5}, "device": {"samples_per_s": 640.0},
                 "stragglers": {"mixture": {"preset": "niagara", "scale": 0.02}}},
        "arms": {"fmb": {}, "amb": {"protocol.name": "amb", "protocol.time_budget_s": 0.05}}}))
    proc = subprocess.run([SWITCHPS, "study", str(study), "--out", str(tmp_path / "out"), "--quiet"],
                          capture_output=True, text=True, timeout=600, cwd=tmp_path)
    assert proc.returncode == 0, proc.stderr[-3000:]
    result = json.loads((tmp_path / "out" / "study.json").read_text())
    assert {(r["arm"], r["repeat"]) for r in result["runs"]} == {("fmb", 0), ("amb", 0), ("fmb", 1), ("amb", 1)}
    for repeat in (0, 1):
        fmb, amb = (Path(r["run_dir"]) for arm in ("fmb", "amb") for r in result["runs"]
                    if r["arm"] == arm and r["repeat"] == repeat)
        a, b = load_trace(fmb / "stragglers.csv"), load_trace(amb / "stragglers.csv")
        common = a.keys() & b.keys()
        assert len(common) >= 20 and all(a[k] == b[k] for k in common), "the same delays in both arms"
    assert result["arms"]["fmb"]["final_accuracy"]["n"] == 2
    assert np.isfinite(result["arms"]["amb"]["samples_per_worker_step"]["mean"])


@pytest.mark.parametrize("command", [["plot"], ["compare"]])
def test_plot_and_compare_on_a_path_that_is_not_a_run_directory_exit_2_in_one_line(tmp_path, command):
    proc = subprocess.run([SWITCHPS, *command, str(tmp_path)], capture_output=True, text=True, timeout=60)
    assert proc.returncode == 2
    assert proc.stderr.strip().splitlines() == [
        f"switchps: {tmp_path} is not a run directory (no config.yaml, ps.csv, eval.csv)"]


def mini_sweep(**edit: object) -> dict:
    """Two arms at 3 and 40 workers (40 > digits' test split, so 40 > any partition a worker could hold)."""
    return {"study": "mini", "mode": "simulate", "repeats": 2, "reference": "bsp", "target": {"absolute": 0.3},
            "metrics": ["time_to_target_s", "final_accuracy", "updates"],
            "base": {"cluster": {"workers": 3}, "model": {"name": "logreg"},
                     "data": {"name": "digits", "sampling": "replacement"},
                     "protocol": {"name": "bsp", "batch": 8}, "train": {"steps": 12}, "eval": {"every_s": 0.5},
                     "device": {"samples_per_s": 80.0}, "stragglers": {"mixture": {"preset": "niagara", "scale": 0.02}}},
            "arms": {"bsp": {}, "backup": {"protocol.backup_workers": 1}},
            "sweep": {"cluster.workers": [3, 40], "arms.backup.protocol.backup_workers": [1, 10]}, **edit}


def test_a_simulated_sweep_runs_every_arm_at_every_value_and_reports_against_it(tmp_path):
    study = tmp_path / "mini.yaml"
    study.write_text(json.dumps(mini_sweep()))
    proc = subprocess.run([SWITCHPS, "study", str(study), "--out", str(tmp_path / "out"), "--quiet"],
                          capture_output=True, text=True, timeout=600, cwd=tmp_path)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert proc.stdout.strip().endswith("sweep.json")
    sweep = json.loads((tmp_path / "out" / "sweep.json").read_text(), parse_constant=pytest.fail)
    assert sweep["key"] == "cluster.workers" and sweep["values"] == [3, 40] and sweep["mode"] == "simulate"
    for point, workers, backups in zip(sweep["points"], (3, 40), (1, 10)):
        result = json.loads((tmp_path / "out" / f"cluster.workers={workers}" / "study.json").read_text())
        assert point["arms"] == result["arms"] and result["arms"]["backup"]["updates"]["n"] == 2
        for run in result["runs"]:
            summary = json.loads((Path(run["run_dir"]) / "summary.json").read_text())
            cfg = (Path(run["run_dir"]) / "config.yaml").read_text()
            assert summary["simulated"] and summary["updates"] == 12, "every run is a whole simulation"
            assert f"workers: {workers}\n" in cfg
            assert (f"backup_workers: {backups}\n" in cfg) == (run["arm"] == "backup"), "the arm's own sweep key"
    assert (tmp_path / "out" / "sweep.png").stat().st_size > 10_000
    fig = plot_sweep(load_study(study), sweep["key"], sweep["points"], tmp_path / "again.png")
    for ax, metric in zip(fig.axes, ("time_to_target_s", "final_accuracy"), strict=True):
        assert ax.get_xlabel() == "cluster.workers" and ax.get_xscale() == "log", "3 to 40 workers: log2"
        for arm, bars in zip(("bsp", "backup"), ax.containers, strict=True):
            means = [(w, p["arms"][arm][metric]["mean"]) for w, p in zip((3, 40), sweep["points"])]
            data = bars.lines[0]
            assert bars.get_label().startswith(arm)
            assert list(zip(data.get_xdata(), data.get_ydata())) == [(w, m) for w, m in means if m is not None]


def test_simulate_runs_a_study_in_simulation_with_more_workers_than_a_real_run_takes(tmp_path):
    raw = mini_sweep(mode="run", sweep={"cluster.workers": [2000]}, repeats=1)
    study = tmp_path / "big.yaml"
    study.write_text(json.dumps(raw))
    with pytest.raises(ConfigError) as e:
        load_study(study)
    assert any("sweep cluster.workers=2000: arms.bsp: cluster.workers: at most 1024 workers" in p
               for p in e.value.problems), e.value.problems
    spec = load_study(study, simulate=True)
    assert spec.mode == "simulate" and spec.run_config("bsp", 0, tmp_path, None).cluster.num_workers == 3
    assert spec.points()[0][1].run_config("bsp", 0, tmp_path, None).cluster.num_workers == 2000


@pytest.mark.parametrize("sweep, problem", [
    ({"cluster.workers": [3, 4], "eval.every_s": [1.0]}, "all of one length"),
    ({"cluster.workers": [3], "arms.nope.protocol.batch": [4]}, "name no arm's field"),
    ({"arms.bsp.protocol.batch": [4]}, "the first key names the points"),
])
def test_a_bad_sweep_names_the_problem(tmp_path, sweep, problem):
    path = tmp_path / "study.yaml"
    path.write_text(json.dumps(mini_sweep(sweep=sweep)))
    with pytest.raises(ConfigError) as e:
        load_study(path)
    assert any(problem in p for p in e.value.problems), e.value.problems



def mini_study(tmp_path: Path) -> Path:
    """``mini_sweep`` without its sweep: 2 arms x 2 repeats of a few seconds each."""
    raw = mini_sweep()
    del raw["sweep"]
    path = tmp_path / "mini.yaml"
    path.write_text(json.dumps(raw))
    return path


def listed_runs(out: Path) -> list[tuple[str, int]]:
    return [(r["arm"], r["repeat"]) for r in map(json.loads, (out / "runs.jsonl").read_text().splitlines())]


def test_a_study_in_two_processes_gives_what_one_gives_and_lists_every_run_once(tmp_path):
    study, one, two = mini_study(tmp_path), tmp_path / "one", tmp_path / "two"
    for out, flags in ((one, ["--quiet"]), (two, ["--jobs", "2"])):
        proc = subprocess.run([SWITCHPS, "study", str(study), "--out", str(out), *flags], capture_output=True,
                              text=True, timeout=600, cwd=tmp_path)
        assert proc.returncode == 0, proc.stderr[-3000:]
    runs = {(a, r) for a in ("bsp", "backup") for r in (0, 1)}
    announced = re.findall(r"^(\w+) repeat (\d): [0-9.]+ s, ", proc.stdout, re.MULTILINE)
    assert sorted((a, int(r)) for a, r in announced) == sorted(runs), "one line per run in the parent"
    assert sorted(listed_runs(two)) == sorted(runs)
    result = json.loads((two / "study.json").read_text())
    assert result["arms"] == json.loads((one / "study.json").read_text())["arms"], "a simulation is deterministic"
    for run in result["runs"]:
        cfg = (Path(run["run_dir"]) / "config.yaml").read_text()
        assert f"name: {run['arm']}\n" in cfg and f"seed: {run['repeat']}\n" in cfg, "a directory per run"


def test_a_parallel_study_runs_only_what_is_missing(tmp_path):
    out = tmp_path / "out"
    (out / "runs").mkdir(parents=True)
    done = {r: fake_run(tmp_path / f"bsp{r}", [0.5, 0.9]) for r in (0, 1)}
    (out / "runs.jsonl").write_text("".join(
        json.dumps({"arm": "bsp", "repeat": r, "run_dir": str(d)}) + "\n" for r, d in done.items()))
    proc = subprocess.run([SWITCHPS, "study", str(mini_study(tmp_path)), "--out", str(out), "--jobs", "2",
                           "--quiet"], capture_output=True, text=True, timeout=600, cwd=tmp_path)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert sorted(p.name.split("-")[0] for p in (out / "runs").iterdir()) == ["backup", "backup"]
    assert sorted(listed_runs(out)) == [("backup", 0), ("backup", 1), ("bsp", 0), ("bsp", 1)]



def test_a_claimed_run_directory_is_created_at_once_so_parallel_runs_never_share_one(tmp_path):
    cfg = load_study(mini_study(tmp_path)).run_config("bsp", 0, tmp_path / "runs", None)
    first, second = cfg.new_run_dir(claim=True), cfg.new_run_dir(claim=True)
    assert first != second and first.is_dir() and second.is_dir() and not list(first.iterdir())

@pytest.mark.parametrize("jobs", ["0", "-2"])
def test_a_study_refuses_fewer_than_one_job_in_one_line(tmp_path, jobs):
    proc = subprocess.run([SWITCHPS, "study", str(mini_study(tmp_path)), "--jobs", jobs, "--out",
                           str(tmp_path / "out")], capture_output=True, text=True, timeout=120)
    assert proc.returncode == 2
    assert proc.stderr.strip().splitlines() == [f"switchps: config error: --jobs: {jobs} processes; give 1 or more"]
    assert not (tmp_path / "out").exists(), "nothing ran"

def test_a_simulated_study_needs_the_device_model_and_says_so_before_running(tmp_path):
    raw = mini_sweep()
    del raw["base"]["device"]
    path = tmp_path / "study.yaml"
    path.write_text(json.dumps(raw))
    proc = subprocess.run([SWITCHPS, "study", str(path), "--out", str(tmp_path / "out")], capture_output=True,
                          text=True, timeout=120)
    assert proc.returncode == 2 and "Traceback" not in proc.stderr
    assert "device.samples_per_s: required by a simulation" in proc.stderr
    assert not (tmp_path / "out").exists(), "nothing ran"


def test_a_second_study_on_the_same_out_is_refused_while_the_first_holds_it(tmp_path):
    out, path = tmp_path / "out", tmp_path / "study.yaml"
    path.write_text(json.dumps(mini_sweep()))
    holder = subprocess.Popen([sys.executable, "-c", "import sys; from pathlib import Path; "
                               "from switchps.studies.runner import locked\n"
                               f"with locked(Path({str(out)!r})):\n    print('held', flush=True); sys.stdin.read()"],
                              stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)
    try:
        assert holder.stdout is not None and holder.stdout.readline() == "held\n"
        proc = subprocess.run([SWITCHPS, "study", str(path), "--out", str(out)], capture_output=True, text=True,
                              timeout=120)
        assert proc.returncode == 2 and "Traceback" not in proc.stderr
        assert f"is in use by another switchps study (pid {holder.pid})" in proc.stderr
        assert not list(out.glob("*/runs.jsonl")), "nothing ran"
    finally:
        holder.communicate("", timeout=30)
    again = subprocess.run([SWITCHPS, "study", str(path), "--out", str(out), "--quiet"], capture_output=True,
                           text=True, timeout=300)
    assert again.returncode == 0, again.stderr[-2000:]
    assert (out / "sweep.json").exists(), "the lock ends with the process that held it"


def test_every_protocol_has_its_own_colour():
    """One colour per protocol name, the same in a run's plots and a study's lanes (``runs.colors``)."""
    from switchps import names

    assert list(PROTOCOL_COLORS) == list(names.PROTOCOLS)
    assert len({matplotlib.colors.to_rgb(c) for c in PROTOCOL_COLORS.values()}) == len(PROTOCOL_COLORS)
