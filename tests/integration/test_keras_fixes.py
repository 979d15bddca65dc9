"""The upstream Keras fixes (tfmulti.runtime.keras_fixes) in processes: each upstream bug
still happens without its fix, in a fresh process, and the fix mends it.

The tests that start processes or clusters; the in-process ones, and the
conventions, are in tests/unit/test_keras_fixes.py."""

from __future__ import annotations

import json
import textwrap

import pytest

from tests._util import (
    WORKERS,
    cluster_python_warm,
    fake_slurm,
    run_python,
    run_python_warm,
)
from tests.unit.test_keras_fixes import (
    BATCH_NORM_STATISTICS,
    BUILT_IN_THE_STEP,
    EMPTY_BATCH_CONV,
    FIT_MULTI_WORKER,
    MODEL_WITHOUT_CALL,
    ONE_REPLICAS_FINITE,
    PACKED_ROWS,
    REPEATED_ROWS,
    SCALAR_LOGS_MULTI_WORKER,
    STEPS_PER_CALL,
    UNEVEN_FIRST_BATCH,
    WHOLE_TABLE_READ,
)
from tests.workers import keras_upstream

# Convolutions on an empty batch under oneDNN. The bug is in oneDNN's
# kernels, which TensorFlow turns on by default only on x86 CPUs with AVX-512
# neural-network features (VNNI, BF16, AMX); elsewhere (an AVX2-only CPU, say)
# the same tests would pass without the fix. So they run in a process with
# oneDNN switched on (TF_ENABLE_ONEDNN_OPTS=1), and mean the same on any x86
# CPU.
_ONEDNN_ON = {"TF_ENABLE_ONEDNN_OPTS": "1"}
_NO_ONEDNN = "this TensorFlow build has no oneDNN (TF_ENABLE_ONEDNN_OPTS=1 did not turn it on)"

_EMPTY_BATCH_LAYERS = {  # layer: (input shape without the batch, constructor args)
    "Conv1D": ((10, 3), (5, 3)),
    "Conv2D": ((9, 9, 3), (5, 3, 2)),
    "Conv3D": ((6, 6, 6, 2), (4, 3)),
    "DepthwiseConv2D": ((8, 8, 3), (3, 2)),
    "SeparableConv2D": ((8, 8, 3), (6, 3)),
}

