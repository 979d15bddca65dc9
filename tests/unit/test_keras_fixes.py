"""Tests of tfmulti.runtime.keras_fixes: each upstream bug still happens without its
fix, the fix works, and `apply_keras_fixes` applies the fixes to a strategy the
user built.

When a test named `test_upstream_bug_*` starts failing after a TensorFlow or
Keras upgrade, upstream has fixed the bug: drop the fix.

The checks that need a process of their own (no fix installed yet, oneDNN on)
share one: `_SINGLE_PROCESS` runs each part in turn and prints one JSON line
(`upstream` fixture). The Keras-under-multi-worker checks share one 2-worker
cluster (`keras_under_multi_worker` fixture, tests/workers/keras_upstream.py).
"""

from __future__ import annotations

import os

import pytest

from tests._util import fake_slurm

STEPS_PER_CALL = "several steps per call with 2+ replicas"
EMPTY_BATCH_CONV = "convolutions on an empty batch under oneDNN"
FIT_MULTI_WORKER = "fit under MultiWorkerMirroredStrategy"
UNEVEN_FIRST_BATCH = "a first batch split unevenly over replicas"
BATCH_NORM_STATISTICS = "BatchNormalization statistics that differ between replicas"
SCALAR_LOGS_MULTI_WORKER = "logged scalars under MultiWorkerMirroredStrategy"


def test_fix_slurm_resolver_on_cpu_nodes(monkeypatch):
    from tfmulti.runtime import keras_fixes

    fake_slurm(monkeypatch)
    resolver = keras_fixes.slurm_cluster_resolver(port_base=7000)
    assert resolver.cluster_spec().as_dict() == {
        "worker": ["cpu-1:7000", "cpu-2:7000", "cpu-3:7000"]}
    assert (resolver.task_type, resolver.task_id) == ("worker", 2)
    assert "CUDA_VISIBLE_DEVICES" not in os.environ
    # No placeholder GPU reaches the strategy: its replicas are the CPUs, as under
    # TF_CONFIG (a GPU:0 placed on the CPU by soft placement cost 15 % under srun).
    assert resolver.num_accelerators() == {}
    import tensorflow as tf

    assert isinstance(resolver, tf.distribute.cluster_resolver.SlurmClusterResolver)


def _fit_and_evaluate(steps_per_execution: int):
    import numpy as np

    import tfmulti
    from tfmulti import data
    from tfmulti.models import builders as models

    strategy = tfmulti.get_strategy("mirrored", devices=["CPU:0", "CPU:1"])
    model = models.build_model("mlp", strategy=strategy, dropout=0.0, seed=0)
    models.compile_model(model, task="classification", strategy=strategy, optimizer="sgd",
                         learning_rate=0.05, steps_per_execution=steps_per_execution)
    train = data.distribute(data.load("synthetic", num_examples=640), strategy, 64, seed=0)
    test = data.distribute(data.load("synthetic", "test", num_examples=420), strategy, 64,
                           training=False)  # 7 batches, the last partial: blocks of 5 + 2
    history = model.fit(**train.fit_kwargs(), epochs=2, verbose=0)
    evaluation = model.evaluate(**test.evaluate_kwargs(), return_dict=True, verbose=0)
    return history.history, evaluation, [np.array(w) for w in model.get_weights()]


def test_fix_steps_per_execution_with_replicas_matches_one_step_per_call():
    import numpy as np

    h1, e1, w1 = _fit_and_evaluate(1)
    # 10 steps per epoch in blocks of 5 (Keras runs whole blocks of
    # steps_per_execution, so it should divide the steps per epoch).
    h4, e4, w4 = _fit_and_evaluate(5)
    np.testing.assert_allclose(h4["loss"], h1["loss"], atol=1e-5)
    np.testing.assert_allclose(h4["accuracy"], h1["accuracy"], atol=1e-6)
    assert e4["loss"] == pytest.approx(e1["loss"], abs=1e-5)
    assert e4["accuracy"] == pytest.approx(e1["accuracy"], abs=1e-6)
    for a, b in zip(w4, w1):
        np.testing.assert_allclose(a, b, atol=1e-5)


def test_fix_evaluates_a_first_batch_split_unevenly_over_replicas():
    # 240 test examples at global batch 256 on 2 replicas: the only batch
    # gives them 128 and 112 rows. Without the fix Keras' symbolic build adds
    # the two replicas' inputs ("AddN must have the same size and shape";
    # tests/integration/test_keras_fixes.py shows it still does upstream).
    import keras
    import numpy as np

    import tfmulti
    from tfmulti import data

    strategy = tfmulti.get_strategy("mirrored", devices=["CPU:0", "CPU:1"])
    assert UNEVEN_FIRST_BATCH in tfmulti.apply_keras_fixes(strategy)

    def model():
        keras.utils.set_random_seed(0)
        m = keras.Sequential([keras.Input((28, 28, 1)), keras.layers.Flatten(),
                              keras.layers.Dense(10)])
        m.compile(loss=keras.losses.SparseCategoricalCrossentropy(from_logits=True),
                  metrics=["accuracy"])
        return m

    with strategy.scope():
        distributed = model()
    test_data = data.load("synthetic", "test", num_examples=240)
    test = data.distribute(test_data, strategy, 256, training=False)
    result = distributed.evaluate(**test.evaluate_kwargs(), return_dict=True, verbose=0)
    single = model()
    single.set_weights(distributed.get_weights())
    expected = single.evaluate(test_data.batch(256), return_dict=True, verbose=0)
    assert result["loss"] == pytest.approx(expected["loss"], rel=1e-5)
    assert result["accuracy"] == pytest.approx(expected["accuracy"], abs=1e-6)
    assert np.isfinite(result["loss"])


