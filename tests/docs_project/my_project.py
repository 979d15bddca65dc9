"""The user's project the docs' command lines name (`--model=my_project:build`,
`--dataset=my_project:data`, ...): the functions of README.md's example. The
docs tests run those commands from this folder, as a user runs them from
theirs."""

from __future__ import annotations

import os

import keras
import numpy as np
import tensorflow as tf


def build(input_shape):
    pixels = keras.Input(input_shape["pixels"], name="pixels")
    extra = keras.Input(input_shape["extra"], name="extra")
    h = keras.layers.Dense(32, activation="relu")(keras.layers.Concatenate()([pixels, extra]))
    h = keras.layers.Add()([h, keras.layers.Dense(32, activation="relu")(h)])
    return keras.Model({"pixels": pixels, "extra": extra}, keras.layers.Dense(2)(h))


def data(seed=0):
    rng = np.random.default_rng(seed)

    def split(n):
        x = {"pixels": rng.random((n, 16), dtype=np.float32),
             "extra": rng.random((n, 4), dtype=np.float32)}
        return x, (x["pixels"].sum(axis=1) > 8).astype(np.int32)

    return split(2048), split(512)


def my_loss(y_true, logits):
    y = tf.one_hot(tf.cast(tf.reshape(y_true, [-1]), tf.int32), 2)
    return keras.losses.categorical_crossentropy(y, logits, from_logits=True,
                                                 label_smoothing=0.1)


_FEATURES = {"pixels": tf.io.FixedLenFeature([16], tf.float32),
             "extra": tf.io.FixedLenFeature([4], tf.float32),
             "label": tf.io.FixedLenFeature([], tf.int64)}


def parse(record):
    example = tf.io.parse_single_example(record, _FEATURES)
    return {"pixels": example["pixels"], "extra": example["extra"]}, example["label"]


def tfrecords():
    """Training files $MY_PROJECT_FILES (a glob), read by worker; the test split in memory."""
    import tfmulti

    train = tfmulti.data.from_files(os.environ.get("MY_PROJECT_FILES", "data/train-*.tfrecord"),
                                    parse)
    return train, data(1)[1]