# One process, oneDNN on, 4 virtual CPUs. The order matters: nothing installs
# a fix before the upstream parts that need it missing (apply_keras_fixes and
# get_strategy install the multi-step and the empty-batch fixes, so they come
# after them; "announce" is the first to install any), and the failed
# all-reduce of "keys_upstream" aborts the process's collectives, so it comes
# last. Each part
# records {"result": ..., "error": "Type: message" or None}.
_SINGLE_PROCESS = textwrap.dedent("""
    import json, sys
    import numpy as np
    import tensorflow as tf
    from tensorflow.python.util import _pywrap_util_port
    import tfmulti
    from tfmulti import data
    from tfmulti.models import builders as models
    from tfmulti.runtime import keras_fixes
    tfmulti.configure_virtual_devices(4)
    import keras

    out = {"onednn": _pywrap_util_port.IsMklEnabled()}

    def part(function):
        try:
            out[function.__name__] = {"result": function(), "error": None}
        except Exception as e:
            out[function.__name__] = {"result": None, "error": f"{type(e).__name__}: {e}"}

    # Several MirroredStrategy in one process: each its own collective keys.
    def all_reduce(strategy):
        value = strategy.run(lambda: tf.distribute.get_replica_context().all_reduce(
            "sum", tf.constant(1.0)))
        return float(strategy.experimental_local_results(value)[0])

    def two_strategies(make):
        first = make([f"CPU:{i}" for i in range(2)])
        second = make([f"CPU:{i}" for i in range(4)])
        return [all_reduce(first), all_reduce(second)]

    @part
    def keys_fix():
        return two_strategies(keras_fixes.mirrored_strategy)

    # Several steps per call (steps_per_execution > 1) with 2 replicas, plain
    # MirroredStrategy.
    @part
    def multi_step_upstream():
        strategy = tf.distribute.MirroredStrategy(["CPU:0", "CPU:1"])  # no tfmulti fixes
        with strategy.scope():
            model = models.build_model("mlp", dropout=0.0, seed=0)
        models.compile_model(model, task="classification", strategy=strategy,
                             optimizer="sgd", steps_per_execution=4)
        train = data.distribute(data.load("synthetic", num_examples=512), strategy, 64, seed=0)
        model.fit(**train.fit_kwargs(), epochs=1, verbose=0)
        return "fit ok"

    # `evaluate` of a model built by `make_model` under 2 mirrored replicas
    # (collective keys of their own, Keras not patched yet).
    def evaluate_unpatched(make_model, num_examples, batch):
        strategy = keras_fixes.mirrored_strategy(["CPU:0", "CPU:1"])
        with strategy.scope():
            model = make_model()
            model.compile(loss="sparse_categorical_crossentropy")
        test = data.distribute(data.load("synthetic", "test", num_examples=num_examples),
                               strategy, batch, training=False)
        model.evaluate(**test.evaluate_kwargs(), verbose=0)
        return "evaluate ok"

    # A first batch split unevenly over 2 replicas (plain MirroredStrategy):
    # 240 test examples at global batch 256 give them 128 and 112 rows.
    @part
    def uneven_first_batch_upstream():
        return evaluate_unpatched(lambda: keras.Sequential([
            keras.Input((28, 28, 1)), keras.layers.Flatten(), keras.layers.Dense(10)]), 240, 256)

    # keras-hub's BERT classifier (tests/corpus/hub_bert_token_ids.py: a boolean
    # padding mask among its inputs) trained by keras-hub's own fit under 2
    # mirrored replicas.
    def fit_bert(strategy):
        from tests.corpus import hub_bert_token_ids as bert
        (x, y), _ = bert.data()
        with strategy.scope():
            model = bert.build()
        x = {name: value[:128] for name, value in x.items()}  # 2 steps
        model.fit(x, y[:128], batch_size=64, epochs=1, verbose=0)
        return "fit ok"

    @part
    def boolean_input_upstream():
        return fit_bert(keras_fixes.mirrored_strategy(["CPU:0", "CPU:1"]))  # not patched yet

    # BatchNormalization's moving statistics under 2 replicas whose halves of
    # every batch differ (plain MirroredStrategy): the largest difference
    # between the replicas' copies of the moving mean after 4 steps.
    @part
    def batch_norm_statistics_upstream():
        strategy = keras_fixes.mirrored_strategy(["CPU:0", "CPU:1"])  # Keras not patched yet
        x = np.random.default_rng(0).normal(size=(256, 8)).astype("float32")
        x[np.arange(256) % 64 >= 32] += 3.0
        y = (x.sum(axis=1) > 12).astype("int32")
        with strategy.scope():
            model = keras.Sequential([keras.Input((8,)), keras.layers.Dense(16),
                                      keras.layers.BatchNormalization(), keras.layers.Dense(2)])
            model.compile("sgd", keras.losses.SparseCategoricalCrossentropy(from_logits=True))
        model.fit(tf.data.Dataset.from_tensor_slices((x, y)).batch(64), verbose=0)
        copies = strategy.experimental_local_results(model.layers[1].moving_mean.value)
        return float(np.max(np.abs(copies[0].numpy() - copies[1].numpy())))

    # A forward that assigns a mean-aggregated variable (a merge_call, where the
    # replicas take turns), then adds a loss of 1.0: the reported losses on one
    # device and on 2 plain mirrored replicas (collective keys of their own).
    @part
    def added_loss_upstream():
        from tests.workers import keras_upstream
        return [keras_upstream.added_loss_runs(s)
                for s in (None, keras_fixes.mirrored_strategy(["CPU:0", "CPU:1"]))]

    # Convolutions on an empty batch.
    def conv_model(**compile_args):
        model = keras.Sequential([keras.Input((28, 28, 1)), keras.layers.Conv2D(4, 3),
                                  keras.layers.Conv2D(8, 3), keras.layers.Flatten(),
                                  keras.layers.Dense(10)])
        model.compile(**compile_args)
        return model

    @part
    def conv_upstream_op():
        y = tf.nn.conv2d(tf.zeros((0, 14, 14, 32)), tf.zeros((3, 3, 32, 64)), 1, "VALID")
        return list(y.shape)

    @part
    def conv_upstream():
        # MirroredStrategy, 2 replicas, 80 test examples at global batch 64: the
        # last batch (16) fits in replica 0's share, replica 1 gets 0 examples.
        return evaluate_unpatched(conv_model, 80, 64)

    # keras-io's GAN (no call; two optimizers built by their first apply)
    # under 2 mirrored replicas, Keras not patched yet: its symbolic build
    # calls the model; past it (`built` set by hand), the optimizers are built
    # inside the replica function.
    def fit_gan(built_by_hand):
        from tests.workers import keras_upstream
        strategy = keras_fixes.mirrored_strategy(["CPU:0", "CPU:1"])
        with strategy.scope():
            gan = keras_upstream.gan()
        gan.built = built_by_hand
        gan.fit(keras_upstream.images(), epochs=1, verbose=0)
        return "fit ok"

    @part
    def model_without_call_upstream():
        return fit_gan(built_by_hand=False)

    @part
    def built_in_the_step_upstream():
        return fit_gan(built_by_hand=True)

    # An Embedding's rows repeated in its batch, Adam, plain Keras on one device
    # (no strategy) and under 2 mirrored replicas (collective keys of their own, as
    # fit_gan's: keys_upstream below needs the first strategies' keys as they are):
    # how far the table trained from its rows is from the one its dense gradient trains.
    @part
    def repeated_rows_upstream():
        from tests.workers import keras_upstream
        return [float(np.max(np.abs(np.subtract(*keras_upstream.embedding_runs("adam", s)))))
                for s in (None, keras_fixes.mirrored_strategy(["CPU:0", "CPU:1"]))]

    # mixed_float16, an outlier whose scaled gradient overflows in the second
    # replica's half of the first batch, under 2 plain mirrored replicas
    # (collective keys of their own): the loss scale, and whether the weights
    # are finite.
    @part
    def loss_scale_upstream():
        from tests.workers import keras_upstream
        with keras_fixes.mirrored_strategy(["CPU:0", "CPU:1"]).scope():
            got = keras_upstream.own_step("mixed_float16_overflow")
        return [got["loss_scale"], bool(np.isfinite(got["weights"]).all())]

    # apply_keras_fixes on strategies the user built: the first call that
    # patches prints one line to stderr, no other call does.
    @part
    def announce():
        import contextlib, io
        r, errors = {}, io.StringIO()
        with contextlib.redirect_stderr(errors):
            r["active_before"] = keras_fixes.active_fixes()
            r["default"] = tfmulti.apply_keras_fixes(tf.distribute.get_strategy())
            r["stderr_before"] = errors.getvalue()  # nothing patched: quiet
            mirrored = tf.distribute.MirroredStrategy(["CPU:0", "CPU:1"])
            r["mirrored"] = tfmulti.apply_keras_fixes(mirrored)
            r["again"] = tfmulti.apply_keras_fixes(mirrored)
            r["one_device"] = tfmulti.apply_keras_fixes(tf.distribute.OneDeviceStrategy("CPU:0"))
            tfmulti.get_strategy("mirrored", devices=["CPU:0", "CPU:1"])
            r["everything"] = tfmulti.apply_keras_fixes()
        r["stderr"] = errors.getvalue()
        return r

    @part
    def conv_fix():
        # The upstream evaluation through get_strategy (which installs the fix)
        # against one device evaluating the same weights.
        r = {}
        strategy = tfmulti.get_strategy("mirrored", devices=["CPU:0", "CPU:1"])
        r["installed_by_get_strategy"] = (
            "convolutions on an empty batch under oneDNN" in keras_fixes.active_fixes())
        compile_args = dict(loss=keras.losses.SparseCategoricalCrossentropy(from_logits=True),
                            metrics=["accuracy"])
        with strategy.scope():
            model = conv_model(**compile_args)
        test_data = data.load("synthetic", "test", num_examples=80)
        r["last_batch"] = int(test_data.cardinality()) % 64
        test = data.distribute(test_data, strategy, 64, training=False)
        r["distributed"] = model.evaluate(**test.evaluate_kwargs(), return_dict=True,
                                          verbose=0)
        single = conv_model(**compile_args)
        single.set_weights(model.get_weights())
        r["one_device"] = single.evaluate(test_data.batch(64), return_dict=True, verbose=0)
        return r

    @part
    def boolean_input_fix():
        return fit_bert(tfmulti.get_strategy("mirrored", devices=["CPU:0", "CPU:1"]))

    @part
    def conv_layers_fix():
        # Each layer on an empty batch, with the fix installed.
        def has_cond(graph):
            return bool({op.type for op in graph.get_operations()} & {"If", "StatelessIf"})

        r = {}
        for name, (shape, args) in json.loads(sys.argv[1]).items():
            layer = getattr(keras.layers, name)(*args)
            x = tf.random.uniform((3, *shape), seed=1)
            full = layer(x)  # builds; static batch 3: the upstream op, unwrapped
            dynamic = tf.function(layer.__call__,
                                  input_signature=[tf.TensorSpec((None, *shape), tf.float32)])
            # A graph with a known, positive batch (every training step): no cond.
            static = tf.function(layer.__call__).get_concrete_function(
                tf.TensorSpec((3, *shape), tf.float32))
            r[name] = {
                "expected": [0, *full.shape[1:]],
                "eager": list(layer(x[:0]).shape),  # eager, static empty batch
                "dynamic": list(dynamic(x[:0]).shape),
                "max_difference": float(np.max(np.abs(dynamic(x) - full))),
                "static_has_cond": has_cond(static.graph),
                "dynamic_has_cond": has_cond(dynamic.get_concrete_function().graph),
            }
        return r

    # Several MirroredStrategy's upstream bug, last: its failed all-reduce aborts
    # the collectives.
    @part
    def keys_upstream():
        return two_strategies(lambda d: tf.distribute.MirroredStrategy(d))

    print(json.dumps(out))
""")


