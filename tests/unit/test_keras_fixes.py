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
MODEL_WITHOUT_CALL = "a model without call under a strategy"
BUILT_IN_THE_STEP = "optimizers and layers built in the train step with 2+ replicas"
REPEATED_ROWS = "rows repeated in a sparse gradient"
PACKED_ROWS = "sparse gradients all-reduced one table at a time"
ONE_REPLICAS_FINITE = "loss scaling that checks one replica's gradients"
WHOLE_TABLE_READ = "a lookup that copies its whole table"


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


@pytest.mark.slow  # seconds of training: the full suite's, not the fast tier's
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


def test_fix_keeps_the_losses_added_in_each_replicas_call_its_own(monkeypatch):
    # With the fix, BatchNormalization's statistics are assigned by a merge_call in
    # the forward, where the replicas take turns: the losses a call adds stay its
    # replica's (tests/integration/test_keras_fixes.py shows them mixed upstream):
    # a loss of 1.0 added in a call is 1.0 on 2 replicas, as on one device; and
    # still after the fixes are installed again (each loss counted once).
    import tfmulti
    from tfmulti.runtime import keras_fixes
    from tests.workers import keras_upstream

    strategy = tfmulti.get_strategy("mirrored", devices=["CPU:0", "CPU:1"])
    assert BATCH_NORM_STATISTICS in tfmulti.apply_keras_fixes(strategy)
    one_device = keras_upstream.added_loss_runs(None)
    assert keras_upstream.added_loss_runs(strategy) == pytest.approx(one_device, abs=1e-5)
    monkeypatch.setattr(keras_fixes, "_applied", set())
    assert BATCH_NORM_STATISTICS in tfmulti.apply_keras_fixes(strategy)
    assert keras_upstream.added_loss_runs(strategy) == pytest.approx(one_device, abs=1e-5)


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
# Models that train on one device with code of their own (a train_step, a
# test_step, no call), as the keras-io guides write them
# (tests/workers/keras_upstream.py, which trains them on 2 workers too).


def test_upstream_bug_keras_builds_a_model_without_call_under_a_strategy(monkeypatch):
    # Keras' symbolic build (keras-team/keras#20051) calls the model, which
    # keras-io's GAN does not have, under any strategy, one device's too.
    # Raised before anything runs: safe in this process, Keras' own build put back.
    import tensorflow as tf
    from keras.src.backend.tensorflow import trainer

    from tests.workers import keras_upstream

    build = trainer.TensorFlowTrainer._maybe_symbolic_build
    monkeypatch.setattr(trainer.TensorFlowTrainer, "_maybe_symbolic_build",
                        getattr(build, "__wrapped__", build))
    with tf.distribute.OneDeviceStrategy("CPU:0").scope():
        gan = keras_upstream.gan()
    with pytest.raises(RuntimeError, match="Unable to automatically build the model"):
        gan.fit(keras_upstream.images(), epochs=1, verbose=0)


def test_fix_trains_a_model_without_call_on_one_device_strategy_as_without():
    # tfmulti.get_strategy("one_device") (and "auto" on a host with one GPU):
    # the GAN trains as with no strategy, to the same weights.
    import numpy as np

    import tfmulti
    from tests.workers import keras_upstream

    strategy = tfmulti.get_strategy("one_device", devices=["CPU:0"])
    assert tfmulti.apply_keras_fixes(strategy) == [MODEL_WITHOUT_CALL, REPEATED_ROWS,
                                                   WHOLE_TABLE_READ]
    with strategy.scope():
        got = keras_upstream.own_step("gan")
    want = keras_upstream.own_step("gan")
    for key in ("d_loss", "g_loss"):
        np.testing.assert_allclose(got["history"][key], want["history"][key], rtol=1e-6)
    np.testing.assert_allclose(got["weights"], want["weights"], atol=1e-6)
    assert got["optimizer_variables"] == want["optimizer_variables"]


@pytest.mark.parametrize("steps_per_execution, inputs", [
    (1, True), pytest.param(2, True, marks=pytest.mark.slow),  # one case in the fast tier
    pytest.param(1, False, marks=pytest.mark.slow)],
    ids=["1_step_per_call", "2_steps_per_call", "built_by_its_first_step"])
