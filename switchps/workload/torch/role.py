"""PyTorch as a ``frameworks.Framework``: ``nn.Module``s, ``TorchComputer``, ``.pt`` (and ``.safetensors``)
files."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import torch
from torch import nn

from switchps.config.run import RunConfig
from switchps.workload.data import Dataset
from switchps.workload.torch.files import save
from switchps.workload.torch.gradients import TorchComputer
from switchps.workload.torch.scoring import Scorer
from switchps.workload.torch.setup import prepare
from switchps.workload.torch.weights import FlatParams


def _device(model: nn.Module) -> torch.device:
    """Where ``prepare`` put the model."""
    return next(iter(model.state_dict().values()), torch.empty(0)).device


class Torch:
    name = "torch"
    model_suffix = ".pt"

    def prepare(self, cfg: RunConfig, worker: int = 0) -> tuple[Dataset, nn.Module]:
        return prepare(cfg, worker)

    def computer(self, cfg: RunConfig, model: nn.Module, x: np.ndarray, y: np.ndarray) -> TorchComputer:
        return TorchComputer(model, x, y, _device(model))

    def weights(self, model: nn.Module) -> FlatParams:
        return FlatParams(model)

    def scorer(self, model: nn.Module, data: Dataset) -> Scorer:
        return Scorer(model, data, _device(model))

    def save(self, model: nn.Module, path: Path) -> Path:
        return save(model, path)


FRAMEWORK = Torch()
