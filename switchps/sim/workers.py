"""Simulated workers: each step is the worker's own ``StepRunner`` under the worker's own straggler plan,
on a virtual clock, with a computer that keeps the sample indices the step drew instead of computing.

So the time a step takes (straggler sleep, micro-batches of ``micro_batch / samples_per_s`` each,
slowdown factors, AMB's time budget, the communication delay) comes from the one place it is written;
the simulator adds only the time and, later, the step's loss and gradient (``learner``).

An order with local steps (``WorkOrder.local``) is that many compute intervals, each a ``StepRunner`` step
of ``batch`` samples under a straggler plan of its own (a local step is drawn as a gradient step is), then
one push of all their samples: under a time budget T (anytime local SGD), local steps start while T lasts,
at least one and at most H, as ``worker.steps.Budget`` starts micro-batches. The communication delay is
slept once, before the push. Straggler plans are drawn per compute interval (``SimWorker.intervals``, which
is the step for gradient steps alone), and the push reports its local steps' summed planned sleep, the last
one's factor and its communication delay.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, replace

import numpy as np

from switchps.config.run import RunConfig
from switchps.ps_server.core.events import Local, StepReport, WorkOrder
from switchps.sim.loop import WorkerClock
from switchps.straggler_trace import StepDelays
from switchps.workload.data import registered_size, share
from switchps.worker.steps import Budget, StepRunner, make_sampler
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
    """Its gradient, when the call that scored it computed that too; with local steps, its payload (the
    learner's, until it is done)."""
    local: Local | None = None
    """The order's local steps (None: a gradient step)."""
    local_steps: int = 0
    """Local steps taken (``rows`` holds ``samples / local_steps`` rows for each, in order)."""
    local_losses: tuple[float, ...] = ()
    """Each local step's summed loss, when a learner computed them."""

    def report(self) -> StepReport:
        """What the worker's push says about this step (its ``StepStats``)."""
        d = self.delays
        return StepReport(self.compute_s, self.sleep_s, self.send_s, self.wait_s, self.step, self.loss_sum or 0.0,
                          d.sleep_s, d.factor, d.comm_s, self.exhausted, self.local_steps,
                          local_loss_sums=self.local_losses)


class SimWorker:
    """Worker ``index`` of ``cfg``: its data share, sampler, straggler plan and step counter, as
    ``worker.main.run_worker`` sets them up, over the training set's ``rows`` (``np.arange(n)``, shared by
    every worker: a share is a view of it).

    Under churn a worker departs and may come back: ``life`` counts its departures, and what was under way
    when it departed (a step, a pull or a reply crossing the link) belongs to an older life and is
    discarded. It comes back as the same process would resume: its sampler, straggler plans and step
    counter go on (a push's step never repeats one the PS has seen)."""

    def __init__(self, cfg: RunConfig, index: int, rows: np.ndarray) -> None:
        n, workers = len(rows), cfg.cluster.max_workers
        rows = rows[share(n, index, workers, cfg.data.sampling)]
        self.index, self.registered = index, registered_size(n, index, cfg)
        self.clock, self.indices = WorkerClock(), Indices(rows)
        sampler = make_sampler(cfg.data.sampling, len(rows), cfg.seed, index)
        self.runner = StepRunner(self.indices, sampler, cfg.device.samples_per_s, self.clock)
        self.stragglers = StragglerInjector(cfg.stragglers, seed=cfg.seed, worker=index, num_workers=workers)
        self.step = 0  # pushes so far
        self.intervals = 0  # compute intervals so far (a gradient step is one, a local step one): straggler plans
        self.started = 0.0  # when its first pull arrived: its straggler plan's time counts from then
        self.pushed_at = 0.0
        self.send_s = self.wait_s = 0.0  # the last push's round trip and wait, reported with the next one
        self.life = 0  # departures so far
        self.running = False  # between its registration and its departure

    def depart(self) -> None:
        """It stops: what it had under way is lost."""
        self.life, self.running = self.life + 1, False

    def arrive(self) -> None:
        """It (re)starts, with no push of this life to report a round trip for."""
        self.running, self.send_s, self.wait_s = True, 0.0, 0.0

    def begin(self, order: WorkOrder, now: float) -> Work:
        """Run a step under ``order``, received at ``now``: it pushes at ``done_at``."""
        self.clock.t = now
        if order.local is not None:
            return self._local(order, order.local, now)
        delays = self._plan()
        s = self.runner.run(order, now, delays)
        return self._work(order, s.samples, s.compute_s, s.sleep_s, s.exhausted, delays)

    def _local(self, order: WorkOrder, local: Local, now: float) -> Work:
        """Local steps under ``order``: each a step of ``local.batch`` samples with its own straggler plan,
        while the time budget lasts (at least one, at most ``local.steps``); then the communication delay."""
        end = math.inf if order.time_budget_s is None else now + order.time_budget_s
        budget = Budget(local.steps * local.batch, local.batch, end)  # a local step is its "micro-batch"
        one = replace(order, sample_budget=local.batch, time_budget_s=None, local=None)
        compute = slept = planned = 0.0
        delays = StepDelays()
        while budget.next(self.clock.t):
            delays = self._plan()
            s = self.runner.run(one, self.clock.t, StepDelays(delays.sleep_s, delays.factor))  # no comm delay yet
            compute, slept, planned = compute + s.compute_s, slept + s.sleep_s, planned + delays.sleep_s
            budget.done += s.samples
        self.clock.sleep(delays.comm_s)
        work = self._work(order, budget.done, compute, slept + delays.comm_s, budget.exhausted(self.clock.t),
                          StepDelays(planned, delays.factor, delays.comm_s))
        work.local, work.local_steps = local, budget.done // local.batch
        return work

    def _plan(self) -> StepDelays:
        """The straggler plan of the next compute interval, which starts now."""
        delays = self.stragglers.plan(self.intervals, self.clock.t - self.started)
        self.intervals += 1
        return delays

    def _work(self, order: WorkOrder, samples: int, compute_s: float, sleep_s: float, exhausted: bool,
              delays: StepDelays) -> Work:
        """The step just run, which pushes now."""
        work = Work(self.index, self.step, order.version, self.indices.take(), samples, compute_s, sleep_s,
                    exhausted, delays, self.send_s, self.wait_s, self.clock.t)
        self.step += 1
        return work

    def replied(self, now: float, wait_s: float) -> None:
        """The reply to its push arrived at ``now``."""
        self.send_s, self.wait_s = now - self.pushed_at, wait_s
