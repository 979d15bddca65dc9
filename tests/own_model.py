"""A user's own code, as users bring it: a functional model with two named
inputs and a residual connection, a subclassed model, data as NumPy dicts and
as TFRecord files, and a loss of their own. None of it comes from tfmulti.

The tests use it from Python (`tests.own_model`) and from the command line
(`--model=own_model:build --dataset=own_model:data`, run in this folder).
"""

from __future__ import annotations

import os

import keras
import numpy as np
import tensorflow as tf

FEATURES = {"pixels": 16, "extra": 4}


def build(input_shape, seed=None):
    """Functional: two named inputs, concatenated, a residual block, 2 logits."""
    pixels = keras.Input(input_shape["pixels"], name="pixels")
    extra = keras.Input(input_shape["extra"], name="extra")
    h = keras.layers.Dense(32, activation="relu", name="mix")(
        keras.layers.Concatenate()([pixels, extra]))
    h = keras.layers.Add(name="residual")([h, keras.layers.Dense(32, activation="relu",
                                                                  name="block")(h)])
    return keras.Model({"pixels": pixels, "extra": extra}, keras.layers.Dense(2, name="out")(h),
                       name="own")


class Subclassed(keras.Model):
    """Subclassed: a residual MLP over the concatenated inputs."""

    def __init__(self, width: int = 32, **kwargs):
        super().__init__(**kwargs)
        self.mix = keras.layers.Dense(width, activation="relu")
        self.block = keras.layers.Dense(width, activation="relu")
        self.out = keras.layers.Dense(2)

    def call(self, inputs):
        h = self.mix(keras.ops.concatenate([inputs["pixels"], inputs["extra"]], axis=-1))
        return self.out(h + self.block(h))


def build_subclassed():
    return Subclassed(name="own_subclassed")


def arrays(n: int, seed: int = 0):
    """(features dict, labels): label 1 when the pixels sum above their mean."""
    rng = np.random.default_rng(seed)
    x = {name: rng.random((n, width), dtype=np.float32) for name, width in FEATURES.items()}
    y = (x["pixels"].sum(axis=1) + 0.5 * x["extra"].sum(axis=1) > 9).astype(np.int32)
    return x, y


def data(seed=0):
    """The dataset function: (train, test) as NumPy arrays."""
    return arrays(2048, seed), arrays(512, seed + 1)


def smooth_loss(y_true, logits):
    """The user's loss: cross-entropy with label smoothing, on logits."""
    y = tf.one_hot(tf.cast(tf.reshape(y_true, [-1]), tf.int32), 2)
    return keras.losses.categorical_crossentropy(y, logits, from_logits=True,
                                                 label_smoothing=0.1)


# ------------------------------------------------------------------------- TFRecord files

def write_tfrecords(folder, num_files: int, per_file: int, seed: int = 0) -> list[str]:
    """`num_files` TFRecord files of `per_file` examples each; every example
    carries its global id, so tests can see which ones were trained."""
    x, y = arrays(num_files * per_file, seed)
    paths = []
    for f in range(num_files):
        path = os.path.join(folder, f"part-{f:03d}.tfrecord")
        with tf.io.TFRecordWriter(path) as writer:
            for i in range(f * per_file, (f + 1) * per_file):
                feature = {
                    "pixels": tf.train.Feature(float_list=tf.train.FloatList(value=x["pixels"][i])),
                    "extra": tf.train.Feature(float_list=tf.train.FloatList(value=x["extra"][i])),
                    "label": tf.train.Feature(int64_list=tf.train.Int64List(value=[y[i]])),
                    "id": tf.train.Feature(int64_list=tf.train.Int64List(value=[i])),
                }
                writer.write(tf.train.Example(
                    features=tf.train.Features(feature=feature)).SerializeToString())
        paths.append(path)
    return paths


_SPEC = {"pixels": tf.io.FixedLenFeature([FEATURES["pixels"]], tf.float32),
         "extra": tf.io.FixedLenFeature([FEATURES["extra"]], tf.float32),
         "label": tf.io.FixedLenFeature([], tf.int64),
         "id": tf.io.FixedLenFeature([], tf.int64)}


def parse(record):
    """One record -> ({"pixels", "extra"}, label)."""
    example = tf.io.parse_single_example(record, _SPEC)
    return {"pixels": example["pixels"], "extra": example["extra"]}, example["label"]


def parse_with_id(record):
    """One record -> ({"pixels", "extra", "id"}, label): the id rides along."""
    example = tf.io.parse_single_example(record, _SPEC)
    return ({"pixels": example["pixels"], "extra": example["extra"], "id": example["id"]},
            example["label"])


def file_data():
    """The dataset function for files: $OWN_MODEL_FILES (a glob) for training."""
    import tfmulti

    train = tfmulti.data.from_files(os.environ["OWN_MODEL_FILES"], parse)
    return train, arrays(256, 7)
