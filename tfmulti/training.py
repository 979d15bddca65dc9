"""One training run from a config: the engine behind `recipes/train.py`.

Everything that can be checked is checked before anything is written, so a bad
configuration leaves `model_dir` untouched.

Example:
    >>> import tfmulti
    >>> from tfmulti.training import TrainConfig, train
    >>> metrics = train(TrainConfig(dataset="synthetic", num_examples=2048,
    ...                             epochs=1, global_batch_size=64,
    ...                             model_dir="/tmp/tfmulti_run"))
    >>> sorted(metrics)[:3]
    ['dataset', 'epoch_seconds', 'epochs_completed']
"""

from __future__ import annotations

import dataclasses
import json
import math
import os
import statistics
import sys
import tempfile
import time

STRATEGIES = ("auto", "one_device", "mirrored", "multi_worker", "pipeline", "hybrid")
MODEL_PARALLEL = ("pipeline", "hybrid")
MIXED_PRECISION = ("none", "bfloat16", "float16")
# The most training steps that steps_per_execution="auto" puts in one
# tf.function call: enough to amortize the per-call cost (seed 003's 3x),
# few enough that progress output, batch-level callbacks and a preemption
# (answered at the end of a call) stay prompt.
AUTO_STEPS_PER_EXECUTION = 32


def parse_steps_per_execution(value) -> int | str:
    """"auto" or a positive integer (also given as text, e.g. from a flag)."""
    if isinstance(value, str) and value.strip().lower() == "auto":
        return "auto"
    try:
        number = int(value) if isinstance(value, str) else value
    except ValueError:
        number = None
    if isinstance(number, bool) or not isinstance(number, int) or number < 1:
        raise ValueError(f"`steps_per_execution` must be 'auto' or a positive integer, got "
                         f"{value!r}.")
    return number


def resolve_steps_per_execution(value, steps_per_epoch: int | None,
                                backup_every_steps: int | None = None) -> int:
    """The steps per call for `value`: itself, or for "auto" the largest divisor
    of `steps_per_epoch` up to `AUTO_STEPS_PER_EXECUTION` (blocks must tile
    the epoch) that also divides `backup_every_steps` (backups come at the
    end of a call); 1 when the epoch length is unknown."""
    value = parse_steps_per_execution(value)
    if value != "auto":
        if steps_per_epoch and steps_per_epoch % value:
            raise ValueError(
                f"`steps_per_execution` ({value}) must divide the steps per epoch "
                f"({steps_per_epoch}): Keras runs whole blocks of steps, so an epoch would "
                f"train {-(-steps_per_epoch // value) * value} steps; use a divisor of "
                f"{steps_per_epoch}, 'auto', or another number of steps per epoch.")
        return value
    if not steps_per_epoch:
        return 1
    from tfmulti.diagnose import suggest_steps_per_execution

    return suggest_steps_per_execution(math.gcd(steps_per_epoch, backup_every_steps or 0),
                                       limit=AUTO_STEPS_PER_EXECUTION)


