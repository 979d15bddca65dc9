"""Tests for tfmulti.runtime.strategy.get_strategy on the 4 virtual CPUs of conftest.py,
and MultiWorkerMirroredStrategy: its options and cluster resolvers in-process,
and 2 workers (`tfmulti launch`) matching MirroredStrategy on 2 devices."""

from __future__ import annotations

import json

import pytest
import tensorflow as tf

from tfmulti.runtime import strategy as strategy_lib
from tfmulti.runtime.strategy import get_strategy

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
    assert text.startswith("MirroredStrategy with 2 replicas; local devices ")
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
    with pytest.raises(ValueError, match=r"device\(s\) \['/device:CPU:9'\] do not exist; "
                                         r"available: ") as info:
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


def test_auto_joins_a_tf_config_cluster_only_under_the_launcher(monkeypatch):
    """A TF_CONFIG left in a shell must not make "auto" open a port and wait for
    peers; the launcher's workers (TFMULTI_LAUNCHED=1) do join."""
    import json

    from tfmulti.runtime import strategy as strategy_lib

    joined = []
    monkeypatch.setattr(strategy_lib, "_multi_worker", lambda *args: joined.append(args) or "mw")
    monkeypatch.setenv("TF_CONFIG", json.dumps({
        "cluster": {"worker": ["localhost:2222", "localhost:2223"]},
        "task": {"type": "worker", "index": 0}}))
    monkeypatch.delenv("TFMULTI_LAUNCHED", raising=False)
    with pytest.raises(ValueError, match=r"TF_CONFIG describes a 2-task cluster, but this process "
                                         r"was not started by `tfmulti launch`, so kind='auto' "
                                         r"does not join it; pass kind='multi_worker'"):
        get_strategy("auto")
    assert joined == []
    assert get_strategy("multi_worker") == "mw"  # asked for by name: joins
    monkeypatch.setenv("TFMULTI_LAUNCHED", "1")
    assert get_strategy("auto") == "mw" and len(joined) == 2


def test_cluster_resolver_auto_prefers_tf_config_then_slurm(monkeypatch):
    from tfmulti.runtime import strategy as strategy_lib

    def picked():
        raise RuntimeError("picked SLURM")

    monkeypatch.setattr(strategy_lib, "slurm_cluster_resolver", picked)
    monkeypatch.delenv("TF_CONFIG", raising=False)
    monkeypatch.setenv("SLURM_STEP_NUM_TASKS", "1")
    with pytest.raises(ValueError, match=r"kind='multi_worker' needs TF_CONFIG"):
        get_strategy("multi_worker", cluster_resolver="auto")  # one SLURM task: no cluster
    monkeypatch.setenv("SLURM_STEP_NUM_TASKS", "2")
    with pytest.raises(RuntimeError, match="picked SLURM"):
        get_strategy("multi_worker", cluster_resolver="auto")
    assert isinstance(get_strategy("auto", cluster_resolver="auto"),
                      tf.distribute.MirroredStrategy)  # "auto" names no cluster


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


# --------------------------------------------------------------------------
# multi_worker: options and resolvers (no cluster)
# --------------------------------------------------------------------------

def test_multi_worker_without_tf_config(monkeypatch):
    monkeypatch.delenv("TF_CONFIG", raising=False)
    with pytest.raises(ValueError, match=r"needs TF_CONFIG .* `tfmulti launch"):
        get_strategy("multi_worker")


_TWO_TASKS = json.dumps({"cluster": {"worker": ["localhost:1", "localhost:2"]},
                         "task": {"type": "worker", "index": 0}})


@pytest.mark.parametrize("kwargs,match", [
    ({"communication": "mpi"}, r"`communication` must be one of \['auto', 'ring', 'nccl'\]"),
    ({"communication": "nccl"}, r"needs GPUs"),
    ({"collective_timeout": 0}, r"`collective_timeout` must be a finite number > 0"),
    ({"startup_timeout": -1}, r"`startup_timeout` must be a finite number > 0"),
    ({"cluster_resolver": "k8s"}, r"`cluster_resolver` must be one of"),
    ({"devices": ["CPU:0"]}, r"`devices` does not apply"),
])
def test_multi_worker_bad_options(monkeypatch, kwargs, match):
    monkeypatch.setenv("TF_CONFIG", _TWO_TASKS)
    with pytest.raises(ValueError, match=match):
        get_strategy("multi_worker", **kwargs)


@pytest.mark.parametrize("text", ["soon", "0", "-5", "inf"])
def test_startup_timeout_from_the_environment_must_be_a_positive_number(monkeypatch, text):
    monkeypatch.setenv("TF_CONFIG", _TWO_TASKS)
    monkeypatch.setenv("TFMULTI_STARTUP_TIMEOUT", text)
    with pytest.raises(ValueError, match=rf"TFMULTI_STARTUP_TIMEOUT is '{text}'; set it to a "
                                         r"number of seconds > 0"):
        get_strategy("multi_worker")


def test_slurm_resolver_from_fake_environment(monkeypatch):
    monkeypatch.delenv("CUDA_VISIBLE_DEVICES", raising=False)
    monkeypatch.setenv("SLURM_PROCID", "1")
    monkeypatch.setenv("SLURM_STEP_NUM_TASKS", "4")
    monkeypatch.setenv("SLURM_STEP_NODELIST", "node[07-08]")
    monkeypatch.setenv("SLURM_STEP_TASKS_PER_NODE", "2(x2)")
    resolver = strategy_lib.slurm_cluster_resolver(port_base=9000)
    spec = resolver.cluster_spec().as_dict()
    assert spec == {"worker": ["node07:9000", "node07:9001", "node08:9000", "node08:9001"]}
    assert (resolver.task_type, resolver.task_id) == ("worker", 1)
    monkeypatch.delenv("SLURM_STEP_NODELIST")
    with pytest.raises(ValueError, match=r"needs SLURM_STEP_NODELIST .* `srun`"):
        strategy_lib.slurm_cluster_resolver()
