"""A run assembled from a `TrainConfig`: strategy, input pipelines, compiled model.

The one place that wires "strategy -> data -> model -> compile" together:
`tfmulti.training.train`, `tfmulti.insight.diagnose` and the benchmarks all
call `build_run`.

Example:
    >>> from tfmulti.config import TrainConfig
    >>> from tfmulti.runs import build_run
    >>> run = build_run(TrainConfig(distribution="mirrored", dataset="synthetic",
    ...                             num_examples=1024, global_batch_size=64))
    >>> run.train_input.num_replicas, run.steps_per_epoch, run.steps_per_execution
    (4, 16, 16)
"""

from __future__ import annotations

import dataclasses

import keras
import tensorflow as tf

from tfmulti import data, devices, models
from tfmulti import strategy as strategy_lib
from tfmulti.config import TrainConfig, resolve_steps_per_execution
from tfmulti.parallel.pipeline import PipelineModel

__all__ = ["Run", "build_run"]


@dataclasses.dataclass
class Run:
    """What `build_run` made: everything `fit` needs, and where it came from.

    Attributes:
        config: the validated configuration.
        strategy: the `tf.distribute.Strategy` (the default strategy for the
            pipeline and hybrid distributions, which place stages themselves).
        train_data, test_data: the unbatched datasets.
        info: the dataset's input shape, classes and task.
        train_input, test_input: the distributed inputs (`DistributedInput`).
        steps_per_epoch: global steps per epoch.
        steps_per_execution: training steps per `tf.function` call.
        model: the compiled model (a `PipelineModel` for pipeline/hybrid).
    """

    config: TrainConfig
    strategy: tf.distribute.Strategy
    train_data: tf.data.Dataset
    test_data: tf.data.Dataset
    info: dict
    train_input: data.DistributedInput
    test_input: data.DistributedInput
    steps_per_epoch: int
    steps_per_execution: int
    model: keras.Model

    @property
    def num_replicas(self) -> int:
        """Data-parallel replicas (a hybrid's pipelines count as replicas)."""
        if self.config.model_parallel:
            return self.model.num_replicas
        return self.strategy.num_replicas_in_sync

    @property
    def per_replica_batch_size(self) -> int:
        return self.config.global_batch_size // self.num_replicas

    def dataset_from(self, step: int):
        """The training stream positioned after `step` global batches (for
        `tfmulti.backup.fit`)."""
        c = self.config
        return data.distribute(self.train_data, self.strategy, c.global_batch_size,
                               training=True, seed=c.seed, skip_steps=step).dataset

    def describe(self) -> str:
        """One line: where the replicas (or stages) run and how the batch splits."""
        c, m = self.config, self.model
        calls = f"{self.steps_per_epoch} steps/epoch, {self.steps_per_execution} per call"
        if c.model_parallel:
            devices_used = [d for row in m.stage_devices for d in row]
            micro = c.global_batch_size // m.num_replicas // m.num_microbatches
            return (f"{c.distribution}: {m.num_replicas} replica(s) x {m.num_stages} stages on "
                    f"{devices_used}; global batch {c.global_batch_size} = {m.num_replicas} x "
                    f"{m.num_microbatches} micro-batches of {micro}; {calls}")
        return (f"{strategy_lib.describe(self.strategy)}; global batch {c.global_batch_size} = "
                f"{self.train_input.num_replicas} x {self.train_input.per_replica_batch_size}"
                f"; {calls}")


def _data(config: TrainConfig) -> tuple[tf.data.Dataset, tf.data.Dataset, dict]:
    data_dir = config.data_dir or data.default_data_dir()
    test_examples = config.num_examples and max(config.num_examples // 4, 1)
    train = data.load(config.dataset, "train", data_dir=data_dir, download=config.download,
                      num_examples=config.num_examples)
    test = data.load(config.dataset, "test", data_dir=data_dir, download=config.download,
                     num_examples=test_examples)
    info = data.dataset_info(config.dataset, data_dir)
    if config.task != info["task"]:
        fix = ("dataset='synthetic_regression'" if config.task == "regression"
               else "model='mlp' or 'cnn'")
        raise ValueError(f"`model` {config.model!r} does {config.task} but `dataset` "
                         f"{config.dataset!r} is a {info['task']} dataset; use {fix}.")
    return train, test, info


def build_run(config: TrainConfig, *, reuse: Run | None = None,
              input_options: dict | None = None) -> Run:
    """Validates `config` and builds its strategy, inputs and compiled model.

    Virtual devices are configured first (`num_virtual_devices`); the model is
    built and compiled under the configured mixed-precision policy, which is
    restored afterwards.

    Args:
        config: the run.
        reuse: a run of the same distribution and dataset whose strategy and
            data to reuse (e.g. `diagnose`'s variants of one configuration).
        input_options: extra `tfmulti.data.distribute` arguments for the
            training input (prefetch, cache, map_fn, batch_map_fn, ...).

    Raises:
        ValueError: a bad configuration, a model that does not fit the data,
            or float16 without a GPU.
        RuntimeError: virtual devices requested after TensorFlow started.
        tfmulti.data.DataNotFoundError: the dataset is not available offline.
    """
    config.validate()
    if reuse is None:
        if config.num_virtual_devices:
            devices.configure_virtual_devices(config.num_virtual_devices)
        if config.model_parallel:
            strategy = tf.distribute.get_strategy()  # placement is manual, per stage
        else:
            strategy = strategy_lib.get_strategy(
                config.distribution, devices=list(config.devices) if config.devices else None,
                cross_device_ops=config.cross_device_ops)
        train_data, test_data, info = _data(config)
    else:
        strategy, train_data, test_data, info = (reuse.strategy, reuse.train_data,
                                                 reuse.test_data, reuse.info)
    train_input = data.distribute(train_data, strategy, config.global_batch_size,
                                  training=True, seed=config.seed, **(input_options or {}))
    test_input = data.distribute(test_data, strategy, config.global_batch_size, training=False)
    steps_per_epoch = config.steps_per_epoch or train_input.steps_per_epoch
    steps_per_execution = resolve_steps_per_execution(
        config.steps_per_execution, steps_per_epoch, config.backup_every_steps)
    with models.mixed_precision_policy(config.mixed_precision):
        model = _model(config, strategy, info)
        models.compile_model(
            model, task=config.task, strategy=None if config.model_parallel else strategy,
            optimizer=config.optimizer, learning_rate=config.learning_rate,
            lr_scaling=config.lr_scaling, global_batch_size=config.global_batch_size,
            base_batch_size=config.base_batch_size, warmup_epochs=config.warmup_epochs,
            steps_per_epoch=steps_per_epoch, steps_per_execution=steps_per_execution,
            jit_compile=config.jit_compile)
    return Run(config, strategy, train_data, test_data, info, train_input, test_input,
               steps_per_epoch, steps_per_execution, model)


def _model(config: TrainConfig, strategy, info: dict) -> keras.Model:
    model = models.build_model(
        config.model, strategy=None if config.model_parallel else strategy,
        input_shape=info["input_shape"], num_classes=info["num_classes"] or 1,
        dropout=config.dropout, seed=config.seed)
    if not config.model_parallel:
        return model
    return PipelineModel(
        model, devices=list(config.devices) if config.devices else None,
        num_stages=config.num_stages, num_microbatches=config.num_microbatches,
        num_replicas=config.num_replicas if config.distribution == "hybrid" else 1,
        partition=config.partition, remat=config.remat, name=config.model)
