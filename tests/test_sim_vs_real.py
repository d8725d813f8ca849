"""bench/sim_vs_real.py on a tiny real study: its help, ``fit`` and ``compare`` as commands, the JSON they
print, that every simulation replayed its real run's straggler delays step by step, and that with the
fitted overhead and jitter every metric of every arm agrees within its tolerance (as the README reports
of its real studies), but for the README's one allowance (``reaching_is_a_coin_flip``)."""

from __future__ import annotations

import json
import math
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest
import yaml

from switchps.runs.record import read_csv
from switchps.straggler_trace import load_trace

from test_launch import SWITCHPS

BENCH = str(Path(__file__).resolve().parents[1] / "bench" / "sim_vs_real.py")
METRICS = {"seconds_per_update", "samples_per_s", "staleness_mean", "time_to_target_s", "final_accuracy"}


def bench(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, BENCH, *args], capture_output=True, text=True, timeout=300)


@pytest.fixture(scope="module")
def real_study(tmp_path_factory) -> Path:
    """A real study: 2 workers behind an emulated link, FMB records a straggler trace and ASP replays it,
    100 updates each; and FMB again without the link ("alone"), where a push's own cost is seen alone.
    Long enough for the compared metrics to be more than a few events: staleness over 100 pushes, the
    target (0.7, about half-way) crossed after 30 evaluations or more (one every 0.2 s), and at SGD's 0.1 a
    final accuracy that a push arriving in another order barely moves. A step computes for 0.2 s (16
    samples at 80/s), so that the milliseconds a busy machine adds to a real push, which one fitted
    overhead cannot follow from arm to arm, stay well inside the 10 % tolerances. The study takes minutes
    (each run starts its processes and TensorFlow): its tests' timeouts allow for it."""
    tmp = tmp_path_factory.mktemp("simreal")
    study = tmp / "mini.yaml"
    study.write_text(json.dumps({
        "study": "mini", "repeats": 1, "reference": "fmb", "target": {"absolute": 0.7},
        "metrics": ["time_to_target_s", "final_accuracy"],
        "base": {"cluster": {"workers": 2}, "model": {"name": "logreg"}, "data": {"name": "digits"},
                 "optimizer": {"name": "sgd", "learning_rate": 0.1},
                 "protocol": {"name": "fmb", "batch": 16, "micro_batch": 4}, "train": {"steps": 100},
                 "eval": {"every_s": 0.2}, "device": {"samples_per_s": 80.0}, "network": {"ps_link_mbit_s": 20.0},
                 "stragglers": {"mixture": {"preset": "niagara", "scale": 0.05}}},
        "arms": {"fmb": {}, "asp": {"protocol.name": "asp"}, "alone": {"network.ps_link_mbit_s": None}}}))
    proc = subprocess.run([SWITCHPS, "study", str(study), "--out", str(tmp / "real"), "--quiet"],
                          capture_output=True, text=True, timeout=600, cwd=tmp)
    assert proc.returncode == 0, proc.stderr[-3000:]
    return tmp / "real"


def test_help_names_both_commands():
    top, cmp, fit = bench("--help"), bench("compare", "--help"), bench("fit", "--help")
    assert top.returncode == cmp.returncode == fit.returncode == 0
    assert "compare" in top.stdout and "fit" in top.stdout
    assert "--overhead" in cmp.stdout and "--jitter" in cmp.stdout and "REAL_STUDY_DIR" in fit.stdout


def sleeps(run_dir: Path) -> dict[tuple[int, int], float]:
    w = read_csv(run_dir / "workers.csv")
    return {(int(a), int(b)): float(s) for a, b, s in zip(w["worker"], w["step"], w["sleep_s"])}


def reaching_is_a_coin_flip(metric: str, judged: dict[str, Any], runs: list[dict[str, Any]],
                             result: dict[str, Any]) -> bool:
    """The one disagreement the README allows (and ``compare`` still reports): how many of an arm's runs
    reach the target at all, where the target lies inside the spread of the arm's final accuracies (its
    runs', real and simulated, widened by the final-accuracy tolerance). Whether a run crosses such a
    target is close to a coin flip, which a few seeds cannot tell from a difference."""
    if metric != "time_to_target_s" or judged["real_missing"] == judged["sim_missing"]:
        return False
    finals = [r[side]["final_accuracy"] for r in runs for side in ("real", "sim")]
    widen = result["tolerances"]["final_accuracy"]["tolerance"] / 100  # points
    return min(finals) - widen <= result["studies"]["mini"]["target"] <= max(finals) + widen


