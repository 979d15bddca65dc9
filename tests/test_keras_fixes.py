"""Each upstream workaround: the bug still happens without it, and the fix works.

When a test named `test_upstream_bug_*` starts failing after a TensorFlow or
Keras upgrade, upstream has fixed the bug: drop the workaround.
"""

from __future__ import annotations

import json
import textwrap

import pytest

from tests._util import run_python

_TWO_STRATEGIES = textwrap.dedent("""
    import tensorflow as tf
    import tfmulti
    from tfmulti import keras_fixes
    tfmulti.configure_virtual_devices(4)
    make = {make}

    def all_reduce(strategy):
        value = strategy.run(lambda: tf.distribute.get_replica_context().all_reduce(
            "sum", tf.constant(1.0)))
        return float(strategy.experimental_local_results(value)[0])

    first = make([f"CPU:{{i}}" for i in range(2)])
    second = make([f"CPU:{{i}}" for i in range(4)])
    print("sums", all_reduce(first), all_reduce(second))
""")


def test_upstream_bug_mirrored_strategies_share_collective_keys():
    # tensorflow/tensorflow#61314: a second MirroredStrategy over other devices
    # reuses group key 1 and its first all-reduce fails.
    code = _TWO_STRATEGIES.format(make="lambda d: tf.distribute.MirroredStrategy(d)")
    result = run_python(["-c", code], timeout=120)
    assert result.returncode != 0, result.stdout
    assert "is joining a group with size" in result.stderr


def test_fix_gives_each_mirrored_strategy_its_own_keys():
    code = _TWO_STRATEGIES.format(make="keras_fixes.mirrored_strategy")
    result = run_python(["-c", code], timeout=120)
    assert result.returncode == 0, result.stderr[-3000:]
    assert "sums 2.0 4.0" in result.stdout


def _fake_slurm(monkeypatch):
    monkeypatch.delenv("CUDA_VISIBLE_DEVICES", raising=False)
    monkeypatch.setenv("PATH", "/nonexistent")  # no nvidia-smi
    monkeypatch.setenv("SLURM_PROCID", "2")
    monkeypatch.setenv("SLURM_STEP_NUM_TASKS", "3")
    monkeypatch.setenv("SLURM_STEP_NODELIST", "cpu-[1-3]")
    monkeypatch.setenv("SLURM_STEP_TASKS_PER_NODE", "1(x3)")


def test_upstream_bug_slurm_resolver_needs_gpus(monkeypatch):
    import tensorflow as tf

    _fake_slurm(monkeypatch)
    with pytest.raises(FileNotFoundError):  # it runs nvidia-smi
        tf.distribute.cluster_resolver.SlurmClusterResolver()
    with pytest.raises(ValueError, match="range"):
        tf.distribute.cluster_resolver.SlurmClusterResolver(gpus_per_node=0).cluster_spec()


def test_fix_slurm_resolver_on_cpu_nodes(monkeypatch):
    from tfmulti import keras_fixes

    _fake_slurm(monkeypatch)
    resolver = keras_fixes.slurm_cluster_resolver(port_base=7000)
    assert resolver.cluster_spec().as_dict() == {
        "worker": ["cpu-1:7000", "cpu-2:7000", "cpu-3:7000"]}
    assert (resolver.task_type, resolver.task_id) == ("worker", 2)
    assert "CUDA_VISIBLE_DEVICES" not in __import__("os").environ


def _keras_under_multi_worker(mode: str) -> tuple[int, str]:
    import io
    import sys

    from tfmulti import launch
    from tests._util import REPO

    out = io.StringIO()
    code = launch.launch(
        [sys.executable, str(REPO / "tests" / "workers" / "keras_upstream.py"), mode],
        num_workers=2, output=out, startup_timeout=120, grace_period=5)
    return code, out.getvalue()


def test_upstream_bug_keras_symbolic_build_under_multi_worker():
    # keras-team/keras#20585: fit reduces the whole (x, y) batch at once.
    code, output = _keras_under_multi_worker("none")
    assert code != 0
    assert "Attempt to convert a value (PerReplica" in output
    assert "fit ok" not in output


def test_upstream_bug_keras_scalar_reduction_under_multi_worker():
    # tensorflow/tensorflow#72388: with the build fixed, scalar logs are reduced on axis 0.
    code, output = _keras_under_multi_worker("build")
    assert code != 0
    assert "Invalid reduction dimension 0 for input with 0 dimensions" in output


def test_fix_keras_fit_under_multi_worker():
    code, output = _keras_under_multi_worker("all")
    assert code == 0, output[-3000:]
    assert output.count("fit ok") == 2


