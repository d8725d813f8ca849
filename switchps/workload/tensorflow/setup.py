"""What every TensorFlow role does first: limit TF's threads, load the data, build the model."""

from __future__ import annotations

import keras
import tensorflow as tf

from switchps.config.run import RunConfig
from switchps.workload.data import Dataset, configured_dataset
from switchps.workload.tensorflow.models import build_model


def configure_threads(intra_op: int, inter_op: int) -> None:
    """Limit TF's thread pools. Only before TF's first op: in a process where TF already ran (the simulator
    called from a session that used TF), its pools stay as they are."""
    try:
        tf.config.threading.set_intra_op_parallelism_threads(intra_op)
        tf.config.threading.set_inter_op_parallelism_threads(inter_op)
    except RuntimeError:  # "cannot be modified after initialization"
        pass


def prepare(cfg: RunConfig) -> tuple[Dataset, keras.Model]:
    """The run's dataset and its model, seeded, with TF limited to the configured threads."""
    configure_threads(cfg.runtime.intra_op_threads, cfg.runtime.inter_op_threads)
    data = configured_dataset(cfg)
    model = build_model(cfg.model.name, data.input_shape, data.num_classes, seed=cfg.seed, **cfg.model.kwargs)
    return data, model