def _onednn_without_asking() -> bool:
    """Whether TensorFlow runs with oneDNN on in this environment as it is (its default
    on x86 CPUs with AVX-512 neural-network features): what this process's import gave,
    and the warm server's (`run_python_warm`: the same environment) too."""
    import os

    from tensorflow.python.util import _pywrap_util_port

    return (bool(_pywrap_util_port.IsMklEnabled())
            and os.environ.get(next(iter(_ONEDNN_ON)), "1") == "1")


@pytest.fixture(scope="module")
def upstream():
    """What each part of `_SINGLE_PROCESS` returned or raised. A process that has done
    nothing but import TensorFlow, Keras and tfmulti (as the script's first lines do):
    forked from the warm server where oneDNN is on there already (no fix installed, no
    strategy made, the runtime not started: as fresh as a new process for every part),
    else a new process that switches it on (TF_ENABLE_ONEDNN_OPTS=1, read at import)."""
    args = ["-c", _SINGLE_PROCESS, json.dumps(_EMPTY_BATCH_LAYERS)]
    out = None
    if _onednn_without_asking():
        result = run_python_warm(args, timeout=240)  # under pytest-timeout (300 s)
        assert result.returncode == 0, result.stdout[-2000:] + result.stderr[-3000:]
        out = json.loads(result.stdout.strip().splitlines()[-1])
    if out is None or not out["onednn"]:  # (the warm server's environment changed since)
        result = run_python(args, timeout=240, env=_ONEDNN_ON)
        assert result.returncode == 0, result.stdout[-2000:] + result.stderr[-3000:]
        out = json.loads(result.stdout.strip().splitlines()[-1])
    return out