def test_the_fixed_build_reads_no_batch_where_the_shapes_are_known():
    """The symbolic build under 2 replicas (the fixes' patch of it) takes its
    shapes from the data's spec where every dimension is known, and reads
    nothing where nothing needs building: each pass over the data opens it once
    (Keras' own build opens a pass of its own to read one batch, before every
    `fit` and `evaluate`). A pass whose last batch is partial has a batch
    dimension of unknown size: that build still reads one batch."""
    import keras
    import numpy as np
    import tensorflow as tf

    import tfmulti

    strategy = tfmulti.get_strategy("mirrored", devices=["CPU:0", "CPU:1"])
    assert UNEVEN_FIRST_BATCH in tfmulti.apply_keras_fixes(strategy)
    opened = []

    def examples():
        opened.append(1)
        for i in range(40):
            yield {"a": np.full(3, i, "float32"), "b": np.full(2, -i, "float32")}, i % 2

    spec = ({"a": tf.TensorSpec([3]), "b": tf.TensorSpec([2])}, tf.TensorSpec([], tf.int64))
    data = tf.data.Dataset.from_generator(examples, output_signature=spec).apply(
        tf.data.experimental.assert_cardinality(40))  # an epoch's end is no surprise

    def model():
        inputs = {"a": keras.Input((3,), name="a"), "b": keras.Input((2,), name="b")}
        m = keras.Model(inputs, keras.layers.Dense(2)(keras.layers.Concatenate()(
            [inputs["a"], inputs["b"]])))
        m.compile("sgd", keras.losses.SparseCategoricalCrossentropy(from_logits=True),
                  metrics=["accuracy"])
        return m

    with strategy.scope():
        fixed = model()
    history = fixed.fit(data.batch(8, drop_remainder=True), epochs=2, verbose=0)
    assert len(opened) == 2 and np.isfinite(history.history["loss"]).all()  # 1 a pass
    fixed.evaluate(data.batch(16), verbose=0)  # partial last batch; built: nothing read
    assert len(opened) == 3
    with strategy.scope():
        unknown = model()
    unknown.fit(data.batch(16), epochs=1, verbose=0)  # batch dimension unknown: a read
    assert len(opened) == 5
    assert unknown.get_weights()[0].shape == fixed.get_weights()[0].shape == (5, 2)


def test_fix_keeps_the_replicas_batch_normalization_statistics_equal():
    # Two replicas see batches of different statistics (the second half of
    # every batch shifted by 3): without the fix each keeps its own moving
    # mean and variance, and the saved model (replica 0's copy) evaluates
    # otherwise than the replicas did (tests/integration/test_keras_fixes.py
    # shows the drift upstream).
    import keras
    import numpy as np
    import tensorflow as tf

    import tfmulti

    strategy = tfmulti.get_strategy("mirrored", devices=["CPU:0", "CPU:1"])
    assert BATCH_NORM_STATISTICS in tfmulti.apply_keras_fixes(strategy)

    def model():
        keras.utils.set_random_seed(0)
        m = keras.Sequential([keras.Input((8,)), keras.layers.Dense(16),
                              keras.layers.BatchNormalization(), keras.layers.Dense(2)])
        m.compile("sgd", keras.losses.SparseCategoricalCrossentropy(from_logits=True))
        return m

    x = np.random.default_rng(0).normal(size=(256, 8)).astype("float32")
    x[np.arange(256) % 64 >= 32] += 3.0  # replica 1's half of every batch of 64
    y = (x.sum(axis=1) > 12).astype("int32")
    batches = tf.data.Dataset.from_tensor_slices((x, y)).batch(64)
    with strategy.scope():
        distributed = model()
    distributed.fit(batches, epochs=2, verbose=0, shuffle=False)
    for name in ("moving_mean", "moving_variance"):
        copies = strategy.experimental_local_results(
            getattr(distributed.layers[1], name).value)
        np.testing.assert_array_equal(copies[0].numpy(), copies[1].numpy())
    saved = model()
    saved.set_weights(distributed.get_weights())
    assert distributed.evaluate(batches, verbose=0) == pytest.approx(
        saved.evaluate(batches, verbose=0), rel=1e-5)


# --------------------------------------------------------------------------
# apply_keras_fixes: the fixes for a strategy the user built.


