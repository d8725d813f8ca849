"""Run a parameter server for one training run until it finishes."""

from __future__ import annotations

import logging
import time
from pathlib import Path
from typing import Any, Callable

from prometheus_client import start_http_server

from switchps.address import publish, published, reachable, split
from switchps.channels import server_security
from switchps.config import RunConfig
from switchps import resources
from switchps.errors import RunDirError
from switchps.resources import ResourceSampler
from switchps.resume_rules import refuse_incompatible
from switchps.policies.registry import make_policy
from switchps.protos.codec import one_arena
from switchps.ps_server import checkpoint
from switchps.ps_server.checkpoint import Checkpoint
from switchps.ps_server.checkpointer import Checkpointer, restore
from switchps.ps_server.core.machine import Core
from switchps.ps_server.link import DuplexLink
from switchps.ps_server.model import ModelStore
from switchps.ps_server.optimizers import Optimizer, configured_momentum, make_optimizer
from switchps.ps_server.overhead import switch_overheads
from switchps.ps_server.records import PS_COLUMNS, RunRecorder
from switchps.ps_server.schedules import make_schedule
from switchps.ps_server.server import Server
from switchps.ps_server.service import ParameterServer

log = logging.getLogger("switchps.ps")
STOP_GRACE_S = 15.0
RECORD_FILES = ("ps.csv", "events.jsonl", "summary.json", "checkpoints")
"""A directory holding any of these holds a run, which a new PS must not overwrite."""


def optimizer_factory(cfg: RunConfig) -> Callable[[int], Optimizer]:
    o = cfg.optimizer
    schedule = make_schedule(o.schedule.kind, o.learning_rate,
                             **o.schedule.model_dump(exclude={"kind"}, exclude_none=True))
    return lambda size: make_optimizer(o.name, size, schedule, **o.params)


def build_ps(cfg: RunConfig, run_dir: Path, resume: Checkpoint | None = None) -> ParameterServer:
    """The PS for ``cfg``: a core, a model store and a run record, driven by the gRPC service; with
    ``resume``, continued from that checkpoint."""
    one_arena()  # before the PS's threads first allocate, so that the heap they free can be trimmed
    # Each worker has one push in flight, and may resend it while the PS still reads the first.
    store = ModelStore(optimizer_factory(cfg), cfg.runtime.chunk_bytes, receive_slots=cfg.cluster.num_workers + 1)
    p = cfg.policy
    core = Core(cfg.protocol, cfg.train, cfg.cluster.num_workers, startup_timeout_s=cfg.cluster.startup_timeout_s,
                on_switch=p.on_switch, momentum=configured_momentum(cfg.optimizer.name, cfg.optimizer.params),
                policy=make_policy(p.name, p.kwargs) if p.name else None, every_k=p.every_k, window=p.window)
    link = DuplexLink(cfg.network.ps_link_mbit_s) if cfg.network.ps_link_mbit_s else None
    rec = RunRecorder(run_dir, trace=cfg.stragglers.active, resume=resume.state["records"] if resume else None)
    ps = ParameterServer(core, store, rec, link, cfg.runtime.receive_timeout_s,
                         int(cfg.runtime.max_model_mb * 2**20))
    if resume is not None:
        restore(ps, resume, time.monotonic())
        _note_resume(ps, resume)
    ck = cfg.checkpoint
    if ck.every_s or ck.every_updates:
        ps.checkpointer = Checkpointer(run_dir / "checkpoints", ck, time.monotonic(), cfg.model_dump(mode="json"))
        if resume is not None:
            ps.checkpointer.last_version = resume.version
    return ps


def check_resumable(run_dir: Path) -> Checkpoint | None:
    """The checkpoint to resume ``run_dir`` from; None if the run never started training (no checkpoint,
    no update recorded), which then starts afresh. Raises ``RunDirError`` for anything else."""
    if not (run_dir / "config.yaml").is_file():
        raise RunDirError(f"{run_dir} is not a run directory (no config.yaml)")
    ckpt = checkpoint.latest(run_dir / "checkpoints")
    ps_csv = run_dir / "ps.csv"
    if ckpt is None and (checkpoint.files(run_dir / "checkpoints") or
                         (ps_csv.exists() and len(ps_csv.read_text().splitlines()) > 1)):
        raise RunDirError(f"{run_dir} has no readable checkpoint to resume from")
    return ckpt


def prepare_run_dir(cfg: RunConfig, run_dir: Path, resume: bool) -> Checkpoint | None:
    """A new run directory (refusing to reuse one that holds a run), or the checkpoint to resume from
    (refusing a config that changes what it was made with: ``ConfigError``)."""
    if resume:
        ckpt = check_resumable(run_dir)
        if ckpt is not None:
            refuse_incompatible(run_dir, ckpt, cfg)
            return ckpt
    elif any((run_dir / name).exists() for name in RECORD_FILES):
        raise RunDirError(f"{run_dir} already holds a run; resume it with --resume {run_dir}, "
                          "or choose another --run-dir")
    run_dir.mkdir(parents=True, exist_ok=True)
    (run_dir / "config.yaml").write_text(cfg.dump())
    return None