def test_fix_trains_keras_io_gan_on_mirrored_replicas(steps_per_execution, inputs):
    # keras-io's GAN (no call; two optimizers built by their first apply, in
    # the replica function; without keras.Input, its networks too) under
    # get_strategy("mirrored") over 2 CPUs. Without the fixes: "Unable to
    # automatically build the model" (above), then "You must feed a value for
    # placeholder tensor" (tests/integration/test_keras_fixes.py).
    import keras
    import numpy as np

    import tfmulti
    from tests.workers import keras_upstream

    strategy = tfmulti.get_strategy("mirrored", devices=["CPU:0", "CPU:1"])
    assert {MODEL_WITHOUT_CALL, BUILT_IN_THE_STEP} <= set(tfmulti.apply_keras_fixes(strategy))
    keras.utils.set_random_seed(0)
    with strategy.scope():
        gan = keras_upstream.gan(steps_per_execution, inputs)
    history = gan.fit(keras_upstream.images(), epochs=2, verbose=0).history
    assert np.isfinite(history["d_loss"]).all() and np.isfinite(history["g_loss"]).all()
    assert int(gan.d_optimizer.iterations.numpy()) == 4  # 2 epochs of 2 batches
    # Each optimizer holds slots for exactly the variables it applies to, as
    # on one device; the "rmsprop" of the GAN's super().compile(), never
    # used, is not built (Keras' own build gives it a copy of every variable).
    for optimizer, model in ((gan.d_optimizer, gan.discriminator),
                             (gan.g_optimizer, gan.generator)):
        assert [id(v) for v in optimizer._trainable_variables] == [
            id(v) for v in model.trainable_variables]
        for variable in optimizer.variables + model.weights:  # the strategy's, equal copies
            copies = strategy.experimental_local_results(variable.value)
            assert len(copies) == 2, variable.path
            np.testing.assert_array_equal(copies[0].numpy(), copies[1].numpy())
        assert len(optimizer.variables) == 2 + 2 * len(model.trainable_variables)  # Adam's
    assert not gan.optimizer.built and len(gan.optimizer.variables) == 2


@pytest.mark.parametrize("name", ["lazy", pytest.param("own_logs", marks=pytest.mark.slow)])
def test_fix_trains_own_steps_on_mirrored_replicas_as_on_one_device(name):
    # A subclassed model built by its first batch; a train_step whose logs
    # are not metrics (a plain tensor, a Python float, a tensor of 2 values)
    # and a test_step of its own: the same weights as on one device.
    import numpy as np

    import tfmulti
    from tests.workers import keras_upstream

    strategy = tfmulti.get_strategy("mirrored", devices=["CPU:0", "CPU:1"])
    tfmulti.apply_keras_fixes(strategy)
    with strategy.scope():
        got = keras_upstream.own_step(name)
    want = keras_upstream.own_step(name)
    np.testing.assert_allclose(got["weights"], want["weights"], atol=1e-5)
    if name == "own_logs":
        assert got["history"]["rate"] == want["history"]["rate"] == [0.5, 0.5]
        np.testing.assert_allclose(got["history"]["bias"], want["history"]["bias"], atol=1e-5)
        # A Keras Loss called in a replica is scaled by 1 / replicas
        # (keras.src.losses.loss.scale_loss_for_distribution), so that the
        # summed gradients are the global mean's: the train_step logs half.
        np.testing.assert_allclose(np.multiply(got["history"]["loss"], 2),
                                   want["history"]["loss"], rtol=1e-5)
        assert got["evaluate"]["mae"] == pytest.approx(want["evaluate"]["mae"], rel=1e-5)
    else:
        np.testing.assert_allclose(got["history"]["loss"], want["history"]["loss"], rtol=1e-5)


