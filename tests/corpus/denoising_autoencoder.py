# Source: keras-team/keras-io examples/vision/autoencoder.py
#         (commit 28033e1c219da0430c695fdcbee81552b8c5f594), "Convolutional Autoencoder
#         For Image Denoising". The model and its compile of the source (same layers and
#         arguments), trained as its second fit (noisy images in, clean ones out); MNIST
#         replaced by synthetic 28x28x1 images.
"""Convolutional autoencoder for image denoising: a functional encoder of
two Conv2D(32, 3x3, relu, same) + MaxPooling2D(2, same) and a decoder of two
Conv2D(32) + UpSampling2D(2) and a sigmoid Conv2D(1); `binary_crossentropy`
between its output and the clean image, no metrics. The labels are images
(floats), not classes: tfmulti is given the source's loss, as a user would
pass `--loss=binary_crossentropy` (`TFMULTI`).

Synthetic data: clean images are a bright band at one of 10 row positions
(values in [0, 1]); the inputs add Gaussian noise of 0.4, clipped to [0, 1],
as the source's `noise` does.
"""

from __future__ import annotations

import numpy as np
from keras import layers
from keras.models import Model

COMPILE = dict(optimizer="adam", loss="binary_crossentropy")
FIT = dict(batch_size=32, epochs=2)
TFMULTI = dict(loss="binary_crossentropy")
CHAIN = True


def build():
    image = layers.Input(shape=(28, 28, 1))
    x = image
    for _ in range(2):  # the encoder
        x = layers.Conv2D(32, (3, 3), activation="relu", padding="same")(x)
        x = layers.MaxPooling2D((2, 2), padding="same")(x)
    for _ in range(2):  # the decoder
        x = layers.Conv2D(32, (3, 3), activation="relu", padding="same")(x)
        x = layers.UpSampling2D((2, 2))(x)
    x = layers.Conv2D(1, (3, 3), activation="sigmoid", padding="same")(x)
    return Model(image, x)


def _split(n, rng):
    clean = np.zeros((n, 28, 28, 1), np.float32)
    for i, k in enumerate(rng.integers(0, 10, n)):
        clean[i, 2 * k + 4: 2 * k + 7, 4:24, 0] = 1.0
    noisy = np.clip(clean + 0.4 * rng.normal(0.0, 1.0, clean.shape), 0.0, 1.0)
    return noisy.astype(np.float32), clean


def data(seed=0):
    rng = np.random.default_rng(seed)
    return _split(512, rng), _split(128, rng)
