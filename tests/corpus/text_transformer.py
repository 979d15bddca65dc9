# Source: keras-team/keras-io examples/nlp/text_classification_with_transformer.py
#         (commit 1909c6710cd3f5af6401f1176dcee9e26781b4f3), "Text classification with
#         Transformer" (Keras 3). The model of the source: its own layers with the same
#         constructors (no **kwargs, no get_config); IMDB replaced by synthetic token ids.
"""Text classification with a Transformer: the source's own `TransformerBlock`
and `TokenAndPositionEmbedding` layers (their `__init__` take no `**kwargs`
and they define no `get_config`, as published), mean pooling, two Dropouts,
a Dense(20, relu) and a 2-way softmax; `sparse_categorical_crossentropy`.

Synthetic data: reviews of 64 token ids (the source pads to 200; the model
takes `maxlen` from the data); a positive review draws its words from ids
51-100, a negative one from 1-50.
"""

from __future__ import annotations

import keras
import numpy as np
from keras import layers, ops

vocab_size = 20000  # as published: the embedding keeps its 20k rows
MAXLEN = 64
embed_dim, num_heads, ff_dim = 32, 2, 32  # as published
COMPILE = dict(optimizer="adam", loss="sparse_categorical_crossentropy", metrics=["accuracy"])
FIT = dict(batch_size=32, epochs=2)
CHAIN = True


class TransformerBlock(layers.Layer):
    """Self-attention and a 2-layer MLP, each with dropout, a residual and a
    LayerNormalization (epsilon 1e-6)."""

    def __init__(self, embed_dim, num_heads, ff_dim, rate=0.1):
        super().__init__()
        self.att = layers.MultiHeadAttention(num_heads=num_heads, key_dim=embed_dim)
        self.ffn = keras.Sequential([layers.Dense(ff_dim, activation="relu"),
                                     layers.Dense(embed_dim)])
        self.layernorm1, self.layernorm2 = (layers.LayerNormalization(epsilon=1e-6)
                                            for _ in range(2))
        self.dropout1, self.dropout2 = layers.Dropout(rate), layers.Dropout(rate)

    def call(self, inputs):
        attended = self.dropout1(self.att(inputs, inputs))
        h = self.layernorm1(inputs + attended)
        return self.layernorm2(h + self.dropout2(self.ffn(h)))


class TokenAndPositionEmbedding(layers.Layer):
    """A token embedding plus a learned position embedding."""

    def __init__(self, maxlen, vocab_size, embed_dim):
        super().__init__()
        self.token_emb = layers.Embedding(input_dim=vocab_size, output_dim=embed_dim)
        self.pos_emb = layers.Embedding(input_dim=maxlen, output_dim=embed_dim)

    def call(self, x):
        positions = self.pos_emb(ops.arange(start=0, stop=ops.shape(x)[-1], step=1))
        return self.token_emb(x) + positions


def build(input_shape):
    (maxlen,) = input_shape
    inputs = layers.Input(shape=(maxlen,))
    x = TokenAndPositionEmbedding(maxlen, vocab_size, embed_dim)(inputs)
    x = TransformerBlock(embed_dim, num_heads, ff_dim)(x)
    x = layers.GlobalAveragePooling1D()(x)
    x = layers.Dropout(0.1)(x)
    x = layers.Dense(20, activation="relu")(x)
    x = layers.Dropout(0.1)(x)
    outputs = layers.Dense(2, activation="softmax")(x)
    return keras.Model(inputs=inputs, outputs=outputs)


def _split(n, rng):
    y = rng.integers(0, 2, n)
    x = rng.integers(1, 51, (n, MAXLEN)) + 50 * y[:, None]
    return x.astype(np.int32), y.astype(np.int64)


def data(seed=0):
    rng = np.random.default_rng(seed)
    return _split(512, rng), _split(128, rng)