def _needs_onednn(upstream) -> None:
    if not upstream["onednn"]:
        pytest.skip(_NO_ONEDNN)


# --------------------------------------------------------------------------
# Several MirroredStrategy in one process share collective keys
# (tensorflow#61314).


@pytest.mark.slow
def test_upstream_bug_mirrored_strategies_share_collective_keys(upstream):
    # tensorflow/tensorflow#61314: a second MirroredStrategy over other devices
    # reuses group key 1 and its first all-reduce fails.
    part = upstream["keys_upstream"]
    assert part["result"] is None, part
    assert "is joining a group with size" in part["error"], part


@pytest.mark.slow
def test_fix_gives_each_mirrored_strategy_its_own_keys(upstream):
    part = upstream["keys_fix"]
    assert part["error"] is None, part["error"][-3000:]
    assert part["result"] == [2.0, 4.0]  # the sums


# --------------------------------------------------------------------------
# SlurmClusterResolver without GPUs (tensorflow#56894).


@pytest.mark.slow  # it tries to start nvidia-smi
def test_upstream_bug_slurm_resolver_needs_gpus(monkeypatch):
    import tensorflow as tf

    fake_slurm(monkeypatch)
    with pytest.raises(FileNotFoundError):  # it runs nvidia-smi
        tf.distribute.cluster_resolver.SlurmClusterResolver()
    with pytest.raises(ValueError, match="range"):
        tf.distribute.cluster_resolver.SlurmClusterResolver(gpus_per_node=0).cluster_spec()


