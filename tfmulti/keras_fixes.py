"""Every workaround tfmulti applies for an upstream Keras or TensorFlow bug.

Each fix names its upstream issue and has a test in tests/test_keras_fixes.py
that shows the upstream bug still happens without the fix on the pinned
versions, so a fix can be dropped as soon as upstream mends it.
"""

from __future__ import annotations

import itertools
import threading

import tensorflow as tf

# --------------------------------------------------------------------------
# Fix 1: several MirroredStrategy instances in one process share collective
# group keys.
#
# Upstream: https://github.com/tensorflow/tensorflow/issues/61314 and
# https://github.com/tensorflow/tensorflow/issues/62790. Every
# MirroredStrategy numbers its collective groups from the same start
# (`_collective_key_base`, 0 outside TensorFlow's own tests), so a second
# strategy over a different set of devices (a notebook trying 2 then 4
# replicas, a test suite, a sweep) reuses group key 1 with another group size
# and its first all-reduce fails with "Device ... is joining a group with
# size 4, but that group has size 2". TensorFlow's own tests avoid it by
# raising the base by 100000 for each strategy
# (tensorflow/python/distribute/strategy_combinations.py); we do the same.
# --------------------------------------------------------------------------

_KEY_STRIDE = 100_000
_key_bases = itertools.count(start=_KEY_STRIDE, step=_KEY_STRIDE)
_key_lock = threading.Lock()


def mirrored_strategy(devices, cross_device_ops=None) -> tf.distribute.MirroredStrategy:
    """`tf.distribute.MirroredStrategy` with collective keys of its own."""
    cls = tf.distribute.MirroredStrategy
    with _key_lock:
        previous = cls._collective_key_base  # pylint: disable=protected-access
        cls._collective_key_base = next(_key_bases)  # pylint: disable=protected-access
        try:
            return cls(devices=devices, cross_device_ops=cross_device_ops)
        finally:
            cls._collective_key_base = previous  # pylint: disable=protected-access
