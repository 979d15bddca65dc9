# Source: keras-team/keras-io examples/timeseries/timeseries_classification_from_scratch.py
#         (commit 02cfaa2fc681064105deb460bde3a5f5e4e0e817),
#         "Timeseries classification from scratch".
# The model, compile and callbacks of the source (same layers, arguments, monitors);
# FordA replaced by synthetic series.
"""Timeseries classification from scratch: a fully convolutional network
(three Conv1D + BatchNormalization + ReLU blocks, global average pooling, a
softmax), `sparse_categorical_crossentropy` on integer labels, and callbacks
that watch `val_loss` (`validation_split=0.2`).

Synthetic data: 1,536 training and 256 test series, univariate, of 128
steps (FordA's are 500; the model takes its length from the data); class 0
is a slow sine, class 1 a fast one, each with a random phase and noise.
Each series is z-normalised like FordA's, then scaled by 4: at unit scale
the first convolution's outputs have a variance near 0.03, which
BatchNormalization's moving variance (starting at 1, momentum 0.99) takes
some 500 steps to reach, so after 2 short epochs the model would answer one
class in inference mode, in plain Keras as in tfmulti (the source trains 500
epochs).
"""

from __future__ import annotations

import keras
import numpy as np

LENGTH = 128
SCALE = 4.0  # see the module docstring
num_classes = 2  # the published code counts the classes of its data: 2
COMPILE = dict(optimizer="adam", loss="sparse_categorical_crossentropy", metrics=["accuracy"])
FIT = dict(batch_size=32, epochs=2, validation_split=0.2)
CHAIN = True


def make_model(input_shape):
    """Three blocks of Conv1D(64, 3, "same"), BatchNormalization and ReLU, global
    average pooling and a softmax over `num_classes`, as the source builds it."""
    inputs = keras.layers.Input(input_shape)
    h = inputs
    for _ in range(3):
        h = keras.layers.Conv1D(filters=64, kernel_size=3, padding="same")(h)
        h = keras.layers.BatchNormalization()(h)
        h = keras.layers.ReLU()(h)
    h = keras.layers.GlobalAveragePooling1D()(h)
    outputs = keras.layers.Dense(num_classes, activation="softmax")(h)
    return keras.models.Model(inputs=inputs, outputs=outputs)


def build(input_shape):
    return make_model(input_shape=input_shape)


def callbacks(folder):
    """The published callbacks (the checkpoint written under `folder`)."""
    return [
        keras.callbacks.ModelCheckpoint(
            f"{folder}/best_model.keras", save_best_only=True, monitor="val_loss"
        ),
        keras.callbacks.ReduceLROnPlateau(
            monitor="val_loss", factor=0.5, patience=20, min_lr=0.0001
        ),
        keras.callbacks.EarlyStopping(monitor="val_loss", patience=50, verbose=1),
    ]


def _split(n, rng):
    y = rng.integers(0, 2, n)
    t = np.arange(LENGTH, dtype=np.float32) / LENGTH
    phase = rng.random((n, 1)) * 2 * np.pi
    freq = np.where(y[:, None] == 1, 12.0, 3.0)
    x = np.sin(2 * np.pi * freq * t[None, :] + phase) + 0.3 * rng.standard_normal((n, LENGTH))
    x = SCALE * (x - x.mean(axis=1, keepdims=True)) / x.std(axis=1, keepdims=True)
    # a multivariate series of one channel, as published
    return x.reshape((n, LENGTH, 1)).astype(np.float32), y.astype(np.int64)


def data(seed=0):
    rng = np.random.default_rng(seed)
    return _split(1536, rng), _split(256, rng)