# --------------------------------------------------------------------------
# Fit under MultiWorkerMirroredStrategy (keras#20585), and its logged scalars
# (tensorflow#72388).


@pytest.fixture(scope="module")
def keras_under_multi_worker():
    """One 2-worker cluster fitting with no fix, with the symbolic build fixed
    but not the logged scalars, and with both, then fitting each model of
    `keras_upstream.OWN_STEPS` with all the fixes: (exit status, {mode or
    model: [worker 0's line, worker 1's line]}, output)."""
    code, output = cluster_python_warm(
        [str(WORKERS / "keras_upstream.py"), "none", "build", "all", "own_steps"],
        grace_period=5)
    lines = {mode: [line for rank in (0, 1) for line in output.splitlines()
                    if line.startswith(f"[worker {rank}] {mode}: fit ")]
             for mode in ("none", "build", "all")}
    lines.update({name: [line for rank in (0, 1) for line in output.splitlines()
                         if line.startswith(f"[worker {rank}] own_steps: {name} ")]
                  for name in keras_upstream.OWN_STEPS})
    return code, lines, output


def _both_workers_failed(keras_under_multi_worker, mode: str, message: str) -> None:
    _, lines, output = keras_under_multi_worker
    assert len(lines[mode]) == 2, output[-3000:]
    for line in lines[mode]:
        assert f"{mode}: fit failed: " in line and message in line
    assert f"{mode}: fit ok" not in output


@pytest.mark.cluster
def test_upstream_bug_keras_symbolic_build_under_multi_worker(keras_under_multi_worker):
    # keras-team/keras#20585: fit reduces the whole (x, y) batch at once.
    _both_workers_failed(keras_under_multi_worker, "none", "Attempt to convert a value (PerReplica")


@pytest.mark.cluster
def test_upstream_bug_keras_scalar_reduction_under_multi_worker(keras_under_multi_worker):
    # tensorflow/tensorflow#72388: with the build fixed, scalar logs are reduced on axis 0.
    _both_workers_failed(keras_under_multi_worker, "build",
                         "Invalid reduction dimension 0 for input with 0 dimensions")


@pytest.mark.cluster
def test_fix_keras_fit_under_multi_worker(keras_under_multi_worker):
    code, _, output = keras_under_multi_worker
    assert code == 0, output[-3000:]
    assert output.count("all: fit ok") == 2


@pytest.fixture(scope="module")
def own_steps_on_one_device():
    """Each model of `keras_upstream.OWN_STEPS` trained here, on one device
    (no strategy), and add_loss's at half its rate: {name: its result}."""
    results = {name: keras_upstream.own_step(name) for name in keras_upstream.OWN_STEPS}
    results["add_loss_at_half_rate"] = keras_upstream.train(
        lambda: keras_upstream.with_add_loss(0.05), keras_upstream.regression())
    return results


