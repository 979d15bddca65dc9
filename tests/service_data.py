"""Data and a model that count the training examples they see, by id, for the
tf.data service's tests (`tests/integration/test_data_service.py`).

Each example's first feature is its id. The model's training step adds the
ids of its replica's batch to a per-replica count (a sync-on-read variable
summed over every replica of every worker when read); `callbacks` returns a
callback that, at each epoch's end, reads the counts on every worker (a
collective) and the chief appends them to the JSON-lines file named by
$SERVICE_COUNTS.
"""

from __future__ import annotations

import json
import os

import keras
import numpy as np
import tensorflow as tf

NUM_EXAMPLES = 512
FEATURES = 8


def dataset(seed: int = 0):
    rng = np.random.default_rng(seed)
    x = rng.normal(size=(NUM_EXAMPLES, FEATURES)).astype("float32")
    y = (x[:, 1] + x[:, 2] > 0).astype("int32")
    x[:, 0] = np.arange(NUM_EXAMPLES)

    def scale(features, label):  # a map the service worker runs
        return tf.concat([features[:1], features[1:] * 2.0], axis=0), label

    train = tf.data.Dataset.from_tensor_slices((x, y)).map(scale)
    return {"train": train, "test": (x[:128], y[:128]), "num_classes": 2}


@keras.saving.register_keras_serializable(package="tests")
class CountingModel(keras.Model):
    """Drops the id column, classifies the rest; counts the ids it trains on."""

    def __init__(self, **kwargs):
        super().__init__(**kwargs)
        self.hidden = keras.layers.Dense(16, activation="relu")
        self.out = keras.layers.Dense(2)
        self.id_counts = tf.Variable(
            tf.zeros([NUM_EXAMPLES]), trainable=False,
            synchronization=tf.VariableSynchronization.ON_READ,
            aggregation=tf.VariableAggregation.SUM)

    def call(self, x):
        return self.out(self.hidden(x[:, 1:]))

    def train_step(self, data):
        ids = tf.cast(data[0][:, 0], tf.int32)
        self.id_counts.assign_add(tf.math.bincount(
            ids, minlength=NUM_EXAMPLES, maxlength=NUM_EXAMPLES, dtype=tf.float32))
        return super().train_step(data)


def model(input_shape, num_classes):
    built = CountingModel()
    built(keras.Input(input_shape))
    built.compile(optimizer=keras.optimizers.SGD(0.05),
                  loss=keras.losses.SparseCategoricalCrossentropy(from_logits=True),
                  metrics=["accuracy"])
    return built


class _WriteCounts(keras.callbacks.Callback):
    def __init__(self, path: str | None, is_chief: bool):
        super().__init__()
        self.path, self.is_chief = path, is_chief

    def on_epoch_end(self, epoch, logs=None):
        counts = self.model.id_counts.numpy()  # summed over every replica and worker
        if self.is_chief and self.path:
            with open(self.path, "a") as f:
                f.write(json.dumps([int(c) for c in counts]) + "\n")


def callbacks(is_chief: bool):
    return [_WriteCounts(os.environ.get("SERVICE_COUNTS"), is_chief)]
