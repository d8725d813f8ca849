"""``bench/sim_scale.py`` runs end to end at toy sizes and prints strict JSON with every figure it promises.

No timing is asserted: the machine's speed decides the verdicts, so only their shape is checked (a run
exits 1 exactly when its JSON says a case failed)."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path
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
def test_quick_run_prints_every_figure() -> None:
    out = subprocess.run([sys.executable, str(SCRIPT), "--quick"], capture_output=True, text=True, timeout=580)
    assert out.returncode in (0, 1), out.stderr
    report = strict(out.stdout)
    assert report["benchmark"] == "sim_scale" and report["quick"] is True
    assert (out.returncode == 0) == report["all_pass"]
    targets = report["targets"]
    assert [(t["protocol"], t["time_only"]) for t in targets] == [("bsp", False), ("asp", False), ("bsp", True)]
    cases = report["growth"]["cases"]
    assert len(cases) == 4 and {c["workers"] for c in cases} == {4, 16}
    for case in [*targets, *cases]:
        assert "error" not in case, case.get("error")
        assert CASE_FIELDS <= set(case), CASE_FIELDS - set(case)
        assert case["updates"] > 0 and case["worker_steps"] == case["samples"] // 16 > 0
        assert case["peak_rss_mb"] > 0 and case["us_per_step_sim"] > 0
    assert all(t["limit_s"] > 0 for t in targets)
    assert [t["memory_limit_mb"] is not None for t in targets] == [True, True, False]
    rows = report["growth"]["table"]
    assert [(r["mode"], r["workers"]) for r in rows] == [("time_only", 4), ("time_only", 16), ("real", 4),
                                                         ("real", 16)]
    for row in rows:
        assert ROW_FIELDS <= set(row)
    assert rows[0]["vs_smallest"] == rows[2]["vs_smallest"] == 1.0
