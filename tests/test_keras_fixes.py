"""Each upstream workaround: the bug still happens without it, and the fix works.

When a test named `test_upstream_bug_*` starts failing after a TensorFlow or
Keras upgrade, upstream has fixed the bug: drop the workaround.
"""

from __future__ import annotations

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