def test_add_loss_summed_over_the_batch_counts_1_over_replicas():
    # keras-io's ActivityRegularizationLayer adds the sum of its inputs over
    # the batch. Keras scales every add_loss term by 1 / replicas (as Keras 2
    # and tf.nn.scale_regularization_loss do: right for a term that does not
    # depend on the batch, as weight regularization), so with 2 replicas the
    # model trains as on one device with half the rate. Not a bug tfmulti
    # fixes: a term written as a mean over the batch trains as on one device.
    import numpy as np

    import tfmulti
    from tests.workers import keras_upstream

    strategy = tfmulti.get_strategy("mirrored", devices=["CPU:0", "CPU:1"])
    with strategy.scope():
        got = keras_upstream.own_step("add_loss")  # rate 0.1
    want = keras_upstream.train(lambda: keras_upstream.with_add_loss(0.05),
                                keras_upstream.regression())
    np.testing.assert_allclose(got["weights"], want["weights"], atol=1e-5)
    np.testing.assert_allclose(got["history"]["loss"], want["history"]["loss"], rtol=1e-5)


@pytest.mark.slow
def test_fix_loss_scaling_skips_a_step_that_overflows_on_any_replica():
    # mixed_float16: the scaled gradient of one outlier overflows float16 in
    # the second replica's half of the first batch. Upstream, the first
    # replica's check passes and the step is applied: the weights turn
    # infinite (tests/integration/test_keras_fixes.py). With the fix every
    # replica skips that step and halves the loss scale, as one device does
    # on the whole batch, and trains to its weights (float16 sums: 1e-4).
    import numpy as np

    import tfmulti
    from tests.workers import keras_upstream

    strategy = tfmulti.get_strategy("mirrored", devices=["CPU:0", "CPU:1"])
    assert ONE_REPLICAS_FINITE in tfmulti.apply_keras_fixes(strategy)
    with strategy.scope():
        got = keras_upstream.own_step("mixed_float16_overflow")
    want = keras_upstream.own_step("mixed_float16_overflow")
    assert got["loss_scale"] == want["loss_scale"] == 2.0 ** 15 / 4  # 2 steps skipped of 4
    assert np.isfinite(got["weights"]).all()
    np.testing.assert_allclose(got["weights"], want["weights"], rtol=0, atol=1e-4)
    np.testing.assert_allclose(got["history"]["loss"], want["history"]["loss"], rtol=1e-4)


# --------------------------------------------------------------------------
# Rows repeated in a sparse gradient (the scatter updates of keras#18692).


@pytest.mark.parametrize("optimizer", ["adam", "rmsprop", "adagrad"])
def test_fix_updates_repeated_rows_by_their_summed_gradient(optimizer):
    # Under 2 replicas (each batch's ids repeat, and the replicas' rows are
    # concatenated by the all-reduce) and on one device, the table trains as its
    # dense gradient trains it (the upstream bug, tests/integration: differs by
    # more than 0.01).
    import numpy as np

    import tfmulti
    from tests.workers import keras_upstream

    for strategy in (tfmulti.get_strategy("mirrored", devices=["CPU:0", "CPU:1"]),
                     tfmulti.get_strategy("one_device", devices=["CPU:0"])):
        assert REPEATED_ROWS in tfmulti.apply_keras_fixes(strategy)
        got, want = keras_upstream.embedding_runs(optimizer, strategy)
        np.testing.assert_allclose(got, want, rtol=0, atol=1e-6)


# --------------------------------------------------------------------------
# Sparse gradients all-reduced one table at a time (tensorflow#53160).