@pytest.mark.cluster
@pytest.mark.parametrize("name", sorted(keras_upstream.OWN_STEPS))
def test_fix_own_steps_under_multi_worker(name, keras_under_multi_worker,
                                          own_steps_on_one_device):
    # keras-io's GAN (no call; its two optimizers built in the replica
    # function), also with 2 steps per call; a model built by its first
    # batch; add_loss; a train_step logging a plain tensor, a Python float
    # and a tensor of 2 values, and a test_step: on 2 workers, each trains
    # to the same weights on both workers, as it does on 2 mirrored replicas
    # (tests/unit/test_keras_fixes.py).
    import numpy as np

    _, lines, output = keras_under_multi_worker
    assert len(lines[name]) == 2, output[-3000:]
    assert all(f"own_steps: {name} ok " in line for line in lines[name]), lines[name]
    first, second = (json.loads(line.split(" ok ", 1)[1]) for line in lines[name])
    np.testing.assert_allclose(first["weights"], second["weights"], atol=1e-5)
    assert first["history"] == second["history"]
    for key, values in first["history"].items():
        assert np.isfinite(values).all(), (key, values)
    one_device = own_steps_on_one_device[name]
    if name.startswith("gan"):
        # Slots for exactly the variables each optimizer applies to, as on
        # one device ("rmsprop", never used: none).
        assert first["optimizer_variables"] == one_device["optimizer_variables"]
        assert len(first["optimizer_variables"]["optimizer"]) == 2
    elif name == "add_loss":  # its term, summed over the batch, counts 1 / 2
        np.testing.assert_allclose(
            first["weights"], own_steps_on_one_device["add_loss_at_half_rate"]["weights"],
            atol=1e-5)
    elif name == "mixed_float16_overflow":  # both workers skip the step one's share overflows
        assert first["loss_scale"] == one_device["loss_scale"] == 2.0 ** 13
        np.testing.assert_allclose(first["weights"], one_device["weights"], atol=1e-4)
    else:  # the same weights as on one device
        np.testing.assert_allclose(first["weights"], one_device["weights"], atol=1e-5)
    if name == "own_logs":  # logs as on one device (a Keras Loss: 1 / 2 of it)
        assert first["history"]["rate"] == [0.5, 0.5]
        np.testing.assert_allclose(first["history"]["bias"], one_device["history"]["bias"],
                                   atol=1e-5)
        np.testing.assert_allclose(np.multiply(first["history"]["loss"], 2),
                                   one_device["history"]["loss"], rtol=1e-5)
        assert first["evaluate"]["mae"] == pytest.approx(one_device["evaluate"]["mae"],
                                                         rel=1e-5)


# --------------------------------------------------------------------------
# Several steps per call (steps_per_execution > 1) with 2 or more replicas
# (keras#19246).


@pytest.mark.slow
def test_upstream_bug_steps_per_execution_with_replicas(upstream):
    # keras-team/keras#19246: steps_per_execution > 1 fails with 2+ replicas.
    part = upstream["multi_step_upstream"]
    assert part["result"] is None, part  # no "fit ok"
    assert "You must feed a value for placeholder tensor" in part["error"], part


@pytest.mark.slow
def test_upstream_bug_symbolic_build_of_a_first_batch_split_unevenly(upstream):
    # keras-team/keras#20585's build under MirroredStrategy: Keras reduces the
    # first batch's inputs over the replicas, which fails for unequal shares.
    part = upstream["uneven_first_batch_upstream"]
    assert part["result"] is None, part  # no "evaluate ok"
    assert "must have the same size and shape" in part["error"], part


@pytest.mark.slow
def test_upstream_bug_symbolic_build_of_a_boolean_input(upstream):
    # The same reduction of the first batch (keras-team/keras#20585's build) over
    # a boolean input: keras-hub's padding mask, an AddN of booleans. The fix of
    # the build takes the shapes from the dataset's spec and reduces nothing.
    part = upstream["boolean_input_upstream"]
    assert part["result"] is None, part  # no "fit ok"
    assert "Value for attr 'T' of bool is not in the list of allowed values" in part["error"], part
    assert upstream["boolean_input_fix"] == {"result": "fit ok", "error": None}


