# Source: keras-team/keras-io examples/structured_data/imbalanced_classification.py
#         (commit 0e2570ad95239574579c493d03eac955af344c24, its Keras 3 form: `import keras`,
#         a `keras.Input` first in the Sequential; commit d8288ba8f6cc707577aebf2321229a5f40419046
#         is the tf.keras form), "Imbalanced classification: credit card fraud detection".
#         The model, compile, class weights and checkpoint callback of the source; the
#         Kaggle CSV replaced by synthetic transactions.
"""Imbalanced classification: a Sequential MLP (three Dense(256, relu), two
Dropout(0.3), a sigmoid unit) on 30 standardized features of a transaction,
`binary_crossentropy` with `Adam(1e-2)` and the source's metrics (false and
true negatives and positives, precision, recall; no accuracy), trained with
`class_weight={0: 1 / count0, 1: 1 / count1}` computed from the training
labels as the source computes it: the weights are ~1/1,900 and ~1/150, so
the training loss the logs report is ~1,000 times smaller than the
unweighted test loss. `FIT` and `TFMULTI` carry the same dict; `TFMULTI`
also the source's learning rate and metrics.

The source trains 30 epochs in batches of 2,048 with its validation set as
`validation_data`; here 2 epochs in the corpus' batches of 32, and the held-out
split is evaluated after training instead. The source's checkpoint callback
(one `.keras` file per epoch) is offered by `callbacks(folder)`.

Synthetic data: 2,048 training and 1,024 test transactions of 30 features
(the CSV's `Time`, `V1`-`V28`, `Amount`), standardized with the training
split's mean and standard deviation as the source does; about 7 % are
frauds, whose features V1-V4 are shifted by two standard deviations (a rule
a model finds, with some overlap; at a shift of 1.5 the test loss of
`Adam(1e-2)` in batches of 32 varied from 0.20 to 0.54 with the batch order).
"""

from __future__ import annotations

import os

import keras
import numpy as np

NUM_FEATURES = 30



def _transactions(n, rng):
    fraud = (rng.random(n) < 0.07).astype(np.uint8)
    features = rng.standard_normal((n, NUM_FEATURES)).astype(np.float32)
    features[:, 0] = rng.uniform(0, 172792, n)  # Time, seconds
    features[:, 29] = rng.lognormal(3.0, 1.5, n)  # Amount
    features[:, 1:5] += 2.0 * fraud[:, None] * np.array([1.0, -1.0, 1.0, -1.0], np.float32)
    return features, fraud[:, None]  # targets of shape (n, 1), as the source's


def _splits(seed):
    rng = np.random.default_rng(seed)
    (train_features, train_targets), (val_features, val_targets) = (
        _transactions(2048, rng), _transactions(1024, rng))
    mean = np.mean(train_features, axis=0)  # normalized with the training statistics
    std = np.std(train_features - mean, axis=0)
    return (((train_features - mean) / std, train_targets),
            ((val_features - mean) / std, val_targets))


def class_weight(train_targets) -> dict:
    """{0: 1 / count0, 1: 1 / count1} of the training targets, as the source."""
    counts = np.bincount(train_targets[:, 0])
    return {0: float(1.0 / counts[0]), 1: float(1.0 / counts[1])}


CLASS_WEIGHT = class_weight(_splits(0)[0][1])
FIT = dict(batch_size=32, epochs=2, class_weight=CLASS_WEIGHT)
# What a user passes tfmulti for the source's fit and compile: the class weights, the
# source's learning rate (tfmulti's adam default is 1e-3) and its metrics, by their Keras
# names (the source names its objects fn, fp, tn, tp).
TFMULTI = dict(class_weight=CLASS_WEIGHT, learning_rate=1e-2,
               metrics=("false_negatives", "false_positives", "true_negatives",
                        "true_positives", "precision", "recall"))
CHAIN = True


def build(input_shape):
    return keras.Sequential(
        [
            keras.Input(shape=input_shape),
            keras.layers.Dense(256, activation="relu"),
            keras.layers.Dense(256, activation="relu"),
            keras.layers.Dropout(0.3),
            keras.layers.Dense(256, activation="relu"),
            keras.layers.Dropout(0.3),
            keras.layers.Dense(1, activation="sigmoid"),
        ]
    )


def __getattr__(name):
    """`COMPILE`, the source's compile arguments, made afresh at each access
    (PEP 562): an optimizer or metric made once at import would be shared by
    every model compiled with it, and would create TensorFlow variables when
    the module is imported (before a worker has configured its runtime)."""
    if name == "COMPILE":
        return dict(
            optimizer=keras.optimizers.Adam(1e-2), loss="binary_crossentropy",
            metrics=[keras.metrics.FalseNegatives(name="fn"),
                     keras.metrics.FalsePositives(name="fp"),
                     keras.metrics.TrueNegatives(name="tn"),
                     keras.metrics.TruePositives(name="tp"),
                     keras.metrics.Precision(name="precision"),
                     keras.metrics.Recall(name="recall")])
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


def callbacks(folder):
    """The published checkpoint of the model at every epoch (written under `folder`)."""
    return [keras.callbacks.ModelCheckpoint(
        os.path.join(folder, "fraud_model_at_epoch_{epoch}.keras"))]


def data(seed=0):
    """(features, targets) for training and testing, standardized."""
    return _splits(seed)
