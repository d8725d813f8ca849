"""Test loss and accuracy of a Keras model on the held-out set, in one traced TF function."""

from __future__ import annotations

import keras

from switchps.workload.data import Dataset


class Evaluator:
    """Test loss and accuracy of the model's current weights on the held-out set."""

    def __init__(self, model: keras.Model, data: Dataset, batch: int = 1024) -> None:
        import tensorflow as tf

        self.x, self.y, self.batch = data.x_test, data.y_test, batch
        signature = [tf.TensorSpec([None, *data.input_shape], tf.float32), tf.TensorSpec([None], tf.int32)]

        @tf.function(input_signature=signature)
        def score(x, y):
            logits = model(x, training=False)
            loss = tf.reduce_sum(tf.keras.losses.sparse_categorical_crossentropy(y, logits, from_logits=True))
            correct = tf.reduce_sum(tf.cast(tf.equal(tf.argmax(logits, axis=-1, output_type=y.dtype), y), tf.float32))
            return loss, correct

        self._score = score

    def __call__(self) -> tuple[float, float]:
        loss = correct = 0.0
        for i in range(0, len(self.x), self.batch):
            l, c = self._score(self.x[i : i + self.batch], self.y[i : i + self.batch])
            loss, correct = loss + float(l), correct + float(c)
        n = len(self.x)
        return loss / n, correct / n
