"""What every driver of a run (the gRPC PS, the simulator) does alike: build the core from the config, make
the run directory afresh (never over a run) or find it resumable, and sum the run up for ``summary.json``."""

from __future__ import annotations

from collections.abc import Iterable
from pathlib import Path
from typing import Any, Protocol

from switchps.config.run import RunConfig
from switchps.errors import RunDirError
from switchps.ps_server import checkpoint
from switchps.ps_server.checkpoint import Checkpoint
from switchps.ps_server.core.events import Bounds
from switchps.ps_server.core.machine import Core
from switchps.policies.registry import make_policy
from switchps.ps_server.link import DuplexLink
from switchps.optim.optimizers import configured_momentum
from switchps.ps_server.core.overhead import switch_overheads
from switchps.ps_server.records import RunRecorder
from switchps.ps_server.resume_rules import refuse_incompatible

RECORD_FILES = ("ps.csv", "events.jsonl", "summary.json", "checkpoints")
"""A directory holding any of these holds a run, which a new PS must not overwrite."""


def build_core(cfg: RunConfig) -> Core:
    """The protocol core ``cfg`` describes: its protocol, length, workers, policy and switch settings."""
    p = cfg.policy
    return Core(cfg.protocol, cfg.train, cfg.cluster.num_workers, startup_timeout_s=cfg.cluster.startup_timeout_s,
                on_switch=p.on_switch, momentum=configured_momentum(cfg.optimizer.name, cfg.optimizer.params),
                policy=make_policy(p.name, p.kwargs) if p.name else None, every_k=p.every_k, window=p.window,
                targets=p.protocols, pipeline=cfg.runtime.pipeline, optimizer=cfg.optimizer,
                bounds=Bounds(e.min, e.max, cfg.cluster.leave_after_s) if (e := cfg.cluster.elastic) else None,
                lease_s=cfg.cluster.lease_s)


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


class Score(Protocol):
    """An evaluation's result (the evaluator's ``EvalReport``, a simulator's own)."""

    @property
    def version(self) -> int: ...

    @property
    def test_loss(self) -> float: ...

    @property
    def test_accuracy(self) -> float: ...


def run_summary(cfg: RunConfig, core: Core, rec: RunRecorder, now: float, *, final: Score | None,
                link: DuplexLink | None, told_stop: set[int], checkpoints: dict[str, Any] | None,
                framework: str = "", devices: Iterable[str] = ()) -> dict[str, Any]:
    """What ``summary.json`` says of a run (with ``RunRecorder.close``'s counts), its times on the driver's
    clock at ``now``: ``wall_time_s`` is training's duration on that clock (virtual in a simulation).
    What it ran on: ``ps_shards``, ``framework`` (the workers', as they registered; else
    ``model.framework``) and ``device``: ``cuda`` if a worker computed on a GPU (``devices``: where each
    said it computes), else ``cpu``; with ``device.samples_per_s``, ``emulated`` (each step takes at least
    the emulated device's time; ``emulated_device`` says its speed)."""
    wall = elapsed(core, now)
    target = cfg.eval.target_accuracy
    reached = [t for t, _, _, acc in rec.evals if target is not None and acc >= target]
    return {
        "name": cfg.name,
        "protocol": cfg.protocol.name,
        "num_workers": cfg.cluster.num_workers,
        "ps_shards": len(cfg.cluster.shards),
        "framework": framework or cfg.model.framework,
        "device": "emulated" if cfg.device.samples_per_s else
        "cuda" if any(d.startswith("cuda") for d in devices) else "cpu",
        "wall_time_s": round(wall, 3),
        "final_test_accuracy": final.test_accuracy if final else None,
        "final_test_loss": final.test_loss if final else None,
        "final_version": final.version if final else None,
        "updates": core.version,
        "samples": core.samples,
        "samples_per_s": round(core.samples / wall, 1) if wall > 0 else None,
        "target_accuracy": target,
        "time_to_target_s": reached[0] if reached else None,
        "worker_utilization": round(sum(rec.busy_s.values()) / member_s, 4)
        if (member_s := rec.member_seconds(wall, cfg.cluster.num_workers)) > 0 else None,
        "emulated_device": cfg.device.model_dump() if cfg.device.samples_per_s else None,
        "emulated_link": link.summary(wall) if link else None,
        "stragglers": cfg.stragglers.model_dump(exclude_none=True) or None,
        "pipeline_depth": cfg.runtime.pipeline_depth,
        "final_eval_reported": final is not None,
        "workers_not_told_stop": sorted(set(core.members.registered) - told_stop),
        "policy": cfg.policy.name,
        "switches": len(core.switching.switches),
        "switch_overhead_s": _overhead_summary(switch_overheads(core.switching.switches)),
        "checkpoints": checkpoints,
        "resumes": rec.counts["resumes"],
    }


def elapsed(core: Core, now: float) -> float:
    """Training's duration on the driver's clock: from its start to its end, or to ``now`` (0.0 is a time
    like any other: a simulator's clock starts there)."""
    end, start = core.finished_at, core.started_at
    return (now if end is None else end) - (now if start is None else start)


def _overhead_summary(overheads: list[float]) -> dict[str, float] | None:
    if not overheads:
        return None
    ordered = sorted(overheads)
    return {"median": round(ordered[len(ordered) // 2], 4), "max": round(ordered[-1], 4)}
