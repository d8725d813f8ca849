"""The worker process.

A worker builds its model with the run's framework and warms its gradient computer up (every TF function
traced, every torch kernel run), then registers
(ready), pulls, and loops: take the sample budget from its data partition, compute
Σ gradients over micro-batches, push them with the sample count and the
model's state, and obey the work order in the reply (which also carries the
fresh values). What it does with the PS (joining, pushing, riding out an outage) is a ``session.Session``,
which a user's own training loop shares (``worker.torch_loop``, which always pushes and waits).

With ``runtime.pipeline_depth`` 1, while its orders say ``pipeline`` (the PS decides, for the protocol in
force), a worker computes step k+1 on the values it has while push k is in flight on the session's thread,
then waits for reply k, sends push k+1 and loads reply k's values: its pushes are one step staler, and
say so (each carries the version of the values it was computed on). The concurrency contract, while push
k is in flight (it reads its payload and may write its reply buffer and the segment's areas):

- step k+1 writes its payload into the other of two private buffers (of the wire's type: the computer
  narrows it), never the segment's gradient area (the PS may still be reading it): a push through
  shared memory copies its payload there (one copy a step; gRPC bytes none beyond today's);
- the model runs at values no reply writes: push k's reply goes into the one of two private values
  buffers the model does not run at, or, through shared memory, is copied there out of the segment's
  values area (one copy a step; none through gRPC), and is staged from there. A computer that copies
  staged values away (a GPU's upload; ``Computer.settle``) is staged from where the reply landed, and
  the upload is waited for before the next push is sent: no host copy.

An order without ``pipeline`` (a switch to a round protocol) ends it: the step computed meanwhile is pushed
at once, as a stale push the PS's rules judge and count, and the worker pushes and waits again.

An order with ``local`` (local SGD, DiLoCo, any protocol with ``local_steps``; never ``pipeline``) is obeyed
by a round of local steps (``worker.local_steps``): the worker pushes what its private copy of the model moved
instead of a gradient, and waits. Orders switch between the two kinds at any step, in either direction.
"""

from __future__ import annotations

import logging
import os
import signal
import threading
from types import FrameType
from typing import Any

import numpy as np

from switchps.config.run import RunConfig
from switchps.protos import switchps_pb2 as pb
from switchps.protos import wire_dtype
from switchps.protos.codec import COPIES
from switchps.straggler_trace import StepDelays
from switchps.worker.client import Reply
from switchps.worker.local_steps import LocalRunner, local_stats
from switchps.worker.session import Session
from switchps.workload.data import registered_size, share
from switchps.workload.frameworks import Computer, framework
from switchps.worker.steps import Step, StepRunner, make_sampler
from switchps.worker.stragglers import StragglerInjector

log = logging.getLogger("switchps.worker")


def run_worker(cfg: RunConfig, index: int) -> int:
    """Train until the PS says stop; returns the number of steps taken."""
    gc, n = _computer(cfg, index)
    gc.warm_up(cfg.protocol.batch, cfg.protocol.micro_batch or cfg.protocol.batch)  # never inside a timed step
    ps = Session(cfg, index, gc.weights.layout(), gc.size, registered_size(n, index, cfg), gc.read,
                 framework=cfg.model.framework, device=str(gc.device), local_steps=True)
    _leave_on_sigterm(ps, index)
    try:
        params = gc.buffer()  # the framework reads the values a reply leaves here in place (as a segment's)
        reply = ps.pull(params)
        gc.assign(params)
        log.info("worker %d: %d samples, model v%d", index, gc.samples, reply.order.version)
        worker = Worker(cfg, index, gc, ps, params)
        while not ps.order.stop:
            if ps.order.HasField("local"):
                worker.local_round()
            elif cfg.runtime.pipeline_depth and ps.order.pipeline:
                worker.overlapped()
            else:
                worker.step()
    finally:
        ps.close()
        gc.close()
    return ps.step


