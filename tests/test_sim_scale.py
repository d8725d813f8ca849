"""``bench/sim_scale.py`` runs end to end at toy sizes, prints strict JSON with every figure it promises and
passes every verdict it judges there; its verdicts, time limits included, fail where they should.

No timing is asserted: the quick run judges no time limit (see ``targets``), and the limits are checked on
figures given to ``measured``."""

from __future__ import annotations

import importlib
import json
import subprocess
import sys
from dataclasses import replace
from pathlib import Path
from types import ModuleType
from typing import Any, NoReturn

import pytest

SCRIPT = Path(__file__).resolve().parents[1] / "bench" / "sim_scale.py"
CASE_FIELDS = {"name", "group", "workers", "protocol", "updates", "time_only", "limit_s", "memory_limit_mb",
               "wall_s", "sim_wall_s", "sim_events", "samples", "worker_steps", "us_per_step_sim",
               "us_per_step_wall", "peak_rss_mb", "pass"}
ROW_FIELDS = {"mode", "workers", "rounds", "worker_steps", "us_per_step_sim", "us_per_step_wall", "vs_smallest",
              "peak_rss_mb"}


def _no_constant(name: str) -> NoReturn:
    raise ValueError(f"not JSON: {name}")


def strict(text: str) -> Any:
    """``text`` as JSON, refusing NaN and Infinity."""
    return json.loads(text, parse_constant=_no_constant)


def test_help() -> None:
    out = subprocess.run([sys.executable, str(SCRIPT), "--help"], capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr
    assert "--quick" in out.stdout and "--only" in out.stdout and "--sizes" in out.stdout


@pytest.mark.timeout(600)
def test_quick_run_passes_and_prints_every_figure() -> None:
    out = subprocess.run([sys.executable, str(SCRIPT), "--quick"], capture_output=True, text=True, timeout=580)
    report = strict(out.stdout)
    assert out.returncode == 0, (out.stderr[-3000:], report)
    assert report["benchmark"] == "sim_scale" and report["quick"] is True and report["all_pass"] is True
    targets = report["targets"]
    assert [(t["protocol"], t["time_only"]) for t in targets] == [("bsp", False), ("asp", False), ("bsp", True),
                                                                  ("local_sgd", True)]
    cases = report["growth"]["cases"]
    assert len(cases) == 4 and {c["workers"] for c in cases} == {4, 16}
    for case in [*targets, *cases]:
        assert "error" not in case, case.get("error")
        assert CASE_FIELDS <= set(case), CASE_FIELDS - set(case)
        assert case["pass"] is True and case["updates"] > 0 and case["worker_steps"] == case["samples"] // 16 > 0
        assert case["peak_rss_mb"] > 0 and case["us_per_step_sim"] > 0
    assert all(t["limit_s"] is None for t in targets)
    assert [t["memory_limit_mb"] for t in targets] == [4096.0, 4096.0, None, None]
    rows = report["growth"]["table"]
    assert [(r["mode"], r["workers"]) for r in rows] == [("time_only", 4), ("time_only", 16), ("real", 4),
                                                         ("real", 16)]
    for row in rows:
        assert ROW_FIELDS <= set(row)
    assert rows[0]["vs_smallest"] == rows[2]["vs_smallest"] == 1.0


def test_a_case_that_does_not_finish_fails_the_run() -> None:
    out = subprocess.run([sys.executable, str(SCRIPT), "--quick", "--only", "targets", "--timeout", "0.01"],
                         capture_output=True, text=True, timeout=120)
    report = strict(out.stdout)
    assert out.returncode == 1 and report["all_pass"] is False
    assert [(t["pass"], t["error"]) for t in report["targets"]] == [(False, "timed out after 0 s")] * 4


@pytest.fixture
def bench(monkeypatch: pytest.MonkeyPatch) -> ModuleType:
    monkeypatch.syspath_prepend(str(SCRIPT.parent))
    return importlib.import_module("sim_scale")


def test_a_target_fails_short_of_its_updates_or_over_its_limits(bench: ModuleType) -> None:
    full = bench.targets(quick=False)
    assert [(c.workers, c.updates, c.limit_s, c.memory_limit_mb) for c in full] == [
        (1024, 500, 300.0, 4096.0), (1024, 20_000, 300.0, 4096.0), (10_000, 100, 120.0, None), (1024, 50, 120.0, None)]
    case = full[0]
    child = {"sim_wall_s": 51.2, "sim_events": 1, "updates": 500, "samples": 1024 * 500 * 16,
             "virtual_time_s": 1.0, "final_test_accuracy": 0.5, "peak_rss_mb": 3000.0}

    def verdict(case: Any, wall: float = 250.0, **got: float) -> bool:
        return bool(bench.measured(case, {**child, **got}, wall, 0.0)["pass"])

    assert verdict(case)
    assert not verdict(case, updates=499), "every update must be done"
    assert not verdict(case, wall=300.0), "within the time limit"
    assert not verdict(case, peak_rss_mb=4096.0), "within the memory limit"
    assert verdict(replace(case, limit_s=None, memory_limit_mb=None), wall=1e6, peak_rss_mb=1e6)
    assert bench.measured(case, child, 250.0, 0.0)["us_per_step_sim"] == 100.0  # 51.2 s / 512,000 steps
