"""A user's program with two outputs, as the Keras guides write one: two
named inputs, a shared trunk, a binary head and a 3-class head; `build`
compiles it as its author would (a loss, a loss weight and metrics per
output, RMSprop), `build_plain` leaves it uncompiled. And an imbalanced
task with per-example weights. None of it comes from tfmulti.

The tests use it from Python (`tests.two_outputs`) and from the command line
(`--model=tests.two_outputs:build --dataset=tests.two_outputs:data`).
"""

from __future__ import annotations

import keras
import numpy as np


def _model():
    title = keras.Input((8,), name="title")
    body = keras.Input((4,), name="body")
    x = keras.layers.Concatenate()([title, body])
    x = keras.layers.Dense(16, activation="relu", name="trunk")(x)
    priority = keras.layers.Dense(1, activation="sigmoid", name="priority")(x)
    department = keras.layers.Dense(3, name="department")(x)
    return keras.Model({"title": title, "body": body},
                       {"priority": priority, "department": department}, name="tickets")


def build(seed=0):
    """The model, compiled as its author compiles it."""
    model = _model()
    model.compile(
        optimizer=keras.optimizers.RMSprop(2e-3),
        loss={"priority": keras.losses.BinaryCrossentropy(),
              "department": keras.losses.SparseCategoricalCrossentropy(from_logits=True)},
        loss_weights={"priority": 1.0, "department": 0.2},
        metrics={"priority": ["accuracy"], "department": ["accuracy"]})
    return model


def build_plain(seed=0):
    """The same model, not compiled."""
    return _model()


def _tickets(n, rng):
    title = rng.normal(size=(n, 8)).astype("float32")
    body = rng.normal(size=(n, 4)).astype("float32")
    labels = {"priority": (title[:, 0] > 0).astype("int32")[:, None],
              "department": ((body[:, 0] > 0).astype("int32") + (body[:, 1] > 0))}
    return {"title": title, "body": body}, labels


def data(seed=0):
    """(train, test): dicts of inputs by name, dicts of labels by output."""
    rng = np.random.default_rng(seed)
    return _tickets(512, rng), _tickets(128, rng)


def rare(seed=0):
    """An imbalanced task: 8 features, class 1 about 6 % of the examples."""
    return keras.Sequential([keras.Input((8,)), keras.layers.Dense(16, activation="relu"),
                             keras.layers.Dense(1, activation="sigmoid")])


def _rare_examples(n, rng):
    x = rng.normal(size=(n, 8)).astype("float32")
    y = ((x[:, 0] + 0.7 * rng.normal(size=n)) > 1.6).astype("int32")
    return x, y


RARE_WEIGHT = 10.0


def rare_data(seed=0):
    """The imbalanced task, unweighted: (train, test)."""
    rng = np.random.default_rng(seed)
    return _rare_examples(2048, rng), _rare_examples(512, rng)


def rare_weighted(seed=0):
    """The same examples, the training split with per-example weights (the rare
    class weighs `RARE_WEIGHT`), the test split without."""
    (x, y), test = rare_data(seed)
    return (x, y, np.where(y == 1, RARE_WEIGHT, 1.0).astype("float32")), test