@pytest.mark.slow
def test_upstream_bug_keras_builds_a_model_without_call_on_mirrored_replicas(upstream):
    # The symbolic build of keras-team/keras#20051 calls keras-io's GAN, which
    # has no call (tests/unit/test_keras_fixes.py: under OneDeviceStrategy too).
    part = upstream["model_without_call_upstream"]
    assert part["result"] is None, part  # no "fit ok"
    assert "Unable to automatically build the model" in part["error"], part


@pytest.mark.slow
def test_upstream_bug_optimizers_built_in_the_train_step_with_replicas(upstream):
    # keras-team/keras#23085: the GAN's two optimizers, built by their first
    # apply inside the replica function, make their slots there.
    part = upstream["built_in_the_step_upstream"]
    assert part["result"] is None, part  # no "fit ok"
    assert "You must feed a value for placeholder tensor" in part["error"], part


@pytest.mark.slow
def test_upstream_bug_repeated_rows_of_a_sparse_gradient_are_updated_one_by_one(upstream):
    # Keras' TensorFlow optimizers scatter their rule over an IndexedSlices'
    # rows (keras-team/keras#18692), so a row repeated in the batch is updated
    # as k steps of its k parts: Adam's table ends far from the one its dense
    # gradient trains, on one device and under 2 replicas (equal within 1e-6
    # with the fix: tests/unit/test_keras_fixes.py).
    part = upstream["repeated_rows_upstream"]
    assert part["error"] is None, part
    one_device, mirrored = part["result"]
    assert one_device > 0.01 and mirrored > 0.01, part


@pytest.mark.slow
def test_upstream_bug_losses_added_in_a_call_mix_between_replicas_that_take_turns(upstream):
    # Keras keeps a layer's added losses in one list for all replicas: where the
    # replicas' threads take turns in the forward (a merge_call: a mean-aggregated
    # assignment, as BatchNormalization's statistics are with the fix below), the
    # second replica's loss also holds the first one's term: a loss of 1.0 added in
    # the call is reported as 1.5 on 2 replicas (equal to one device's with the fix:
    # tests/unit/test_keras_fixes.py).
    part = upstream["added_loss_upstream"]
    assert part["error"] is None, part
    one_device, mirrored = part["result"]
    assert all(abs(m - o - 0.5) < 1e-4 for m, o in zip(mirrored, one_device, strict=True)), part


@pytest.mark.slow
def test_upstream_bug_loss_scaling_reads_the_first_replicas_gradients(upstream):
    # keras-team/keras#18691's LossScaleOptimizer takes the first replica's
    # check of its own gradients, before they are summed: the overflow in the
    # second replica's share is applied, the weights turn infinite and the
    # scale keeps halving (one device skips 2 steps of 4: a scale of 2 ** 13;
    # the same under 2 replicas with the fix: tests/unit/test_keras_fixes.py).
    part = upstream["loss_scale_upstream"]
    assert part["error"] is None, part
    scale, finite = part["result"]
    assert not finite and scale < 2.0 ** 13, part


@pytest.mark.slow
def test_upstream_bug_batch_normalization_statistics_differ_between_replicas(upstream):
    # tensorflow/tensorflow#46488 (Keras 3: moving statistics made with
    # aggregation "none"): each replica's copy follows its own batches.
    part = upstream["batch_norm_statistics_upstream"]
    assert part["error"] is None, part
    assert part["result"] > 0.1, part  # equal with the fix (tests/unit/test_keras_fixes.py)


# --------------------------------------------------------------------------
# Convolutions on an empty batch under oneDNN (tensorflow#30968).


