"""Tests of tfmulti.runtime.keras_fixes: each upstream bug still happens without its
workaround, and the fix works.

When a test named `test_upstream_bug_*` starts failing after a TensorFlow or
Keras upgrade, upstream has fixed the bug: drop the workaround.

The checks that need a process of their own (no fix installed yet, oneDNN on)
share one: `_SINGLE_PROCESS` runs each part in turn and prints one JSON line
(`upstream` fixture). The Keras-under-multi-worker checks share one 2-worker
cluster (`keras_under_multi_worker` fixture, tests/workers/keras_upstream.py).
"""

from __future__ import annotations

import json
import os
import textwrap

import pytest

from tests._util import WORKERS, launch_python, run_python
from tests.workers import accumulate

# Fix 6: convolutions on an empty batch (oneDNN). The bug is in oneDNN's
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
# a fix before the upstream parts that need it missing (get_strategy installs
# fixes 5 and 6, so it comes after them), and the failed all-reduce of
# "keys_upstream" aborts the process's collectives, so it comes last. Each part
# records {"result": ..., "error": "Type: message" or None}.
_SINGLE_PROCESS = textwrap.dedent("""
    import json, sys
    import numpy as np
    import tensorflow as tf
    from tensorflow.python.util import _pywrap_util_port
    import tfmulti
    from tfmulti import data
    from tfmulti.models import builders as models
    from tfmulti.runtime import keras_fixes as workarounds
    tfmulti.configure_virtual_devices(4)
    import keras

    out = {"onednn": _pywrap_util_port.IsMklEnabled()}

    def part(function):
        try:
            out[function.__name__] = {"result": function(), "error": None}
        except Exception as e:
            out[function.__name__] = {"result": None, "error": f"{type(e).__name__}: {e}"}

    # Fix 1: each MirroredStrategy its own collective keys.
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
        return two_strategies(workarounds.mirrored_strategy)

    # Fix 5: steps_per_execution > 1 with 2 replicas, plain MirroredStrategy.
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

    # Fix 6: convolutions on an empty batch.
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
        strategy = workarounds.mirrored_strategy(["CPU:0", "CPU:1"])  # no fix 6
        with strategy.scope():
            model = conv_model(loss="sparse_categorical_crossentropy")
        test = data.distribute(data.load("synthetic", "test", num_examples=80), strategy, 64,
                               training=False)
        model.evaluate(**test.evaluate_kwargs(), verbose=0)
        return "evaluate ok"

    @part
    def conv_fix():
        # The upstream evaluation through get_strategy (which installs the fix)
        # against one device evaluating the same weights.
        r = {}
        strategy = tfmulti.get_strategy("mirrored", devices=["CPU:0", "CPU:1"])
        r["installed_by_get_strategy"] = "empty_batch_conv" in workarounds._applied
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

    # Fix 1's upstream bug, last: its failed all-reduce aborts the collectives.
    @part
    def keys_upstream():
        return two_strategies(lambda d: tf.distribute.MirroredStrategy(d))

    print(json.dumps(out))
""")


@pytest.fixture(scope="module")
def upstream():
    """What each part of `_SINGLE_PROCESS` returned or raised."""
    result = run_python(["-c", _SINGLE_PROCESS, json.dumps(_EMPTY_BATCH_LAYERS)],
                        timeout=240, env=_ONEDNN_ON)  # under pytest-timeout (300 s)
    assert result.returncode == 0, result.stdout[-2000:] + result.stderr[-3000:]
    return json.loads(result.stdout.strip().splitlines()[-1])


def _needs_onednn(upstream) -> None:
    if not upstream["onednn"]:
        pytest.skip(_NO_ONEDNN)


# --------------------------------------------------------------------------
# Fix 1: several MirroredStrategy instances share collective keys.


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
# Fix 4: SlurmClusterResolver on CPU-only nodes.


def _fake_slurm(monkeypatch):
    monkeypatch.delenv("CUDA_VISIBLE_DEVICES", raising=False)
    monkeypatch.setenv("PATH", "/nonexistent")  # no nvidia-smi
    monkeypatch.setenv("SLURM_PROCID", "2")
    monkeypatch.setenv("SLURM_STEP_NUM_TASKS", "3")
    monkeypatch.setenv("SLURM_STEP_NODELIST", "cpu-[1-3]")
    monkeypatch.setenv("SLURM_STEP_TASKS_PER_NODE", "1(x3)")


