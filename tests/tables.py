"""A recommender of the shape users bring, for the tests of tables sharded by
rows (`shard_embeddings`): two towers over a user table (one id per example)
and an item table (3 ids per example, averaged), whose rows do not split
evenly over 2 or 4 replicas; its item ids negative for half of the lookups
(counted from the end, as Keras' `take` counts them), repeated within and
across the replicas' batches. None of it comes from tfmulti.
"""

from __future__ import annotations

import keras
import numpy as np

USERS, ITEMS, WIDTH = 1001, 37, 8


def two_tower():
    """A user table (one id per example) and an item table (3 ids, averaged),
    the rows through a small MLP: a regression."""
    users = keras.Input((), dtype="int32", name="user")
    items = keras.Input((3,), dtype="int32", name="items")
    u = keras.layers.Embedding(USERS, WIDTH, name="users")(users)
    i = keras.layers.GlobalAveragePooling1D()(keras.layers.Embedding(ITEMS, WIDTH,
                                                                     name="items_table")(items))
    x = keras.layers.Dense(16, activation="relu")(keras.layers.Concatenate()([u, i]))
    model = keras.Model({"user": users, "items": items}, keras.layers.Dense(1)(x))
    model.compile(keras.optimizers.Adam(0.01), "mse")
    return model


def clicks(seed: int = 0, num_examples: int | None = None):
    """`two_tower`'s data, as a dataset function returns it."""
    num_examples = num_examples or 256
    rng = np.random.default_rng(seed)
    features = {"user": rng.integers(0, USERS, num_examples).astype("int32"),
                "items": rng.integers(-ITEMS, ITEMS, (num_examples, 3)).astype("int32")}
    labels = rng.normal(size=(num_examples, 1)).astype("float32")
    return {"train": (features, labels),
            "test": ({k: v[:64] for k, v in features.items()}, labels[:64]),
            "task": "regression"}
