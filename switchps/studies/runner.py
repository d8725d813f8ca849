"""`switchps study FILE`: run every arm of a study, ``repeats`` times, then report (``report``).

Each repeat runs the arms in the file's order with seed ``base.seed + repeat``. If the base has
stragglers, the repeat's first arm records their trace and the others replay it, so every arm of a
repeat faces the same delays. A finished run is listed in ``OUT/runs.jsonl``; an interrupted study run
again with the same ``--out`` skips the runs listed there and redoes only the one cut short. In
``mode: simulate`` every run is a simulation (``switchps.sim.run.simulate``). A ``sweep`` runs the whole
study once per value, into ``OUT/KEY=VALUE/``, then writes ``OUT/sweep.json`` and ``OUT/sweep.png``.
"""

from __future__ import annotations

import fcntl
import json
import os
from contextlib import contextmanager
from importlib.resources import files
from pathlib import Path
from typing import Any, Iterator

from switchps.config.run import RunConfig
from switchps.jsonfile import dumps
from switchps.launch.launcher import launch
from switchps.problems import ConfigError
from switchps.studies.report import report
from switchps.studies.spec import StudySpec
from switchps.studies.sweep import sweep_report

PACKAGED = ("amb-vs-fmb", "dynamic-batching", "local-steps-stragglers", "post-local-sgd", "scale", "sync-switch",
            "switch-config")


def packaged(name: str) -> Path:
    """The study file shipped as ``name`` (examples/studies/<name>.yaml)."""
    return Path(str(files("switchps.examples") / "studies" / f"{name}.yaml"))


def run_study(spec: StudySpec, out: Path, quiet: bool = True) -> dict[str, Any]:
    """Run what ``out`` has not finished yet, then write study.json and the figure, and print the table
    (for a sweep: each value's, then sweep.json and sweep.png). One study at a time writes to ``out``."""
    with locked(out):
        if spec.sweep is None:
            return run_point(spec, out, quiet)
        results = {point: run_point(study, out / point, quiet) for point, study in spec.points()}
        return sweep_report(spec, results, out)


@contextmanager
def locked(out: Path) -> Iterator[None]:
    """Hold ``out/.study.lock`` (an advisory lock the OS drops when the process ends, however it ends);
    ``ConfigError`` if another study holds it: two studies appending to one runs.jsonl would each
    skip or redo the other's runs."""
    out.mkdir(parents=True, exist_ok=True)
    with open(out / ".study.lock", "a+") as f:
        try:
            fcntl.flock(f, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            f.seek(0)
            holder = f.read().strip() or "?"
            raise ConfigError(f"--out: {out} is in use by another switchps study (pid {holder}); "
                              "wait for it or choose another --out") from None
        f.seek(0)
        f.truncate()
        f.write(f"{os.getpid()}\n")
        f.flush()
        yield


def run_point(spec: StudySpec, out: Path, quiet: bool) -> dict[str, Any]:
    """One study without a sweep: its runs, then its report."""
    out.mkdir(parents=True, exist_ok=True)
    done = finished_runs(out)
    for repeat in range(spec.repeats):
        trace: Path | None = None
        for i, arm in enumerate(spec.arms):
            run_dir = done.get((arm, repeat))
            if run_dir is None:
                cfg = spec.run_config(arm, repeat, out / "runs", trace if i else None)
                run_dir = run_one(cfg, spec.mode, quiet)
                with (out / "runs.jsonl").open("a") as f:
                    f.write(dumps({"arm": arm, "repeat": repeat, "run_dir": str(run_dir)}) + "\n")
                done[(arm, repeat)] = run_dir
            if i == 0 and (run_dir / "stragglers.csv").exists():
                trace = run_dir / "stragglers.csv"
    return report(spec, {k: v for k, v in done.items() if k[0] in spec.arms and k[1] < spec.repeats}, out)


def run_one(cfg: RunConfig, mode: str, quiet: bool) -> Path:
    """Run ``cfg`` for real or in simulation; its run directory."""
    if mode == "run":
        return launch(cfg, quiet=quiet)[0]
    from switchps.sim.run import simulate

    run_dir = cfg.new_run_dir()
    simulate(cfg, run_dir, quiet=quiet)
    return run_dir


def finished_runs(out: Path) -> dict[tuple[str, int], Path]:
    """(arm, repeat) -> run directory, for the runs of ``out`` that finished (their summary exists)."""
    listed = out / "runs.jsonl"
    runs = {}
    for line in listed.read_text().splitlines() if listed.exists() else []:
        r = json.loads(line)
        if (Path(r["run_dir"]) / "summary.json").exists():
            runs[(r["arm"], int(r["repeat"]))] = Path(r["run_dir"])
    return runs