def _leave_on_sigterm(ps: Session, index: int) -> None:
    """A worker stopped (`switchps scale`, a preemption's notice) tells the PS it leaves, then exits: an elastic
    run counts it gone at once. ``os._exit``, as on a Ctrl-C (``launch.role_commands.exit_on_sigint``): the
    signal may land inside a gRPC call, whose locks an orderly exit would wait on."""

    def handler(signum: int, frame: FrameType | None) -> None:
        os.write(2, f"switchps worker-{index}: stopped (SIGTERM), leaving the run\n".encode())
        ps.leave()
        os._exit(128 + signum)

    if threading.current_thread() is threading.main_thread():  # the process's own worker, not a test's thread
        signal.signal(signal.SIGTERM, handler)


class Worker:
    """Worker ``index``'s steps against its session ``ps``; see the module docstring."""

    def __init__(self, cfg: RunConfig, index: int, gc: Computer, ps: Session, params: np.ndarray) -> None:
        self.index, self.gc, self.ps, self.params = index, gc, ps, params
        self.wire = cfg.runtime.wire_dtype
        self.runner = StepRunner(gc, make_sampler(cfg.data.sampling, gc.samples, cfg.seed, index),
                                 cfg.device.samples_per_s, ps.clock)
        self.stragglers = StragglerInjector(cfg.stragglers, seed=cfg.seed, worker=index,
                                            num_workers=cfg.cluster.max_workers)
        self.local: LocalRunner | None = None  # made by the first order for local steps
        self.started = ps.received_at
        self.intervals = 0
        """Compute intervals so far (gradient steps and local steps): the straggler plan's step number."""
        self.warned: set[str] = set()
        self.staged: np.ndarray | None = None
        """The values the model runs at, read in place (None: assigned into the model, read from nowhere)."""
        self.values: tuple[np.ndarray, np.ndarray] | None = None  # overlapping: where replies' values go
        self.grads: tuple[np.ndarray, np.ndarray] | None = None  # overlapping: where steps' payloads go

    def step(self) -> None:
        """One step as without overlap: the payload written where the push sends it from, pushed, waited for."""
        ps = self.ps
        self.gc.payload_to = ps.payload_area
        s, delays = self._compute(ps.order, ps.received_at)
        reply = ps.push(s.grad, s.samples, self.params, **_stats(s, delays, overlapped=False))
        self._stage(reply)

    def local_round(self) -> None:
        """A round of local steps from the values the model runs at (``local_steps``), its movement pushed
        from where a step's payload is, waited for; then the model runs at the reply's values, or back at
        the start's if the reply brings none."""
        ps, order = self.ps, self.ps.order
        local = self.local = self.local or LocalRunner(self.runner, self.gc)
        start = self.staged if self.staged is not None else self.gc.read()
        r = local.run(order, local.spec(order.local.inner_optimizer), order.local.reset_inner_state, ps.received_at,
                      start, lambda: self._plan(ps.clock.now()), ps.payload_area)
        reply = ps.push(r.payload, r.samples, self.params, **local_stats(r.taken))
        if reply.fresh:
            self._stage(reply)
        else:
            self._stage_at(start)

    def overlapped(self) -> None:
        """Steps while the orders say ``pipeline``, each computed while the previous one's push is in flight;
        returns with no push in flight."""
        ps, clock = self.ps, self.ps.clock
        if self.values is None or self.grads is None:
            self.values = self.params, self.gc.buffer()
            self.grads = self._payload_buffer(), self._payload_buffer()
        order, base = ps.order, ps.order.version  # ``base``: the version of the values the model runs at
        self.gc.payload_to = self.grads[0]
        s, delays = self._compute(order, ps.received_at)
        its_base, overlapped, i = base, False, 0
        while True:
            into = self._unstaged()
            ps.send(s.grad, s.samples, into, base_version=its_base, **_stats(s, delays, overlapped))
            i ^= 1
            self.gc.payload_to = self.grads[i]
            s, delays = self._compute(order, clock.now())
            reply = ps.receive(since=clock.now())
            self._stage(reply, into)
            order, its_base, overlapped, base = reply.order, base, True, reply.order.version
            if order.stop:  # the step computed meanwhile is not pushed: training is over
                return
            if not order.pipeline:  # a round protocol from now on: the step computed meanwhile goes as it is
                self._stage(ps.push(s.grad, s.samples, self.params, base_version=its_base,
                                    **_stats(s, delays, overlapped)))
                return

    def _payload_buffer(self) -> np.ndarray:
        """A private payload buffer of the computer's kind (aligned; page-locked on a GPU), of the wire's type
        (the computer narrows the payload itself: a GPU on the device, half the bytes crossing)."""
        wide = self.gc.buffer()  # a narrow buffer in its memory: page-locked once, not at every step's copy
        return wide if self.wire == "float32" else wide.view(wire_dtype.STORAGE[self.wire])[: self.gc.size]

    def _compute(self, order: pb.WorkOrder, received_at: float) -> tuple[Step, StepDelays]:
        """A step under ``order``, received (or, overlapping, started) at ``received_at``."""
        delays = self._plan(received_at)
        s = self.runner.run(order, received_at, delays)
        _warn_once(self.warned, self.index, s, order, self.stragglers)
        return s, delays

    def _plan(self, t: float) -> StepDelays:
        """The straggler delays of the next compute interval, which starts at ``t``: each gradient step and
        each local step is one (without local steps, the push's step number)."""
        delays = self.stragglers.plan(self.intervals, t - self.started)
        self.intervals += 1
        return delays

    def _stage(self, reply: Reply, into: np.ndarray | None = None) -> None:
        """Run the model at a fresh reply's values (loaded inside the next step's gradient call, counted in its
        compute_s): read where they are, or (``into``, overlapping) first copied there out of the segment,
        so that they are staged once, from where the next reply does not write (a GPU's copy of them may
        still be reading them when it is sent)."""
        if not reply.fresh:
            return
        if into is None:
            self._stage_at(reply.values)
        elif self.gc.settle():  # it copies staged values away (a GPU): from where they are, waited for
            self.gc.stage(reply.values)
            self.gc.settle()
            self.staged = None  # the model runs at the device's copy: no host vector to keep
        else:
            self._stage_at(_copied(reply.values, into))

    def _stage_at(self, values: np.ndarray) -> None:
        self.gc.stage(values)
        self.staged = values

    def _unstaged(self) -> np.ndarray:
        """The private values buffer the model does not run at, for the reply of a push sent while the next
        step computes. Values staged in the segment (by a step before the overlap began), which that reply
        rewrites, are copied out first."""
        assert self.values is not None
        a, b = self.values
        if self.staged is not None and self.staged is not a and self.staged is not b:
            if self.gc.settle():  # on the device already
                self.staged = None
            else:
                self._stage_at(_copied(self.staged, a))
        return b if self.staged is a else a


