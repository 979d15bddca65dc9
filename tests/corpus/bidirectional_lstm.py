# Source: keras-team/keras-io examples/nlp/bidirectional_lstm_imdb.py
#         (commit 0a4be8bbc3ae126f3ca49a0bf173902866ec06f0), "Bidirectional LSTM on IMDB".
# The model of the source (same layers and arguments); IMDB replaced by synthetic token ids.
"""Bidirectional LSTM on IMDB: variable-length int32 sequences, an
Embedding(20000, 128), two Bidirectional LSTM(64) layers (the first returning
sequences) and a sigmoid unit; `binary_crossentropy`.

Synthetic data: reviews of 16 token ids (the source pads to 200); a positive
review draws its words from ids 51-100, a negative one from 1-50.
"""

from __future__ import annotations

import keras
import numpy as np
from keras import layers

max_features = 20000  # as published
MAXLEN = 16
COMPILE = dict(optimizer="adam", loss="binary_crossentropy", metrics=["accuracy"])
FIT = dict(batch_size=32, epochs=2)
CHAIN = True


def build():
    inputs = keras.Input(shape=(None,), dtype="int32")  # any length, as published
    x = layers.Embedding(max_features, 128)(inputs)
    for last in (False, True):
        x = layers.Bidirectional(layers.LSTM(64, return_sequences=not last))(x)
    outputs = layers.Dense(1, activation="sigmoid")(x)
    return keras.Model(inputs, outputs)


def _split(n, rng):
    y = rng.integers(0, 2, n)
    x = rng.integers(1, 51, (n, MAXLEN)) + 50 * y[:, None]
    return x.astype(np.int32), y.astype(np.int64)


def data(seed=0):
    rng = np.random.default_rng(seed)
    return _split(512, rng), _split(128, rng)
