"""What every PyTorch role does first: limit torch's threads, pick the device, load the data, build the
model (and load ``model.state_dict`` into it)."""

from __future__ import annotations

from pathlib import Path

import torch
from torch import nn

from switchps.config.run import RunConfig
from switchps.workload.data import Dataset, configured_dataset
from switchps.workload.torch.files import load
from switchps.workload.torch.models import build_model


def configure_threads(intra_op: int, inter_op: int) -> None:
    """Limit torch's thread pools. The inter-op pool can be sized only once, before any parallel work: in a
    process where torch already did (the simulator called from a session that used torch) it stays."""
    torch.set_num_threads(intra_op)
    try:
        torch.set_num_interop_threads(inter_op)
    except RuntimeError:  # "cannot set number of interop threads after parallel work has started or ... set"
        pass


def resolve_device(device: str, worker: int = 0) -> torch.device:
    """``runtime.device`` for role ``worker``: auto is GPU ``worker`` mod the GPUs there are, else the CPU."""
    if device == "auto":
        count = torch.cuda.device_count() if torch.cuda.is_available() else 0
        return torch.device(f"cuda:{worker % count}") if count else torch.device("cpu")
    if device.startswith("cuda") and not torch.cuda.is_available():
        raise ValueError(f"runtime.device: {device} but torch sees no GPU (torch {torch.__version__})")
    return torch.device(device)


def load_state_dict(module: nn.Module, path: str) -> None:
    """Load the ``model.state_dict`` file ``path`` into ``module``, strictly: every key, every shape."""
    try:
        module.load_state_dict(load(Path(path)), strict=True)
    except (RuntimeError, OSError, ValueError) as e:
        raise ValueError(f"model.state_dict {path} does not fit the model: {e}") from e


def prepare(cfg: RunConfig, worker: int = 0) -> tuple[Dataset, nn.Module]:
    """The run's dataset and its model, seeded (or loaded from ``model.state_dict``), on ``worker``'s
    device, with torch limited to the configured threads."""
    configure_threads(cfg.runtime.intra_op_threads, cfg.runtime.inter_op_threads)
    data = configured_dataset(cfg)
    model = build_model(cfg.model.name, data.input_shape, data.num_classes, seed=cfg.seed, **cfg.model.kwargs)
    if cfg.model.state_dict is not None:
        load_state_dict(model, cfg.model.state_dict)
    return data, model.to(resolve_device(cfg.runtime.device, worker))
