"""A run assembled from a `TrainConfig`: strategy, input pipelines, compiled model.

The one place that wires "strategy -> data -> model -> compile" together:
`tfmulti.training.train.train`, `tfmulti.insight.diagnose`, `tfmulti estimate-memory`
and the benchmarks all call it. The data and the model are tfmulti's built-in
ones or the user's own (`--dataset=package.module:function`,
`--model=package.module:function`, or the functions themselves from Python;
`tfmulti.config.user_functions`).

Example:
    >>> from tfmulti.config.train_config import TrainConfig
    >>> from tfmulti.training.run import build_run
    >>> run = build_run(TrainConfig(distribution="mirrored", dataset="synthetic",
    ...                             num_examples=1024, global_batch_size=64))
    >>> run.train_input.num_replicas, run.steps_per_epoch, run.steps_per_execution
    (4, 16, 16)
"""

from __future__ import annotations

import contextlib
import dataclasses

import keras
import numpy as np
import tensorflow as tf

from tfmulti import data
from tfmulti.runtime import devices
from tfmulti.config import user_functions as hooks
from tfmulti.models import builders as models
from tfmulti.models import transformer
from tfmulti.runtime import strategy as strategy_lib
from tfmulti.config import train_config as config_lib
from tfmulti.config.train_config import TrainConfig, resolve_steps_per_execution
from tfmulti.data.sources import FileSource
from tfmulti.parallel.layouts import build_parallel_transformer
from tfmulti.parallel.pipeline import PipelineModel

__all__ = ["Run", "RunData", "build_model_for", "build_run", "features_spec", "is_text_dataset",
           "load_data"]

_LEARNING_RATE_DEFAULT = TrainConfig().learning_rate


@dataclasses.dataclass
class RunData:
    """A run's data, unbatched, and what it says about the model it feeds.

    Attributes:
        train, test: `tf.data.Dataset`s, or `tfmulti.data.FileSource`s; `test`
            is None when the data has no test split (nothing is evaluated).
        input_shape: the per-example feature shape (a dict of shapes for dict
            features).
        task: "classification" or "regression" (None: the user's loss decides).
        num_classes: classes of a classification dataset when known (given,
            or read from the labels when a model asks for it), else None.
    """

    train: object
    test: object
    input_shape: object
    task: str | None
    num_classes: int | None = None

    @property
    def info(self) -> dict:
        return {"input_shape": self.input_shape, "num_classes": self.num_classes,
                "task": self.task}

    def classes(self) -> int:
        """`num_classes`, read from the training labels (one pass) when unknown.

        Raises:
            ValueError: the labels are not integers, or the data is not
                (features, labels).
        """
        if self.num_classes is None:
            self.num_classes = _count_classes(self.train)
        return self.num_classes


def _spec_of(source):
    ds = source.dataset() if isinstance(source, FileSource) else source
    return ds.element_spec


def _shape(spec):
    if isinstance(spec, dict):
        return {k: tuple(v.shape) for k, v in spec.items()}
    return tuple(spec.shape)


def features_spec(source):
    """The element spec of the features of `source` (a dataset or file source)."""
    spec = _spec_of(source)
    return spec[0] if isinstance(spec, tuple) else spec


def _labels_spec(spec):
    return spec[1] if isinstance(spec, tuple) and len(spec) >= 2 else None


def _count_classes(source) -> int:
    labels = _labels_spec(_spec_of(source))
    if labels is None or not isinstance(labels, tf.TensorSpec) or not labels.dtype.is_integer:
        raise ValueError("the model asks for `num_classes`, but the labels are not integer "
                         "class ids; return 'num_classes' from the dataset function.")
    ds = source.dataset() if isinstance(source, FileSource) else source
    top = ds.map(lambda x, y, *w: tf.reduce_max(tf.cast(y, tf.int64))).reduce(
        np.int64(-1), tf.maximum)
    print(f"tfmulti: read the labels once: {int(top) + 1} classes (return 'num_classes' "
          "from the dataset function to skip this)", flush=True)
    return int(top) + 1


def _as_source(value, what: str):
    if value is None or isinstance(value, (tf.data.Dataset, FileSource)):
        return value
    try:
        return data.as_dataset(value)
    except ValueError as e:
        raise ValueError(f"the dataset function's {what} data: {e}") from None


