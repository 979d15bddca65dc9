# Source: keras-team/keras-io guides/understanding_masking_and_padding.py, its Keras 3
#         form guides/keras_core/understanding_masking_and_padding.py
#         (commit 855e37d4f5562751e6694cdadf93b2b7a72c935f; `import keras`, `keras.ops`;
#         commit be6d3665bad56d9e9ce5ad7ef083da75dd514afc is the tf.keras form),
#         "Opting-in to mask propagation on compatible layers". The guide's model
#         (Embedding(mask_zero=True), its own MyActivation, LSTM(32)) with a classifier
#         head and a compile the guide does not have (it only calls the model); its
#         random token ids replaced by padded sequences with a rule.
"""Masking and padding: a functional model over variable-length sequences of
word ids (`Input(shape=(None,), dtype="int32")`), an
`Embedding(input_dim=5000, output_dim=16, mask_zero=True)` that makes a mask
of the non-zero ids, the guide's own `MyActivation` layer (a ReLU that sets
`supports_masking = True`, so the mask passes through it) and an `LSTM(32)`
that receives the mask and skips the padded steps.

The guide stops at the LSTM's 32 features and never trains; the corpus adds
the smallest head and compile that make it a classifier: `Dense(1,
activation="sigmoid")`, `binary_crossentropy`, adam, accuracy. The model is a
chain of layers (`CHAIN`): a pipeline cut after the embedding or the
activation must carry the mask across.

Synthetic data: sequences of 2 to 48 word ids, padded with zeros at the end
to 48 steps (the guide pads "post", as it recommends for RNNs; its example
calls take 100 steps); 1,024 for training and 256 for testing. A sequence is
positive when most of its words are "positive" ones (ids 51-100) rather than
"negative" ones (ids 1-50): the rule depends on the unpadded tokens only, and
their count varies.
"""

from __future__ import annotations

import keras
import numpy as np
from keras import layers, ops

MAXLEN = 48
COMPILE = dict(optimizer="adam", loss="binary_crossentropy", metrics=["accuracy"])
FIT = dict(batch_size=32, epochs=2)
CHAIN = True


class MyActivation(keras.layers.Layer):
    def __init__(self, **kwargs):
        super().__init__(**kwargs)
        self.supports_masking = True  # the layer passes its input's mask on

    def call(self, inputs):
        return ops.relu(inputs)


def build():
    inputs = keras.Input(shape=(None,), dtype="int32")
    x = layers.Embedding(input_dim=5000, output_dim=16, mask_zero=True)(inputs)
    x = MyActivation()(x)  # passes the mask along
    x = layers.LSTM(32)(x)  # receives the mask
    outputs = layers.Dense(1, activation="sigmoid")(x)  # the corpus' head
    return keras.Model(inputs, outputs)


def _split(n, rng):
    lengths = rng.integers(2, MAXLEN + 1, n)
    share = rng.uniform(0.0, 1.0, n)  # of positive words
    x = np.zeros((n, MAXLEN), np.int32)  # 0: padding
    for i, (length, p) in enumerate(zip(lengths, share)):
        positive = rng.random(length) < p
        x[i, :length] = rng.integers(1, 51, length) + 50 * positive
    y = ((x > 50).sum(axis=1) * 2 > lengths).astype(np.int64)
    return x, y


def data(seed=0):
    rng = np.random.default_rng(seed)
    return _split(1024, rng), _split(256, rng)