def _copied(values: np.ndarray, into: np.ndarray) -> np.ndarray:
    """``values`` in ``into`` (copied, and counted, unless they are there already)."""
    if values is not into:
        np.copyto(into, values)
        COPIES.add(into.nbytes)
    return into


def _stats(s: Step, delays: StepDelays, overlapped: bool) -> dict[str, Any]:
    """A step's statistics, as its push reports them (``pb.StepStats``)."""
    return dict(compute_s=s.compute_s, sleep_s=s.sleep_s, loss_sum=s.loss_sum, delay_sleep_s=delays.sleep_s,
                delay_factor=delays.factor, delay_comm_s=delays.comm_s, batch_exhausted=s.exhausted,
                overlapped=overlapped)


def _computer(cfg: RunConfig, index: int) -> tuple[Computer, int]:
    """The model, holding this worker's share of the training set as tensors (the host copy is not kept);
    and the training set's size."""
    fw = framework(cfg.model.framework)
    data, model = fw.prepare(cfg, index)
    rows = share(len(data.x_train), index, cfg.cluster.max_workers, cfg.data.sampling)
    return fw.computer(cfg, model, data.x_train[rows], data.y_train[rows]), len(data.x_train)


def _warn_once(warned: set[str], index: int, s: Step, order: pb.WorkOrder, stragglers: StragglerInjector) -> None:
    """Say once per worker what the AMB code warns about, and when a replayed trace runs out."""
    if s.exhausted and "exhausted" not in warned:
        warned.add("exhausted")
        log.warning("worker %d: max_batch (%d) ran out before the time budget (%.3gs); increase max_batch "
                    "or decrease time_budget_s (counted in summary.json)", index, order.sample_budget,
                    order.time_budget_s)
    if stragglers.beyond_trace and "trace" not in warned:
        warned.add("trace")
        log.warning("worker %d: the straggler trace has no more steps; no further delays", index)
