"""Tests for switchps.runs.plots on synthetic run directories."""

from __future__ import annotations

import json
import struct
import subprocess
from collections.abc import Sequence
from pathlib import Path

import numpy as np
import pytest

from matplotlib.axes import Axes
from matplotlib.lines import Line2D
from matplotlib.patches import Rectangle

from switchps.runs.compare import RunResult, compare_runs, comparison, load_result, time_to_target
from switchps.runs.plots import DPI, PLOT_FILES, plot_run, run_figures
from switchps.runs.record import Run, read_csv

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


def png_size(path: Path) -> tuple[int, int]:
    """A PNG's (width, height) in pixels, from its IHDR chunk."""
    data = path.read_bytes()
    assert data.startswith(PNG_SIGNATURE) and data[12:16] == b"IHDR", path
    return struct.unpack(">II", data[16:24])


def xy(ln: Line2D) -> tuple[list[float], list[float]]:
    """A line's (x, y) data."""
    return np.asarray(ln.get_xdata(), float).tolist(), np.asarray(ln.get_ydata(), float).tolist()


def line(ax: Axes, label: str) -> tuple[list[float], list[float]]:
    """The (x, y) data of the line labelled ``label``."""
    (found,) = [ln for ln in ax.lines if ln.get_label() == label]
    return xy(found)


def phases(ax: Axes) -> list[tuple[str, float, float]]:
    """The shaded protocol bands: (legend label, start, end)."""
    bands = [p for p in ax.patches if isinstance(p, Rectangle)]
    assert len(bands) == len(ax.patches)
    return [(str(p.get_label()), p.get_x(), p.get_x() + p.get_width()) for p in bands]


def bars(ax: Axes) -> dict[str, list[tuple[float, float, float]]]:
    """Each histogram's non-empty bars (one histogram per worker when stacked) by its legend label:
    (left, right, count)."""
    return {c[0].get_label(): [(b.get_x(), b.get_x() + b.get_width(), b.get_height()) for b in c if b.get_height()]
            for c in ax.containers}


T = [0.5 * (i + 1) for i in range(20)]  # make_run: update i at 0.5 (i + 1) s is version i + 1
VERSIONS = [float(i + 1) for i in range(20)]
LOSS = [round(2.0 / v, 4) for v in VERSIONS]
HAS_LOSS = [i for i in range(20) if i != 3]  # make_run leaves update 3's train_loss out


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


def test_each_plot_draws_its_columns_over_the_protocol_phases(tmp_path: Path) -> None:
    figures = run_figures(Run.load(make_run(tmp_path, "r", "switching", FAST, protocols=("bsp", "asp", "ssp"))))
    assert list(figures) == list(PLOT_FILES)
    ax = {name: fig.axes[0] for name, fig in figures.items() if fig is not None}
    assert len(ax) == len(PLOT_FILES)
    eval_t, acc = [t for t, _ in FAST], [a for _, a in FAST]
    by_time = [("bsp phase", 0.0, 4.0), ("asp phase", 4.0, 7.5), ("ssp phase", 7.5, 10.0)]  # updates 1-7, 8-14, 15-20
    by_version = [("bsp phase", 0.0, 8.0), ("asp phase", 8.0, 15.0), ("ssp phase", 15.0, 20.0)]

    assert line(ax["accuracy_vs_time.png"], "test accuracy") == (eval_t, acc)
    assert phases(ax["accuracy_vs_time.png"]) == by_time
    assert line(ax["accuracy_vs_version.png"], "test accuracy") == ([2 * t for t in eval_t], acc)
    assert phases(ax["accuracy_vs_version.png"]) == by_version
    assert line(ax["loss_vs_step.png"], "train loss (ps updates)") == ([VERSIONS[i] for i in HAS_LOSS],
                                                                       [LOSS[i] for i in HAS_LOSS])
    assert line(ax["loss_vs_step.png"], "test loss (eval)") == ([2 * t for t in eval_t], [round(1 - a, 3) for a in acc])
    assert line(ax["loss_vs_time.png"], "training loss") == ([T[i] for i in HAS_LOSS], [LOSS[i] for i in HAS_LOSS])
    assert ax["loss_vs_time.png"].get_yscale() == "log" and phases(ax["loss_vs_time.png"]) == by_time
    assert line(ax["lr_vs_step.png"], "learning rate") == (VERSIONS, [0.1] * 20)
    assert phases(ax["lr_vs_step.png"]) == by_version
    assert line(ax["step_vs_time.png"], "model version") == (T, VERSIONS)
    assert phases(ax["step_vs_time.png"]) == by_time

    # per worker, step 0 left out as warm-up: 19 steps each, worker 0 at 30 samples and 0.05 s, worker 1 at 34, 0.06 s
    assert bars(ax["samples_hist.png"]) == {"worker 0": [(29.5, 30.5, 19)], "worker 1": [(33.5, 34.5, 19)]}
    compute = bars(ax["compute_time_hist.png"])
    assert [(w, n) for w, ((_, _, n),) in compute.items()] == [("worker 0", 19), ("worker 1", 19)]
    for (lo, hi, _), seconds in zip((b for (b,) in compute.values()), (0.05, 0.06)):
        assert lo <= seconds <= hi
    waits = ax["wait_time_hist.png"]  # 0.00, 0.01, ..., 0.04, four times each
    assert [n for _, _, n in bars(waits)["_nolegend_"]] == [4] * 5 and "(n=20)" in waits.get_title()
    assert line(waits, "mean 0.02")[0] == pytest.approx([0.02, 0.02]) and line(waits, "median 0.02")[0] == [0.02] * 2
    assert bars(ax["staleness_hist.png"]) == {"_nolegend_": [(0.5, 1.5, 20)]}


