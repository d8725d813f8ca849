"""A Keras model's float32 variables as one flat vector: trainable, then non-trainable state.

The flat vector is what crosses the wire. Its first ``trainable_size``
elements are the trainable variables; the rest are non-trainable float32
state such as BatchNorm's moving mean and variance, which the PS keeps per
version so that evaluation and the exported model use real statistics.
"""

from __future__ import annotations

import math
from pathlib import Path

import keras
import numpy as np
import tensorflow as tf

from switchps.protos import switchps_pb2 as pb
from switchps.protos.layout import make_layout


def _name(v: keras.Variable) -> str:
    return getattr(v, "path", v.name)


class FlatWeights:
    """Reads and assigns a model's variables as one float32 vector (trainable first)."""

    def __init__(self, model: keras.Model) -> None:
        self.model = model
        self.trainable = list(model.trainable_variables)
        self.state = [v for v in model.non_trainable_weights if v.dtype == "float32"]
        self.variables = self.trainable + self.state
        self.shapes = [tuple(int(d) for d in v.shape) for v in self.variables]
        self.sizes = [math.prod(s) for s in self.shapes]
        self.trainable_size = sum(self.sizes[: len(self.trainable)])
        self.size = sum(self.sizes)
        self.spec = tf.TensorSpec([self.size], tf.float32)
        self._assign = tf.function(self.load, input_signature=[self.spec]).get_concrete_function()  # traced once

    def layout(self) -> pb.Layout:
        """The wire layout: (name, shape) per variable, trainable then state."""
        specs = [(_name(v), s) for v, s in zip(self.variables, self.shapes)]
        k = len(self.trainable)
        return make_layout(specs[:k], specs[k:])

    def read(self) -> np.ndarray:
        return np.concatenate([np.ravel(v.numpy()) for v in self.variables]).astype(np.float32, copy=False)

    def parts(self, flat: tf.Tensor) -> list[tf.Tensor]:
        """A flat vector as one tensor per variable (trainable, then state), its slices reshaped: views of
        ``flat`` wherever TF can keep them so (a 64-byte aligned slice)."""
        ends = [int(e) for e in np.cumsum(self.sizes)]
        return [tf.reshape(flat[end - size : end], shape) for end, size, shape in zip(ends, self.sizes, self.shapes)]

    def load(self, flat: tf.Tensor) -> None:
        """Assign a flat vector to the variables; for use inside a ``tf.function`` (one call, not one per
        variable)."""
        for v, part in zip(self.variables, self.parts(flat)):
            v.assign(part)

    def tensor(self) -> tf.Tensor:
        """The variables' values as one flat tensor (inside a ``tf.function``: read in program order)."""
        return tf.concat([tf.reshape(v.value, [-1]) for v in self.variables], axis=0)

    def assign(self, flat: np.ndarray) -> None:
        """Load a flat vector (trainable then state) into the model's variables."""
        self._assign(tf.convert_to_tensor(flat))


def save_keras(model: keras.Model, path: Path) -> Path:
    """Write ``model`` as a ``.keras`` file atomically: a reader never sees half a file."""
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(f".{path.stem}.tmp.keras")
    model.save(tmp)
    tmp.replace(path)
    return path