@dataclasses.dataclass
class TrainConfig:
    """A training run. Batch sizes are global (all replicas together).

    `mixed_precision` is "none" (float32, the default), "bfloat16" (CPUs and
    recent GPUs) or "float16" (GPUs only; loss scaling is automatic): variables
    stay float32 and the logits are float32. `jit_compile` compiles the train
    step with XLA (not with the placed pipeline/hybrid strategies).

    `steps_per_execution` is how many training steps run in one `tf.function`
    call: "auto" (the default) takes the largest divisor of the steps per
    epoch up to `AUTO_STEPS_PER_EXECUTION` (32) that also divides
    `backup_every_steps`, 1 when the epoch length is unknown. Batch-level
    callbacks and the progress bar see the end of each call; pass 1 where a
    callback must see every step.

    `backup_dir` makes the run resumable (see `tfmulti.backup`): a checkpoint at
    every epoch end and every `backup_every_steps` steps; rerunning the same
    config after a crash, SIGKILL or preemption resumes at the next step with
    the same data order (needs a `seed`). The backup is deleted when the run
    ends normally unless `keep_backup`.
    """

    strategy: str = "auto"
    num_virtual_devices: int = 0
    devices: tuple[str, ...] | None = None
    cross_device_ops: str = "auto"
    dataset: str = "fashion_mnist"
    data_dir: str | None = None
    download: bool = False
    num_examples: int | None = None
    model: str = "mlp"
    dropout: float = 0.2
    epochs: int = 5
    steps_per_epoch: int | None = None
    global_batch_size: int = 256
    learning_rate: float = 1e-3
    lr_scaling: str = "none"
    base_batch_size: int = 256
    warmup_epochs: float = 0.0
    optimizer: str = "adam"
    seed: int | None = 0
    steps_per_execution: int | str = "auto"
    num_stages: int = 2
    num_microbatches: int = 4
    num_replicas: int = 2
    partition: str = "params"
    remat: bool = False
    mixed_precision: str = "none"
    jit_compile: bool = False
    backup_dir: str | None = None
    backup_every_steps: int | None = None
    keep_backup: bool = False
    model_dir: str | None = None
    verbose: int | str = "auto"

    def validate(self) -> None:
        """Checks what needs no TensorFlow; raises ValueError naming the field."""
        from tfmulti import models

        if self.strategy not in STRATEGIES:
            raise ValueError(f"unknown strategy {self.strategy!r}; valid: {list(STRATEGIES)}.")
        for name in ("epochs", "global_batch_size", "base_batch_size"):
            value = getattr(self, name)
            if not isinstance(value, int) or value < 1:
                raise ValueError(f"`{name}` must be a positive integer, got {value!r}.")
        parse_steps_per_execution(self.steps_per_execution)
        if self.num_examples is not None and (
                not isinstance(self.num_examples, int) or self.num_examples < 1):
            raise ValueError(f"`num_examples` must be a positive integer (or unset), got "
                             f"{self.num_examples!r}.")
        if self.steps_per_epoch is not None and self.steps_per_epoch < 1:
            raise ValueError(
                f"`steps_per_epoch` must be positive (or unset for full epochs), "
                f"got {self.steps_per_epoch}."
            )
        if self.num_virtual_devices < 0:
            raise ValueError(
                f"`num_virtual_devices` must be >= 0 (0: leave devices as they are), "
                f"got {self.num_virtual_devices}."
            )
        models.model_task(self.model)
        models.scaled_learning_rate(self.learning_rate, self.global_batch_size,
                                    self.base_batch_size, self.lr_scaling)
        if self.optimizer not in models.OPTIMIZERS:
            raise ValueError(
                f"`optimizer` must be one of {list(models.OPTIMIZERS)}, got {self.optimizer!r}."
            )
        if not self.learning_rate > 0:
            raise ValueError(f"`learning_rate` must be positive, got {self.learning_rate}.")
        if self.warmup_epochs < 0:
            raise ValueError(f"`warmup_epochs` must be >= 0, got {self.warmup_epochs}.")
        if self.strategy in MODEL_PARALLEL:
            for name in ("num_stages", "num_microbatches", "num_replicas"):
                value = getattr(self, name)
                if not isinstance(value, int) or value < 1:
                    raise ValueError(f"`{name}` must be a positive integer, got {value!r}.")
            replicas = self.num_replicas if self.strategy == "hybrid" else 1
            if self.global_batch_size % (replicas * self.num_microbatches):
                raise ValueError(
                    f"`global_batch_size` ({self.global_batch_size}) must split into "
                    f"{replicas} replica(s) x {self.num_microbatches} micro-batches; use a "
                    f"multiple of {replicas * self.num_microbatches}.")
            if self.partition not in ("params", "flops", "time"):
                raise ValueError(f"`partition` must be 'params', 'flops' or 'time', got "
                                 f"{self.partition!r}.")
        if self.mixed_precision not in MIXED_PRECISION:
            raise ValueError(
                f"`mixed_precision` must be one of {list(MIXED_PRECISION)}, got "
                f"{self.mixed_precision!r}.")
        if self.jit_compile and self.strategy in MODEL_PARALLEL:
            raise ValueError(
                f"`jit_compile` cannot be used with strategy {self.strategy!r}: XLA would "
                f"compile the step as one cluster and collapse the per-stage device placement; "
                f"drop --jit_compile or use one_device/mirrored.")
        if self.backup_every_steps is not None and (
                not isinstance(self.backup_every_steps, int) or self.backup_every_steps < 1):
            raise ValueError(f"`backup_every_steps` must be a positive integer, got "
                             f"{self.backup_every_steps!r}.")
        if self.backup_every_steps and not self.backup_dir:
            raise ValueError("`backup_every_steps` needs `backup_dir`; pass "
                             "--backup_dir=DIR too.")
        if self.backup_dir is not None:
            if not self.backup_dir:
                raise ValueError("`backup_dir` is empty; pass a directory path.")
            if os.path.exists(self.backup_dir) and not os.path.isdir(self.backup_dir):
                raise ValueError(f"`backup_dir` {self.backup_dir!r} exists and is not a "
                                 "directory; pass a directory path.")
            if self.seed is None:
                raise ValueError("`backup_dir` needs a fixed `seed`: a resumed run skips the "
                                 "batches already trained, which must come in the same order; "
                                 "set --seed.")
        if self.model_dir and os.path.exists(self.model_dir) and not os.path.isdir(self.model_dir):
            raise ValueError(f"`model_dir` {self.model_dir!r} exists and is not a directory.")


