"""Dataset functions whose training data is a Python loader, as Keras users
write them: a `keras.utils.PyDataset` with augmentation in Python, an endless
generator of examples; and the same examples as arrays (the reference).

Four classes of 16 features (Gaussian blobs), learnable to about 0.99. When
TFMULTI_TEST_LOADER_LOG names a folder, the PyDataset writes there, per
worker of a cluster, each pass's start ("pass") and each batch index it
serves, with the process that did it, so a test can count what every worker
read, and where.
"""

from __future__ import annotations

import json
import math
import os

import keras
import numpy as np

FEATURES, CLASSES, TRAIN, TEST, BATCH = 16, 4, 1024, 512, 32


def _blobs(count: int, seed: int):
    rng = np.random.default_rng(seed)
    centers = np.random.default_rng(1234).normal(0, 1.2, (CLASSES, FEATURES))
    y = rng.integers(0, CLASSES, count)
    x = (centers[y] + rng.normal(0, 1.0, (count, FEATURES))).astype("float32")
    return x, y.astype("int64")


def _log(line: str) -> None:
    folder = os.environ.get("TFMULTI_TEST_LOADER_LOG")
    if folder:  # one file per worker of a cluster (its loader's processes too)
        task = json.loads(os.environ.get("TF_CONFIG", "{}")).get("task", {})
        with open(os.path.join(folder, f"worker{task.get('index', 0)}.log"), "a") as f:
            f.write(f"{line} {os.getpid()}\n")


class Blobs(keras.utils.PyDataset):
    """The training examples in batches of `batch_size`, each batch's features
    jittered (a Python augmentation, drawn anew every time it is read)."""

    def __init__(self, x, y, batch_size=BATCH, jitter=0.05, **kwargs):
        super().__init__(**kwargs)
        self.x, self.y, self.batch_size, self.jitter = x, y, batch_size, jitter
        self.rng = np.random.default_rng()

    def __len__(self):
        return math.ceil(len(self.x) / self.batch_size)

    def __getitem__(self, index):
        _log(str(index))
        low = index * self.batch_size
        high = min(low + self.batch_size, len(self.x))
        x = self.x[low:high]
        if self.jitter:
            x = x + self.rng.normal(0, self.jitter, x.shape).astype("float32")
        return x, self.y[low:high]

    def on_epoch_begin(self):
        _log("pass")


def arrays():
    """The reference: the same training and test examples as arrays."""
    return {"train": _blobs(TRAIN, 0), "test": _blobs(TEST, 1), "num_classes": CLASSES}


def pydataset():
    """The training examples as a PyDataset, the test split as arrays."""
    return {"train": Blobs(*_blobs(TRAIN, 0)), "test": _blobs(TEST, 1), "num_classes": CLASSES}


def pydataset_threads():
    """As `pydataset`, read by the PyDataset's own 2 threads."""
    return {"train": Blobs(*_blobs(TRAIN, 0), workers=2), "test": _blobs(TEST, 1),
            "validation": Blobs(*_blobs(256, 2), jitter=0), "num_classes": CLASSES}


def pydataset_processes():
    """As `pydataset`, read by the PyDataset's own 2 processes."""
    return {"train": Blobs(*_blobs(TRAIN, 0), workers=2, use_multiprocessing=True),
            "test": _blobs(TEST, 1), "num_classes": CLASSES}


def endless_examples(seed=0):
    """An endless generator of (features, label) examples, drawn afresh."""
    centers = np.random.default_rng(1234).normal(0, 1.2, (CLASSES, FEATURES))

    def examples():
        rng = np.random.default_rng(seed)
        while True:
            label = int(rng.integers(0, CLASSES))
            yield (centers[label] + rng.normal(0, 1.0, FEATURES)).astype("float32"), label

    return {"train": examples(), "test": _blobs(TEST, 1), "num_classes": CLASSES}


def model(input_shape, num_classes):
    inputs = keras.Input(input_shape)
    hidden = keras.layers.Dense(32, activation="relu")(inputs)
    return keras.Model(inputs, keras.layers.Dense(num_classes)(hidden))
