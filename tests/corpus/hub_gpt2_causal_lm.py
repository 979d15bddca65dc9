# Source: keras-team/keras-hub keras_hub/src/models/gpt2/gpt2_causal_lm.py
#         (keras-hub 0.32.0, `GPT2CausalLM`'s docstring, "Custom backbone and
#         vocabulary": a `GPT2Tokenizer` over a byte-pair vocabulary and merges of its
#         own, a `GPT2CausalLMPreprocessor`, a `GPT2Backbone` and the language model,
#         fit on raw strings). The same classes and arguments; the docstring's
#         vocabulary lacks the pieces its merges name, which keras-hub 0.32 refuses
#         ("Merge rule 'Ġ q' contains token 'Ġ' or 'q' that is not in the
#         vocabulary"), so every piece is listed; the backbone is small (2 layers of
#         32) and the sequences 16 tokens.
"""A keras-hub GPT-2 language model trained from raw text: its attached
`GPT2CausalLMPreprocessor` tokenizes each text into byte-pair ids and makes
the labels (the next token) and the sample weights (the padding) itself,
inside the task's own `fit` under plain Keras, in tfmulti's input pipeline
under tfmulti: the data has no labels. The user recompiles it with a faster
learning rate (its own compile: its default loss, its metric, its sampler).

Synthetic data: texts "a quick fox quick fox." of 1 to 4 "quick fox"; 512
training and 128 test texts, as a `tf.data.Dataset` of strings. A model that
has learned them continues "a quick" with " fox".
"""

from __future__ import annotations

import keras
import keras_hub
import numpy as np
import tensorflow as tf

SEQUENCE_LENGTH = 16
COMPILE = None  # build() compiles, with the task's own compile
FIT = dict(batch_size=32, epochs=2)
CHAIN = True


def build():
    pieces = ["<|endoftext|>", "a", ".", "Ġ", "q", "u", "i", "c", "k", "f", "o", "x",
              "Ġq", "ui", "ck", "uick", "Ġquick", "Ġf", "ox", "Ġfox"]
    vocab = {piece: index for index, piece in enumerate(pieces)}
    merges = ["Ġ q", "u i", "c k", "ui ck", "Ġq uick"]
    merges += ["Ġ f", "o x", "Ġf ox"]
    tokenizer = keras_hub.models.GPT2Tokenizer(
        vocabulary=vocab,
        merges=merges,
    )
    preprocessor = keras_hub.models.GPT2CausalLMPreprocessor(
        tokenizer=tokenizer,
        sequence_length=SEQUENCE_LENGTH,
    )
    backbone = keras_hub.models.GPT2Backbone(
        vocabulary_size=len(vocab),
        num_layers=2,
        num_heads=2,
        hidden_dim=32,
        intermediate_dim=64,
        max_sequence_length=SEQUENCE_LENGTH,
    )
    causal_lm = keras_hub.models.GPT2CausalLM(
        backbone=backbone,
        preprocessor=preprocessor,
    )
    causal_lm.compile(optimizer=keras.optimizers.Adam(1e-2))
    return causal_lm


def _split(n: int, rng) -> tf.data.Dataset:
    texts = ["a" + " quick fox" * int(k) + "." for k in rng.integers(1, 5, size=n)]
    return tf.data.Dataset.from_tensor_slices(texts)


def data(seed=0):
    rng = np.random.default_rng(seed)
    return _split(512, rng), _split(128, rng)
