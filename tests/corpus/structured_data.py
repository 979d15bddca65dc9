# Source: keras-team/keras-io
#         examples/structured_data/structured_data_classification_from_scratch.py,
#         its TensorFlow version (2020/06/09, before the backend-agnostic rewrite read at
#         commit 002c7bbfe68f2f82b7294b712e9784c03a16e960, whose Normalization layers sit
#         outside its model, which then trains on raw values). The model of that version:
#         13 named inputs, lookup and Normalization layers adapted on the training data
#         inside the model; the heart-disease CSV replaced by synthetic rows.
"""Structured data classification: 13 features of a patient, each a named
`keras.Input` of shape (1,) (`thal` a string), encoded inside the model by
preprocessing layers adapted on the batched training data when the model is
built (`IntegerLookup`/`StringLookup` with `output_mode="binary"` for the 7
categorical ones, `Normalization` for the 6 numeric ones), concatenated,
Dense(32, relu), Dropout(0.5), a sigmoid unit; `binary_crossentropy`. The
data arrives as a dict of features, which Keras matches to the inputs by
name.

Synthetic data: patients like the 303 of the source's CSV, 768 for training and
192 for testing (more than the source has, so 2 epochs learn the rule), whose
target is 1 when a linear score of `age`, `thalach`, `oldpeak` and `cp`
(plus noise) is high.
"""

from __future__ import annotations

import keras
import numpy as np
import tensorflow as tf
from keras import layers

INTEGER_CATEGORICAL = ["sex", "cp", "fbs", "restecg", "exang", "ca"]
STRING_CATEGORICAL = ["thal"]
NUMERIC = ["age", "trestbps", "chol", "thalach", "oldpeak", "slope"]
THAL = np.array(["fixed", "normal", "reversible"])
COMPILE = dict(optimizer="adam", loss="binary_crossentropy", metrics=["accuracy"])
FIT = dict(batch_size=32, epochs=2)
CHAIN = True  # 13 inputs, preprocessed and concatenated: one tensor crosses after that


def _rows(n, rng):
    """The columns of a dataframe-like table (a dict), and the target."""
    age = rng.normal(54, 9, n)
    thalach = rng.normal(150, 22, n)
    oldpeak = np.abs(rng.normal(1.0, 1.1, n))
    cp = rng.integers(0, 5, n)
    columns = {
        "age": age, "sex": rng.integers(0, 2, n), "cp": cp,
        "trestbps": rng.normal(131, 17, n), "chol": rng.normal(246, 51, n),
        "fbs": rng.integers(0, 2, n), "restecg": rng.integers(0, 3, n), "thalach": thalach,
        "exang": rng.integers(0, 2, n), "oldpeak": oldpeak,
        "slope": rng.integers(0, 4, n).astype(np.float64), "ca": rng.integers(0, 4, n),
        "thal": rng.choice(THAL, n),
    }
    score = ((age - 54) / 9 - (thalach - 150) / 22 + (oldpeak - 1.0) + (cp >= 3)
             + 0.3 * rng.standard_normal(n))
    return columns, (score > 0.5).astype(np.int64)


def dataframe_to_dataset(columns, target):
    """(dict of features, target) examples; numeric columns float32, as Keras' Inputs."""
    columns = {name: (values.astype(np.float32) if name in NUMERIC else values)
               for name, values in columns.items()}
    return tf.data.Dataset.from_tensor_slices((columns, target))


def _patients(seed):
    rng = np.random.default_rng(seed)
    train, test = _rows(768, rng), _rows(192, rng)
    return dataframe_to_dataset(*train), dataframe_to_dataset(*test)


def _feature(dataset, name):
    """The dataset's `name` column, one value per row, as the adapt calls take it."""
    return dataset.map(lambda x, y: x[name]).map(lambda x: tf.expand_dims(x, -1))


def encode_numerical_feature(feature, name, dataset):
    normalizer = layers.Normalization()
    normalizer.adapt(_feature(dataset, name))
    return normalizer(feature)


def encode_categorical_feature(feature, name, dataset, is_string):
    lookup = (layers.StringLookup if is_string else layers.IntegerLookup)(output_mode="binary")
    lookup.adapt(_feature(dataset, name))
    return lookup(feature)


def build(seed=0):
    """The source's model, its preprocessing layers adapted on the training
    split of `data(seed)`, batched by 32 as the source's `train_ds` is."""
    train_ds = _patients(seed)[0].batch(32)
    inputs = {name: keras.Input(shape=(1,), name=name, dtype="int64")
              for name in INTEGER_CATEGORICAL}
    inputs["thal"] = keras.Input(shape=(1,), name="thal", dtype="string")
    inputs.update({name: keras.Input(shape=(1,), name=name) for name in NUMERIC})
    encoded = [encode_categorical_feature(inputs[name], name, train_ds, name in STRING_CATEGORICAL)
               for name in INTEGER_CATEGORICAL + STRING_CATEGORICAL]
    encoded += [encode_numerical_feature(inputs[name], name, train_ds) for name in NUMERIC]
    x = layers.Dense(32, activation="relu")(layers.concatenate(encoded))
    x = layers.Dropout(0.5)(x)
    output = layers.Dense(1, activation="sigmoid")(x)
    return keras.Model(list(inputs.values()), output)


def data(seed=0):
    """Unbatched (dict of features, target) datasets: 768 training, 192 test patients."""
    train, test = _patients(seed)
    return {"train": train, "test": test}
