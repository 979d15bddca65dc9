"""Tests for tfmulti.strategy.get_strategy on the 4 virtual CPUs of conftest.py."""

from __future__ import annotations

import pytest
import tensorflow as tf

from tfmulti import strategy as strategy_lib
from tfmulti.strategy import get_strategy

NUM_DEVICES = 4  # configured by conftest.py
FOUR_CPUS = [f"/device:CPU:{i}" for i in range(NUM_DEVICES)]


def _worker_devices(strategy) -> list[str]:
    return [tf.DeviceSpec.from_string(d).device_index for d in strategy.extended.worker_devices]


def _replica_sum(strategy) -> float:
    """Each replica contributes (replica id + 1); returns the SUM reduction."""

    def step():
        ctx = tf.distribute.get_replica_context()
        return tf.cast(ctx.replica_id_in_sync_group, tf.float32) + 1.0

    per_replica = strategy.run(step)
    return float(strategy.reduce(tf.distribute.ReduceOp.SUM, per_replica, axis=None))


def test_auto_is_mirrored_over_all_cpus():
    strategy = get_strategy("auto")
    assert isinstance(strategy, tf.distribute.MirroredStrategy)
    assert strategy.num_replicas_in_sync == NUM_DEVICES
    assert sorted(_worker_devices(strategy)) == list(range(NUM_DEVICES))


def test_default_kind_is_auto():
    strategy = get_strategy()
    assert isinstance(strategy, tf.distribute.MirroredStrategy)
    assert strategy.num_replicas_in_sync == NUM_DEVICES


def test_auto_with_one_device_is_one_device():
    strategy = get_strategy("auto", devices=["CPU:2"])
    assert isinstance(strategy, tf.distribute.OneDeviceStrategy)
    assert strategy.num_replicas_in_sync == 1


def test_one_device_default():
    strategy = get_strategy("one_device")
    assert isinstance(strategy, tf.distribute.OneDeviceStrategy)
    assert strategy.num_replicas_in_sync == 1
    assert strategy.extended.worker_devices[0].endswith("CPU:0")


def test_one_device_explicit():
    strategy = get_strategy("one_device", devices="cpu:3")
    assert isinstance(strategy, tf.distribute.OneDeviceStrategy)
    assert strategy.extended.worker_devices[0].endswith("CPU:3")
    assert _replica_sum(strategy) == 1.0


def test_mirrored_on_two_devices():
    strategy = get_strategy("mirrored", devices=["CPU:0", "CPU:1"])
    assert isinstance(strategy, tf.distribute.MirroredStrategy)
    assert strategy.num_replicas_in_sync == 2
    assert sorted(_worker_devices(strategy)) == [0, 1]
    assert _replica_sum(strategy) == 3.0  # 1 + 2


@pytest.mark.parametrize("cross_device_ops", ["auto", "reduce_to_one"])
def test_mirrored_run_and_reduce(cross_device_ops):
    strategy = get_strategy("mirrored", cross_device_ops=cross_device_ops)
    assert isinstance(strategy, tf.distribute.MirroredStrategy)
    assert strategy.num_replicas_in_sync == NUM_DEVICES
    if cross_device_ops == "reduce_to_one":
        assert isinstance(strategy.extended._cross_device_ops, tf.distribute.ReductionToOneDevice)
    assert _replica_sum(strategy) == 10.0  # 1 + 2 + 3 + 4


def test_describe():
    text = strategy_lib.describe(get_strategy("mirrored", devices=["CPU:0", "CPU:1"]))
    assert text.startswith("MirroredStrategy with 2 replica(s); local devices ")
    assert "CPU:0" in text and "CPU:1" in text


# --------------------------------------------------------------------------
# Errors
# --------------------------------------------------------------------------

@pytest.mark.parametrize("kind", ["tpu", "Mirrored", "multiworker", ""])
def test_unknown_kind_lists_valid_kinds(kind):
    with pytest.raises(ValueError, match=r"unknown strategy kind") as info:
        get_strategy(kind)
    assert "['auto', 'one_device', 'mirrored', 'multi_worker']" in str(info.value)


@pytest.mark.parametrize("kind", ["auto", "one_device", "mirrored"])
def test_missing_device_lists_available(kind):
    with pytest.raises(ValueError, match=r"device\(s\) \['/device:CPU:9'\] do not exist; available: ") as info:
        get_strategy(kind, devices=["CPU:9"])
    for name in FOUR_CPUS:
        assert name in str(info.value)


@pytest.mark.parametrize("ops", ["nccl", "hierarchical_copy"])
def test_gpu_only_cross_device_ops_refused_on_cpus(ops):
    with pytest.raises(ValueError, match=rf"`cross_device_ops='{ops}'` needs GPU devices") as info:
        get_strategy("mirrored", cross_device_ops=ops)
    assert "reduce_to_one" in str(info.value)


@pytest.mark.parametrize("ops", ["ring", "NCCL", None])
def test_unknown_cross_device_ops(ops):
    with pytest.raises(ValueError, match=r"`cross_device_ops` must be one of \['auto', 'nccl', "):
        get_strategy("mirrored", cross_device_ops=ops)


def test_one_device_with_two_devices():
    with pytest.raises(ValueError, match=r"'one_device' takes exactly one device") as info:
        get_strategy("one_device", devices=["CPU:0", "CPU:1"])
    assert "mirrored" in str(info.value)


def test_auto_with_a_cluster_resolver_means_multi_worker():
    # Naming a cluster under "auto" trains on it (here the name is checked
    # first, as for "multi_worker"), instead of falling back to this host alone.
    with pytest.raises(ValueError, match=r"`cluster_resolver` must be one of .*got 'k8s'"):
        get_strategy("auto", cluster_resolver="k8s")


@pytest.mark.parametrize("kind", ["mirrored", "one_device"])
def test_cluster_resolver_refused_where_it_does_not_apply(kind):
    with pytest.raises(ValueError, match=rf"applies to 'multi_worker' \(or 'auto'\), not '{kind}'"):
        get_strategy(kind, cluster_resolver="slurm")


def test_resolver_peers_name_the_other_tasks():
    # What the startup watchdog names when a cluster from SLURM or a custom
    # resolver does not form (TF_CONFIG's are named the same way).
    resolver = tf.distribute.cluster_resolver.SimpleClusterResolver(
        tf.train.ClusterSpec({"worker": ["h1:2222", "h2:2222", "h3:2222"]}),
        task_type="worker", task_id=1)
    assert strategy_lib._resolver_peers(resolver) == (["h1:2222", "h3:2222"], "h2:2222")
    assert strategy_lib._resolver_peers(object()) == ([], None)
