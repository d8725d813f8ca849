"""The evaluator process: scores the latest model off the critical path, and the last one when training ends.

It pulls the latest version every ``eval.every_s``, scores it on the held-out set
and reports to the PS. Once training is done it scores the last version, writes
it as ``model.keras`` (TensorFlow) or ``model.pt`` (PyTorch) and reports that final score, on which the PS exits. Through
an outage of the PS it retries (``client.Reconnect``); a score of a version the PS
lost in a crash is not reported.
"""

from __future__ import annotations

import logging
import time
from pathlib import Path

import grpc
import numpy as np

from switchps.security.channels import client_security
from switchps.config.run import RunConfig
from switchps.worker.client import PSClient, Reconnect
from switchps.worker.sharded import ShardedClient, connect
from switchps.workload.frameworks import framework

log = logging.getLogger("switchps.evaluator")

POLL_S = 0.5
"""Between evaluations, how often the evaluator asks whether training is done (its final score is due then)."""


def run_evaluator(cfg: RunConfig, out_dir: Path) -> Path:
    """Score the latest model every ``eval.every_s``; once training is done, score the last version,
    write it as ``out_dir/model`` + the framework's suffix and report that final score. Returns the model's path."""
    fw = framework(cfg.model.framework)
    data, model = fw.prepare(cfg)
    evaluate = fw.scorer(model, data)
    evaluate()  # trace before the PS starts the clock
    weights = fw.weights(model)
    client = connect(cfg.cluster.shards, weights.layout(), cfg.runtime.shard_max_bytes, cfg.runtime.chunk_bytes,
                     client_security(cfg, "evaluator"))
    retry = Reconnect(client.address, cfg.cluster.reconnect_s)
    values = np.empty(weights.size, np.float32)
    master = cfg.runtime.wire_dtype != "float32"  # scores the PS's float32 values, not the wire's narrowed ones
    version = retry(lambda: client.pull(values, wait_initialized=True, master=master)).order.version
    weights.assign(values)
    while True:
        t0 = time.monotonic()
        final = retry(client.status).done  # once done, the next pull is the last version
        reply = retry(lambda: client.pull(values, have_version=version, master=master))
        if reply.fresh:
            weights.assign(values)
            version = reply.order.version
        loss, acc = evaluate()
        if final:
            path = fw.save(model, out_dir / f"model{fw.model_suffix}")  # before the report: the PS exits on it
        if not _report(client, retry, version, loss, acc, final):
            continue
        log.info("evaluator: version %d, test loss %.4f, test accuracy %.4f", version, loss, acc)
        if final:
            log.info("evaluator: final version %d, test accuracy %.4f, model written to %s", version, acc, path)
            client.close()
            return path
        _until_due(client, retry, t0 + cfg.eval.every_s)


def _until_due(client: PSClient | ShardedClient, retry: Reconnect, due: float) -> None:
    """Wait until ``due`` (the next evaluation), or until training is done: the final score is due at once
    (a long ``eval.every_s`` used to hold the run's end for the PS's ``eval.final_timeout_s``)."""
    while (left := due - time.monotonic()) > 0:
        time.sleep(min(left, POLL_S))
        if retry(client.status).done:
            return


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
