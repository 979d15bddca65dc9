# Source: keras-team/keras-io guides/functional_api.py, "Models with multiple inputs and
#         outputs". Read at commit 6f78709a673691753bdba7f1422390a73a93a1a5 (its tf.keras
#         form: the same layers, outputs as a list) and in its Keras 3 form as keras.io
#         publishes it now (`import keras`; the model's outputs a dict by name), stored in
#         the keras-io fork Xcoke919/keras-io at commit
#         67e2c7062095bcae4746153831a1ac547abb9b42. The model and the source's second
#         compile (a loss and a loss weight per output, by name); its random dummy data
#         replaced by synthetic tickets with a rule.
"""Ticket priority and department: three named inputs (`title` and `body`,
variable-length sequences of word ids, each embedded (10,000 words, 64
dimensions) and read by an LSTM (128 and 32 units); `tags`, a binary vector
of 12 tags), concatenated, and two named linear heads: `priority` (1 unit)
and `department` (4 units). The model's outputs are a dict by name, and it is
compiled by its author with a dict of losses (`BinaryCrossentropy` and
`CategoricalCrossentropy`, both `from_logits=True`, matching the heads, which
have no activation) and a dict of `loss_weights` (1.0 and 0.2), no metrics.
The data is fed as a dict of inputs by name and a dict of labels by output.
`build()` returns the model compiled as the source compiles it
(`COMPILE = None`).

Why this program and not the multi-output model of
`guides/training_with_built_in_methods.py`: that one gives its linear
`class_output` head (no softmax) a `CategoricalCrossentropy()` that is not
from logits, so its loss normalizes raw scores that can be negative; it
trains on no meaningful quantity. Here both losses are computed as the
source computes them and are what a user of these heads would want.

Synthetic data: sizes as the source's dummy data takes them (titles of 10
words, bodies of 100, 12 tags; 1,280 training tickets, 256 for testing). The
department is one-hot; a ticket of department k has title words drawn from
ids 25k+1 to 25k+12 when it is routine and 25k+13 to 25k+24 when it is urgent,
a body of words from the whole vocabulary and random tags (noise). The
priority target is a score in [0, 1] like the source's (a soft label for the
binary cross-entropy): 0.9 for an urgent ticket, 0.1 for a routine one. (A
rule on the tags is not learned in 2 epochs: each tag reaches the priority
head through one Dense weight, which 80 RMSprop steps of 1e-3 move too little;
the title's LSTM features learn this one.)
"""

from __future__ import annotations

import keras
import numpy as np
from keras import layers

num_tags = 12  # unique issue tags
num_words = 10000  # vocabulary size
num_departments = 4
TITLE_LENGTH, BODY_LENGTH = 10, 100  # the source's dummy data's
COMPILE = None  # build() compiles, as the source does
FIT = dict(batch_size=32, epochs=2)
# A chain: the cut crosses after the title's LSTM; the body and tags are side inputs of the
# last stage, which holds both heads.
CHAIN = True


def build():
    """The source's three-input, two-output model, compiled as the source's
    second compile (losses and loss weights by output name)."""
    title_input = keras.Input(shape=(None,), name="title")  # variable-length word ids
    body_input = keras.Input(shape=(None,), name="body")
    tags_input = keras.Input(shape=(num_tags,), name="tags")  # binary vectors

    title_features = layers.Embedding(num_words, 64)(title_input)
    body_features = layers.Embedding(num_words, 64)(body_input)
    title_features = layers.LSTM(128)(title_features)
    body_features = layers.LSTM(32)(body_features)
    x = layers.concatenate([title_features, body_features, tags_input])

    priority_pred = layers.Dense(1, name="priority")(x)
    department_pred = layers.Dense(num_departments, name="department")(x)
    model = keras.Model(
        inputs=[title_input, body_input, tags_input],
        outputs={"priority": priority_pred, "department": department_pred},
    )
    model.compile(
        optimizer=keras.optimizers.RMSprop(1e-3),
        loss={
            "priority": keras.losses.BinaryCrossentropy(from_logits=True),
            "department": keras.losses.CategoricalCrossentropy(from_logits=True),
        },
        loss_weights={"priority": 1.0, "department": 0.2},
    )
    return model


def _tickets(n, rng):
    department = rng.integers(0, num_departments, n)
    urgent = rng.integers(0, 2, n)
    title = rng.integers(1, 13, (n, TITLE_LENGTH)) + 25 * department[:, None] + 12 * urgent[:, None]
    body = rng.integers(1, num_words, (n, BODY_LENGTH))
    tags = rng.integers(0, 2, (n, num_tags)).astype(np.float32)
    features = {"title": title.astype(np.int32), "body": body.astype(np.int32), "tags": tags}
    labels = {"priority": np.where(urgent, 0.9, 0.1)[:, None].astype(np.float32),
              "department": keras.utils.to_categorical(department, num_departments)}
    return features, labels


def data(seed=0):
    """((inputs by name, labels by output), the same for testing) of NumPy arrays."""
    rng = np.random.default_rng(seed)
    return _tickets(1280, rng), _tickets(256, rng)