def run_ps(cfg: RunConfig, run_dir: Path, resume: bool = False) -> dict[str, Any]:
    """Serve until training ends and the final evaluation is in; write and return the summary."""
    ckpt = prepare_run_dir(cfg, run_dir, resume)
    ps = build_ps(cfg, run_dir, ckpt)
    sampler = ResourceSampler("ps", run_dir / "resources.csv")
    server = serve(ps, cfg, run_dir, resume)
    if cfg.runtime.metrics_port is not None:
        start_http_server(cfg.runtime.metrics_port)
    try:
        ps.finished.wait()
        ps.final_evaluated.wait(cfg.eval.final_timeout_s)
        ps.all_told_stop.wait(STOP_GRACE_S)
    finally:
        server.stop(grace=1.0)
    ps.store.wait_idle(timeout=60)  # every queued update applied and recorded
    if ps.checkpointer is not None:  # the final state, for export and for a resume that only evaluates
        ps.checkpointer.wait(60)
        ps.checkpointer.take(ps, time.monotonic())
        ps.checkpointer.close(120)
    sampler.stop()
    return ps.rec.close({**_summary(cfg, ps), "resources": resources.summary(run_dir / "resources.csv")})


def serve(ps: ParameterServer, cfg: RunConfig, run_dir: Path, resume: bool) -> Server:
    """Bind, then publish the address clients reach to ``RUN_DIR/ps.address`` (``switchps.address``) and
    as the event ``ps_serving``.

    With port 0 the OS picks the port. A resumed PS first tries the port its predecessor published:
    workers and the evaluator riding out the restart reconnect to the address they had
    (``switchps.worker.client.Reconnect`` never looks it up again), so only a PS back on the same port is
    found by them. If that port is taken, the PS binds a new one and publishes it; processes started
    afterwards find it there, those already running give up after ``cluster.reconnect_s``.
    """
    bind = cfg.cluster.bind or cfg.cluster.ps
    host, port = split(bind)
    previous = published(run_dir) if resume and port == 0 and split(cfg.cluster.ps)[1] == 0 else None
    security = server_security(cfg.security)
    server = None
    if previous is not None:
        try:
            server = Server(ps, f"{host}:{split(previous)[1]}", security)
        except OSError as e:
            log.warning("%s, which the PS had before its restart; binding another port", e)
    if server is None:
        server = Server(ps, bind, security)
    address = reachable(cfg.cluster.ps, server.port)
    ps.rec.event("ps_serving", address=address)
    publish(run_dir, address)
    log.info("PS serving at %s (port %d), run directory %s", address, server.port, run_dir)
    return server


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


def _summary(cfg: RunConfig, ps: ParameterServer) -> dict[str, Any]:
    core, rec = ps.core, ps.rec
    wall = (core.finished_at or time.monotonic()) - (core.started_at or time.monotonic())
    target = cfg.eval.target_accuracy
    reached = [t for t, _, _, acc in rec.evals if target is not None and acc >= target]
    final = ps.final_eval
    return {
        "name": cfg.name,
        "protocol": cfg.protocol.name,
        "num_workers": cfg.cluster.num_workers,
        "wall_time_s": round(wall, 3),
        "final_test_accuracy": final.test_accuracy if final else None,
        "final_test_loss": final.test_loss if final else None,
        "final_version": final.version if final else None,
        "updates": core.version,
        "samples": core.samples,
        "samples_per_s": round(core.samples / wall, 1) if wall > 0 else None,
        "target_accuracy": target,
        "time_to_target_s": reached[0] if reached else None,
        "worker_utilization": round(sum(rec.busy_s.values()) / (wall * cfg.cluster.num_workers), 4)
        if wall > 0 else None,
        "emulated_device": cfg.device.model_dump() if cfg.device.samples_per_s else None,
        "emulated_link": ps.link.summary(wall) if ps.link else None,
        "stragglers": cfg.stragglers.model_dump(exclude_none=True) or None,
        "final_eval_reported": final is not None,
        "workers_not_told_stop": sorted(set(core.members.registered) - ps.told_stop),
        "policy": cfg.policy.name,
        "switches": len(core.switching.switches),
        "switch_overhead_s": _overhead_summary(switch_overheads(core.switching.switches, core.switching.update_times)),
        "checkpoints": ps.checkpointer.stats.summary() if ps.checkpointer else None,
        "resumes": rec.counts["resumes"],
    }


def _overhead_summary(overheads: list[float]) -> dict[str, float] | None:
    if not overheads:
        return None
    ordered = sorted(overheads)
    return {"median": round(ordered[len(ordered) // 2], 4), "max": round(ordered[-1], 4)}
