"""The AMB-vs-FMB study, shrunk: both arms run as real processes on the same straggler trace."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest

from switchps.plots import read_csv
from switchps.studies.amb_vs_fmb import AmbStudy, run_amb_vs_fmb
from switchps.ps_server.records import load_trace

pytestmark = pytest.mark.integration


def test_amb_vs_fmb_replays_the_same_trace_and_writes_its_outputs(tmp_path):
    study = AmbStudy(workers=3, steps=12, scale=0.05, samples_per_s=320.0, micro_batch=4, target=0.5,
                     out=str(tmp_path))
    result = run_amb_vs_fmb(study)
    fmb, amb = (Path(a["run_dir"]) for a in result["arms"])
    for arm in (fmb, amb):
        summary = json.loads((arm / "summary.json").read_text())
        assert summary["final_version"] == summary["updates"] == 12, "each arm's final accuracy is of its last version"
    fmb_trace, amb_trace = load_trace(fmb / "stragglers.csv"), load_trace(amb / "stragglers.csv")
    common = fmb_trace.keys() & amb_trace.keys()
    assert len(common) >= 3 * 10
    assert all(fmb_trace[k] == amb_trace[k] for k in common), "AMB must replay FMB's straggler delays exactly"
    assert any(d.sleep_s > 0 for d in fmb_trace.values())
    amb_ps, fmb_ps = read_csv(amb / "ps.csv"), read_csv(fmb / "ps.csv")
    assert set(amb_ps["protocol"]) == {"amb"} and set(fmb_ps["protocol"]) == {"fmb"}
    assert np.allclose(amb_ps["time_budget_s"], result["amb_time_budget_s"], rtol=1e-3)
    assert set(fmb_ps["b_mean"]) == {16.0}
    saved = json.loads((tmp_path / "study.json").read_text())
    assert saved["speedup_seconds_per_step"] == result["speedup_seconds_per_step"] > 0
    assert (tmp_path / "amb_vs_fmb.png").stat().st_size > 10_000


def test_sync_switch_asp_arm_starts_with_what_the_hybrid_switches_to():
    from switchps.config import parse_config
    from switchps.studies.base import merge
    from switchps.studies.sync_switch import SyncSwitchStudy

    study = SyncSwitchStudy()
    arms = study.arms()
    asp = parse_config(merge(study.base(), arms["asp"]))
    # the switch's factor: 0.2 / 16, then momentum 0.9 - (1 - 1/8) = 0.025 with lr x (1 - 0.025) / (1 - 0.9)
    assert asp.optimizer.learning_rate == pytest.approx(0.2 / 16 * 9.75)
    assert asp.optimizer.params["momentum"] == pytest.approx(0.025)
    hybrid = parse_config(merge(study.base(), arms["hybrid0.125"]))
    assert hybrid.policy.on_switch.momentum == "asynchrony" and hybrid.policy.on_switch.lr == 16.0
    assert hybrid.network.ps_link_mbit_s == 5.0


def test_time_to_target_reads_the_mean_of_the_last_five_evals_and_counts_epochs_seen(tmp_path):
    from switchps.studies.sync_switch import _time_and_epochs_to

    accuracies = [0.5, 1.0, 1.0, 1.0, 1.0, 1.0]  # trailing means: 0.5, 0.75, 0.83, 0.875, 0.9, 1.0
    (tmp_path / "eval.csv").write_text("time_s,version,test_loss,test_accuracy\n" + "".join(
        f"{i + 1.0},{2 * (i + 1)},0.1,{a}\n" for i, a in enumerate(accuracies)))
    (tmp_path / "ps.csv").write_text("time_s,version,samples\n" + "".join(f"{v / 2},{v},100\n" for v in range(1, 13)))
    # the single eval at t=2 is already 1.0, but the mean first reaches 0.9 at t=5 (version 10: 1000 samples)
    assert _time_and_epochs_to(tmp_path, 0.9, samples_per_epoch=200.0) == (5.0, 5.0)
    assert _time_and_epochs_to(tmp_path, 1.01, samples_per_epoch=200.0) == (None, None)


def test_sync_switch_arms_are_selectable_and_bsp_always_runs():
    from switchps.config import parse_config
    from switchps.studies.base import merge
    from switchps.studies.sync_switch import SyncSwitchStudy

    study = SyncSwitchStudy(arms_run=("hybrid", "asp"), model="logreg")
    arms = study.arms()
    assert list(arms) == ["bsp", "asp", "hybrid0.125"]
    cfg = parse_config(merge(study.base(), arms["bsp"]))
    assert cfg.model.name == "logreg" and cfg.model.kwargs == {}


def test_sync_switch_unknown_arm_exits_2_naming_the_option():
    import subprocess
    import sys

    r = subprocess.run([sys.executable, "-m", "switchps.cli", "study", "sync-switch", "--arms", "asp,bogus"],
                       capture_output=True, text=True, timeout=60)
    assert r.returncode == 2
    lines = r.stderr.strip().splitlines()
    assert len(lines) == 1 and "--arms" in lines[0] and "bogus" in lines[0]
