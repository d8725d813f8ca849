"""The worker and evaluator processes.

A worker builds its model and traces every TF function, then registers
(ready), pulls, and loops: take the sample budget from its shard, compute
Σ gradients over micro-batches, push them with the sample count and the
model's state, and obey the work order in the reply (which also carries the
fresh values). The evaluator pulls the latest model at the configured
interval, scores it on the held-out set and reports to the PS, off the
critical path; once training is done it scores the last version and writes
it as ``model.keras``.
"""

from __future__ import annotations

import logging
import time
from pathlib import Path

import keras
import numpy as np

from switchps.config import RunConfig

from switchps.protos import switchps_pb2 as pb
from switchps.worker.client import PSClient
from switchps.worker.data import Dataset, load_dataset
from switchps.worker.gradients import GradientComputer, configure_threads
from switchps.worker.models import build_model
from switchps.worker.steps import RealClock, Sampler, Step, StepRunner
from switchps.worker.stragglers import StragglerInjector
from switchps.worker.weights import FlatWeights, save_keras

log = logging.getLogger("switchps.worker")


def _setup(cfg: RunConfig) -> tuple[Dataset, keras.Model]:
    configure_threads(cfg.runtime.intra_op_threads, cfg.runtime.inter_op_threads)
    d = cfg.data
    data = load_dataset(d.name, path=d.path, seed=cfg.seed, test_fraction=d.test_fraction,
                        num_samples=d.num_samples, num_features=d.num_features, num_classes=d.num_classes)
    model = build_model(cfg.model.name, data.input_shape, data.num_classes, seed=cfg.seed, **cfg.model.kwargs)
    return data, model


def run_worker(cfg: RunConfig, index: int) -> int:
    """Train until the PS says stop; returns the number of steps taken."""
    data, model = _setup(cfg)
    x, y = data.shard(index, cfg.cluster.num_workers)
    gc = GradientComputer(model, data.input_shape)
    gc.warm_up(x, y, cfg.protocol.batch, cfg.protocol.micro_batch or cfg.protocol.batch)  # never inside a timed step
    layout = gc.weights.layout()
    client = PSClient(cfg.cluster.ps, cfg.runtime.chunk_bytes)
    reg = client.register(index, layout, len(x))  # ready: the PS starts the clock once every worker is
    if reg.send_init:
        client.init(index, layout, gc.weights.read())
    params = np.empty(gc.size, np.float32)
    reply = client.pull(params, worker=index, wait_initialized=True)
    clock = RealClock()
    received_at = started = clock.now()
    gc.assign(params)
    log.info("worker %d: %d samples, model v%d", index, len(x), reply.order.version)
    runner = StepRunner(gc, x, y, Sampler(len(x), seed=cfg.seed * 1000 + index), cfg.device.samples_per_s, clock)
    stragglers = StragglerInjector(cfg.stragglers, seed=cfg.seed, worker=index, num_workers=cfg.cluster.num_workers)
    warned: set[str] = set()
    step, send_s, wait_s = 0, 0.0, 0.0
    order = reply.order
    while not order.stop:
        delays = stragglers.plan(step, received_at - started)
        s = runner.run(order, received_at, delays)
        _warn_once(warned, index, s, order, stragglers)
        stats = pb.StepStats(step=step, compute_s=s.compute_s, send_s=send_s, wait_s=wait_s, sleep_s=s.sleep_s,
                             loss_sum=s.loss_sum, delay_sleep_s=delays.sleep_s, delay_factor=delays.factor,
                             delay_comm_s=delays.comm_s, batch_exhausted=s.exhausted)
        header = pb.PushHeader(worker=index, base_version=order.version, samples=s.samples,
                               layout_digest=layout.digest, stats=stats)
        t1 = clock.now()
        reply = client.push(header, s.grad, params)
        received_at = clock.now()
        send_s, wait_s = received_at - t1, reply.reply.wait_s
        if reply.fresh:
            gc.assign(params)
        order = reply.order
        step += 1
    client.close()
    return step


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


def run_evaluator(cfg: RunConfig, out_dir: Path) -> Path:
    """Score the latest model every ``eval.every_s``; once training is done, score the last version,
    write it as ``out_dir/model.keras`` and report that final score. Returns the model's path."""
    data, model = _setup(cfg)
    evaluate = Evaluator(model, data)
    evaluate()  # trace before the PS starts the clock
    weights = FlatWeights(model)
    client = PSClient(cfg.cluster.ps, cfg.runtime.chunk_bytes)
    values = np.empty(weights.size, np.float32)
    version = client.pull(values, wait_initialized=True).order.version
    weights.assign(values)
    while True:
        t0 = time.monotonic()
        final = client.status().done  # once done, the next pull is the last version
        reply = client.pull(values, have_version=version)
        if reply.fresh:
            weights.assign(values)
            version = reply.order.version
        loss, acc = evaluate()
        if final:
            path = save_keras(model, out_dir / "model.keras")  # before the report: the PS exits on it
            client.report_eval(version, loss, acc, final=True)
            log.info("evaluator: final version %d, test accuracy %.4f, model written to %s", version, acc, path)
            client.close()
            return path
        client.report_eval(version, loss, acc)
        time.sleep(max(0.0, cfg.eval.every_s - (time.monotonic() - t0)))


class Evaluator:
    """Test loss and accuracy of the model's current weights on the held-out set."""

    def __init__(self, model: keras.Model, data: Dataset, batch: int = 1024) -> None:
        import tensorflow as tf

        self.x, self.y, self.batch = data.x_test, data.y_test, batch
        signature = [tf.TensorSpec([None, *data.input_shape], tf.float32), tf.TensorSpec([None], tf.int32)]

        @tf.function(input_signature=signature)
        def score(x, y):
            logits = model(x, training=False)
            loss = tf.reduce_sum(tf.keras.losses.sparse_categorical_crossentropy(y, logits, from_logits=True))
            correct = tf.reduce_sum(tf.cast(tf.equal(tf.argmax(logits, axis=-1, output_type=y.dtype), y), tf.float32))
            return loss, correct

        self._score = score

    def __call__(self) -> tuple[float, float]:
        loss = correct = 0.0
        for i in range(0, len(self.x), self.batch):
            l, c = self._score(self.x[i : i + self.batch], self.y[i : i + self.batch])
            loss, correct = loss + float(l), correct + float(c)
        n = len(self.x)
        return loss / n, correct / n