_MULTI_STEP = textwrap.dedent("""
    import sys
    import tensorflow as tf
    import tfmulti
    from tfmulti import data, models
    tfmulti.configure_virtual_devices(2)
    strategy = tf.distribute.MirroredStrategy(["CPU:0", "CPU:1"])  # plain, no tfmulti fixes
    with strategy.scope():
        model = models.build_model("mlp", dropout=0.0, seed=0)
    models.compile_model(model, strategy=strategy, optimizer="sgd", steps_per_execution=4)
    train = data.distribute(data.load("synthetic", num_examples=512), strategy, 64, seed=0)
    model.fit(**train.fit_kwargs(), epochs=1, verbose=0)
    print("fit ok")
""")


def test_upstream_bug_steps_per_execution_with_replicas():
    # keras-team/keras#19246: steps_per_execution > 1 fails with 2+ replicas.
    result = run_python(["-c", _MULTI_STEP], timeout=120)
    assert result.returncode != 0
    assert "You must feed a value for placeholder tensor" in result.stderr
    assert "fit ok" not in result.stdout


def _fit_and_evaluate(steps_per_execution: int):
    import numpy as np

    import tfmulti
    from tfmulti import data, models

    strategy = tfmulti.get_strategy("mirrored", devices=["CPU:0", "CPU:1"])
    model = models.build_model("mlp", strategy=strategy, dropout=0.0, seed=0)
    models.compile_model(model, strategy=strategy, optimizer="sgd", learning_rate=0.05,
                         steps_per_execution=steps_per_execution)
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


# Fix 6: convolutions on an empty batch (oneDNN). The bug is in oneDNN's
# kernels, which TensorFlow turns on by default only on x86 CPUs with AVX-512
# neural-network features (VNNI, BF16, AMX); elsewhere (an AVX2-only CPU, say)
# the same tests would pass without the fix. So they run in a process with
# oneDNN switched on (TF_ENABLE_ONEDNN_OPTS=1), and mean the same on any x86
# CPU.
_ONEDNN_ON = {"TF_ENABLE_ONEDNN_OPTS": "1"}
_NO_ONEDNN = "this TensorFlow build has no oneDNN (TF_ENABLE_ONEDNN_OPTS=1 did not turn it on)"

_EMPTY_CONV = textwrap.dedent("""
    import tensorflow as tf
    from tensorflow.python.util import _pywrap_util_port
    import tfmulti
    from tfmulti import data, keras_fixes
    import keras
    tfmulti.configure_virtual_devices(2)
    print("onednn", _pywrap_util_port.IsMklEnabled())
    out = tf.nn.conv2d(tf.zeros((0, 14, 14, 32)), tf.zeros((3, 3, 32, 64)), 1, "VALID")
    print("conv2d shape", tuple(out.shape))
    # MirroredStrategy, 2 replicas, 80 test examples at global batch 64: the
    # last batch (16) fits in replica 0's share, replica 1 gets 0 examples.
    strategy = keras_fixes.mirrored_strategy(["CPU:0", "CPU:1"])  # no fix 6
    with strategy.scope():
        model = keras.Sequential([keras.Input((28, 28, 1)), keras.layers.Conv2D(4, 3),
                                  keras.layers.Conv2D(8, 3), keras.layers.Flatten(),
                                  keras.layers.Dense(10)])
        model.compile(loss="sparse_categorical_crossentropy")
    test = data.distribute(data.load("synthetic", "test", num_examples=80), strategy, 64,
                           training=False)
    model.evaluate(**test.evaluate_kwargs(), verbose=0)
    print("evaluate ok")
""")


def test_upstream_bug_conv_on_empty_batch():
    # Same oneDNN conv kernel as tensorflow/tensorflow#30968 (fixed there for
    # Conv3D only): an empty batch comes back with the input's shape.
    result = run_python(["-c", _EMPTY_CONV], timeout=120, env=_ONEDNN_ON)
    if "onednn False" in result.stdout:
        pytest.skip(_NO_ONEDNN)
    assert "conv2d shape (0, 14, 14, 32)" in result.stdout, result.stdout + result.stderr[-2000:]
    assert result.returncode != 0
    assert "Incompatible shapes" in result.stderr or "evenly divisible" in result.stderr
    assert "evaluate ok" not in result.stdout


_EMPTY_BATCH_LAYERS = {  # layer: (input shape without the batch, constructor args)
    "Conv1D": ((10, 3), (5, 3)),
    "Conv2D": ((9, 9, 3), (5, 3, 2)),
    "Conv3D": ((6, 6, 6, 2), (4, 3)),
    "DepthwiseConv2D": ((8, 8, 3), (3, 2)),
    "SeparableConv2D": ((8, 8, 3), (6, 3)),
}