def _sparse_reduction(reduce_all):
    """Three sparse gradients of 2 replicas (two tables of 8-wide rows, int64
    ids; one of 3-wide rows, int32 ids) and a dense one, reduced by
    `reduce_all(context, gradients)` in one traced step: (each replica's
    results as NumPy, the step's graph)."""
    import tensorflow as tf

    import tfmulti

    strategy = tfmulti.get_strategy("mirrored", devices=["CPU:0", "CPU:1"])

    def step():
        context = tf.distribute.get_replica_context()
        r = tf.cast(context.replica_id_in_sync_group, tf.int64)
        f = tf.cast(r, tf.float32)
        gradients = [
            tf.IndexedSlices(tf.reshape(tf.range(24.0), [3, 8]) + 100 * f,
                             tf.constant([4, 0, 4], tf.int64) + r, tf.constant([6, 8], tf.int64)),
            tf.ones([2, 2]) * (f + 1),
            tf.IndexedSlices(tf.fill([1 + 2 * r, 3], 7.0 + f), tf.range(1 + 2 * r, dtype=tf.int32),
                             tf.constant([3, 3], tf.int32)),
            tf.IndexedSlices(tf.fill([2 - r, 8], -1.0 - f), tf.constant([2, 1], tf.int64)[:2 - r],
                             tf.constant([3, 8], tf.int64)),
        ]
        return reduce_all(context, gradients)

    function = tf.function(lambda: strategy.run(step))
    results = [[(g.values.numpy(), g.indices.numpy(), g.dense_shape.numpy())
                if isinstance(g, tf.IndexedSlices) else g.numpy() for g in replica]
               for replica in strategy.experimental_local_results(function())]
    return results, function.get_concrete_function().graph


def _gathers(graph) -> int:
    """The all-gathers in `graph`, its functions' included (the conds' branches)."""
    nodes = [n.op for n in graph.as_graph_def().node]
    nodes += [n.op for f in graph.as_graph_def().library.function for n in f.node_def]
    return sum(op.startswith("CollectiveGather") for op in nodes)


def test_upstream_bug_each_sparse_gradient_is_all_reduced_on_its_own():
    # TensorFlow's all-reduce of a list: per IndexedSlices, an all-gather of its
    # length and a cond between two pairs of all-gathers, on each replica.
    import tensorflow as tf

    _, graph = _sparse_reduction(lambda c, g: c.all_reduce(tf.distribute.ReduceOp.SUM, g))
    assert _gathers(graph) == 2 * 3 * (1 + 2 + 2)


def test_fix_packs_sparse_gradients_of_one_row_shape_into_one_reduction():
    # The two tables of 8-wide rows reduced as one (the 3-wide one on its own):
    # each result the unpacked reduction's, the same rows in the same order.
    import numpy as np
    import tensorflow as tf

    from tfmulti.runtime import keras_fixes

    want, _ = _sparse_reduction(lambda c, g: c.all_reduce(tf.distribute.ReduceOp.SUM, g))
    got, graph = _sparse_reduction(keras_fixes.packed_rows_all_reduce)
    assert _gathers(graph) == 2 * 2 * (1 + 2 + 2)
    for mine, theirs in zip(got, want):
        for a, b in zip(mine, theirs):
            for x, y in zip(a if isinstance(a, tuple) else [a], b if isinstance(b, tuple) else [b]):
                assert x.dtype == y.dtype and x.shape == y.shape
                np.testing.assert_array_equal(x, y)
    # Replica 1's rows of the second table follow replica 0's; its ids its own.
    np.testing.assert_array_equal(got[0][3][1], [2, 1, 2])


# --------------------------------------------------------------------------
# A lookup that copies its whole table (keras-core#229).

TABLE_BYTES = 1000 * 256 * 4


def _keras_take():
    """Keras' own TensorFlow `take`, unpatched wherever the fix is installed."""
    import inspect

    from keras.src.backend.tensorflow import numpy as tf_numpy

    return inspect.unwrap(tf_numpy.take)  # (installed again by a test of the fixes: twice)


def _table_readers(function, table) -> set[str]:
    """The types of the ops of `function`'s graph that read `table` (a Keras
    variable) through its handle."""
    concrete = function.get_concrete_function()
    handles = [inner for outer, inner in concrete.graph.captures
               if outer is table._value.handle]  # pylint: disable=protected-access
    return {op.type for op in concrete.graph.get_operations()
            if any(t is h for t in op.inputs for h in handles)}


def _allocated_by(function) -> int | None:
    """The bytes TensorFlow's CPU allocator held at most during `function()`
    above what it held before (None: the allocator keeps no count here)."""
    import tensorflow as tf

    try:
        tf.config.experimental.reset_memory_stats("CPU:0")
        before = tf.config.experimental.get_memory_info("CPU:0")["current"]
        function()
        peak = tf.config.experimental.get_memory_info("CPU:0")["peak"]
    except (ValueError, tf.errors.OpError):
        return None
    return None if peak == 0 else peak - before


