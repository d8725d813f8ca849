"""Run a parameter server for one training run until it finishes."""

from __future__ import annotations

import logging
import time
from pathlib import Path
from typing import Any, Callable

from switchps.address import publish, published, reachable, split
from switchps.security.channels import server_security
from switchps.config.run import RunConfig
from switchps import resources
from switchps.resources import ResourceSampler
from switchps.protos.heap import one_arena
from switchps.ps_server.checkpoint import Checkpoint
from switchps.ps_server.checkpointer import MANIFEST_WAIT_S, Checkpointer, Parts, record_position, restore
from switchps.optim.lanes import ps_threads
from switchps.ps_server.link import DuplexLink
from switchps.ps_server.store import ModelStore
from switchps.optim.optimizers import optimizer_factory
from switchps.ps_server.records import PS_COLUMNS, RunRecorder
from switchps.ps_server.mlflow_log import live_log
from switchps.ps_server.drivers import build_core, prepare_run_dir, run_summary
from switchps.ps_server.rpc.server import Servable, Server
from switchps.ps_server.rpc.service import PUSH_STREAMS, ParameterServer
from switchps.ps_server import metrics
from switchps.ps_server.rpc.admission import Admission, Alone
from switchps.ps_server.shard.zero import ShardZero
from switchps.ps_server.shard.followers import Leader

log = logging.getLogger("switchps.ps")
STOP_GRACE_S = 15.0


def build_ps(cfg: RunConfig, run_dir: Path, resume: Checkpoint | None = None) -> ParameterServer:
    """The PS for ``cfg``: a core, a model store and a run record, driven by the gRPC service; with
    ``resume``, continued from that checkpoint."""
    one_arena()  # before the PS's threads first allocate, so that the heap they free can be trimmed
    store = ModelStore(optimizer_factory(cfg.optimizer), cfg.runtime.chunk_bytes, workers=cfg.cluster.max_workers,
                       threads=ps_threads(cfg.runtime.ps_threads, cfg.cluster.shards), wire=cfg.runtime.wire_dtype)
    core = build_core(cfg)
    link = DuplexLink(cfg.network.ps_link_mbit_s) if cfg.network.ps_link_mbit_s else None
    clock = time.monotonic  # the core's times and the record's are on the driver's one clock
    rec = RunRecorder(run_dir, trace=cfg.stragglers.active, resume=record_position(resume.state) if resume else None,
                      clock=clock, mlflow=live_log(cfg, run_dir))
    followers = len(cfg.cluster.shards) - 1
    admission: Admission = Alone()
    if followers:
        admission = ShardZero(Leader(followers, cfg.runtime.receive_timeout_s), cfg.runtime.shard_max_bytes, rec)
    ps = ParameterServer(core, store, rec, link, cfg.runtime.receive_timeout_s, int(cfg.runtime.max_model_mb * 2**20),
                         clock=clock, max_grad_norm=cfg.runtime.max_grad_norm, admission=admission)
    parts = Parts(core, store.sums, rec, store, ps, admission.followers)
    if resume is not None:
        restore(parts, resume.state, resume.version, time.monotonic())
        admission.resumed(resume)
        _note_resume(ps, resume)
    ck = cfg.checkpoint
    if ck.every_s or ck.every_updates:
        ps.checkpointer = Checkpointer(run_dir / "checkpoints", ck, time.monotonic(), cfg.model_dump(mode="json"),
                                       parts)
        if resume is not None:
            ps.checkpointer.last_version = resume.version
    return ps


def run_ps(cfg: RunConfig, run_dir: Path, resume: bool = False) -> dict[str, Any]:
    """Serve until training ends and the final evaluation is in; write and return the summary."""
    ckpt = prepare_run_dir(cfg, run_dir, resume)
    ps = build_ps(cfg, run_dir, ckpt)
    exporter = None  # before the PS is reachable: a taken metrics port stops it before any worker finds it
    if cfg.runtime.metrics_port is not None:
        exporter = metrics.serve(metrics.registry(ps.series(), PUSH_STREAMS), cfg.runtime.metrics_port)
        ps.rec.event("metrics_serving", port=exporter.server_port)
    sampler = ResourceSampler("ps", run_dir / "resources.csv")
    server = serve(ps, cfg, run_dir, resume)
    followers = ps.admission.followers  # a sharded PS's: they serve until its final checkpoint is taken
    try:
        ps.finished.wait()
        ps.final_evaluated.wait(cfg.eval.final_timeout_s)
        ps.all_told_stop.wait(STOP_GRACE_S)
        if ps.failed:  # ``end`` sets every event the waits above are on
            raise ps.failed
        if followers is not None:  # every worker has its last reply: a last checkpoint, then the followers go
            _final_checkpoint(ps, lambda take: server.call(take))
            server.call(followers.stop)
    finally:
        server.stop(grace=1.0)
        if exporter is not None:
            metrics.stop(exporter)
    ps.store.wait_idle(timeout=60)  # every queued update applied and recorded
    if followers is None:
        _final_checkpoint(ps, lambda take: take())
    if ps.checkpointer is not None:
        ps.checkpointer.close(120)
    sampler.stop()
    summary = run_summary(cfg, ps.core, ps.rec, time.monotonic(), final=ps.final_eval, link=ps.link,
                          told_stop=ps.told_stop, framework=ps.framework, devices=ps.devices,
                          checkpoints=ps.checkpointer.stats.summary() if ps.checkpointer else None)
    return ps.rec.close({**summary, "mean_apply_ms": ps.store.mean_apply_ms,
                         **resources.in_summary(run_dir / "resources.csv")})


