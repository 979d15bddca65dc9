"""`tfmulti.ray` without starting Ray: what it refuses before anything starts,
the config each worker trains, and the one-line error without Ray installed.
(Training on a real local Ray: tests/integration/test_ray.py.)"""

from __future__ import annotations

import importlib
import os
import sys

import pytest

import tfmulti.ray
from tfmulti import TrainConfig


@pytest.mark.parametrize("changes,match", [
    ({"distribution": "mirrored"}, r"`distribution` is 'mirrored'.*'multi_worker'"),
    ({"cluster_resolver": "slurm"}, r"`cluster_resolver` is 'slurm'.*TF_CONFIG"),
    ({"global_batch_size": 0}, r"global_batch_size"),
])
def test_a_bad_config_is_refused_before_ray_starts(changes, match, tmp_path):
    import ray

    with pytest.raises(ValueError, match=match):
        tfmulti.ray.train(TrainConfig(**changes), storage_path=str(tmp_path))
    assert not ray.is_initialized()
    assert list(tmp_path.iterdir()) == []  # nothing written


@pytest.mark.parametrize("arguments,match", [
    ({"num_workers": 0}, r"`num_workers` must be a positive integer, got 0"),
    ({"max_failures": -2}, r"`max_failures` must be an integer >= -1, got -2"),
    ({"cpus_per_worker": 0}, r"`cpus_per_worker` must be a finite number > 0, got 0"),
    ({"worker_env": {"A": 1}}, r"`worker_env` must map names to strings"),
    ({"storage_path": "s3://bucket/runs"}, r"pass backup_dir and model_dir on a filesystem"),
])
def test_bad_arguments_are_refused_before_ray_starts(arguments, match):
    import ray

    with pytest.raises(ValueError, match=match):
        tfmulti.ray.train(TrainConfig(), **arguments)
    assert not ray.is_initialized()


def test_each_worker_trains_multi_worker_with_its_backup_and_outputs_in_the_run(
        tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    config = tfmulti.ray._worker_config(TrainConfig(data_dir="data"), "/runs/run1")
    assert (config.distribution, config.cluster_resolver) == ("multi_worker", "tf_config")
    assert (config.backup_dir, config.model_dir) == ("/runs/run1/backup", "/runs/run1/model")
    assert config.data_dir == str(tmp_path / "data")  # the workers' working directory differs
    given = tfmulti.ray._worker_config(TrainConfig(backup_dir="b", model_dir="/out/m"), "/r")
    assert (given.backup_dir, given.model_dir) == (str(tmp_path / "b"), "/out/m")


def test_without_ray_the_import_names_the_extra(monkeypatch):
    monkeypatch.setitem(sys.modules, "ray", None)  # as if Ray were not installed
    monkeypatch.delitem(sys.modules, "tfmulti.ray")
    with pytest.raises(ModuleNotFoundError, match=r'^tfmulti.ray needs Ray: pip install '
                                                  r'"tfmulti\[ray\]"$'):
        importlib.import_module("tfmulti.ray")
    assert os.path.basename(tfmulti.ray.__file__) == "__init__.py"


def test_ray_train_v1_is_refused_before_ray_starts(monkeypatch, tmp_path):
    """RAY_TRAIN_V2_ENABLED=0 gives Ray Train v1's trainer, which drops the
    workers' return values (the chief's metrics)."""
    import ray
    import ray.train.tensorflow
    from ray.train.tensorflow import tensorflow_trainer

    monkeypatch.setattr(ray.train.tensorflow, "TensorflowTrainer",
                        tensorflow_trainer.TensorflowTrainer)
    with pytest.raises(ValueError, match=r"needs Ray Train v2 .* unset RAY_TRAIN_V2_ENABLED"):
        tfmulti.ray.train(TrainConfig(), storage_path=str(tmp_path))
    assert not ray.is_initialized()


def test_backup_false_trains_without_one_and_refuses_a_config_that_sets_one():
    config = tfmulti.ray._worker_config(TrainConfig(), "/runs/run1", backup=False)
    assert (config.backup_dir, config.model_dir) == (None, "/runs/run1/model")
    with pytest.raises(ValueError, match=r"backup=False trains without a backup, but the config "
                                         r"sets backup_dir \(None\) or backup_every_steps \(8\)"):
        tfmulti.ray.train(TrainConfig(backup_every_steps=8), backup=False)
    with pytest.raises(ValueError, match=r"`backup` must be True or False, got 'no'"):
        tfmulti.ray.train(TrainConfig(), backup="no")


def test_runs_started_in_the_same_second_get_folders_of_their_own():
    names = {tfmulti.ray._default_name() for _ in range(20)}
    assert len(names) == 20 and all(n.startswith("tfmulti-20") for n in names), names