@pytest.mark.slow  # it tries to start nvidia-smi
def test_upstream_bug_slurm_resolver_needs_gpus(monkeypatch):
    import tensorflow as tf

    _fake_slurm(monkeypatch)
    with pytest.raises(FileNotFoundError):  # it runs nvidia-smi
        tf.distribute.cluster_resolver.SlurmClusterResolver()
    with pytest.raises(ValueError, match="range"):
        tf.distribute.cluster_resolver.SlurmClusterResolver(gpus_per_node=0).cluster_spec()


def test_fix_slurm_resolver_on_cpu_nodes(monkeypatch):
    from tfmulti.runtime import keras_fixes as workarounds

    _fake_slurm(monkeypatch)
    resolver = workarounds.slurm_cluster_resolver(port_base=7000)
    assert resolver.cluster_spec().as_dict() == {
        "worker": ["cpu-1:7000", "cpu-2:7000", "cpu-3:7000"]}
    assert (resolver.task_type, resolver.task_id) == ("worker", 2)
    assert "CUDA_VISIBLE_DEVICES" not in os.environ


# --------------------------------------------------------------------------
# Fixes 2 and 3: Keras fit under MultiWorkerMirroredStrategy.


@pytest.fixture(scope="module")
def keras_under_multi_worker():
    """One 2-worker cluster fitting with no fix, without fix 3, and with all
    fixes: (exit status, {mode: [worker 0's line, worker 1's line]}, output)."""
    code, output = launch_python([str(WORKERS / "keras_upstream.py"), "none", "build", "all"],
                                 startup_timeout=120, grace_period=5)
    lines = {mode: [line for rank in (0, 1) for line in output.splitlines()
                    if line.startswith(f"[worker {rank}] {mode}: fit ")]
             for mode in ("none", "build", "all")}
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


# --------------------------------------------------------------------------
# Fix 5: steps_per_execution > 1 with 2 or more replicas.


@pytest.mark.slow
def test_upstream_bug_steps_per_execution_with_replicas(upstream):
    # keras-team/keras#19246: steps_per_execution > 1 fails with 2+ replicas.
    part = upstream["multi_step_upstream"]
    assert part["result"] is None, part  # no "fit ok"
    assert "You must feed a value for placeholder tensor" in part["error"], part


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


# --------------------------------------------------------------------------
# Fix 6: convolutions on an empty batch (oneDNN).


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


# --------------------------------------------------------------------------
# Fix 7: gradient accumulation with 2 or more replicas. The user's model
# (functional, dict inputs, a residual, an L2 penalty, its own loss, Keras'
# Adam) and the runs come from tests/workers/accumulate.py, which the
# 2-worker test runs too.


@pytest.fixture(scope="module")
def big_batch():
    """Plain Keras on one device, one update per global batch of 32 rows."""
    return accumulate.reference()


def test_upstream_bug_keras_gradient_accumulation_with_replicas():
    # keras-team/keras#20582: Keras' own accumulation applies inside an
    # ops.cond in the replica function, and the apply is a merge_call.
    import keras
    import numpy as np

    from tfmulti.runtime import keras_fixes as workarounds

    strategy = workarounds.mirrored_strategy(["CPU:0", "CPU:1"])
    with strategy.scope():
        model = keras.Sequential([keras.Input((4,)), keras.layers.Dense(3)])
        model.compile(keras.optimizers.SGD(0.1, gradient_accumulation_steps=2), "mse")
    with pytest.raises(RuntimeError, match="merge_call` called while defining a new graph"):
        model.fit(np.ones((16, 4), "float32"), np.ones((16, 3), "float32"), batch_size=8,
                  verbose=0)


