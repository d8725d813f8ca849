"""Simulated workers: each step is the worker's own ``StepRunner`` under the worker's own straggler plan,
on a virtual clock, with a computer that keeps the sample indices the step drew instead of computing.

So the time a step takes (straggler sleep, micro-batches of ``micro_batch / samples_per_s`` each,
slowdown factors, AMB's time budget, the communication delay) comes from the one place it is written;
the simulator adds only the time and, later, the step's loss and gradient (``learner``).
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from switchps.config.run import RunConfig
from switchps.ps_server.core.events import StepReport, WorkOrder
from switchps.sim.loop import WorkerClock
from switchps.straggler_trace import StepDelays
from switchps.workload.data import share, share_size
from switchps.worker.steps import StepRunner, make_sampler
from switchps.worker.stragglers import StragglerInjector

NOTHING = np.empty(0, np.float32)


class Indices:
    """A ``worker.steps.Computer`` that computes nothing: it keeps the rows a step's micro-batches name, as
    rows of the training set (``rows``: the worker's share of them)."""

    def __init__(self, rows: np.ndarray) -> None:
        self.rows = rows
        self.parts: list[np.ndarray] = []

    def compute(self, rows: np.ndarray, micro_batch: int) -> tuple[np.ndarray, float]:
        self.parts.append(self.rows[rows])
        return NOTHING, 0.0

    def accumulate(self, rows: np.ndarray) -> None:
        self.parts.append(self.rows[rows])

    def finish(self) -> tuple[np.ndarray, float]:
        return NOTHING, 0.0

    def take(self) -> np.ndarray:
        """The step's rows, in the order it drew them; the next step starts afresh."""
        rows = self.parts[0] if len(self.parts) == 1 else np.concatenate(self.parts)
        self.parts = []
        return rows


@dataclass(eq=False)
class Work:
    """One worker step: what it drew and how long it took; its loss (and perhaps its gradient) is filled
    in when it is first needed."""

    worker: int
    step: int
    version: int
    rows: np.ndarray
    samples: int
    compute_s: float
    sleep_s: float
    exhausted: bool
    delays: StepDelays
    send_s: float
    wait_s: float
    done_at: float
    loss_sum: float | None = None
    grad: np.ndarray | None = None
    """Its gradient, when the call that scored it computed that too (the learner's, until it is done)."""

    def report(self) -> StepReport:
        """What the worker's push says about this step (its ``StepStats``)."""
        d = self.delays
        return StepReport(self.compute_s, self.sleep_s, self.send_s, self.wait_s, self.step, self.loss_sum or 0.0,
                          d.sleep_s, d.factor, d.comm_s, self.exhausted)


class SimWorker:
    """Worker ``index`` of ``cfg``: its data share, sampler, straggler plan and step counter, as
    ``worker.main.run_worker`` sets them up, over the training set's ``rows`` (``np.arange(n)``, shared by
    every worker: a share is a view of it)."""

    def __init__(self, cfg: RunConfig, index: int, rows: np.ndarray) -> None:
        n, workers = len(rows), cfg.cluster.num_workers
        rows = rows[share(n, index, workers, cfg.data.sampling)]
        self.index, self.registered = index, share_size(n, index, workers)
        self.clock, self.indices = WorkerClock(), Indices(rows)
        sampler = make_sampler(cfg.data.sampling, len(rows), cfg.seed, index)
        self.runner = StepRunner(self.indices, sampler, cfg.device.samples_per_s, self.clock)
        self.stragglers = StragglerInjector(cfg.stragglers, seed=cfg.seed, worker=index, num_workers=workers)
        self.step = 0
        self.started = 0.0  # when its first pull arrived: its straggler plan's time counts from then
        self.pushed_at = 0.0
        self.send_s = self.wait_s = 0.0  # the last push's round trip and wait, reported with the next one

    def begin(self, order: WorkOrder, now: float) -> Work:
        """Run a step under ``order``, received at ``now``: it pushes at ``done_at``."""
        self.clock.t = now
        delays = self.stragglers.plan(self.step, now - self.started)
        s = self.runner.run(order, now, delays)
        work = Work(self.index, self.step, order.version, self.indices.take(), s.samples, s.compute_s, s.sleep_s,
                    s.exhausted, delays, self.send_s, self.wait_s, self.clock.t)
        self.step += 1
        return work

    def replied(self, now: float, wait_s: float) -> None:
        """The reply to its push arrived at ``now``."""
        self.send_s, self.wait_s = now - self.pushed_at, wait_s
