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

import dataclasses
import re
from typing import Callable

import keras
import tensorflow as tf

from tfmulti import data
from tfmulti.config import keras_forms
from tfmulti.config import train_config as config_lib
from tfmulti.config import user_functions as hooks
from tfmulti.config.train_config import TrainConfig, resolve_steps_per_execution
from tfmulti.data import service, weights
from tfmulti.data.checks import check_model_fits, one_hot_width
from tfmulti.data.from_config import RunData, load_data
from tfmulti.data.sources import FileSource
from tfmulti.models import builders as models
from tfmulti.models import own_fit, sparse_updates
from tfmulti.models.from_config import build_model_for, transformer_sizes
from tfmulti.parallel import zero
from tfmulti.parallel.layouts import build_parallel_transformer
from tfmulti.parallel.pipeline import PipelineModel
from tfmulti.parallel.tensor_models import split_for_pipeline
from tfmulti.runtime import devices, keras_fixes
from tfmulti.runtime import strategy as strategy_lib
from tfmulti.training import compiling
from tfmulti.utils import human

__all__ = ["Run", "build_run"]

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
        validation_input: the validation split (`validation_split`, or the
            dataset function's "validation") distributed as the test split
            is; None without one.
        preprocess: the model's own preparation of a batch, mapped over every
            input's batches (`tfmulti.models.own_fit`); None for most models.
        data_service: the tf.data service's address the training input is
            read from (`tfmulti.data.service`), else None.
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
    validation_input: data.DistributedInput | None = None
    preprocess: Callable | None = None
    data_service: str | None = None

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
            batch_map_fn=self.preprocess, data_service=self.data_service,
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
            return (f"{c.distribution}: {human.count(m.num_replicas, 'replica')} x "
                    f"{m.num_stages} stages on "
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
        keras_fixes.apply_placement_fixes()
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
    if config.optimizer is not None and not isinstance(config.optimizer, str) \
            and config.learning_rate is not None:
        raise ValueError(f"`learning_rate` ({config.learning_rate}) applies to an optimizer "
                         f"given by name; set the rate on your "
                         f"{type(config.optimizer).__name__} instead.")
    loss = _loss(config)
    if reuse is None:
        strategy = _strategy(config)
        run_data = load_data(config, strategy_lib.cluster_role(strategy))
        if config.class_weight is not None:  # each training example weighed by its class
            given = (weights.balanced_class_weights(run_data.train)
                     if config.class_weight == keras_forms.BALANCED else config.class_weight)
            run_data.train = weights.with_class_weights(run_data.train, given)
    else:
        strategy = reuse.strategy
        run_data = RunData(reuse.train_data, reuse.test_data, reuse.info["input_shape"],
                           reuse.info["task"], reuse.info["num_classes"])
    with models.mixed_precision_policy(config.mixed_precision):
        model = _model(config, strategy, run_data)
    # A model whose fit prepares its own input (keras-hub's tasks): prepared here.
    preprocess = own_fit.preprocessing(compiling.source_model(model))
    options = dict(input_options or {})
    options["batch_map_fn"] = _then(preprocess, options.get("batch_map_fn"))
    examples_per_step = config.global_batch_size * config.accumulate_steps
    if "data_service" not in options:
        options["data_service"], line = service.resolve(config.data_service)
        if line:
            print(f"tfmulti: {line}", flush=True)
    train_input = data.distribute(
        run_data.train, strategy, examples_per_step, training=True, seed=config.seed,
        sharding=config.input_sharding, **options,
        steps_per_epoch=_if_unknown_size(run_data.train, config.steps_per_epoch))
    test_input = _evaluation_input(run_data.test, strategy, config, preprocess)
    validation_input = _evaluation_input(run_data.validation, strategy, config, preprocess)
    steps_per_epoch = config.steps_per_epoch or train_input.steps_per_epoch
    steps_per_execution = resolve_steps_per_execution(
        config.steps_per_execution, steps_per_epoch, config.backup_every_steps)
    with models.mixed_precision_policy(config.mixed_precision):
        output = models.output_head(model)[1]  # also a pipeline's (its last stage's)
        compiling.compile_for_run(
            model, config, strategy=None if config.model_parallel else strategy, loss=loss,
            task=run_data.task, one_hot_labels=_one_hot_labels(run_data, model, output),
            global_batch_size=examples_per_step, steps_per_epoch=steps_per_epoch,
            steps_per_execution=steps_per_execution)
    if config.sparse_updates == "lazy":
        _lazy(model)
    if (config.zero_stage or config.shard_embeddings) and not config.model_parallel:
        _shard(model, strategy, config.zero_stage, train_input, config.shard_embeddings)
    # labels and inputs the model takes, before the first epoch
    if preprocess is None:  # else the data is the preprocessor's to check
        check_model_fits(run_data, model, output_shape=output)
    return Run(config, strategy, run_data.train, run_data.test, run_data.info, train_input,
               test_input, steps_per_epoch, steps_per_execution, model,
               validation_input, preprocess, options["data_service"])


def _lazy(model) -> None:
    """The compiled `model`'s optimizer made to update a sparse gradient's rows
    only (`tfmulti.models.sparse_updates`), said in one line."""
    optimizer = zero.updating(getattr(model, "optimizer", None))
    if optimizer is None:
        raise ValueError("`sparse_updates` 'lazy' changes the model's optimizer, and your model "
                         "has none (it trains by a train_step of its own); use "
                         "sparse_updates='dense'.")
    try:
        sparse_updates.lazy(optimizer)
    except TypeError as e:
        raise ValueError(str(e)) from None
    print(f"tfmulti: sparse_updates=lazy: {type(optimizer).__name__} updates only the rows a "
          "batch touched of a sparse gradient (an embedding table's), and their slots",
          flush=True)
    dense = sparse_updates.dense_tables(model)
    if dense:
        tables = (f"tables {', '.join(dense)} update" if len(dense) > 1
                  else f"table {dense[0]} updates")
        print(f"tfmulti: sparse_updates=lazy: {tables} every row every step all the same "
              "(a regularizer's gradient covers the whole table; a constraint is applied to "
              "it whole after each update); drop them for lazy updates of these tables",
              flush=True)


def _shard(model, strategy, stage: int, train_input, tables: bool = False) -> None:
    """The compiled `model`'s optimizer state sharded over the replicas (ZeRO
    `stage`), and where `tables` its embedding tables by rows, said in one
    line each. A model that makes its variables at its first call
    (subclassed, no `keras.Input`) is built first, from the shapes of
    `train_input`'s batches (`_build_from_batches`)."""
    asked = " and ".join(([f"zero_stage={stage}"] if stage else []) +
                         (["shard_embeddings"] if tables else []))
    replicas = strategy.num_replicas_in_sync
    if replicas < 2:
        print(f"tfmulti: {asked} shards over data-parallel replicas; this run has one, so "
              f"its training state is whole, as without it", flush=True)
        return
    optimizer = zero.updating(model.optimizer)
    own = sorted(name for name, value in vars(model).items()
                 if isinstance(value, keras.optimizers.Optimizer) and value is not model.optimizer
                 and not name.startswith("_"))
    if own:
        raise ValueError(
            f"{asked} shards the model's optimizer (model.optimizer), and your "
            f"model {type(model).__name__} trains with optimizers of its own in its "
            f"train_step ({', '.join(own)}), which would stay whole; leave it off.")
    failure = None if _built(model) else _build_from_batches(model, strategy, train_input)
    if not _built(model):
        why = f" ({failure})" if failure else ""
        raise ValueError(
            f"{asked} shards the optimizer over the model's variables, and your "
            f"model {type(model).__name__} has none yet, and calling it on inputs of the "
            f"training batches' shapes made none{why}: build it in your model function "
            f"(keras.Input, or call it on a batch).")
    layers = zero.table_layers(model, replicas) if tables else []
    if tables and not layers:
        print("tfmulti: shard_embeddings: the model has no trainable keras.layers.Embedding "
              f"table of {replicas} rows or more; none sharded", flush=True)
        if not stage:
            return
    zero.shard_optimizer(optimizer, model.trainable_variables, strategy, stage, model=model,
                         tables=layers)
    if stage:
        what = {1: "its slots", 2: "its slots and the gradients",
                3: "its slots, the gradients and the parameters"}[stage]
        print(f"tfmulti: zero_stage={stage}: {type(optimizer).__name__}'s state sharded over "
              f"{replicas} replicas ({what}: 1/{replicas} on each)", flush=True)
    if layers:
        named = ", ".join(f"{layer.name} ({layer.input_dim:,} x {layer.output_dim})"
                          for layer in layers)
        print(f"tfmulti: shard_embeddings: {named} split by rows over {replicas} replicas "
              f"(1/{replicas} of the rows and their slots on each; lookups go to the rows' "
              f"owners)", flush=True)


def _built(model) -> bool:
    """Whether `model` has made its variables (keras-io's VAE: built models in one
    of its own, itself not marked built)."""
    layers = list(model._flatten_layers(include_self=False))  # pylint: disable=protected-access
    built = model.built or (layers and all(layer.built for layer in layers))
    return bool(built and model.trainable_variables)


def _build_from_batches(model, strategy, train_input) -> str | None:
    """`model` called symbolically, under `strategy`, on inputs of the shapes and
    dtypes of one replica's training batch (as Keras' `fit` builds it, reading
    no data; its optimizer is not built), so that its variables exist before
    the first step; said in one line. Nothing where the batches' spec is not
    tensors, or the call fails: then what failed, in a few words (the caller
    says what to do)."""
    from keras.src import backend  # (its symbolic call: Keras' own `compute_output_spec`)

    spec = getattr(getattr(train_input, "dataset", None), "element_spec", None)
    if spec is None:
        return None
    spec = tf.nest.map_structure(lambda s: getattr(s, "_value_specs", (s,))[0], spec)
    inputs = spec[0] if isinstance(spec, tuple) else spec
    if not all(isinstance(s, tf.TensorSpec) for s in tf.nest.flatten(inputs)):
        return "its batches are not tensors"
    inputs = tf.nest.map_structure(
        lambda s: keras.KerasTensor(tuple(s.shape), dtype=s.dtype.name), inputs)
    try:
        with strategy.scope():
            backend.compute_output_spec(model, inputs)
    except Exception as e:  # noqa: BLE001  (whatever the model's call raises: refused after)
        # (Keras wraps what the call raised: "Exception encountered when calling ...", then
        # the cause, in bold)
        lines = [re.sub(r"\x1b\[[0-9;]*m", "", line).strip() for line in str(e).splitlines()]
        cause = next((line for line in lines
                      if line and not line.startswith("Exception encountered when calling")), "")
        return f"its call failed: {type(e).__name__}: {cause[:200]}"
    print(f"tfmulti: built {type(model).__name__} from the shapes of a training batch, to "
          f"shard its variables before the first step", flush=True)
    return None


def _evaluation_input(source, strategy, config: TrainConfig, preprocess):
    """A test or validation split distributed for evaluation (None for no
    split): `input_sharding` is about the training input, so evaluated data
    that is not files is read by examples (files: as the training files)."""
    if source is None:
        return None
    return data.distribute(
        source, strategy, config.global_batch_size, training=False, batch_map_fn=preprocess,
        sharding=config.input_sharding if isinstance(source, FileSource) else "examples")


def _then(first, second):
    """`first`, then `second`, over a batch (either may be None)."""
    if first is None or second is None:
        return first or second
    return lambda *batch: second(*_as_args(first(*batch)))


def _as_args(batch) -> tuple:
    return batch if isinstance(batch, tuple) else (batch,)


def _loss(config: TrainConfig):
    """The loss (None: not given): a Keras name, the user's function (resolved
    from its hook and checked to take `(y_true, y_pred)`), or a loss object;
    or a dict or list of them, one per output."""
    def one(loss):
        loss = hooks.resolve(loss, "loss") if config_lib.is_hook(loss) else loss
        if callable(loss) and not isinstance(loss, (str, keras.losses.Loss)):
            hooks.check_takes(loss, ("y_true", "y_pred"), "loss")
        return loss

    if isinstance(config.loss, dict):
        return {key: one(value) for key, value in config.loss.items()}
    if isinstance(config.loss, list):
        return [one(value) for value in config.loss]
    return one(config.loss)


def _one_hot_labels(run_data: RunData, model, output_shape):
    """Whether the labels are one-hot rows: for one output (`RunData.one_hot_labels`),
    or for each part of labels of several parts, by its key."""
    parts = run_data.label_parts()
    if parts is None:
        return run_data.one_hot_labels(output_shape)
    found = {key: one_hot_width(spec, examples) is not None for key, spec, examples in parts}
    return found if isinstance(parts[0][0], str) else list(found.values())


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
            **transformer_sizes(config))
    with tf.device("/CPU:0"):  # built on the host; the pipeline places its stages
        model = build_model_for(config, run_data, None)
    devices = list(config.devices) if config.devices else None
    if config.tensor_parallel > 1:  # the user's layers split over the stage's T devices
        model, devices = split_for_pipeline(model, config.tensor_parallel, devices)
    return PipelineModel(
        model, devices=devices,
        num_stages=config.num_stages, num_microbatches=config.num_microbatches,
        num_replicas=config.num_replicas if config.distribution == "hybrid" else 1,
        partition=config.partition, remat=config.remat,
        name=config.model if config.builtin_model else "pipeline")