# One process, oneDNN on: first the upstream test's evaluation through
# get_strategy (which installs the fix) against one device evaluating the same
# weights, then each layer on an empty batch. Prints one JSON line.
_EMPTY_BATCH_FIX = textwrap.dedent("""
    import json, sys
    import numpy as np
    import tensorflow as tf
    from tensorflow.python.util import _pywrap_util_port
    import tfmulti
    from tfmulti import data, keras_fixes
    tfmulti.configure_virtual_devices(2)
    import keras

    out = {"onednn": _pywrap_util_port.IsMklEnabled()}
    strategy = tfmulti.get_strategy("mirrored", devices=["CPU:0", "CPU:1"])
    out["installed_by_get_strategy"] = "empty_batch_conv" in keras_fixes._applied

    def build():
        model = keras.Sequential([keras.Input((28, 28, 1)), keras.layers.Conv2D(4, 3),
                                  keras.layers.Conv2D(8, 3), keras.layers.Flatten(),
                                  keras.layers.Dense(10)])
        model.compile(loss=keras.losses.SparseCategoricalCrossentropy(from_logits=True),
                      metrics=["accuracy"])
        return model

    with strategy.scope():
        model = build()
    test_data = data.load("synthetic", "test", num_examples=80)
    out["last_batch"] = int(test_data.cardinality()) % 64
    test = data.distribute(test_data, strategy, 64, training=False)
    out["distributed"] = model.evaluate(**test.evaluate_kwargs(), return_dict=True, verbose=0)
    single = build()
    single.set_weights(model.get_weights())
    out["one_device"] = single.evaluate(test_data.batch(64), return_dict=True, verbose=0)

    def has_cond(graph):
        return bool({op.type for op in graph.get_operations()} & {"If", "StatelessIf"})

    for name, (shape, args) in json.loads(sys.argv[1]).items():
        layer = getattr(keras.layers, name)(*args)
        x = tf.random.uniform((3, *shape), seed=1)
        full = layer(x)  # builds; static batch 3: the upstream op, unwrapped
        dynamic = tf.function(layer.__call__,
                              input_signature=[tf.TensorSpec((None, *shape), tf.float32)])
        # A graph with a known, positive batch (every training step): no cond.
        static = tf.function(layer.__call__).get_concrete_function(
            tf.TensorSpec((3, *shape), tf.float32))
        out[name] = {
            "expected": [0, *full.shape[1:]],
            "eager": list(layer(x[:0]).shape),  # eager, static empty batch
            "dynamic": list(dynamic(x[:0]).shape),
            "max_difference": float(np.max(np.abs(dynamic(x) - full))),
            "static_has_cond": has_cond(static.graph),
            "dynamic_has_cond": has_cond(dynamic.get_concrete_function().graph),
        }
    print(json.dumps(out))
""")


@pytest.fixture(scope="module")
def empty_batch_fix():
    result = run_python(["-c", _EMPTY_BATCH_FIX, json.dumps(_EMPTY_BATCH_LAYERS)],
                        timeout=180, env=_ONEDNN_ON)
    assert result.returncode == 0, result.stdout[-2000:] + result.stderr[-3000:]
    out = json.loads(result.stdout.strip().splitlines()[-1])
    if not out["onednn"]:
        pytest.skip(_NO_ONEDNN)
    return out


@pytest.mark.parametrize("name", sorted(_EMPTY_BATCH_LAYERS))
def test_fix_conv_layers_on_empty_batch(name, empty_batch_fix):
    r = empty_batch_fix[name]
    assert r["eager"] == r["expected"]
    assert r["dynamic"] == r["expected"]
    assert r["max_difference"] <= 1e-5  # full batches: the same values
    # Training graphs (static, full batches) are unchanged; only an unknown
    # batch size gets the cond.
    assert not r["static_has_cond"]
    assert r["dynamic_has_cond"]


def test_fix_evaluates_conv_model_with_empty_replicas(empty_batch_fix):
    # The upstream test's evaluation, through get_strategy (which installs the
    # fix): the result equals one device evaluating the same weights.
    assert empty_batch_fix["installed_by_get_strategy"]
    assert empty_batch_fix["last_batch"] == 16  # replica 1 gets nothing
    got, want = empty_batch_fix["distributed"], empty_batch_fix["one_device"]
    assert got["accuracy"] == pytest.approx(want["accuracy"], abs=1e-6)
    assert got["loss"] == pytest.approx(want["loss"], abs=1e-5)