def _sparsely_updated_table():
    """A Keras variable of 1000 x 256 floats (1 MB) that had a sparse update,
    as SGD's update of an `Embedding`'s gradient (a scatter) leaves a table."""
    import keras
    import numpy as np
    import tensorflow as tf

    table = keras.Variable(np.arange(1000 * 256, dtype="float32").reshape(1000, 256))
    table._value.scatter_sub(tf.IndexedSlices(tf.ones([1, 256]), tf.constant([3])))
    return table


def test_upstream_bug_a_lookup_reads_its_whole_table_and_copies_it_after_a_sparse_update():
    # Keras' take of rows reads the table whole (a ReadVariableOp), and TensorFlow,
    # which keeps a sparsely updated variable in copy-on-read mode, copies it all
    # at that read: 1 MB allocated for a lookup of 3 rows.
    import tensorflow as tf

    table, take = _sparsely_updated_table(), _keras_take()
    lookup = tf.function(lambda: take(table, tf.constant([3, 1, -1]), axis=0))
    assert _table_readers(lookup, table) == {"ReadVariableOp"}
    copied = _allocated_by(lookup)
    if copied is None:
        pytest.skip("TensorFlow's CPU allocator keeps no count of its bytes here (oneDNN off)")
    assert copied >= TABLE_BYTES, copied


def test_fix_gathers_the_rows_from_the_variable():
    # The same rows (a negative id counted from the end, as Keras counts it) by a
    # ResourceGather of the variable: only the rows' bytes are allocated.
    import numpy as np
    import tensorflow as tf

    import tfmulti
    from keras.src.backend.tensorflow import numpy as tf_numpy

    assert WHOLE_TABLE_READ in tfmulti.apply_keras_fixes(tf.distribute.OneDeviceStrategy("CPU:0"))
    table = _sparsely_updated_table()
    ids = tf.constant([3, 1, -1])
    lookup = tf.function(lambda: tf_numpy.take(table, ids, axis=0))
    assert _table_readers(lookup, table) == {"ResourceGather"}
    np.testing.assert_array_equal(lookup(), _keras_take()(table, ids, axis=0))
    np.testing.assert_array_equal(lookup()[0], np.arange(3 * 256, 4 * 256) - 1)
    copied = _allocated_by(lookup)
    assert copied is None or copied < TABLE_BYTES / 10, copied
    # Not a row lookup, or not a variable: Keras' own.
    flat = tf.function(lambda: tf_numpy.take(table, tf.constant([5])))
    assert _table_readers(flat, table) == {"ReadVariableOp"}
    np.testing.assert_array_equal(tf_numpy.take(table.value, ids, axis=0), lookup())


def _embedding_sgd_run(strategy):
    """An Embedding (1000 x 8, ids -1 included) and a Dense, trained by SGD 2
    epochs under `strategy`: the weights."""
    import keras
    import numpy as np

    keras.utils.set_random_seed(0)
    with strategy.scope():
        ids = keras.Input((), dtype="int32")
        model = keras.Model(ids, keras.layers.Dense(1)(keras.layers.Embedding(1000, 8)(ids)))
        model.compile(keras.optimizers.SGD(0.5), "mse")
    rng = np.random.default_rng(0)
    x = rng.integers(-1, 1000, 256).astype("int32")
    model.fit(x, (x % 2).astype("float32"), batch_size=32, epochs=2, shuffle=False, verbose=0)
    return model.get_weights()


@pytest.mark.slow
def test_fix_trains_a_table_to_the_weights_of_keras_own_lookup(monkeypatch):
    # SGD's scatter updates put the table in copy-on-read mode after the first
    # step; on one device and on 2 replicas the gathered rows train it to the
    # very weights the whole reads do.
    import numpy as np

    import tfmulti
    from keras.src.backend.tensorflow import numpy as tf_numpy

    for strategy in (tfmulti.get_strategy("one_device", devices=["CPU:0"]),
                     tfmulti.get_strategy("mirrored", devices=["CPU:0", "CPU:1"])):
        assert WHOLE_TABLE_READ in tfmulti.apply_keras_fixes(strategy)
        got = _embedding_sgd_run(strategy)
        with monkeypatch.context() as patch:
            patch.setattr(tf_numpy, "take", _keras_take())
            want = _embedding_sgd_run(strategy)
        assert len(got) == len(want) == 3
        for a, b in zip(got, want, strict=True):
            np.testing.assert_array_equal(a, b)
        assert np.abs(got[0] - want[0]).max() == 0 and np.abs(got[0]).max() > 0