@pytest.mark.parametrize("replicas, steps_per_execution", [(1, 2), (2, 2), (4, 1)])
def test_fix_accumulation_equals_the_big_batch(replicas, steps_per_execution, big_batch):
    # 4 micro-batches per update at global batch 32: 8 rows per micro-step
    # (over the replicas), the same weights and losses as 32-row steps; 2
    # replicas x 2 steps per call run inside fix 5's loop.
    import numpy as np

    got = accumulate.fit(accumulate.strategy_of(replicas), accumulate.ACCUMULATE,
                         steps_per_execution)
    assert big_batch["rows"] == 32
    assert got["rows"] == 32 // replicas // accumulate.ACCUMULATE  # the probe's micro-batch
    accumulate.assert_same_training(got, big_batch)
    np.testing.assert_allclose(got["loss"], big_batch["loss"], atol=1e-6)  # every micro-batch


def test_fix_accumulation_keeps_the_loss_scaling(big_batch):
    # A LossScaleOptimizer (Keras' mixed float16) scales the loss by 2**15:
    # the summed gradients are unscaled once, so the update is the plain one.
    import keras

    strategy = accumulate.strategy_of(2)
    with strategy.scope():  # its variables on the strategy
        optimizer = keras.optimizers.LossScaleOptimizer(keras.optimizers.Adam(0.01))
    got = accumulate.fit(strategy, accumulate.ACCUMULATE, optimizer=optimizer)
    assert got["rows"] == 4  # micro-batches of 4 rows per replica
    assert float(optimizer.dynamic_scale.numpy()) == 2.0 ** 15  # scaled, never overflowed
    accumulate.assert_same_training(got, big_batch)


class _Subclassed:
    """A subclassed Keras model (its own `call`, Keras' `train_step`)."""

    def __new__(cls):
        import keras

        class Subclassed(keras.Model):
            def __init__(self):
                super().__init__()
                self.probe = accumulate.RowProbe(name="probe")
                self.hidden = keras.layers.Dense(4, activation="tanh")
                self.out = keras.layers.Dense(2)

            def call(self, x):
                return self.out(self.hidden(self.probe(x, training=True)))

        return Subclassed()


@pytest.mark.parametrize("kind", ["sequential", "subclassed"])
def test_fix_accumulation_equals_keras_own_on_one_device(kind):
    # Where Keras' own accumulation works (one device), tfmulti's gives the
    # same weights: 4 Keras steps of 8 rows = one tfmulti step of 32.
    import keras
    import numpy as np

    from tfmulti.runtime import keras_fixes as workarounds

    rng = np.random.default_rng(0)
    x, y = rng.normal(size=(64, 5)).astype("float32"), rng.normal(size=(64, 2)).astype("float32")

    def trained(optimizer, batch_size, accumulate_steps):
        keras.utils.set_random_seed(0)
        model = _Subclassed() if kind == "subclassed" else keras.Sequential(
            [keras.Input((5,)), accumulate.RowProbe(name="probe"),
             keras.layers.Dense(4, activation="tanh"), keras.layers.Dense(2)])
        model.compile(optimizer, "mse")
        if accumulate_steps:
            workarounds.accumulate_gradients(model, accumulate_steps)
        model.fit(x, y, batch_size=batch_size, shuffle=False, verbose=0)  # 2 updates
        probe = model.probe if kind == "subclassed" else model.get_layer("probe")
        assert int(probe.rows.numpy()) == 8  # both: 8-row micro-steps
        return model.trainable_weights

    keras_own = trained(keras.optimizers.Adam(0.01, gradient_accumulation_steps=4), 8, None)
    ours = trained(keras.optimizers.Adam(0.01), 32, 4)
    for a, b in zip(ours, keras_own):
        np.testing.assert_allclose(a, b, atol=1e-6)


def _tiny_model(optimizer="sgd", model_class=None, strategy=None):
    import contextlib

    import keras

    with strategy.scope() if strategy else contextlib.nullcontext():
        inputs = keras.Input((3,))
        model = (model_class or keras.Model)(inputs, keras.layers.Dense(2)(inputs))
        model.compile(optimizer, "mse")
    return model


@pytest.mark.parametrize("steps", [0, -1, 1.5, True, "2", None])
def test_accumulation_refuses_a_bad_count(steps):
    from tfmulti.runtime import keras_fixes as workarounds

    with pytest.raises(ValueError, match=r"`accumulate_steps` must be an integer >= 1, got"):
        workarounds.accumulate_gradients(_tiny_model(), steps)


