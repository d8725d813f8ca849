"""Tests for switchps.plots on synthetic run directories."""

from __future__ import annotations

import json
import subprocess
from collections.abc import Sequence
from pathlib import Path

import numpy as np
import pytest

from switchps.compare import RunResult, compare_runs, load_result, time_to_target
from switchps.plots import PLOT_FILES, plot_run
from switchps.runrecord import read_csv

from test_launch import SWITCHPS

PNG_SIGNATURE = b"\x89PNG\r\n\x1a\n"
PS_HEADER = "time_s,version,protocol,workers,samples,staleness_max,staleness_mean,lr,train_loss,b_min,b_mean,b_max,wait_s"
WORKERS_HEADER = "time_s,worker,step,base_version,samples,compute_s,send_s,wait_s,sleep_s,loss"
EVAL_HEADER = "time_s,version,test_loss,test_accuracy"


def _write_csv(path: Path, header: str, rows: Sequence[Sequence[object]]) -> None:
    lines = [header] + [",".join("" if v is None else str(v) for v in row) for row in rows]
    path.write_text("\n".join(lines) + "\n")


def make_run(
    root: Path,
    dirname: str,
    name: str,
    eval_points: list[tuple[float, float]],
    protocols: tuple[str, ...] = ("bsp",),
    summary: bool = True,
    ran_on: dict | None = None,
) -> Path:
    """A run with one PS update per 0.5 s, protocols in equal consecutive phases, and the given
    (time_s, test_accuracy) eval points (version = 2 * time_s); ``ran_on``: more summary.json fields."""
    run_dir = root / dirname
    run_dir.mkdir()
    (run_dir / "config.yaml").write_text(f"name: {name}\nprotocol: {protocols[0]}\n")
    n_updates = 20
    ps_rows, worker_rows = [], []
    for i in range(n_updates):
        t, version = 0.5 * (i + 1), i + 1
        proto = protocols[i * len(protocols) // n_updates]
        loss = None if i == 3 else round(2.0 / version, 4)  # one missing train_loss
        ps_rows.append([t, version, proto, "0;1", 64, 1, 0.5, 0.1, loss, 30, 32, 34, round(0.01 * (i % 5), 3)])
        for w in range(2):
            worker_rows.append([t - 0.1, w, i, i, 30 + 4 * w, 0.05 + 0.01 * w, 0.002, 0.01, 0.0, loss])
    _write_csv(run_dir / "ps.csv", PS_HEADER, ps_rows)
    _write_csv(run_dir / "workers.csv", WORKERS_HEADER, worker_rows)
    _write_csv(run_dir / "eval.csv", EVAL_HEADER, [[t, int(2 * t), round(1 - a, 3), a] for t, a in eval_points])
    switches = [
        {"time_s": 0.5 * (1 + k * n_updates // len(protocols)), "event": "switch", "from": a, "to": b}
        for k, (a, b) in enumerate(zip(protocols, protocols[1:]), start=1)
    ]
    (run_dir / "events.jsonl").write_text("".join(json.dumps(e) + "\n" for e in switches))
    if summary:
        accs = [a for _, a in eval_points]
        (run_dir / "summary.json").write_text(json.dumps({
            "name": name,
            "protocol": "→".join(protocols),
            "final_test_accuracy": accs[-1] if accs else None,
            "best_test_accuracy": max(accs) if accs else None,
            "wall_time_s": 10.5,
            "updates": n_updates,
            "samples": 64 * n_updates,
            "pushes_accepted": 2 * n_updates,
            "pushes_rejected": 0,
            "pushes_dropped": 0,
            **(ran_on or {}),
        }))
    return run_dir


FAST = [(1.0, 0.5), (3.0, 0.8), (5.0, 0.9), (7.0, 0.93)]
SLOW = [(2.0, 0.4), (4.0, 0.6), (6.0, 0.85), (8.0, 0.91), (10.0, 0.89)]
NEVER = [(2.0, 0.3), (6.0, 0.7), (10.0, 0.75)]


def make_header_only(root: Path) -> Path:
    run_dir = root / "empty"
    run_dir.mkdir()
    for filename, header in (("ps.csv", PS_HEADER), ("workers.csv", WORKERS_HEADER), ("eval.csv", EVAL_HEADER)):
        _write_csv(run_dir / filename, header, [])
    (run_dir / "events.jsonl").write_text("")
    (run_dir / "summary.json").write_text(json.dumps({
        "name": "empty", "protocol": "asp", "final_test_accuracy": None, "best_test_accuracy": None,
        "wall_time_s": None, "updates": 0,
    }))
    return run_dir


def assert_png(path: Path) -> None:
    data = path.read_bytes()
    assert len(data) > 1000 and data.startswith(PNG_SIGNATURE), path


def test_read_csv_types(tmp_path: Path) -> None:
    run_dir = make_run(tmp_path, "r", "r", FAST, protocols=("bsp", "asp"))
    ps = read_csv(run_dir / "ps.csv")
    assert list(ps) == PS_HEADER.split(",")
    assert ps["version"].dtype.kind == "f" and ps["version"][:3].tolist() == [1.0, 2.0, 3.0]
    assert np.isnan(ps["train_loss"][3]) and ps["train_loss"][0] == pytest.approx(2.0)
    assert ps["protocol"].dtype.kind == "U" and ps["protocol"][0] == "bsp" and ps["protocol"][-1] == "asp"
    assert ps["workers"][0] == "0;1"

    header_only = read_csv(make_header_only(tmp_path) / "eval.csv")
    assert list(header_only) == EVAL_HEADER.split(",")
    assert all(col.size == 0 for col in header_only.values())

    (tmp_path / "blank.csv").write_text("")
    assert read_csv(tmp_path / "blank.csv") == {}
    assert read_csv(tmp_path / "missing.csv") == {}


def test_time_to_target() -> None:
    t = np.array([2.0, 4.0, 6.0, 8.0, 10.0])
    acc = np.array([0.4, 0.6, 0.92, 0.85, 0.95])
    assert time_to_target(t, acc, 0.9) == 6.0
    assert time_to_target(t, acc, 0.6) == 4.0  # >= counts
    assert time_to_target(t, acc, 0.99) is None
    assert time_to_target(t[::-1], acc[::-1], 0.9) == 6.0  # ordered by time, not by row
    assert time_to_target(np.array([1.0, 2.0]), np.array([np.nan, 0.95]), 0.9) == 2.0
    assert time_to_target(np.array([]), np.array([]), 0.5) is None


def test_load_result(tmp_path: Path) -> None:
    result = load_result(make_run(tmp_path, "fast_dir", "fast", FAST, protocols=("bsp", "asp")), 0.9)
    assert result == RunResult(
        name="fast", run_dir=tmp_path / "fast_dir", protocol="bsp→asp", final_accuracy=0.93,
        best_accuracy=0.93, wall_time_s=10.5, updates=20, time_to_target_s=5.0,
    )

    # Without summary.json: name from config.yaml, protocol phases and numbers from the CSVs.
    fallback = load_result(make_run(tmp_path, "slow_dir", "slow", SLOW, ("ssp", "amb"), summary=False), 0.9)
    assert (fallback.name, fallback.protocol, fallback.updates) == ("slow", "ssp→amb", 20)
    assert fallback.final_accuracy == 0.89 and fallback.best_accuracy == 0.91
    assert fallback.wall_time_s == 10.0 and fallback.time_to_target_s == 8.0

    empty = load_result(make_header_only(tmp_path), 0.9)
    assert (empty.name, empty.protocol, empty.updates) == ("empty", "asp", 0)
    assert empty.final_accuracy is empty.best_accuracy is empty.wall_time_s is empty.time_to_target_s is None


def test_plot_run_writes_all_pngs(tmp_path: Path) -> None:
    run_dir = make_run(tmp_path, "r", "switching", FAST, protocols=("bsp", "asp", "ssp"))
    written = plot_run(run_dir)
    assert [p.name for p in written] == list(PLOT_FILES)
    assert sorted(p.name for p in (run_dir / "plots").iterdir()) == sorted(PLOT_FILES)
    for path in written:
        assert path.parent == run_dir / "plots"
        assert_png(path)

    custom = plot_run(run_dir, tmp_path / "elsewhere")
    assert {p.parent for p in custom} == {tmp_path / "elsewhere"} and len(custom) == len(PLOT_FILES)


def test_plot_run_skips_empty_data(tmp_path: Path) -> None:
    assert plot_run(make_header_only(tmp_path), tmp_path / "out_empty") == []
    assert not (tmp_path / "out_empty").exists()  # no plots, no directory

    run_dir = make_run(tmp_path, "no_eval", "no_eval", [])
    written = plot_run(run_dir)
    assert [p.name for p in written] == [f for f in PLOT_FILES if not f.startswith("accuracy_")]
    for path in written:
        assert_png(path)


def test_compare_runs_and_table(tmp_path: Path) -> None:
    dirs = [
        make_run(tmp_path, "a", "mnist", FAST, protocols=("bsp", "asp"),
                 ran_on={"framework": "tensorflow", "device": "cpu", "ps_shards": 3, "hosts": 2}),
        make_run(tmp_path, "b", "slow", SLOW, protocols=("ssp",),
                 ran_on={"framework": "tensorflow", "device": "emulated", "emulated_device": {"samples_per_s": 800.0},
                         "ps_shards": 1, "hosts": 1}),
        make_run(tmp_path, "c", "mnist", NEVER, protocols=("amb",)),  # from before summary.json said what it ran on
    ]
    out = tmp_path / "cmp" / "compare.png"
    results = compare_runs(dirs, 0.9, out)
    assert_png(out)
    assert [r.time_to_target_s for r in results] == [5.0, 8.0, None]
    assert [r.protocol for r in results] == ["bsp→asp", "ssp", "amb"]

    rows = compare_rows(*dirs, "--target", "0.9", "--out", str(tmp_path / "cli.png"))
    assert rows["run"] == ["protocol", "final acc", "best acc", "wall time (s)", "updates", "time to 0.9 (s)",
                           "framework", "device", "PS shards", "hosts"]
    assert rows["mnist (a)"] == ["bsp→asp", "0.9300", "0.9300", "10.5", "20", "5.0", "tensorflow", "cpu", "3", "2"]
    assert rows["slow"] == ["ssp", "0.8900", "0.9100", "10.5", "20", "8.0", "tensorflow",
                            "emulated, 800 samples/s", "1", "1"]
    assert rows["mnist (c)"] == ["amb", "0.7500", "0.7500", "10.5", "20", "—", "—", "—", "—", "—"]
    assert_png(tmp_path / "cli.png")


def compare_rows(*args: str | Path) -> dict[str, list[str]]:
    """``switchps compare ARGS``'s table (its header row too) as run -> the other cells."""
    proc = subprocess.run([SWITCHPS, "compare", *map(str, args)], capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stderr[-3000:]
    lines = [line.replace("┃", "│") for line in proc.stdout.splitlines()]
    return {cells[0]: cells[1:] for line in lines if line.count("│") == 12
            for cells in [[c.strip() for c in line.split("│")[1:-1]]]}
