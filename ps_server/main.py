"""Run a parameter server for one training run until it finishes."""

from __future__ import annotations

import logging
import time
from pathlib import Path
from typing import Any

from prometheus_client import start_http_server

from switchps.config import RunConfig
from switchps.policies.registry import make_policy
from switchps.ps_server.controller import Controller
from switchps.ps_server.link import DuplexLink
from switchps.ps_server.model import ModelStore
from switchps.ps_server.optimizers import configured_momentum, make_optimizer
from switchps.ps_server.overhead import switch_overheads
from switchps.ps_server.records import RunRecorder
from switchps.ps_server.schedules import make_schedule
from switchps.ps_server.server import Server, wait_until
from switchps.ps_server.service import ParameterServer
from switchps.ps_server.sync import SyncEngine

log = logging.getLogger("switchps.ps")
STOP_GRACE_S = 15.0


def optimizer_factory(cfg: RunConfig):
    o = cfg.optimizer
    schedule = make_schedule(o.schedule.kind, o.learning_rate,
                             **o.schedule.model_dump(exclude={"kind"}, exclude_none=True))
    return lambda size: make_optimizer(o.name, size, schedule, **o.params)


def build_engine(cfg: RunConfig, run_dir: Path) -> SyncEngine:
    store = ModelStore(optimizer_factory(cfg), cfg.runtime.chunk_bytes)
    engine = SyncEngine(store, RunRecorder(run_dir, trace=cfg.stragglers.active), cfg.protocol, cfg.train,
                        cfg.cluster.num_workers, cfg.cluster.startup_timeout_s, cfg.policy.on_switch,
                        configured_momentum(cfg.optimizer.name, cfg.optimizer.params))
    if cfg.policy.name:
        policy = make_policy(cfg.policy.name, cfg.policy.kwargs, cfg.policy.every_k)
        engine.controller = Controller(engine, policy, cfg.policy.window)
    return engine


def run_ps(cfg: RunConfig, run_dir: Path) -> dict[str, Any]:
    """Serve until training ends and the final evaluation is in; write and return the summary."""
    run_dir.mkdir(parents=True, exist_ok=True)
    (run_dir / "config.yaml").write_text(cfg.dump())
    engine = build_engine(cfg, run_dir)
    link = DuplexLink(cfg.network.ps_link_mbit_s) if cfg.network.ps_link_mbit_s else None
    ps = ParameterServer(engine, cfg.cluster.num_workers, link, cfg.runtime.receive_timeout_s,
                         int(cfg.runtime.max_model_mb * 2**20))
    server = Server(ps, cfg.cluster.ps)
    if cfg.runtime.metrics_port is not None:
        start_http_server(cfg.runtime.metrics_port)
    log.info("PS serving on port %d, run directory %s", server.port, run_dir)
    try:
        while not engine.done:
            engine.tick()
            time.sleep(0.05)
        wait_until(lambda: ps.final_eval is not None, cfg.eval.final_timeout_s)
        wait_until(lambda: ps.told_stop >= set(engine.registered), STOP_GRACE_S)
    finally:
        server.stop(grace=1.0)
    engine.store.wait_idle(timeout=60)  # every queued update applied and recorded
    return engine.rec.close(_summary(cfg, engine, ps))


def _summary(cfg: RunConfig, engine: SyncEngine, ps: ParameterServer) -> dict[str, Any]:
    wall = (engine.finished_at or time.monotonic()) - (engine.started_at or time.monotonic())
    target = cfg.eval.target_accuracy
    reached = [t for t, _, _, acc in engine.rec.evals if target is not None and acc >= target]
    final = ps.final_eval
    return {
        "name": cfg.name,
        "protocol": cfg.protocol.name,
        "num_workers": cfg.cluster.num_workers,
        "wall_time_s": round(wall, 3),
        "final_test_accuracy": final.test_accuracy if final else None,
        "final_test_loss": final.test_loss if final else None,
        "final_version": final.version if final else None,
        "updates": engine.store.version,
        "samples": engine.samples_applied,
        "samples_per_s": round(engine.samples_applied / wall, 1) if wall > 0 else None,
        "target_accuracy": target,
        "time_to_target_s": reached[0] if reached else None,
        "worker_utilization": round(sum(engine.rec.busy_s.values()) / (wall * cfg.cluster.num_workers), 4)
        if wall > 0 else None,
        "emulated_device": cfg.device.model_dump() if cfg.device.samples_per_s else None,
        "emulated_link": ps.link.summary(wall) if ps.link else None,
        "stragglers": cfg.stragglers.model_dump(exclude_none=True) or None,
        "final_eval_reported": final is not None,
        "workers_not_told_stop": sorted(set(engine.registered) - ps.told_stop),
        "policy": cfg.policy.name,
        "switches": len(engine.switches),
        "switch_overhead_s": _overhead_summary(switch_overheads(engine.switches, engine.update_times)),
    }


def _overhead_summary(overheads: list[float]) -> dict[str, float] | None:
    if not overheads:
        return None
    ordered = sorted(overheads)
    return {"median": round(ordered[len(ordered) // 2], 4), "max": round(ordered[-1], 4)}
