"""Tests of tfmulti.cluster.notebook_launcher (and its worker,
tfmulti.cluster._notebook_worker): the chief's value comes back, a worker's
traceback is raised, and what cannot reach fresh worker processes is refused
before anything starts."""

from __future__ import annotations

import threading

import pytest

from tfmulti.cluster.notebook_launcher import notebook_launcher


def test_notebook_launcher_rejects_what_workers_cannot_receive():
    # Refused before any process starts (the fast tier would fail otherwise).
    import tensorflow as tf

    with pytest.raises(ValueError, match=r"cannot pickle `function` or `args` .*lock.*create "
                                         r"TensorFlow objects, locks"):
        notebook_launcher(lambda lock: None, args=(threading.Lock(),))

    weights = tf.Variable(1.0)
    with pytest.raises(ValueError, match=r"captured variable `weights` is a TensorFlow/Keras "
                                         r"object .*create models, tensors"):
        notebook_launcher(lambda: weights.numpy())
    with pytest.raises(ValueError, match=r"args\[0\] is a TensorFlow/Keras object"):
        notebook_launcher(lambda t: None, args=(tf.constant(1.0),))
