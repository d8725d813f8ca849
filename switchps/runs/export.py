"""`switchps export`: the run's model (Keras or PyTorch) from any checkpoint of a run, loadable without switchps.

A command, not worker code: it joins the PS's checkpoint file (``ps_server.checkpoint``) and the
worker's model (``workload``), so it sits above both."""

from __future__ import annotations

import logging
from pathlib import Path

import numpy as np

from switchps.checks import PREFLIGHT
from switchps.config.run import load_config
from switchps.errors import RunDirError
from switchps.protos import switchps_pb2 as pb
from switchps.ps_server import checkpoint
from switchps.ps_server.shard.checkpoint import whole_model
from switchps.workload.frameworks import framework

log = logging.getLogger("switchps.runs.export")


def export(run_dir: Path, version: int | None = None, out: Path | None = None) -> Path:
    """Write the model of ``run_dir``'s checkpoint of ``version`` (default: the latest) as the framework's model file."""
    if not (run_dir / "config.yaml").is_file():
        raise RunDirError(f"{run_dir} is not a run directory (no config.yaml)")
    ckpt = checkpoint.latest(run_dir / "checkpoints", version)
    if ckpt is None:
        which = "" if version is None else f" of version {version}"
        kept = ", ".join(str(int(p.stem[1:])) for p in checkpoint.files(run_dir / "checkpoints")) or "none"
        raise RunDirError(f"{run_dir}: no readable checkpoint{which} (versions kept: {kept})")
    cfg = load_config(run_dir / "config.yaml", checks=PREFLIGHT)
    fw = framework(cfg.model.framework)
    _, model = fw.prepare(cfg)
    weights = fw.weights(model)
    weights.assign(_values(ckpt, run_dir, weights.layout(), cfg.runtime.shard_max_bytes))
    path = fw.save(model, out or run_dir / f"model-v{ckpt.version}{fw.model_suffix}")
    log.info("exported version %d of %s to %s", ckpt.version, run_dir, path)
    return path


def _values(ckpt: checkpoint.Checkpoint, run_dir: Path, layout: pb.Layout, max_bytes: int) -> np.ndarray:
    """The checkpoint's whole parameter vector (a sharded PS's: every shard's part, joined)."""
    if ckpt.state.get("shards"):
        try:
            return whole_model(ckpt, run_dir, layout, max_bytes)
        except ValueError as e:
            raise RunDirError(str(e)) from None
    if pb.Layout.FromString(ckpt.state["layout"].tobytes()).digest != layout.digest:
        raise RunDirError(f"{ckpt.path}: its variables do not match the model in {run_dir}/config.yaml")
    values: np.ndarray = ckpt.state["values"]
    return values
