"""TensorFlow as a ``frameworks.Framework``: Keras models, ``GradientComputer``, ``.keras`` files."""

from __future__ import annotations

from pathlib import Path

import keras
import numpy as np

from switchps.config.run import RunConfig
from switchps.workload.data import Dataset
from switchps.workload.frameworks import Framework
from switchps.workload.tensorflow.gradients import GradientComputer
from switchps.workload.tensorflow.scoring import Evaluator
from switchps.workload.tensorflow.setup import prepare
from switchps.workload.tensorflow.weights import FlatWeights, save_keras


class TensorFlow:
    name = "tensorflow"
    model_suffix = ".keras"

    def prepare(self, cfg: RunConfig, worker: int = 0) -> tuple[Dataset, keras.Model]:
        return prepare(cfg)

    def computer(self, cfg: RunConfig, model: keras.Model, x: np.ndarray, y: np.ndarray) -> GradientComputer:
        return GradientComputer(model, x, y)

    def weights(self, model: keras.Model) -> FlatWeights:
        return FlatWeights(model)

    def scorer(self, model: keras.Model, data: Dataset) -> Evaluator:
        return Evaluator(model, data)

    def save(self, model: keras.Model, path: Path) -> Path:
        return save_keras(model, path)


FRAMEWORK: Framework = TensorFlow()  # mypy checks it keeps the seam
