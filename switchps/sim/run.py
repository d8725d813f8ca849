"""``simulate``: one run of a config on virtual time, written as a normal run directory.

The directory holds what a real run's does (``config.yaml``, ``ps.csv``, ``workers.csv``, ``eval.csv``,
``events.jsonl``, ``summary.json``; ``stragglers.csv`` with stragglers), every time in it virtual: seconds
since training started. ``summary.json`` says ``device: simulated``, ``framework`` TensorFlow (None with
``time_only``: no model), ``ps_shards`` 1 (the simulated PS is one) and ``hosts`` None (no role runs on a
host), and adds ``simulated``, ``time_only``, ``virtual_time_s`` (training's virtual duration, which
``wall_time_s`` also is, as every tool reads it as the run's duration), ``sim_wall_s`` (the real seconds
the simulation took), ``sim_events``, ``interrupted`` and ``stalled`` (the run ended unfinished because nothing
could happen any more: under churn, every worker departed for good, or those left wait below
``cluster.workers.min``; ``events.jsonl`` says ``simulation_stalled``). Ctrl-C stops
the simulation between two events (or inside one): the record so far is written, with
``"interrupted": true``, and ``KeyboardInterrupt`` is raised again.
"""

from __future__ import annotations

import gc
import time
from pathlib import Path
from typing import Any

import numpy as np
from rich.console import Console
from rich.progress import BarColumn, Progress, TextColumn, TimeElapsedColumn

from switchps.config.run import RunConfig
from switchps.errors import RunDirError
from switchps.problems import ConfigError
from switchps.ps_server.link import DuplexLink
from switchps.optim.optimizers import optimizer_factory
from switchps.ps_server.records import RunRecorder
from switchps.ps_server.mlflow_log import live_log
from switchps.ps_server.drivers import RECORD_FILES, build_core, elapsed, prepare_run_dir, run_summary
from switchps.sim.driver import Drive, Simulator
from switchps.sim.learner import Learner, TimeOnly
from switchps.sim.loop import Loop
from switchps.workload.data import configured_dataset

EVENTS_PER_TURN = 2000
"""Events between two looks at the progress bar and the record's buffers."""
REFRESH_S = 0.2
"""The progress bar is redrawn at most this often (by this thread: rich's own refresh thread is off)."""


def simulate(cfg: RunConfig, run_dir: Path, *, time_only: bool = False, quiet: bool = True) -> dict[str, Any]:
    """Simulate ``cfg`` to the end, write the run directory ``run_dir`` and return its summary (what
    ``summary.json`` holds). ``time_only``: no model and no TensorFlow (losses 0, no evaluation).
    Raises ``ConfigError`` before anything starts for a config a simulation cannot run, ``RunDirError``
    for a ``run_dir`` that holds a run."""
    check(cfg, time_only)
    if any((run_dir / name).exists() for name in RECORD_FILES):  # a simulation cannot resume one
        raise RunDirError(f"{run_dir} already holds a run; choose another --run-dir")
    learner, n, variables = _learner(cfg, time_only)
    if cfg.data.sampling == "partition" and cfg.cluster.num_workers > n:
        raise ConfigError(f"data.sampling: {cfg.cluster.num_workers} workers cannot each have a partition of "
                          f"{n} training samples; use replacement")
    prepare_run_dir(cfg, run_dir, resume=False)
    loop = Loop()
    rec = RunRecorder(run_dir, trace=cfg.stragglers.active, flush_every_s=None, clock=lambda: loop.now,
                      mlflow=live_log(cfg, run_dir))
    link = DuplexLink(cfg.network.ps_link_mbit_s) if cfg.network.ps_link_mbit_s else None
    optimizer = optimizer_factory(cfg.optimizer)(learner.trainable)
    optimizer.set_variables(variables)  # per-variable clipping's boundaries
    parts = Drive(build_core(cfg), learner, optimizer, rec, np.arange(n), link)
    sim = Simulator(cfg, parts, loop)
    started, interrupted = time.monotonic(), False
    # While the loop runs, what exists before it (the workers, their generators, the model, TensorFlow's
    # objects) is frozen out of the cyclic collector, whose full collections otherwise traverse all of it
    # again and again: at 10,000 workers 3 s of 11 (time only, 100,000 worker steps), 1.1 s frozen.
    # Reference counting still frees frozen objects; ``unfreeze`` hands them back when the run ends.
    freeze = gc.get_freeze_count() == 0  # a caller's own freeze is left alone
    if freeze:
        gc.freeze()
    try:
        sim.start()
        _drive(cfg, sim, quiet)
    except KeyboardInterrupt:
        interrupted = True
    finally:
        if freeze:
            gc.unfreeze()
    summary = rec.close(_summary(cfg, sim, time.monotonic() - started, time_only, interrupted))
    if interrupted:
        raise KeyboardInterrupt
    return summary


