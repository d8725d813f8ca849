"""Run a follower shard of a sharded PS (`switchps ps --shard K`) until shard 0 says training is over."""

from __future__ import annotations

import logging
import time
from pathlib import Path

from switchps.address import publish, reachable
from switchps.security.channels import client_security
from switchps.config.run import RunConfig
from switchps.errors import RunDirError, ShardLost
from switchps.jsonfile import write_json
from switchps.protos.heap import one_arena
from switchps.ps_server import metrics
from switchps.ps_server.shard.follower import Follower
from switchps.ps_server.rpc.main import bind_server
from switchps.optim.lanes import ps_threads
from switchps.ps_server.store import ModelStore
from switchps.optim.optimizers import optimizer_factory
from switchps.ps_server.shard.checkpoint import part_dir
from switchps.ps_server.tensorboard import EventFile, shard_scalars
from switchps.resources import ResourceSampler

log = logging.getLogger("switchps.ps")
RECORD_EVERY_S = 1.0
"""How often a follower rewrites its record (``shard-K.json``), which `switchps status` shows."""


def record(run_dir: Path, follower: Follower, tensorboard: EventFile) -> dict[str, object]:
    """Write the follower's record (``shard-K.json``) and its scalars; the record."""
    summary = follower.summary()
    write_json(run_dir / f"shard-{follower.shard}.json", summary)
    tensorboard.summary(shard_scalars(summary), follower.store.version, time.time())
    tensorboard.flush()
    return summary


def run_follower(cfg: RunConfig, run_dir: Path, shard: int, leader: str) -> None:
    """Serve part ``shard`` of the model, following shard 0 at ``leader``; ``ShardLost`` if shard 0 goes
    away before training is over."""
    one_arena()
    run_dir.mkdir(parents=True, exist_ok=True)
    store = ModelStore(optimizer_factory(cfg.optimizer), cfg.runtime.chunk_bytes, workers=cfg.cluster.max_workers,
                       threads=ps_threads(cfg.runtime.ps_threads, cfg.cluster.shards, shard),
                       wire=cfg.runtime.wire_dtype)
    follower = Follower(shard, len(cfg.cluster.shards), leader, client_security(cfg, "shard", shard), store,
                        cfg.runtime.shard_max_bytes, cfg.runtime.receive_timeout_s, part_dir(run_dir, shard),
                        cfg.checkpoint.keep, workers=cfg.cluster.max_workers)
    exporter = None
    if cfg.runtime.metrics_port is not None:  # its own port: shards on one host never ask for the same one
        series = metrics.ShardSeries(lambda: follower.store.version, follower.traffic, follower.rejections)
        exporter = metrics.serve(metrics.registry(series), cfg.runtime.metrics_port, shard)
    sampler = ResourceSampler(f"ps-{shard}", run_dir / "resources.csv")
    server = bind_server(follower, cfg, run_dir, shard, reuse=True)  # workers know the port it had
    tensorboard = EventFile(run_dir / "tensorboard" / f"shard-{shard}")
    address = reachable(cfg.cluster.shards[shard], server.port)
    publish(run_dir, address, shard)
    log.info("PS shard %d of %d serving at %s, following shard 0 at %s", shard, len(cfg.cluster.shards),
             address, leader)
    try:
        while not (follower.finished.is_set() or follower.failed.is_set()):  # the record, live
            follower.finished.wait(RECORD_EVERY_S)
            record(run_dir, follower, tensorboard)
        if follower.refused:
            raise RunDirError(follower.refused)
        if follower.failed.is_set():
            raise ShardLost(f"shard {shard}: shard 0 at {leader} left before training was over")
    finally:
        server.stop(grace=1.0)
        if exporter is not None:
            metrics.stop(exporter)
        sampler.stop()
        follower.saver.close()
    store.wait_idle(timeout=60)
    summary = record(run_dir, follower, tensorboard)
    tensorboard.close()
    log.info("PS shard %d: done: %s", shard, summary)
