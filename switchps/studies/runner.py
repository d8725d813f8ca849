"""`switchps study FILE`: run every arm of a study, ``repeats`` times, then report (``report``).

Each repeat runs the arms in the file's order with seed ``base.seed + repeat``. If the base has
stragglers, the repeat's first arm records their trace and the others replay it, so every arm of a
repeat faces the same delays. A finished run is listed in ``OUT/runs.jsonl``; an interrupted study run
again with the same ``--out`` skips the runs listed there and redoes only the one cut short. In
``mode: simulate`` every run is a simulation (``switchps.sim.run.simulate``). A ``sweep`` runs the whole
study once per value, into ``OUT/KEY=VALUE/``, then writes ``OUT/sweep.json`` and ``OUT/sweep.png``.

With ``jobs`` > 1 the repeats left to run go to that many processes (``spawn``ed: never a fork of a
process that may hold TensorFlow or torch), one repeat, all its arms in order, at a time each; the
sweep's values still run one after another. Each run is seeded by its repeat, so the results do not
depend on ``jobs``. Only this process writes ``runs.jsonl``, a line as each run finishes.
"""

from __future__ import annotations

import fcntl
import json
import multiprocessing
import os
import time
from concurrent.futures import FIRST_COMPLETED, ProcessPoolExecutor, wait
from contextlib import contextmanager
from dataclasses import dataclass
from importlib.resources import files
from multiprocessing.queues import SimpleQueue
from pathlib import Path
from typing import Any, Callable, Iterator, Mapping

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


@dataclass(frozen=True)
class FinishedRun:
    """A run that finished: what ``runs.jsonl`` lists, and its real duration for the progress line."""

    arm: str
    repeat: int
    run_dir: Path
    wall_s: float


def run_study(spec: StudySpec, out: Path, quiet: bool = True, jobs: int = 1) -> dict[str, Any]:
    """Run what ``out`` has not finished yet (``jobs`` repeats at a time), then write study.json and the
    figure, and print the table (for a sweep: each value's, then sweep.json and sweep.png). One study at a
    time writes to ``out``."""
    with locked(out):
        if spec.sweep is None:
            return run_point(spec, out, quiet, jobs)
        results = {point: run_point(study, out / point, quiet, jobs) for point, study in spec.points()}
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


def run_point(spec: StudySpec, out: Path, quiet: bool, jobs: int = 1) -> dict[str, Any]:
    """One study without a sweep: its runs, then its report."""
    out.mkdir(parents=True, exist_ok=True)
    done = finished_runs(out)
    todo = [r for r in range(spec.repeats) if any((arm, r) not in done for arm in spec.arms)]
    parallel = jobs > 1 and len(todo) > 1

    def record(run: FinishedRun) -> None:
        with (out / "runs.jsonl").open("a") as f:
            f.write(dumps({"arm": run.arm, "repeat": run.repeat, "run_dir": str(run.run_dir)}) + "\n")
        done[(run.arm, run.repeat)] = run.run_dir
        if parallel and not quiet:  # the line in place of the run's own progress, which its process hides
            print(f"{run.arm} repeat {run.repeat}: {run.wall_s:.1f} s, {run.run_dir}", flush=True)

    if parallel:
        run_parallel(spec, out, todo, done, jobs, record)
    else:
        for repeat in todo:
            run_repeat(spec, out, repeat, done, quiet, record)
    return report(spec, {k: v for k, v in done.items() if k[0] in spec.arms and k[1] < spec.repeats}, out)


def run_repeat(spec: StudySpec, out: Path, repeat: int, done: Mapping[tuple[str, int], Path], quiet: bool,
               record: Callable[[FinishedRun], None]) -> None:
    """The arms of ``repeat`` that ``done`` lacks, in order (the first one's straggler trace is the others'),
    each ``record``ed as it finishes."""
    trace: Path | None = None
    for i, arm in enumerate(spec.arms):
        run_dir = done.get((arm, repeat))
        if run_dir is None:
            started = time.monotonic()
            cfg = spec.run_config(arm, repeat, out / "runs", trace if i else None)
            run_dir = run_one(cfg, spec.mode, quiet)
            record(FinishedRun(arm, repeat, run_dir, time.monotonic() - started))
        if i == 0 and (run_dir / "stragglers.csv").exists():
            trace = run_dir / "stragglers.csv"


def run_parallel(spec: StudySpec, out: Path, repeats: list[int], done: Mapping[tuple[str, int], Path], jobs: int,
                 record: Callable[[FinishedRun], None]) -> None:
    """``repeats`` in ``jobs`` processes, quiet; each run is ``record``ed here within a second of finishing.
    On an error or Ctrl-C no further repeat starts, and the ones running are waited for (a Ctrl-C at the
    terminal stops them too) and what they finished is recorded."""
    ctx = multiprocessing.get_context("spawn")
    finished: SimpleQueue[FinishedRun] = ctx.SimpleQueue()  # put() writes at once: before the repeat's result

    def drain() -> None:
        while not finished.empty():
            record(finished.get())

    pool = ProcessPoolExecutor(min(jobs, len(repeats)), mp_context=ctx, initializer=_report_to,
                               initargs=(finished,))
    try:
        pending = {pool.submit(_run_repeat_quietly, spec, out, r, {k: v for k, v in done.items() if k[1] == r})
                   for r in repeats}
        while pending:
            ended, pending = wait(pending, timeout=1.0, return_when=FIRST_COMPLETED)
            drain()
            for future in ended:
                future.result()  # a repeat's error, raised here
    finally:
        pool.shutdown(cancel_futures=True)
        drain()


_finished: SimpleQueue[FinishedRun] | None = None
"""In a process of ``run_parallel``'s pool: where its finished runs go."""


def _report_to(finished: SimpleQueue[FinishedRun]) -> None:
    global _finished
    _finished = finished


def _run_repeat_quietly(spec: StudySpec, out: Path, repeat: int, done: Mapping[tuple[str, int], Path]) -> None:
    assert _finished is not None, "run in run_parallel's pool"
    run_repeat(spec, out, repeat, done, True, _finished.put)


def run_one(cfg: RunConfig, mode: str, quiet: bool) -> Path:
    """Run ``cfg`` for real or in simulation; its run directory."""
    if mode == "run":
        return launch(cfg, quiet=quiet)[0]
    from switchps.sim.run import simulate

    run_dir = cfg.new_run_dir(claim=True)
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
