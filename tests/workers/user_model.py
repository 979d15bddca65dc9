"""A model, loss and data that tfmulti did not make, shared by the tests and
their workers: a functional model with dict inputs ("a", "b") and a residual
connection, a loss of its own, and a small 3-class problem in dict form."""

import numpy as np


def functional_model(seed: int = 3):
    """Dict inputs `a` (6 features) and `b` (2), a residual block, 3 logits."""
    import keras

    keras.utils.set_random_seed(seed)
    a, b = keras.Input((6,), name="a"), keras.Input((2,), name="b")
    h = keras.layers.Dense(8, activation="relu")(a)
    h = keras.layers.Add()([h, keras.layers.Dense(8, activation="tanh")(h)])
    out = keras.layers.Dense(3)(keras.layers.Concatenate()([h, b]))
    return keras.Model({"a": a, "b": b}, out)


def loss(y_true, y_pred):
    """Squared distance to the one-hot label (a loss Keras does not name)."""
    import tensorflow as tf

    target = tf.one_hot(tf.cast(y_true, tf.int32), 3)
    return tf.reduce_mean(tf.square(y_pred - target), axis=-1)


def examples(num: int, seed: int = 11) -> tuple[np.ndarray, np.ndarray]:
    """(features, labels): 8 features in [0, 1), a label from their sum."""
    x = np.random.default_rng(seed).random((num, 8), dtype=np.float32)
    return x, (x.sum(axis=1) * 3 / 8).astype(np.int32) % 3


def as_inputs(x: np.ndarray) -> dict:
    """The model's dict inputs from 8 features."""
    return {"a": x[:, :6], "b": x[:, 6:]}