class _EpochTimer:
    """Wall time of each epoch (a Keras callback, built lazily to keep imports light)."""

    def __new__(cls):
        import keras

        class EpochTimer(keras.callbacks.Callback):
            def __init__(self):
                super().__init__()
                self.seconds: list[float] = []

            def on_epoch_begin(self, epoch, logs=None):
                self._start = time.perf_counter()

            def on_epoch_end(self, epoch, logs=None):
                self.seconds.append(time.perf_counter() - self._start)

        return EpochTimer()


def _write_json_atomic(path: str, payload: dict) -> None:
    folder = os.path.dirname(path)
    fd, tmp = tempfile.mkstemp(dir=folder, prefix=".tmp-", suffix=".json")
    os.fchmod(fd, 0o644)
    with os.fdopen(fd, "w") as f:
        json.dump(payload, f, indent=2, sort_keys=True)
        f.write("\n")
    os.replace(tmp, path)


def _save_model_atomic(model, path: str) -> None:
    folder = os.path.dirname(path)
    tmp = os.path.join(folder, f".tmp-{os.getpid()}-model.keras")
    try:
        model.save(tmp)
        os.replace(tmp, path)
    finally:
        if os.path.exists(tmp):
            os.remove(tmp)


def train(config: TrainConfig, callbacks=()) -> dict:
    """Trains, evaluates on the test split, and writes results to `model_dir`.

    Writes `<model_dir>/metrics.json`, `<model_dir>/model.keras` and TensorBoard
    logs under `<model_dir>/logs` (when `model_dir` is set). In a multi-worker
    cluster only the chief writes and shows progress; the others write nothing.

    Args:
        config: the run.
        callbacks: extra Keras callbacks for `fit`.

    Returns:
        The metrics: test loss/accuracy (or MAE), examples per second, replica
        count, strategy, epochs completed, and the effective learning rate.

    Raises:
        ValueError: a bad configuration (nothing is written then).
        RuntimeError: virtual devices requested after TensorFlow started.
        tfmulti.data.DataNotFoundError: the dataset is not available offline.
    """
    config.validate()
    from tfmulti import cluster, devices

    # Only the chief writes: metrics, model and TensorBoard logs.
    chief = cluster.is_chief(cluster.from_environ())

    if config.num_virtual_devices:
        devices.configure_virtual_devices(config.num_virtual_devices)
    _check_mixed_precision_devices(config.mixed_precision)
    import keras

    policy = {"bfloat16": "mixed_bfloat16", "float16": "mixed_float16"}.get(
        config.mixed_precision, "float32")
    # Set before building: layers take the global policy when created. Keras
    # wraps the optimizer in a LossScaleOptimizer itself for mixed_float16.
    previous = keras.mixed_precision.global_policy()
    keras.mixed_precision.set_global_policy(policy)
    try:
        return _train(config, chief, list(callbacks))
    finally:  # library callers keep their own policy
        keras.mixed_precision.set_global_policy(previous)


