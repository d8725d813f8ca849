"""The evaluator process: scores the latest model off the critical path, and the last one when training ends.

It pulls the latest version every ``eval.every_s``, scores it on the held-out set
and reports to the PS. Once training is done it scores the last version, writes
it as ``model.keras`` and reports that final score, on which the PS exits. Through
an outage of the PS it retries (``client.Reconnect``); a score of a version the PS
lost in a crash is not reported.
"""

from __future__ import annotations

import logging
import time
from pathlib import Path

import grpc
import keras
import numpy as np

from switchps.security.channels import client_security
from switchps.config.run import RunConfig
from switchps.worker.client import PSClient, Reconnect
from switchps.worker.data import Dataset
from switchps.worker.setup import prepare
from switchps.worker.sharded import ShardedClient, connect
from switchps.worker.weights import FlatWeights, save_keras

log = logging.getLogger("switchps.evaluator")


def run_evaluator(cfg: RunConfig, out_dir: Path) -> Path:
    """Score the latest model every ``eval.every_s``; once training is done, score the last version,
    write it as ``out_dir/model.keras`` and report that final score. Returns the model's path."""
    data, model = prepare(cfg)
    evaluate = Evaluator(model, data)
    evaluate()  # trace before the PS starts the clock
    weights = FlatWeights(model)
    client = connect(cfg.cluster.shards, weights.layout(), cfg.runtime.shard_max_bytes, cfg.runtime.chunk_bytes,
                     client_security(cfg, "evaluator"))
    retry = Reconnect(client.address, cfg.cluster.reconnect_s)
    values = np.empty(weights.size, np.float32)
    version = retry(lambda: client.pull(values, wait_initialized=True)).order.version
    weights.assign(values)
    while True:
        t0 = time.monotonic()
        final = retry(client.status).done  # once done, the next pull is the last version
        reply = retry(lambda: client.pull(values, have_version=version))
        if reply.fresh:
            weights.assign(values)
            version = reply.order.version
        loss, acc = evaluate()
        if final:
            path = save_keras(model, out_dir / "model.keras")  # before the report: the PS exits on it
        if not _report(client, retry, version, loss, acc, final):
            continue
        log.info("evaluator: version %d, test loss %.4f, test accuracy %.4f", version, loss, acc)
        if final:
            log.info("evaluator: final version %d, test accuracy %.4f, model written to %s", version, acc, path)
            client.close()
            return path
        time.sleep(max(0.0, cfg.eval.every_s - (time.monotonic() - t0)))


def _report(client: PSClient | ShardedClient, retry: Reconnect, version: int, loss: float, acc: float, final: bool) -> bool:
    """Report a score; False if the PS came back from a checkpoint older than ``version`` meanwhile."""
    outages = retry.outages
    try:
        retry(lambda: client.report_eval(version, loss, acc, final=final))
        return True
    except grpc.RpcError as e:
        if e.code() == grpc.StatusCode.INVALID_ARGUMENT and retry.outages > outages:
            log.info("evaluator: version %d was lost in a PS restart; scoring the current one", version)
            return False
        raise


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