def test_apply_keras_fixes_to_a_mirrored_strategy_the_user_built():
    # A plain MirroredStrategy over 2 of the test's virtual CPUs: after
    # apply_keras_fixes, several steps per call train (keras#19246 without it).
    import keras
    import numpy as np
    import tensorflow as tf

    import tfmulti

    strategy = tf.distribute.MirroredStrategy(["CPU:0", "CPU:1"])
    assert tfmulti.apply_keras_fixes(strategy) == [UNEVEN_FIRST_BATCH, STEPS_PER_CALL,
                                                   BATCH_NORM_STATISTICS, EMPTY_BATCH_CONV]
    with strategy.scope():
        model = keras.Sequential([keras.Input((4,)), keras.layers.Dense(3)])
        model.compile(keras.optimizers.SGD(0.1), "mse", steps_per_execution=2)
    rng = np.random.default_rng(0)
    x, y = rng.random((64, 4), dtype=np.float32), rng.random((64, 3), dtype=np.float32)
    history = model.fit(x, y, batch_size=16, epochs=2, verbose=0)  # 2 calls of 2 steps each
    assert int(model.optimizer.iterations.numpy()) == 8
    assert np.all(np.isfinite(history.history["loss"]))


def test_apply_keras_fixes_by_strategy():
    import tensorflow as tf

    from tfmulti.runtime import keras_fixes

    keras_fixes.apply_keras_fixes()  # all of them, once
    assert keras_fixes.apply_keras_fixes(tf.distribute.OneDeviceStrategy("CPU:0")) == []
    assert keras_fixes.apply_keras_fixes(tf.distribute.get_strategy()) == []
    assert keras_fixes.apply_keras_fixes() == keras_fixes.active_fixes() == [
        FIT_MULTI_WORKER, UNEVEN_FIRST_BATCH, SCALAR_LOGS_MULTI_WORKER, STEPS_PER_CALL,
        BATCH_NORM_STATISTICS, EMPTY_BATCH_CONV]


# --------------------------------------------------------------------------
# The guard: a fix patches only the Keras functions it was written for.


def test_recorded_keras_functions_are_the_installed_ones():
    # Fails after a Keras upgrade that changed a function a fix replaces or
    # copies: check the fix against the new code, then record the new digest.
    from tfmulti.runtime import keras_fixes

    assert keras_fixes.changed_keras_functions(keras_fixes.KERAS_ORIGINALS) == []


@pytest.mark.parametrize("fix, changed", [
    (FIT_MULTI_WORKER,
     "keras.src.backend.tensorflow.trainer:TensorFlowTrainer._maybe_symbolic_build"),
    (UNEVEN_FIRST_BATCH,
     "keras.src.backend.tensorflow.trainer:TensorFlowTrainer._maybe_symbolic_build"),
    (SCALAR_LOGS_MULTI_WORKER, "keras.src.backend.tensorflow.trainer:reduce_per_replica"),
    (STEPS_PER_CALL, "keras.src.backend.tensorflow.trainer:TensorFlowTrainer._make_function"),
    (BATCH_NORM_STATISTICS,
     "keras.src.layers.normalization.batch_normalization:BatchNormalization.build"),
    (EMPTY_BATCH_CONV, "keras.src.backend.tensorflow.nn:conv"),
])
def test_guard_leaves_a_fix_off_where_keras_changed(fix, changed, monkeypatch):
    import importlib
    import re
    import warnings

    from tfmulti.runtime import keras_fixes

    def target(name):
        module, _, path = name.partition(":")
        holder, _, attribute = path.rpartition(".")
        owner = importlib.import_module(module)
        return (getattr(owner, holder) if holder else owner), attribute

    monkeypatch.setattr(keras_fixes, "_applied", set())
    monkeypatch.setattr(keras_fixes, "_off", set())
    monkeypatch.setattr(keras_fixes, "_announced", True)  # this process printed its line
    for name in keras_fixes.KERAS_ORIGINALS:  # whatever the fixes patch is put back after
        owner, attribute = target(name)
        monkeypatch.setattr(owner, attribute, getattr(owner, attribute))

    def new_keras_version(*args, **kwargs):  # a Keras release changed the function
        raise NotImplementedError

    owner, attribute = target(changed)
    monkeypatch.setattr(owner, attribute, new_keras_version)
    with pytest.warns(RuntimeWarning) as caught:
        active = keras_fixes.apply_keras_fixes()
    # One warning per fix that replaces the changed function, this one's among them.
    sharing = [f for f in keras_fixes._needed(None) if changed in f.replaces]
    assert len(caught) == len(sharing)
    assert any(re.search(rf"fix for {re.escape(fix)} \([a-z]+#\d+\) was written for Keras "
                         rf"3\.15, .*{attribute}\. The fix stays off", str(w.message))
               for w in caught), [str(w.message) for w in caught]
    assert getattr(owner, attribute) is new_keras_version  # not patched
    # The others are on: all but the fixes that replace the changed function.
    assert fix not in active and len(active) == len(keras_fixes._needed(None)) - len(sharing)
    assert fix not in keras_fixes.active_fixes()
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # once
        assert keras_fixes.apply_keras_fixes() == active