def _check_mixed_precision_devices(mixed_precision: str) -> None:
    """float16 needs a GPU: CPUs have no fast float16 kernels (bfloat16 instead)."""
    if mixed_precision != "float16":
        return
    import tensorflow as tf

    if not tf.config.list_physical_devices("GPU"):
        raise ValueError(
            "`mixed_precision='float16'` needs a GPU and none was found; use "
            "--mixed_precision=bfloat16 on CPUs.")


def _train(config: TrainConfig, chief: bool, extra_callbacks: list) -> dict:
    """`train` after the device set-up, under the mixed-precision policy."""
    from tfmulti import cluster, data, models, strategy as strategy_lib

    model_parallel = config.strategy in MODEL_PARALLEL
    if model_parallel:
        import tensorflow as tf

        strategy = tf.distribute.get_strategy()  # placement is manual, per stage
    else:
        strategy = strategy_lib.get_strategy(
            config.strategy, devices=list(config.devices) if config.devices else None,
            cross_device_ops=config.cross_device_ops,
        )
    data_dir = config.data_dir or data.default_data_dir()
    train_ds = data.load(config.dataset, "train", data_dir=data_dir,
                         download=config.download, num_examples=config.num_examples)
    test_ds = data.load(config.dataset, "test", data_dir=data_dir, download=config.download,
                        num_examples=config.num_examples and max(config.num_examples // 4, 1))
    info = data.dataset_info(config.dataset, data_dir)
    task = models.model_task(config.model)
    if task != info["task"]:
        raise ValueError(
            f"model {config.model!r} does {task} but dataset {config.dataset!r} is a "
            f"{info['task']} dataset; use "
            + ("--dataset=synthetic_regression" if task == "regression" else "--model=mlp or cnn")
            + "."
        )
    train_input = data.distribute(train_ds, strategy, config.global_batch_size,
                                  training=True, seed=config.seed)
    test_input = data.distribute(test_ds, strategy, config.global_batch_size, training=False)
    steps_per_epoch = config.steps_per_epoch or train_input.steps_per_epoch
    spe = resolve_steps_per_execution(config.steps_per_execution, steps_per_epoch,
                                      config.backup_every_steps)
    model = models.build_model(
        config.model, strategy=None if model_parallel else strategy,
        input_shape=info["input_shape"], num_classes=info["num_classes"] or 1,
        dropout=config.dropout, seed=config.seed,
    )
    if model_parallel:
        from tfmulti.parallel import PipelineModel, format_memory

        model = PipelineModel(
            model, devices=list(config.devices) if config.devices else None,
            num_stages=config.num_stages, num_microbatches=config.num_microbatches,
            num_replicas=config.num_replicas if config.strategy == "hybrid" else 1,
            partition=config.partition, remat=config.remat, name=config.model)
    models.compile_model(
        model, strategy=None if model_parallel else strategy, task=task,
        optimizer=config.optimizer,
        learning_rate=config.learning_rate, lr_scaling=config.lr_scaling,
        global_batch_size=config.global_batch_size, base_batch_size=config.base_batch_size,
        warmup_epochs=config.warmup_epochs, steps_per_epoch=steps_per_epoch,
        steps_per_execution=spe,
        jit_compile=config.jit_compile,
    )
    # All checks passed: from here on we write.
    import keras

    timer = _EpochTimer()
    callbacks = [timer, *extra_callbacks]
    writes = bool(config.model_dir) and chief
    if writes:
        os.makedirs(config.model_dir, exist_ok=True)
        callbacks.append(keras.callbacks.TensorBoard(os.path.join(config.model_dir, "logs")))
    verbose = config.verbose
    if verbose == "auto":
        verbose = 0 if not chief else 1 if sys.stdout.isatty() else 2
    if model_parallel:
        replicas = model.num_replicas
        print(f"tfmulti: {config.strategy}: {replicas} replica(s) x {model.num_stages} stages "
              f"on {[d for r in model.stage_devices for d in r]}; global batch "
              f"{config.global_batch_size} = {replicas} x {config.num_microbatches} "
              f"micro-batches of {config.global_batch_size // replicas // config.num_microbatches}"
              f"; {steps_per_epoch} steps/epoch, {spe} per call\n{model.plan.table()}\n"
              f"{format_memory(model.memory_report(config.global_batch_size))}", flush=True)
    else:
        print(f"tfmulti: {strategy_lib.describe(strategy)}; global batch "
              f"{config.global_batch_size} = {train_input.num_replicas} x "
              f"{train_input.per_replica_batch_size}; {steps_per_epoch} steps/epoch, {spe} per "
              f"call", flush=True)
    resumed_step = 0
    if config.backup_dir:
        from tfmulti import backup

        if not train_input.repeats:
            raise ValueError(f"`backup_dir` needs training data of known size; dataset "
                             f"{config.dataset!r} has none.")

        def dataset_from(step: int):
            return data.distribute(train_ds, strategy, config.global_batch_size,
                                   training=True, seed=config.seed, skip_steps=step).dataset

        result = backup.fit(model, dataset_from, epochs=config.epochs,
                            steps_per_epoch=steps_per_epoch, backup_dir=config.backup_dir,
                            save_every_steps=config.backup_every_steps,
                            delete_on_success=False,  # after evaluation and writing, below
                            callbacks=callbacks,
                            verbose=verbose)
        history, resumed_step = result.history, result.resumed_step
    else:
        fit_kwargs = train_input.fit_kwargs()
        if config.steps_per_epoch:
            fit_kwargs["steps_per_epoch"] = config.steps_per_epoch
        history = model.fit(**fit_kwargs, epochs=config.epochs, callbacks=callbacks,
                            verbose=verbose).history
    results = model.evaluate(**test_input.evaluate_kwargs(), return_dict=True, verbose=0)
    epoch_seconds = timer.seconds
    steady = epoch_seconds[1:] or epoch_seconds
    examples_per_epoch = steps_per_epoch * config.global_batch_size
    metrics = {
        "strategy": (config.strategy if model_parallel
                     else strategy_lib.strategy_name(strategy)),
        "num_replicas": model.num_replicas if model_parallel else strategy.num_replicas_in_sync,
        "num_workers": cluster.num_tasks(cluster.from_environ() or {"cluster": {"worker": [0]}}),
        "dataset": config.dataset,
        "model": config.model,
        "global_batch_size": config.global_batch_size,
        "per_replica_batch_size": (config.global_batch_size // model.num_replicas
                                   if model_parallel else train_input.per_replica_batch_size),
        "learning_rate": models.scaled_learning_rate(
            config.learning_rate, config.global_batch_size, config.base_batch_size,
            config.lr_scaling),
        "epochs_completed": resumed_step // steps_per_epoch + len(history.get("loss", [])),
        "resumed_from_step": resumed_step,
        "steps_per_epoch": steps_per_epoch,
        "steps_per_execution": spe,
        "mixed_precision": config.mixed_precision,
        "jit_compile": config.jit_compile,
        "train_seconds": sum(epoch_seconds),
        "epoch_seconds": [float(t) for t in epoch_seconds],  # this run's epochs
        "examples_per_second": (examples_per_epoch / statistics.median(steady)
                                if steady else None),  # None: nothing left to train
        "train_loss": history["loss"][-1] if history.get("loss") else None,
        "test_loss": results["loss"],
    }
    if task == "classification":
        metrics["train_accuracy"] = (history["accuracy"][-1] if history.get("accuracy")
                                     else None)
        metrics["test_accuracy"] = results["accuracy"]
    else:
        metrics["test_mae"] = results["mae"]
    if model_parallel:
        metrics.update(num_stages=model.num_stages, num_microbatches=model.num_microbatches,
                       partition_sizes=list(model.plan.sizes),
                       partition_balance=model.plan.balance)
    metrics = {k: (float(v) if hasattr(v, "__float__") and not isinstance(v, (int, str, list))
                   else v)
               for k, v in metrics.items()}
    if writes:
        _write_json_atomic(os.path.join(config.model_dir, "metrics.json"), metrics)
        # A pipeline is saved unpartitioned: a plain Keras model anyone can load.
        _save_model_atomic(model.to_sequential(name=config.model) if model_parallel else model,
                           os.path.join(config.model_dir, "model.keras"))
        print(f"tfmulti: wrote metrics.json, model.keras and logs/ to {config.model_dir}",
              flush=True)
    if config.backup_dir and chief and not config.keep_backup:
        # Only now: a crash during evaluation or the writes above resumes from
        # the finished backup instead of training again.
        from tfmulti import backup

        backup.delete(config.backup_dir)
    return metrics
