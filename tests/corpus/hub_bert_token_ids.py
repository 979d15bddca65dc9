# Source: keras-team/keras-hub keras_hub/src/models/bert/bert_text_classifier.py
#         (keras-hub 0.32.0, `BertTextClassifier`'s docstring, "Preprocessed integer
#         data": a classifier with `preprocessor=None` fed a dict of token ids, segment
#         ids and a padding mask). The preset backbone it loads (`from_preset`, a
#         download) replaced by a `BertBackbone` of the same class built from its
#         arguments (the docstring's "Custom backbone" form), small: 2 layers of 32.
"""A keras-hub BERT classifier on token ids: a `keras_hub.models.BertTextClassifier`
(a keras-hub `Task`: it compiles itself with its own defaults on construction
and overrides `fit`, `evaluate` and `predict` to run its preprocessor over the
input), over a random-initialized `BertBackbone`, no preprocessor: its inputs
are the backbone's `token_ids`, `segment_ids` and `padding_mask` (variable
lengths, zero-padded), its output 2 logits. The user recompiles it with a
faster learning rate, as keras-hub's guides do (`classifier.compile(optimizer=
keras.optimizers.Adam(...))`: its own `compile`, its default loss and metric).

Synthetic data: sequences of 8-32 token ids, those of class 1 drawn from the
upper half of the vocabulary, those of class 0 from the lower; 1,024 training
and 256 test examples.
"""

from __future__ import annotations

import keras
import keras_hub
import numpy as np

SEQUENCE_LENGTH = 32
VOCABULARY = 100
COMPILE = None  # build() compiles, with the task's own compile
FIT = dict(batch_size=32, epochs=2)
CHAIN = True  # a functional model: the backbone, then the classifier's head


def build():
    backbone = keras_hub.models.BertBackbone(
        vocabulary_size=VOCABULARY,
        num_layers=2,
        num_heads=2,
        hidden_dim=32,
        intermediate_dim=64,
        max_sequence_length=SEQUENCE_LENGTH,
    )
    classifier = keras_hub.models.BertTextClassifier(
        backbone=backbone,
        num_classes=2,
        preprocessor=None,
    )
    classifier.compile(optimizer=keras.optimizers.Adam(1e-3))
    return classifier


def _split(n: int, rng):
    labels = rng.integers(0, 2, size=n).astype("int32")
    half = VOCABULARY // 2
    ids = rng.integers(5, half, size=(n, SEQUENCE_LENGTH)) + (half - 5) * labels[:, None]
    lengths = rng.integers(8, SEQUENCE_LENGTH + 1, size=n)
    mask = np.arange(SEQUENCE_LENGTH)[None, :] < lengths[:, None]
    ids = np.where(mask, ids, 0).astype("int32")
    features = {"token_ids": ids, "segment_ids": np.zeros_like(ids), "padding_mask": mask}
    return features, labels


def data(seed=0):
    rng = np.random.default_rng(seed)
    return _split(1024, rng), _split(256, rng)
