"""The worker process.

A worker builds its model with the run's framework and warms its gradient computer up (every TF function
traced, every torch kernel run), then registers
(ready), pulls, and loops: take the sample budget from its data partition, compute
Σ gradients over micro-batches, push them with the sample count and the
model's state, and obey the work order in the reply (which also carries the
fresh values). Through an outage of the PS it retries (``client.Reconnect``): it registers again and
sends the same push, which the PS recognises by its (worker, session, step) if it had it already.
"""

from __future__ import annotations

import logging
import secrets

from switchps.security.channels import client_security
from switchps.config.run import RunConfig

from switchps.protos import switchps_pb2 as pb
from switchps.worker.client import Reconnect
from switchps.worker.sharded import connect
from switchps.workload.data import share, share_size
from switchps.workload.frameworks import Computer, framework
from switchps.worker.steps import RealClock, Step, StepRunner, make_sampler
from switchps.worker.stragglers import StragglerInjector

log = logging.getLogger("switchps.worker")


def run_worker(cfg: RunConfig, index: int) -> int:
    """Train until the PS says stop; returns the number of steps taken."""
    gc, n = _computer(cfg, index)
    workers = cfg.cluster.num_workers
    gc.warm_up(cfg.protocol.batch, cfg.protocol.micro_batch or cfg.protocol.batch)  # never inside a timed step
    layout = gc.weights.layout()
    client = connect(cfg.cluster.shards, layout, cfg.runtime.shard_max_bytes, cfg.runtime.chunk_bytes,
                     client_security(cfg, "worker", index))

    def join(wait: bool = True) -> None:  # ready: the PS starts the clock once every worker is
        if client.register(index, layout, share_size(n, index, workers), wait, framework=cfg.model.framework,
                           device=str(gc.device)).send_init:  # the PS has no model yet
            client.init(index, layout, gc.read())
        if cfg.runtime.shared_memory and client.attach(index, gc.size * 4):
            log.info("worker %d: pushes through shared memory (the PS is on this host)%s", index,
                     ", its headers through the PS's socket" if client.socket_path else "")

    retry = Reconnect(client.address, cfg.cluster.reconnect_s, rejoin=lambda: join(wait=False))
    retry(join)  # a sharded PS answers UNAVAILABLE until its shards have attached
    session = secrets.randbits(31)
    params = gc.buffer()  # the framework reads the values a reply leaves here in place (as a segment's)
    reply = retry(lambda: client.pull(params, worker=index, wait_initialized=True))
    clock = RealClock()
    received_at = started = clock.now()
    gc.assign(params)
    log.info("worker %d: %d samples, model v%d", index, gc.samples, reply.order.version)
    runner = StepRunner(gc, make_sampler(cfg.data.sampling, gc.samples, cfg.seed, index), cfg.device.samples_per_s,
                        clock)
    stragglers = StragglerInjector(cfg.stragglers, seed=cfg.seed, worker=index, num_workers=cfg.cluster.num_workers)
    warned: set[str] = set()
    step, send_s, wait_s = 0, 0.0, 0.0
    order = reply.order
    while not order.stop:
        delays = stragglers.plan(step, received_at - started)
        gc.payload_to = client.payload_area  # the step writes its payload where the push sends it from
        s = runner.run(order, received_at, delays)
        _warn_once(warned, index, s, order, stragglers)
        stats = pb.StepStats(step=step, compute_s=s.compute_s, send_s=send_s, wait_s=wait_s, sleep_s=s.sleep_s,
                             loss_sum=s.loss_sum, delay_sleep_s=delays.sleep_s, delay_factor=delays.factor,
                             delay_comm_s=delays.comm_s, batch_exhausted=s.exhausted)
        header = pb.PushHeader(worker=index, base_version=order.version, samples=s.samples,
                               layout_digest=layout.digest, stats=stats, session=session)
        t1 = clock.now()
        reply = retry(lambda: client.push(header, s.grad, params))
        received_at = clock.now()
        send_s, wait_s = received_at - t1, reply.reply.wait_s
        if reply.fresh:  # loaded inside the next step's gradient call, counted in its compute_s
            gc.stage(reply.values)  # params, or the segment's values area: rewritten only by the next push's reply
        order = reply.order
        step += 1
    client.close()
    return step


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