def _user_data(config: TrainConfig, data_dir: str) -> RunData:
    fn = hooks.resolve(config.dataset, "dataset")
    result = hooks.call(fn, {"seed": config.seed, "data_dir": data_dir,
                             "num_examples": config.num_examples}, "dataset")
    name = config.dataset_name
    if isinstance(result, dict):
        unknown = set(result) - {"train", "test", "num_classes", "task"}
        if "train" not in result or unknown:
            raise ValueError(
                f"the dataset function {name} returned a dict with keys {sorted(result)}; "
                "expected 'train' and optionally 'test', 'num_classes', 'task'.")
        train, test = result["train"], result.get("test")
        num_classes, task = result.get("num_classes"), result.get("task")
    elif isinstance(result, tuple) and len(result) == 2:
        (train, test), num_classes, task = result, None, None
    else:
        raise ValueError(
            f"the dataset function {name} returned {type(result).__name__}"
            + (f" of {len(result)}" if isinstance(result, tuple) else "")
            + "; expected (train, test) (each a tf.data.Dataset, (features, labels) arrays, or "
            "tfmulti.data.from_files(...); test may be None) or a dict with 'train' and 'test'.")
    train, test = _as_source(train, "train"), _as_source(test, "test")
    if train is None:
        raise ValueError(f"the dataset function {name} returned no training data.")
    spec = _spec_of(train)
    features = spec[0] if isinstance(spec, tuple) else spec
    labels = _labels_spec(spec)
    if task is None:
        task = config.builtin_task
    if task is None and isinstance(labels, tf.TensorSpec):
        task = "classification" if labels.dtype.is_integer else "regression"
    return RunData(train, test, _shape(features), task, num_classes)