@pytest.mark.integration
@pytest.mark.timeout(900)
def test_fit_then_compare_replay_the_real_delays_and_agree_on_every_arm(real_study, tmp_path):
    fit = bench("fit", str(real_study))
    assert fit.returncode == 0, fit.stderr[-3000:]
    fitted = json.loads(fit.stdout, parse_constant=pytest.fail)
    assert set(fitted["per_arm"]) == {"mini/fmb", "mini/asp", "mini/alone"}
    overhead, jitter = fitted["fitted_push_overhead_s"], fitted["fitted_push_jitter_s"]
    assert fitted["command"].endswith(f"compare {real_study} --overhead {overhead} --jitter {jitter}")
    for name, arm in fitted["per_arm"].items():
        (run,) = arm["runs"]
        assert run["overhead_s"] == pytest.approx(run["rpc_s"] + run["local_s"] - run["link_s"])
        if name == "mini/alone":
            assert run["link_s"] == 0 and run["jitter_s"] > 0, "the cost's spread is measured without a link"
            assert fitted["jitter_steps"] == run["steps"] and jitter == pytest.approx(run["jitter_s"], abs=1e-6)
        else:
            assert run["link_s"] > 2 * 2600 * 8 / 20e6, "logreg's 2,600 bytes each way at 20 Mbit/s, at least"
            assert run["rpc_s"] > run["link_s"], "a real push costs more than its link time"
            assert run["jitter_s"] is None, "behind a link a step's cost varies with the crowd"
    pooled = sum(r["overhead_s"] * r["steps"] for a in fitted["per_arm"].values() for r in a["runs"]) / \
        sum(r["steps"] for a in fitted["per_arm"].values() for r in a["runs"])
    assert overhead == pytest.approx(max(0.0, pooled - jitter), abs=1e-6), "the constant keeps the mean cost"

    cmp = bench("compare", str(real_study), "--overhead", str(overhead), "--jitter", str(jitter), "--out",
                str(tmp_path))
    result = json.loads(cmp.stdout, parse_constant=pytest.fail)
    assert cmp.returncode == (1 if result["failed"] else 0) and result["passed"] == (not result["failed"])
    study = result["studies"]["mini"]
    assert study["target"] == 0.7 and set(study["arms"]) == {"fmb", "asp", "alone"}
    for name, arm in study["arms"].items():
        assert arm["seeds"] == 1 and set(arm["metrics"]) == METRICS
        for metric, m in arm["metrics"].items():
            assert {"real", "sim", "diff", "tolerance", "pass"} <= set(m)
            if m["real"] is not None and m["sim"] is not None and m["real_missing"] == m["sim_missing"]:
                assert m["pass"] == (m["diff"] is not None and abs(m["diff"]) <= m["tolerance"])
            runs = [r for r in study["runs"] if r["arm"] == name]
            assert m["pass"] or reaching_is_a_coin_flip(metric, m, runs, result), (name, metric, m)
        reached = arm["metrics"]["time_to_target_s"]
        assert reached["real"] is not None or reached["sim"] is not None, "the target is in reach: compared"
    assert study["arms"]["fmb"]["metrics"]["staleness_mean"]["real"] == 0.0
    assert study["arms"]["asp"]["metrics"]["staleness_mean"]["sim"] > 0

    for run in study["runs"]:
        real, sim = Path(run["real_dir"]), Path(run["sim_dir"])
        cfg = yaml.safe_load((sim / "config.yaml").read_text())
        assert cfg["stragglers"]["trace"] == str(real / "stragglers.csv")
        assert cfg["network"]["push_overhead_s"] == overhead and cfg["network"]["push_jitter_s"] == jitter
        assert cfg["seed"] == yaml.safe_load((real / "config.yaml").read_text())["seed"]
        a, b = load_trace(real / "stragglers.csv"), load_trace(sim / "stragglers.csv")
        common = a.keys() & b.keys()
        assert len(common) >= 10 and all(a[k] == b[k] for k in common), "the same delays at every step"
        assert any(a[k].sleep_s > 0 for k in common)
        r, s = sleeps(real), sleeps(sim)
        both = r.keys() & s.keys()
        assert len(both) >= 10 and all(math.isclose(r[k], s[k], rel_tol=1e-4, abs_tol=1e-6) for k in both)
        assert run["trace_check"]["trace_steps_differing"] == run["trace_check"]["sleep_rows_differing"] == 0


@pytest.mark.integration
@pytest.mark.timeout(900)
def test_an_overhead_is_paid_by_every_simulated_push(real_study, tmp_path):
    cmp = bench("compare", str(real_study), "--overhead", "0.05", "--jitter", "0.001", "--out", str(tmp_path))
    result = json.loads(cmp.stdout, parse_constant=pytest.fail)
    assert result["overhead_s"] == 0.05 and result["jitter_s"] == 0.001
    for arm in result["studies"]["mini"]["arms"].values():  # a push costs its link time and these, nothing else
        # (within CSV and summary rounding, and link_s's mean sharing delay, which counts the initial pulls: < 0.5 ms)
        d = arm["diagnostics"]
        assert d["rpc_s"]["sim"] - d["link_s"]["sim"] == pytest.approx(0.051, abs=1e-3), "0.05 s + 1 ms on average"
    runs = result["studies"]["mini"]["runs"]
    assert all(Path(r["sim_dir"]).parent.parent.name == "o0.05-j0.001" for r in runs)
    for r in runs:
        assert yaml.safe_load((Path(r["sim_dir"]) / "config.yaml").read_text())["network"]["push_jitter_s"] == 0.001