@pytest.mark.parametrize("distribution", ["pipeline", "hybrid"])
def test_a_model_placed_by_hand_gets_the_lookup_fix(distribution, monkeypatch):
    # tfmulti's pipeline and hybrid train without a strategy (placement by hand):
    # their lookups gather rows too.
    from keras.src.backend.tensorflow import numpy as tf_numpy

    from tfmulti.config.train_config import TrainConfig
    from tfmulti.runtime import keras_fixes
    from tfmulti.training import run as runs

    monkeypatch.setattr(keras_fixes, "_applied", set())
    monkeypatch.setattr(keras_fixes, "_announced", True)  # this process printed its line
    monkeypatch.setattr(tf_numpy, "take", _keras_take())
    runs._strategy(TrainConfig(distribution=distribution))
    assert keras_fixes.active_fixes() == [WHOLE_TABLE_READ]
    assert tf_numpy.take.__wrapped__ is _keras_take()


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
                                                   BATCH_NORM_STATISTICS, EMPTY_BATCH_CONV,
                                                   MODEL_WITHOUT_CALL, BUILT_IN_THE_STEP,
                                                   REPEATED_ROWS, PACKED_ROWS,
                                                   ONE_REPLICAS_FINITE, WHOLE_TABLE_READ]
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
    assert keras_fixes.apply_keras_fixes(tf.distribute.OneDeviceStrategy("CPU:0")) == [
        MODEL_WITHOUT_CALL, REPEATED_ROWS, WHOLE_TABLE_READ]
    assert keras_fixes.apply_keras_fixes(tf.distribute.get_strategy()) == []
    assert keras_fixes.apply_keras_fixes() == keras_fixes.active_fixes() == [
        FIT_MULTI_WORKER, UNEVEN_FIRST_BATCH, SCALAR_LOGS_MULTI_WORKER, STEPS_PER_CALL,
        BATCH_NORM_STATISTICS, EMPTY_BATCH_CONV, MODEL_WITHOUT_CALL, BUILT_IN_THE_STEP,
        REPEATED_ROWS, PACKED_ROWS, ONE_REPLICAS_FINITE, WHOLE_TABLE_READ]


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
    (MODEL_WITHOUT_CALL,
     "keras.src.backend.tensorflow.trainer:TensorFlowTrainer._maybe_symbolic_build"),
    (BUILT_IN_THE_STEP, "keras.src.backend.tensorflow.core:Variable._initialize"),
    (REPEATED_ROWS,
     "keras.src.backend.tensorflow.optimizer:TFOptimizer._distributed_tf_update_step"),
    (PACKED_ROWS, "keras.src.backend.tensorflow.optimizer:TFOptimizer._all_reduce_sum_gradients"),
    (ONE_REPLICAS_FINITE,
     "keras.src.optimizers.loss_scale_optimizer:LossScaleOptimizer.check_finite"),
    (WHOLE_TABLE_READ, "keras.src.backend.tensorflow.numpy:take"),
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
    assert any(re.search(rf"fix for {re.escape(fix)} \([a-z-]+#\d+\) was written for Keras "
                         rf"3\.15, .*{attribute}\. The fix stays off", str(w.message))
               for w in caught), [str(w.message) for w in caught]
    assert getattr(owner, attribute) is new_keras_version  # not patched
    # The others are on: all but the fixes that replace the changed function.
    assert fix not in active and len(active) == len(keras_fixes._needed(None)) - len(sharing)
    assert fix not in keras_fixes.active_fixes()
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # once
        assert keras_fixes.apply_keras_fixes() == active
