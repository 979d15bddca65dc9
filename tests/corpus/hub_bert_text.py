# Source: keras-team/keras-hub keras_hub/src/models/bert/bert_text_classifier.py
#         (keras-hub 0.32.0, `BertTextClassifier`'s docstring, "Custom backbone and
#         vocabulary": a `BertTokenizer` over a word-piece vocabulary of its own, a
#         `BertTextClassifierPreprocessor`, a `BertBackbone` and the classifier, fit on
#         raw strings). The same classes and arguments; the vocabulary holds the words
#         of the synthetic sentences, the backbone is small (2 layers of 32) and the
#         sequences 16 tokens.
"""A keras-hub BERT classifier trained from raw strings: its attached
`BertTextClassifierPreprocessor` tokenizes each sentence and packs it with
`[CLS]`/`[SEP]` into token ids, segment ids and a padding mask of 16, inside
the task's own `fit` under plain Keras, in tfmulti's input pipeline under
tfmulti. The user recompiles it with a faster learning rate (its own compile,
its default loss and metric).

Synthetic data: sentences of 3-8 words ending in ".", the words of class 0 from
one half of the vocabulary ("the quick brown fox jumped"), those of class 1
from the other ("i forgot my homework today"); 1,024 training and 256 test
sentences.
"""

from __future__ import annotations

import keras
import keras_hub
import numpy as np

WORDS = (["The", "quick", "brown", "fox", "jumped"], ["I", "forgot", "my", "homework", "today"])
SEQUENCE_LENGTH = 16
COMPILE = None  # build() compiles, with the task's own compile
FIT = dict(batch_size=32, epochs=2)
CHAIN = True


def build():
    vocab = ["[UNK]", "[CLS]", "[SEP]", "[PAD]", "[MASK]"]
    vocab += [word.lower() for words in WORDS for word in words] + ["."]
    tokenizer = keras_hub.models.BertTokenizer(
        vocabulary=vocab,
    )
    preprocessor = keras_hub.models.BertTextClassifierPreprocessor(
        tokenizer=tokenizer,
        sequence_length=SEQUENCE_LENGTH,
    )
    backbone = keras_hub.models.BertBackbone(
        vocabulary_size=len(vocab),
        num_layers=2,
        num_heads=2,
        hidden_dim=32,
        intermediate_dim=64,
        max_sequence_length=SEQUENCE_LENGTH,
    )
    classifier = keras_hub.models.BertTextClassifier(
        backbone=backbone,
        preprocessor=preprocessor,
        num_classes=2,
    )
    classifier.compile(optimizer=keras.optimizers.Adam(1e-3))
    return classifier


def _split(n: int, rng):
    labels = rng.integers(0, 2, size=n).astype("int32")
    sentences = [" ".join(rng.choice(WORDS[label], size=rng.integers(3, 9))) + "."
                 for label in labels]
    return np.array(sentences), labels


def data(seed=0):
    rng = np.random.default_rng(seed)
    return _split(1024, rng), _split(256, rng)
