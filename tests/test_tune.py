"""The BSP-fraction search: logic on scripted accuracies, and one real two-trial run."""

from __future__ import annotations

import json
from importlib.resources import files
from pathlib import Path

import pytest
import yaml

from switchps.config.run import load_config
from switchps.runs.tune import hybrid_config, search_fraction, tune_switch


def scripted(accuracy_by_fraction: dict[float, float]):
    calls = []

    def run(f: float) -> tuple[float, float]:
        calls.append(f)
        return accuracy_by_fraction[f], 10.0 * f

    return run, calls


def test_halves_while_accuracy_holds_and_keeps_the_last_good_fraction():
    run, calls = scripted({1.0: 0.95, 0.5: 0.949, 0.25: 0.946, 0.125: 0.93})
    trials, chosen = search_fraction(run, tolerance=0.005)
    assert calls == [1.0, 0.5, 0.25, 0.125]
    assert chosen == 0.25
    assert [t.bsp_fraction for t in trials] == [1.0, 0.5, 0.25, 0.125]


def test_bsp_alone_when_even_half_loses_accuracy():
    run, _ = scripted({1.0: 0.95, 0.5: 0.90})
    assert search_fraction(run)[1] == 1.0


def test_repeats_average_and_min_fraction_stops():
    results = iter([(0.95, 1), (0.93, 1), (0.951, 1), (0.949, 1), (0.95, 1), (0.95, 1)])
    trials, chosen = search_fraction(lambda f: next(results), tolerance=0.005, repeats=2, min_fraction=0.25)
    assert [t.accuracy for t in trials] == pytest.approx([0.94, 0.95, 0.95])
    assert chosen == 0.25 and len(trials) == 3


def test_hybrid_config_is_bsp_then_asp():
    base = load_config(None)
    hybrid = hybrid_config(base, 0.125, "x")
    assert hybrid.protocol.name == "bsp" and hybrid.policy.name == "schedule"
    assert hybrid.policy.kwargs == {"phases": [{"bsp": 0.125}, {"asp": 0.875}]}
    assert hybrid_config(base, 1.0, "y").policy.name is None


def test_hybrid_config_of_another_protocol_keeps_only_what_bsp_takes():
    """The config's protocol's own fields (ASP's staleness_lr) are not BSP's: a trial drops them."""
    hybrid = hybrid_config(load_config(None, ["protocol.name=asp", "protocol.staleness_lr=true"]), 0.5, "x")
    assert (hybrid.protocol.name, hybrid.protocol.batch) == ("bsp", 16)
    assert "staleness_lr" not in hybrid.protocol.model_dump()


@pytest.mark.integration
def test_real_two_trial_search(tmp_path):
    """A tolerance of 1 (all of accuracy's range) keeps any hybrid: the search must choose 0.5, whatever
    accuracies the two runs reach, and report the ones they did."""
    cfg = load_config(Path(str(files("switchps.examples"))) / "bsp.yaml",
                      [f"output.dir={tmp_path}", "train.epochs=6", "cluster.workers=2"])
    result = tune_switch(cfg, tolerance=1.0, repeats=1, min_fraction=0.5)
    out = tmp_path / "tune-switch-bsp"
    assert [t["bsp_fraction"] for t in result["trials"]] == [1.0, 0.5] and result["chosen_bsp_fraction"] == 0.5
    assert json.loads((out / "tune_switch.json").read_text()) == result
    assert yaml.safe_load((out / "schedule.yaml").read_text()) == {
        "policy": {"name": "schedule", "kwargs": {"phases": [{"bsp": 0.5}, {"asp": 0.5}]}}}
    runs = {fraction: next(d for d in out.iterdir() if f"-bsp{fraction}-" in d.name) for fraction in ("1", "0.5")}
    finals = [json.loads((runs[f] / "summary.json").read_text())["final_test_accuracy"] for f in ("1", "0.5")]
    assert [t["accuracies"] for t in result["trials"]] == [[a] for a in finals] and result["bsp_accuracy"] == finals[0]
    protocols = [line.split(",")[2] for line in (runs["0.5"] / "ps.csv").read_text().splitlines()[1:]]
    assert protocols[0] == "bsp" and protocols[-1] == "asp", "the hybrid switched live"
    assert set(line.split(",")[2] for line in (runs["1"] / "ps.csv").read_text().splitlines()[1:]) == {"bsp"}