def check(cfg: RunConfig, time_only: bool) -> None:
    """Raise ``ConfigError`` for what a simulation cannot do: time without a device model, or a link's
    transfers without a model to size them."""
    if cfg.device.samples_per_s is None:
        raise ConfigError("device.samples_per_s: required by a simulation, whose compute time comes from the "
                          "device model alone (e.g. --set device.samples_per_s=2000)")
    if time_only and cfg.network.ps_link_mbit_s is not None:
        raise ConfigError("network.ps_link_mbit_s: a time-only simulation has no model to size the link's "
                          "transfers; simulate with gradients, or without the link")


def _learner(cfg: RunConfig, time_only: bool) -> tuple[Learner, int, list[int]]:
    """The model's side of the simulation, the number of training samples and the trainable variables' sizes."""
    if time_only:
        return TimeOnly(), len(configured_dataset(cfg).x_train), []
    from switchps.sim.gradients import real_learner

    learner = real_learner(cfg)
    return learner, learner.gc.samples, learner.variables


def _drive(cfg: RunConfig, sim: Simulator, quiet: bool) -> None:
    """Run the loop to its end, flushing the record and redrawing the progress bar between turns."""
    loop, core = sim.loop, sim.core
    columns = [TextColumn("[bold]{task.description}"), BarColumn(), TextColumn("{task.percentage:>3.0f}%"),
               TextColumn("virtual {task.fields[virtual]}  v{task.fields[version]} {task.fields[protocol]}"),
               TextColumn("wall"), TimeElapsedColumn()]
    with Progress(*columns, console=Console(stderr=True), disable=quiet, auto_refresh=False) as bar:
        task = bar.add_task(f"{cfg.name} (simulated)", total=1.0, virtual="0s", version=0, protocol=cfg.protocol.name)
        drawn = 0.0
        while loop.run(EVENTS_PER_TURN):
            sim.rec.flush()
            if not quiet and time.monotonic() - drawn >= REFRESH_S:
                bar.update(task, completed=core.progress(loop.now), virtual=f"{loop.now:.1f}s", version=core.version,
                           protocol=core.spec.name)
                bar.refresh()
                drawn = time.monotonic()
        bar.update(task, completed=1.0, virtual=f"{loop.now:.1f}s", version=core.version, protocol=core.spec.name)
        bar.refresh()
    if not core.done:  # nothing can happen any more: every worker departed for good, or waits for one
        sim.rec.event("simulation_stalled", version=core.version, members=core.members.num_workers)


def _summary(cfg: RunConfig, sim: Simulator, wall_s: float, time_only: bool, interrupted: bool) -> dict[str, Any]:
    core, now = sim.core, sim.loop.now
    return {**run_summary(cfg, core, sim.rec, now, final=sim.final, link=sim.parts.link, told_stop=sim.told_stop,
                          checkpoints=None),
            "framework": None if time_only else cfg.model.framework, "device": "simulated",
            "ps_shards": 1, "hosts": None,  # one PS on a virtual clock, whatever cluster.ps lists; no role runs
            "simulated": True, "time_only": time_only,
            "virtual_time_s": round(elapsed(core, now), 6),
            "sim_wall_s": round(wall_s, 3), "sim_events": sim.loop.events, "interrupted": interrupted,
            "stalled": not (core.done or interrupted)}