def _final_checkpoint(ps: ParameterServer, run: Callable[[Callable[[], None]], None]) -> None:
    """The final state, for export and for a resume that only evaluates; ``run`` runs the take where the
    checkpointer may (a sharded PS's on its loop, which reaches the followers, while they still serve)."""
    if ps.checkpointer is not None:
        checkpointer = ps.checkpointer
        checkpointer.wait(60)
        run(lambda: checkpointer.take(time.monotonic()))
        checkpointer.wait(MANIFEST_WAIT_S + 60)


def serve(ps: ParameterServer, cfg: RunConfig, run_dir: Path, resume: bool) -> Server:
    """Bind, then publish the address clients reach to ``RUN_DIR/ps.address`` (``switchps.address``) and
    as the event ``ps_serving``.

    With port 0 the OS picks the port. A resumed PS first tries the port its predecessor published:
    workers and the evaluator riding out the restart reconnect to the address they had
    (``switchps.worker.client.Reconnect`` never looks it up again), so only a PS back on the same port is
    found by them. If that port is taken, the PS binds a new one and publishes it; processes started
    afterwards find it there, those already running give up after ``cluster.reconnect_s``.
    """
    server = bind_server(ps, cfg, run_dir, 0, reuse=resume)
    address = reachable(cfg.cluster.shards[0], server.port)
    ps.rec.event("ps_serving", address=address)
    publish(run_dir, address)
    log.info("PS serving at %s (port %d), run directory %s", address, server.port, run_dir)
    return server


def bind_server(ps: Servable, cfg: RunConfig, run_dir: Path, shard: int, reuse: bool) -> Server:
    """Serve shard ``shard`` (0: the PS) where ``bind_address`` says; with ``reuse`` and port 0 there,
    first on the port it published before, if it can (see ``serve``)."""
    bind = bind_address(cfg, shard)
    host, port = split(bind)
    configured = split(cfg.cluster.shards[shard])[1]
    previous = published(run_dir, shard) if reuse and port == 0 and configured == 0 else None
    security = server_security(cfg.security)
    if previous is not None:
        try:
            return Server(ps, f"{host}:{split(previous)[1]}", security)
        except OSError as e:
            log.warning("%s, which shard %d had before its restart; binding another port", e, shard)
    return Server(ps, bind, security)


def bind_address(cfg: RunConfig, shard: int) -> str:
    """Where shard ``shard`` listens: ``cluster.bind`` (its host, at the shard's port when there are
    several shards), else the shard's own address."""
    own = cfg.cluster.shards[shard]
    if cfg.cluster.bind is None:
        return own
    return cfg.cluster.bind if len(cfg.cluster.shards) == 1 else f"{split(cfg.cluster.bind)[0]}:{split(own)[1]}"


def _note_resume(ps: ParameterServer, ckpt: Checkpoint) -> None:
    """Record what the crash lost: at least the updates recorded after the checkpoint (their rows moved
    to ps.lost.csv; the last half second before a crash may not have reached the disk)."""
    versions = [int(row[PS_COLUMNS.index("version")]) for row in ps.rec.ps.lost]
    if ps.core.started_at is not None:
        ps.rec.start(ps.core.started_at)
    ps.rec.count("resumes")
    ps.rec.event("resumed", version=ckpt.version, checkpoint=ckpt.path.name,
                 checkpoint_age_s=round(time.time() - ckpt.state["saved_at"], 3),
                 lost_updates=max(versions, default=ckpt.version) - ckpt.version)
    ps.rec.flush()  # on disk at once: another crash right after the restart must not lose it
    log.info("resumed from %s at version %d", ckpt.path.name, ckpt.version)
