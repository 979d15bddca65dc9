# Source: keras-team/keras-io examples/vision/mnist_convnet.py
#         (commit 02cfe8063b505adc073986c91729f22039f77ad0), "Simple MNIST convnet".
# The model of the source (same layers and arguments); MNIST replaced by synthetic 28x28x1 images.
"""Simple MNIST convnet: a Sequential of two Conv2D/MaxPooling2D pairs,
Dropout and a 10-way softmax, trained with `categorical_crossentropy` on
ONE-HOT labels (`keras.utils.to_categorical`).

Synthetic data: the digit k is a bright horizontal band at rows 2k+4 to
2k+6 (0.8 brighter) over uniform noise in [0, 0.2), so a convnet separates
the classes in a few steps.
"""

from __future__ import annotations

import keras
import numpy as np
from keras import layers

NUM_CLASSES = 10
INPUT_SHAPE = (28, 28, 1)
COMPILE = dict(loss="categorical_crossentropy", optimizer="adam", metrics=["accuracy"])
FIT = dict(batch_size=32, epochs=2)
CHAIN = True


def build(input_shape=INPUT_SHAPE, num_classes=NUM_CLASSES):
    """The source's Sequential: two (Conv2D 3x3 relu, MaxPooling2D 2x2) with 32
    then 64 filters, Flatten, Dropout(0.5), a softmax over `num_classes`."""
    stack = [keras.Input(shape=input_shape)]
    for filters in (32, 64):
        stack += [layers.Conv2D(filters, kernel_size=(3, 3), activation="relu"),
                  layers.MaxPooling2D(pool_size=(2, 2))]
    stack += [layers.Flatten(), layers.Dropout(0.5),
              layers.Dense(num_classes, activation="softmax")]
    return keras.Sequential(stack)


def _split(n, rng):
    digits = rng.integers(0, NUM_CLASSES, n)
    x = rng.random((n, 28, 28, 1), dtype=np.float32) * 0.2
    for i, k in enumerate(digits):
        x[i, 2 * k + 4: 2 * k + 7, 4:24, 0] += 0.8
    # convert class vectors to binary class matrices, as published
    return x, keras.utils.to_categorical(digits, NUM_CLASSES)


def data(seed=0):
    rng = np.random.default_rng(seed)
    return _split(512, rng), _split(128, rng)
