"""A dataset function for recipes/train.py whose input is slow: the synthetic
data, each example held back `DELAY_S` in its input pipeline.

    recipes/train.py --dataset=tests.workers.slow_input:data ...

Workers that train on it spend most of their time waiting for their input,
not computing: tests/integration/test_launch_signals.py signals a launch of
such workers that would otherwise train flat out for the seconds the
launcher gives them between its SIGTERM and its SIGKILL.
"""

from __future__ import annotations

import time

DELAY_S = 0.005
"""Seconds each example waits: a step of 64 examples (each worker reads every
example and keeps its half) waits ~0.3 s, against a few ms of computing."""


def _held_back(label):
    time.sleep(DELAY_S)
    return label


def data(num_examples: int = 256) -> dict:
    """The synthetic train split of `num_examples`, each label read through
    `_held_back`; no test split (the run is stopped, never evaluated)."""
    import tensorflow as tf

    from tfmulti import data as tfm_data

    def slow(image, label):
        held = tf.numpy_function(_held_back, [label], label.dtype, stateful=True)
        held.set_shape(label.shape)
        return image, held

    train = tfm_data.load("synthetic", "train", num_examples=num_examples)
    # Of unknown size (the filter keeps all): tfmulti caches a small dataset of known
    # size after its first pass, which would wait only in the first epoch.
    train = train.map(slow).filter(lambda image, label: True)
    return {"train": train, "test": None, "num_classes": 10}