def test_accumulation_refuses_a_batch_it_cannot_split():
    import numpy as np
    import tensorflow as tf

    from tfmulti.runtime import keras_fixes as workarounds

    model = workarounds.accumulate_gradients(_tiny_model(), 3)
    x, y = np.ones((16, 3), "float32"), np.ones((16, 2), "float32")
    static = tf.data.Dataset.from_tensor_slices((x, y)).batch(8, drop_remainder=True)
    with pytest.raises(ValueError, match=r"batch \(8 rows\) must be divisible by "
                                         r"accumulate_steps \(3\)"):
        model.fit(static, shuffle=False, verbose=0)
    model = workarounds.accumulate_gradients(_tiny_model(), 4)
    dynamic = tf.data.Dataset.from_tensor_slices((x[:10], y[:10])).batch(8)  # 8, then 2 rows
    with pytest.raises(tf.errors.InvalidArgumentError, match="divisible by accumulate_steps"):
        model.fit(dynamic, shuffle=False, verbose=0)


def test_accumulation_refuses_a_synchronized_update_in_the_forward_pass():
    # A layer that updates a variable with aggregation "mean" in its forward
    # pass needs a merge_call, which the micro-batch loop cannot hold.
    import keras
    import numpy as np
    import tensorflow as tf

    from tfmulti.runtime import keras_fixes as workarounds

    class Counter(keras.layers.Layer):
        def build(self, input_shape):
            self.calls = self.add_weight(shape=(), initializer="zeros", trainable=False,
                                         aggregation="mean")

        def call(self, x, training=False):
            if training:
                self.calls.assign_add(1.0)
            return x

    strategy = accumulate.strategy_of(2)
    with strategy.scope():
        model = keras.Sequential([keras.Input((3,)), Counter(), keras.layers.Dense(2)])
        model.compile("sgd", "mse")
    workarounds.accumulate_gradients(model, 2)
    data = tf.data.Dataset.from_tensor_slices((np.ones((8, 3), "float32"),
                                               np.ones((8, 2), "float32"))).batch(8)
    with pytest.raises(ValueError, match="a layer there updates a variable synchronized"):
        model.fit(data, shuffle=False, verbose=0)


def test_accumulation_refuses_a_step_of_its_own():
    import keras

    from tfmulti.runtime import keras_fixes as workarounds

    class OwnStep(keras.Model):
        def train_step(self, data):
            return super().train_step(data)

    with pytest.raises(ValueError, match="OwnStep overrides `train_step`"):
        workarounds.accumulate_gradients(_tiny_model(model_class=OwnStep), 2)
    model = _tiny_model(model_class=OwnStep)
    assert workarounds.accumulate_gradients(model, 1) is model  # nothing to split


def test_accumulation_of_a_pipeline_model():
    # PipelineModel runs its own schedule: refused with a pointer, unless its
    # class accumulates by itself (a method `accumulate_gradients(steps)`).
    import keras

    from tfmulti.runtime import keras_fixes as workarounds
    from tfmulti.parallel import PipelineModel

    model = PipelineModel([keras.layers.Dense(4), keras.layers.Dense(2)], input_shape=(3,),
                          devices=["CPU:0", "CPU:1"], num_microbatches=2)
    model.compile("sgd", "mse")
    if hasattr(PipelineModel, "accumulate_gradients"):
        assert workarounds.accumulate_gradients(model, 2) is model
    else:
        with pytest.raises(ValueError, match="PipelineModel runs its own micro-batch schedule"):
            workarounds.accumulate_gradients(model, 2)

    calls = []

    class Accumulating(keras.Model):
        def accumulate_gradients(self, steps):
            calls.append(steps)

    model = _tiny_model(model_class=Accumulating)
    assert workarounds.accumulate_gradients(model, 3) is model and calls == [3]