def test_plot_run_writes_all_pngs(tmp_path: Path) -> None:
    run_dir = make_run(tmp_path, "r", "switching", FAST, protocols=("bsp", "asp", "ssp"))
    written = plot_run(run_dir)
    assert [p.name for p in written] == list(PLOT_FILES)
    assert sorted(p.name for p in (run_dir / "plots").iterdir()) == sorted(PLOT_FILES)
    sizes = {name: (round(w * DPI), round(h * DPI))
             for name, fig in run_figures(Run.load(run_dir)).items() if fig is not None
             for w, h in [fig.get_size_inches()]}
    for path in written:
        assert path.parent == run_dir / "plots"
        assert png_size(path) == sizes[path.name], "each file is its own figure"

    custom = plot_run(run_dir, tmp_path / "elsewhere")
    assert {p.parent for p in custom} == {tmp_path / "elsewhere"} and len(custom) == len(PLOT_FILES)


def test_plot_run_skips_empty_data(tmp_path: Path) -> None:
    assert plot_run(make_header_only(tmp_path), tmp_path / "out_empty") == []
    assert not (tmp_path / "out_empty").exists()  # no plots, no directory

    run_dir = make_run(tmp_path, "no_eval", "no_eval", [])
    written = plot_run(run_dir)
    assert [p.name for p in written] == [f for f in PLOT_FILES if not f.startswith("accuracy_")]
    loss = run_figures(Run.load(run_dir))["loss_vs_step.png"]
    assert loss is not None and [ln.get_label() for ln in loss.axes[0].lines] == ["train loss (ps updates)"]


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
    assert png_size(out) == (13 * DPI, 9 * DPI)
    assert [r.time_to_target_s for r in results] == [5.0, 8.0, None]
    assert [r.protocol for r in results] == ["bsp→asp", "ssp", "amb"]

    _, fig = comparison(dirs, 0.9)
    by_time, by_version, loss, rate = fig.axes
    curves = [ln for ln in by_time.lines if ln.get_marker() == "o"]
    assert [xy(ln) for ln in curves] == [([t for t, _ in p], [a for _, a in p]) for p in (FAST, SLOW, NEVER)]
    assert [ln.get_label() for ln in curves] == ["mnist (a) [bsp→asp]", "slow [ssp]", "mnist (c) [amb]"]
    stars = [xy(ln) for ln in by_time.lines if ln.get_marker() == "*"]
    assert stars == [([5.0], [0.9]), ([8.0], [0.9])], "a star where each run first reached the target"
    assert [xy(ln)[0] for ln in by_version.lines[:3]] == [[2 * t for t, _ in p] for p in (FAST, SLOW, NEVER)]
    assert all(xy(ln)[1] == [LOSS[i] for i in HAS_LOSS] for ln in loss.lines)
    for ln in rate.lines:  # 64 samples an update, an update every 0.5 s (the last, at 10 s, in the last bin)
        x, y = xy(ln)
        assert x == [2.0, 4.0, 6.0, 8.0, 10.0] and sum(y) * 2.0 == 64 * 20 and y[1:4] == [128.0] * 3

    rows = compare_rows(*dirs, "--target", "0.9", "--out", str(tmp_path / "cli.png"))
    assert rows["run"] == ["protocol", "final acc", "best acc", "wall time (s)", "updates", "time to 0.9 (s)",
                           "framework", "device", "PS shards", "hosts"]
    assert rows["mnist (a)"] == ["bsp→asp", "0.9300", "0.9300", "10.5", "20", "5.0", "tensorflow", "cpu", "3", "2"]
    assert rows["slow"] == ["ssp", "0.8900", "0.9100", "10.5", "20", "8.0", "tensorflow",
                            "emulated, 800 samples/s", "1", "1"]
    assert rows["mnist (c)"] == ["amb", "0.7500", "0.7500", "10.5", "20", "—", "—", "—", "—", "—"]
    assert png_size(tmp_path / "cli.png") == (13 * DPI, 9 * DPI)


def compare_rows(*args: str | Path) -> dict[str, list[str]]:
    """``switchps compare ARGS``'s table (its header row too) as run -> the other cells."""
    proc = subprocess.run([SWITCHPS, "compare", *map(str, args)], capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stderr[-3000:]
    lines = [line.replace("┃", "│") for line in proc.stdout.splitlines()]
    return {cells[0]: cells[1:] for line in lines if line.count("│") == 12
            for cells in [[c.strip() for c in line.split("│")[1:-1]]]}
