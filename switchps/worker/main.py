"""The worker process.

A worker builds its model with the run's framework and warms its gradient computer up (every TF function
traced, every torch kernel run), then registers
(ready), pulls, and loops: take the sample budget from its data partition, compute
Σ gradients over micro-batches, push them with the sample count and the
model's state, and obey the work order in the reply (which also carries the
fresh values). What it does with the PS (joining, pushing, riding out an outage) is a ``session.Session``,
which a user's own training loop shares (``worker.torch_loop``).
"""

from __future__ import annotations

import logging

from switchps.config.run import RunConfig
from switchps.protos import switchps_pb2 as pb
from switchps.worker.session import Session
from switchps.workload.data import share, share_size
from switchps.workload.frameworks import Computer, framework
from switchps.worker.steps import Step, StepRunner, make_sampler
from switchps.worker.stragglers import StragglerInjector

log = logging.getLogger("switchps.worker")


def run_worker(cfg: RunConfig, index: int) -> int:
    """Train until the PS says stop; returns the number of steps taken."""
    gc, n = _computer(cfg, index)
    gc.warm_up(cfg.protocol.batch, cfg.protocol.micro_batch or cfg.protocol.batch)  # never inside a timed step
    ps = Session(cfg, index, gc.weights.layout(), gc.size, share_size(n, index, cfg.cluster.num_workers), gc.read,
                 framework=cfg.model.framework, device=str(gc.device))
    params = gc.buffer()  # the framework reads the values a reply leaves here in place (as a segment's)
    reply = ps.pull(params)
    started = ps.received_at
    gc.assign(params)
    log.info("worker %d: %d samples, model v%d", index, gc.samples, reply.order.version)
    runner = StepRunner(gc, make_sampler(cfg.data.sampling, gc.samples, cfg.seed, index), cfg.device.samples_per_s,
                        ps.clock)
    stragglers = StragglerInjector(cfg.stragglers, seed=cfg.seed, worker=index, num_workers=cfg.cluster.num_workers)
    warned: set[str] = set()
    while not ps.order.stop:
        order = ps.order
        delays = stragglers.plan(ps.step, ps.received_at - started)
        gc.payload_to = ps.payload_area  # the step writes its payload where the push sends it from
        s = runner.run(order, ps.received_at, delays)
        _warn_once(warned, index, s, order, stragglers)
        reply = ps.push(s.grad, s.samples, params, compute_s=s.compute_s, sleep_s=s.sleep_s, loss_sum=s.loss_sum,
                        delay_sleep_s=delays.sleep_s, delay_factor=delays.factor, delay_comm_s=delays.comm_s,
                        batch_exhausted=s.exhausted)
        if reply.fresh:  # loaded inside the next step's gradient call, counted in its compute_s
            gc.stage(reply.values)  # params, or the segment's values area: rewritten only by the next push's reply
    ps.close()
    return ps.step


def _computer(cfg: RunConfig, index: int) -> tuple[Computer, int]:
    """The model, holding this worker's share of the training set as tensors (the host copy is not kept);
    and the training set's size."""
    fw = framework(cfg.model.framework)
    data, model = fw.prepare(cfg, index)
    rows = share(len(data.x_train), index, cfg.cluster.num_workers, cfg.data.sampling)
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