def load_data(config: TrainConfig) -> RunData:
    """The run's train and test data: a named dataset (TFDS, synthetic), or
    what the user's dataset function returns.

    Raises:
        ValueError: a dataset function that cannot be found or returns
            something else than train and test data; a built-in model whose
            task the dataset does not fit.
        tfmulti.data.DataNotFoundError: a named dataset is not available offline.
    """
    data_dir = config.data_dir or data.default_data_dir()
    is_text = is_text_dataset(config.dataset)
    if (config.model == config_lib.TRANSFORMER) != is_text and config.builtin_model \
            and isinstance(config.dataset, str) and ":" not in config.dataset:
        raise ValueError(
            f"`model` {config.model!r} and `dataset` {config.dataset!r} do not fit: the "
            f"transformer reads byte sequences (dataset={data.text.NAME!r}), the other built-in "
            f"models images or features; use model='transformer' with "
            f"dataset={data.text.NAME!r}, or another pair.")
    if not isinstance(config.dataset, str) or ":" in config.dataset:
        run_data = _user_data(config, data_dir)
    elif is_text:
        train, test = (data.text.load(config.dataset, split, data_dir, download=config.download,
                                      sequence_length=config.seq_len)
                       for split in ("train", "validation"))
        run_data = RunData(train, test, (config.seq_len,), "classification", 256)
    else:
        test_examples = config.num_examples and max(config.num_examples // 4, 1)
        train = data.load(config.dataset, "train", data_dir=data_dir, download=config.download,
                          num_examples=config.num_examples)
        test = data.load(config.dataset, "test", data_dir=data_dir, download=config.download,
                         num_examples=test_examples)
        info = data.dataset_info(config.dataset, data_dir)
        run_data = RunData(train, test, info["input_shape"], info["task"], info["num_classes"])
    wanted = config.builtin_task
    if wanted is not None and run_data.task is not None and wanted != run_data.task:
        fix = ("dataset='synthetic_regression'" if wanted == "regression"
               else "model='mlp' or 'cnn'")
        raise ValueError(f"`model` {config.model_name!r} does {wanted} but `dataset` "
                         f"{config.dataset_name!r} is a {run_data.task} dataset; use {fix}.")
    return run_data


def is_text_dataset(dataset) -> bool:
    """Whether `dataset` names tfmulti's byte-level text data (`tfmulti.data.text`)."""
    return isinstance(dataset, str) and dataset.partition("/")[0] == data.text.NAME


def _transformer_sizes(config: TrainConfig) -> dict:
    return dict(seq_len=config.seq_len, d_model=config.d_model, num_heads=config.num_heads,
                num_layers=config.num_layers, dropout=config.dropout)


def build_model_for(config: TrainConfig, run_data: RunData, strategy=None) -> keras.Model:
    """The run's model, unpartitioned: a built-in builder's, or the user's
    model function's, built under `strategy`'s scope (none: the current one).

    Raises:
        ValueError: a model function that cannot be found, asks for an
            argument tfmulti does not offer, or returns no Keras model.
    """
    if config.model == config_lib.TRANSFORMER:
        with strategy.scope() if strategy is not None else contextlib.nullcontext():
            return transformer.build_transformer(seed=config.seed, **_transformer_sizes(config))
    if config.builtin_model:
        return models.build_model(
            config.model, strategy=strategy, input_shape=run_data.input_shape,
            num_classes=run_data.classes() if run_data.task == "classification" else 1,
            dropout=config.dropout, seed=config.seed)
    fn = hooks.resolve(config.model, "model")
    offered = {"input_shape": run_data.input_shape, "dropout": config.dropout,
               "seed": config.seed}
    wanted = hooks.parameters(fn)
    if wanted is None or "num_classes" in wanted:
        offered["num_classes"] = (run_data.classes() if run_data.task == "classification"
                                  else None)
    if config.seed is not None:
        keras.utils.set_random_seed(config.seed)
    with strategy.scope() if strategy is not None else contextlib.nullcontext():
        model = hooks.call(fn, offered, "model")
    if not isinstance(model, keras.Model):
        raise ValueError(f"the model function {config.model_name} returned "
                         f"{type(model).__name__}; expected a keras.Model (functional, "
                         "Sequential or subclassed).")
    return model


@dataclasses.dataclass
class Run:
    """What `build_run` made: everything `fit` needs, and where it came from.

    Attributes:
        config: the validated configuration.
        strategy: the `tf.distribute.Strategy` (the default strategy for the
            pipeline and hybrid distributions, which place stages themselves).
        train_data, test_data: the unbatched data (datasets or file sources;
            `test_data` None without a test split).
        info: the data's input shape, classes and task.
        train_input, test_input: the distributed inputs (`DistributedInput`;
            `test_input` None without a test split).
        steps_per_epoch: global steps (optimizer updates) per epoch.
        steps_per_execution: training steps per `tf.function` call.
        model: the compiled model (a `PipelineModel` for pipeline/hybrid).
    """

    config: TrainConfig
    strategy: tf.distribute.Strategy
    train_data: object
    test_data: object
    info: dict
    train_input: data.DistributedInput
    test_input: data.DistributedInput | None
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

    @property
    def examples_per_step(self) -> int:
        """Examples per optimizer update: the global batch times `accumulate_steps`."""
        return self.config.global_batch_size * self.config.accumulate_steps

    def dataset_from(self, step: int):
        """The training stream positioned after `step` global steps (for
        `tfmulti.training.backup.fit`)."""
        c = self.config
        return data.distribute(
            self.train_data, self.strategy, self.examples_per_step, training=True,
            seed=c.seed, skip_steps=step, sharding=self.train_input.sharding,
            steps_per_epoch=(self.train_input.steps_per_epoch
                             if self.train_input.num_examples is None else None)).dataset

    def describe(self) -> str:
        """One line: where the replicas (or stages) run and how the batch splits."""
        c, m = self.config, self.model
        calls = f"{self.steps_per_epoch} steps/epoch, {self.steps_per_execution} per call"
        if c.accumulate_steps > 1:
            calls += (f", each step {c.accumulate_steps} accumulated micro-steps of "
                      f"{c.global_batch_size}")
        if c.model_parallel:
            devices_used = [d for row in m.stage_devices for d in row]
            micro = c.global_batch_size // m.num_replicas // m.num_microbatches
            return (f"{c.distribution}: {m.num_replicas} replica(s) x {m.num_stages} stages on "
                    f"{devices_used}; global batch {c.global_batch_size} = {m.num_replicas} x "
                    f"{m.num_microbatches} micro-batches of {micro}; {calls}")
        sharding = (f"; input sharded by {self.train_input.sharding}"
                    if strategy_lib.cluster_role(self.strategy).num_workers > 1 else "")
        return (f"{strategy_lib.describe(self.strategy)}; global batch {c.global_batch_size} = "
                f"{self.num_replicas} x {c.global_batch_size // self.num_replicas}"
                f"; {calls}{sharding}")


def _strategy(config: TrainConfig):
    if config.num_virtual_devices:
        devices.configure_virtual_devices(config.num_virtual_devices)
    if config.model_parallel:
        return tf.distribute.get_strategy()  # placement is manual, per stage
    return strategy_lib.get_strategy(
        config.distribution, devices=list(config.devices) if config.devices else None,
        cross_device_ops=config.cross_device_ops,
        cluster_resolver=config.cluster_resolver if config.distribution == "multi_worker"
        else None)


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
            a user's function that cannot be found or returns the wrong thing,
            or float16 without a GPU.
        RuntimeError: virtual devices requested after TensorFlow started.
        tfmulti.data.DataNotFoundError: the dataset is not available offline.
    """
    config.validate()
    named_optimizer = isinstance(config.optimizer, str)
    if not named_optimizer and config.learning_rate != _LEARNING_RATE_DEFAULT:
        raise ValueError(f"`learning_rate` ({config.learning_rate}) applies to an optimizer "
                         f"given by name; set the rate on your "
                         f"{type(config.optimizer).__name__} instead.")
    if reuse is None:
        strategy = _strategy(config)
        run_data = load_data(config)
    else:
        strategy = reuse.strategy
        run_data = RunData(reuse.train_data, reuse.test_data, reuse.info["input_shape"],
                           reuse.info["task"], reuse.info["num_classes"])
    examples_per_step = config.global_batch_size * config.accumulate_steps
    train_input = data.distribute(
        run_data.train, strategy, examples_per_step, training=True, seed=config.seed,
        sharding=config.input_sharding, **(input_options or {}),
        steps_per_epoch=_if_unknown_size(run_data.train, config.steps_per_epoch))
    test_input = None
    if run_data.test is not None:
        # input_sharding is about the training input; test data that is not
        # files is read by examples (files: as the training data).
        test_input = data.distribute(
            run_data.test, strategy, config.global_batch_size, training=False,
            sharding=(config.input_sharding if isinstance(run_data.test, FileSource)
                      else "examples"))
    steps_per_epoch = config.steps_per_epoch or train_input.steps_per_epoch
    steps_per_execution = resolve_steps_per_execution(
        config.steps_per_execution, steps_per_epoch, config.backup_every_steps)
    with models.mixed_precision_policy(config.mixed_precision):
        model = _model(config, strategy, run_data)
        models.compile_model(
            model, task=run_data.task, strategy=None if config.model_parallel else strategy,
            optimizer=config.optimizer,
            learning_rate=config.learning_rate if named_optimizer else None,
            loss=hooks.resolve(config.loss, "loss") if config_lib.is_hook(config.loss)
            else config.loss, metrics=list(config.metrics) if config.metrics else None,
            lr_scaling=config.lr_scaling, global_batch_size=examples_per_step,
            base_batch_size=config.base_batch_size, warmup_epochs=config.warmup_epochs,
            steps_per_epoch=steps_per_epoch, steps_per_execution=steps_per_execution,
            accumulate_steps=config.accumulate_steps, jit_compile=config.jit_compile)
    return Run(config, strategy, run_data.train, run_data.test, run_data.info, train_input,
               test_input, steps_per_epoch, steps_per_execution, model)


def _if_unknown_size(source, steps):
    """`steps` for data of unknown size (it sets the epoch's length there);
    None for data of known size (`fit` takes it instead)."""
    if isinstance(source, FileSource):
        return steps
    return steps if int(source.cardinality()) < 0 else None


def _model(config: TrainConfig, strategy, run_data: RunData) -> keras.Model:
    if not config.model_parallel:
        return build_model_for(config, run_data, strategy)
    if config.model == config_lib.TRANSFORMER:  # stages of T devices each
        return build_parallel_transformer(
            num_replicas=config.num_replicas if config.distribution == "hybrid" else 1,
            num_stages=config.num_stages, tensor_parallel=config.tensor_parallel,
            num_microbatches=config.num_microbatches,
            devices=list(config.devices) if config.devices else None,
            partition=config.partition, remat=config.remat,
            accumulate_steps=config.accumulate_steps, seed=config.seed,
            **_transformer_sizes(config))
    with tf.device("/CPU:0"):  # built on the host; the pipeline places its stages
        model = build_model_for(config, run_data, None)
    return PipelineModel(
        model, devices=list(config.devices) if config.devices else None,
        num_stages=config.num_stages, num_microbatches=config.num_microbatches,
        num_replicas=config.num_replicas if config.distribution == "hybrid" else 1,
        partition=config.partition, remat=config.remat,
        name=config.model if config.builtin_model else "pipeline")