@pytest.mark.slow
def test_upstream_bug_conv_on_empty_batch(upstream):
    # Same oneDNN conv kernel as tensorflow/tensorflow#30968 (fixed there for
    # Conv3D only): an empty batch comes back with the input's shape.
    _needs_onednn(upstream)
    assert upstream["conv_upstream_op"]["result"] == [0, 14, 14, 32], upstream["conv_upstream_op"]
    part = upstream["conv_upstream"]
    assert part["result"] is None, part  # no "evaluate ok"
    assert "Incompatible shapes" in part["error"] or "evenly divisible" in part["error"], part


@pytest.mark.slow
@pytest.mark.parametrize("name", sorted(_EMPTY_BATCH_LAYERS))
def test_fix_conv_layers_on_empty_batch(name, upstream):
    _needs_onednn(upstream)
    assert upstream["conv_layers_fix"]["error"] is None, upstream["conv_layers_fix"]
    r = upstream["conv_layers_fix"]["result"][name]
    assert r["eager"] == r["expected"]
    assert r["dynamic"] == r["expected"]
    assert r["max_difference"] <= 1e-5  # full batches: the same values
    # Training graphs (static, full batches) are unchanged; only an unknown
    # batch size gets the cond.
    assert not r["static_has_cond"]
    assert r["dynamic_has_cond"]


@pytest.mark.slow
def test_fix_evaluates_conv_model_with_empty_replicas(upstream):
    # The upstream test's evaluation, through get_strategy (which installs the
    # fix): the result equals one device evaluating the same weights.
    _needs_onednn(upstream)
    part = upstream["conv_fix"]
    assert part["error"] is None, part
    fix = part["result"]
    assert fix["installed_by_get_strategy"]
    assert fix["last_batch"] == 16  # replica 1 gets nothing
    got, want = fix["distributed"], fix["one_device"]
    assert got["accuracy"] == pytest.approx(want["accuracy"], abs=1e-6)
    assert got["loss"] == pytest.approx(want["loss"], abs=1e-5)


@pytest.mark.slow
def test_apply_keras_fixes_says_once_which_fixes_are_active(upstream):
    # In a fresh process: quiet while nothing is patched, then one line on
    # stderr at the first call that patches, never again (another call,
    # get_strategy, all the fixes).
    part = upstream["announce"]
    assert part["error"] is None, part["error"]
    r = part["result"]
    assert r["active_before"] == [] and r["default"] == [] and r["stderr_before"] == ""
    assert r["mirrored"] == r["again"] == [UNEVEN_FIRST_BATCH, STEPS_PER_CALL,
                                           BATCH_NORM_STATISTICS, EMPTY_BATCH_CONV,
                                           MODEL_WITHOUT_CALL, BUILT_IN_THE_STEP,
                                           REPEATED_ROWS, PACKED_ROWS, ONE_REPLICAS_FINITE,
                                           WHOLE_TABLE_READ]
    assert r["one_device"] == [MODEL_WITHOUT_CALL, REPEATED_ROWS, WHOLE_TABLE_READ]
    assert r["everything"] == [FIT_MULTI_WORKER, UNEVEN_FIRST_BATCH, SCALAR_LOGS_MULTI_WORKER,
                               STEPS_PER_CALL, BATCH_NORM_STATISTICS, EMPTY_BATCH_CONV,
                               MODEL_WITHOUT_CALL, BUILT_IN_THE_STEP, REPEATED_ROWS,
                               PACKED_ROWS, ONE_REPLICAS_FINITE, WHOLE_TABLE_READ]
    assert r["stderr"] == ("tfmulti: Keras fixes active: a first batch split unevenly over "
                           "replicas (keras#20585), several steps per call with 2+ "
                           "replicas (keras#19246), BatchNormalization statistics that differ "
                           "between replicas (tensorflow#46488), convolutions on an empty "
                           "batch under oneDNN (tensorflow#30968), a model without call "
                           "under a strategy (keras#20051), optimizers and layers built in "
                           "the train step with 2+ replicas (keras#23085), rows repeated in "
                           "a sparse gradient (keras#18692), sparse gradients all-reduced one "
                           "table at a time (tensorflow#53160), loss scaling that checks one "
                           "replica's gradients (keras#18691), a lookup that copies its whole "
                           "table (keras-core#229)\n")