def test_accumulation_refuses_keras_own_accumulation():
    import keras
    import numpy as np

    from tfmulti.runtime import keras_fixes as workarounds

    def keras_accumulating():
        return keras.optimizers.SGD(gradient_accumulation_steps=2)

    # Under 2 replicas Keras' own fails: pointed to tfmulti's, even with
    # accumulate_steps=1 (the default compile_model passes).
    strategy = accumulate.strategy_of(2)
    with strategy.scope():
        optimizer = keras_accumulating()
    with pytest.raises(ValueError, match=r"gradient_accumulation_steps \(2\) fails with 2 "
                                         r"replicas .* use tfmulti's accumulate_steps=2"):
        workarounds.accumulate_gradients(_tiny_model(optimizer, strategy=strategy), 1)
    # Both at once (one device): refused when the step is traced, for a model
    # made to accumulate before it was compiled.
    model = _tiny_model()
    workarounds.accumulate_gradients(model, 2)
    model.compile(keras_accumulating(), "mse")
    with pytest.raises(ValueError, match="use accumulate_steps alone"):
        model.fit(np.ones((8, 3), "float32"), np.ones((8, 2), "float32"), verbose=0)


@pytest.mark.cluster
def test_fix_accumulation_under_multi_worker(tmp_path, big_batch):
    # 2 workers x 1 replica, 4 micro-batches of 4 rows each per update, 2
    # steps per call (fix 5): the one-device big-batch training.
    got = accumulate.on_two_workers(tmp_path, "fit")
    assert got["rows"] == 4
    accumulate.assert_same_training(got, big_batch)


# --------------------------------------------------------------------------
# The guard: a fix patches only the Keras functions it was written for.


def test_recorded_keras_functions_are_the_installed_ones():
    # Fails after a Keras upgrade that changed a function a fix replaces or
    # copies: check the fix against the new code, then record the new digest.
    from tfmulti.runtime import keras_fixes as workarounds

    assert workarounds._changed(workarounds.KERAS_ORIGINALS) == []


@pytest.mark.parametrize("apply, key, changed", [
    ("apply_multi_worker_fixes", "symbolic_build",
     "keras.src.backend.tensorflow.trainer:TensorFlowTrainer._maybe_symbolic_build"),
    ("apply_multi_worker_fixes", "reduce_per_replica",
     "keras.src.backend.tensorflow.trainer:reduce_per_replica"),
    ("apply_multi_step_fix", "multi_step",
     "keras.src.backend.tensorflow.trainer:TensorFlowTrainer._make_function"),
    ("apply_empty_batch_conv_fix", "empty_batch_conv", "keras.src.backend.tensorflow.nn:conv"),
])
def test_guard_leaves_a_fix_off_where_keras_changed(apply, key, changed, monkeypatch):
    import importlib
    import warnings

    from tfmulti.runtime import keras_fixes as workarounds

    def target(name):
        module, _, path = name.partition(":")
        holder, _, attribute = path.rpartition(".")
        owner = importlib.import_module(module)
        return (getattr(owner, holder) if holder else owner), attribute

    monkeypatch.setattr(workarounds, "_applied", set())
    monkeypatch.setattr(workarounds, "_off", set())
    for name in workarounds.KERAS_ORIGINALS:  # whatever the fix patches is put back after
        owner, attribute = target(name)
        monkeypatch.setattr(owner, attribute, getattr(owner, attribute))

    def new_keras_version(*args, **kwargs):  # a Keras release changed the function
        raise NotImplementedError

    owner, attribute = target(changed)
    monkeypatch.setattr(owner, attribute, new_keras_version)
    with pytest.warns(RuntimeWarning, match=rf"fix \d .* written for Keras 3\.15, .*"
                                            rf"{attribute}\. The fix stays off"):
        getattr(workarounds, apply)()
    assert getattr(owner, attribute) is new_keras_version  # not patched
    assert key in workarounds._off and key not in workarounds._applied
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # once
        getattr(workarounds, apply)()


def test_guard_refuses_accumulation_where_keras_changed_its_step(monkeypatch):
    from keras.src.backend.tensorflow.trainer import TensorFlowTrainer

    from tfmulti.runtime import keras_fixes as workarounds

    def train_step(self, data):  # a Keras release changed the step fix 7 copies
        raise NotImplementedError

    monkeypatch.setattr(TensorFlowTrainer, "train_step", train_step)
    with pytest.raises(RuntimeError, match=r"fix 7 .* written for Keras 3\.15, .*"
                                           r"TensorFlowTrainer\.train_step: .* install keras"):
        workarounds.accumulate_gradients(_tiny_model(), 2)
    model = _tiny_model()
    assert workarounds.accumulate_gradients(model, 1) is model  # Keras' own step: nothing copied
