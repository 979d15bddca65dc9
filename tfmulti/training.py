"""One training run from a config: the engine behind `recipes/train.py`.

Everything that can be checked is checked before anything is written, so a bad
configuration leaves `model_dir` untouched.

Example:
    >>> from tfmulti.config import TrainConfig
    >>> from tfmulti.training import train
    >>> metrics = train(TrainConfig(dataset="synthetic", num_examples=2048, epochs=1,
    ...                             global_batch_size=64, verbose=0))  # doctest: +ELLIPSIS
    tfmulti: ...
    >>> metrics["epochs_completed"], "test_accuracy" in metrics
    (1, True)
"""

from __future__ import annotations

import os
import statistics
import sys

import keras

from tfmulti import backup, footprint, models, runs
from tfmulti._io import write_json_atomic
from tfmulti.insight import timing
from tfmulti import strategy as strategy_lib
from tfmulti.cluster import tf_config
from tfmulti.config import TrainConfig

__all__ = ["train"]


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
        count, distribution, epochs completed, and the effective learning rate.

    Raises:
        ValueError: a bad configuration (nothing is written then).
        RuntimeError: virtual devices requested after TensorFlow started.
        tfmulti.data.DataNotFoundError: the dataset is not available offline.
    """
    environ = tf_config.from_environ()
    chief = tf_config.is_chief(environ)  # only the chief writes
    run = runs.build_run(config)  # validates the config first
    model = run.model
    if config.backup_dir and not run.train_input.repeat:
        raise ValueError(f"`backup_dir` needs training data of known size; dataset "
                         f"{config.dataset!r} has none.")
    # All checks passed: from here on we write.
    timer = timing.EpochTimer()
    all_callbacks = [timer, *callbacks]
    writes = bool(config.model_dir) and chief
    if writes:
        os.makedirs(config.model_dir, exist_ok=True)
        all_callbacks.append(keras.callbacks.TensorBoard(os.path.join(config.model_dir, "logs")))
    verbose = config.verbose
    if verbose == "auto":
        verbose = 0 if not chief else 1 if sys.stdout.isatty() else 2
    print(f"tfmulti: {run.describe()}", flush=True)
    if config.model_parallel:
        print(f"{model.plan.table()}\n"
              f"{footprint.format_footprint(model.memory_report(config.global_batch_size))}",
              flush=True)
    resumed_step = 0
    if config.backup_dir:
        result = backup.fit(model, run.dataset_from, epochs=config.epochs,
                            steps_per_epoch=run.steps_per_epoch, backup_dir=config.backup_dir,
                            save_every_steps=config.backup_every_steps,
                            delete_on_success=False,  # after evaluation and writing, below
                            callbacks=all_callbacks, verbose=verbose)
        history, resumed_step = result.history, result.resumed_step
    else:
        fit_kwargs = run.train_input.fit_kwargs()
        if config.steps_per_epoch:
            fit_kwargs["steps_per_epoch"] = config.steps_per_epoch
        history = model.fit(**fit_kwargs, epochs=config.epochs, callbacks=all_callbacks,
                            verbose=verbose).history
    results = model.evaluate(**run.test_input.evaluate_kwargs(), return_dict=True, verbose=0)
    metrics = _metrics(run, history, results, timer.seconds, resumed_step,
                       tf_config.num_tasks(environ) if environ else 1)
    if writes:
        write_json_atomic(os.path.join(config.model_dir, "metrics.json"), metrics,
                          sort_keys=True)
        # A pipeline is saved unpartitioned: a plain Keras model anyone can load.
        _save_model_atomic(model.to_sequential(name=config.model) if config.model_parallel
                           else model, os.path.join(config.model_dir, "model.keras"))
        print(f"tfmulti: wrote metrics.json, model.keras and logs/ to {config.model_dir}",
              flush=True)
    if config.backup_dir and chief and not config.keep_backup:
        # Only now: a crash during evaluation or the writes above resumes from
        # the finished backup instead of training again.
        backup.delete(config.backup_dir)
    return metrics


def _metrics(run: runs.Run, history: dict, results: dict, epoch_seconds: list[float],
             resumed_step: int, num_workers: int) -> dict:
    config, model = run.config, run.model
    steady = epoch_seconds[1:] or epoch_seconds
    examples_per_epoch = run.steps_per_epoch * config.global_batch_size
    metrics = {
        "distribution": (config.distribution if config.model_parallel
                         else strategy_lib.strategy_name(run.strategy)),
        "num_replicas": run.num_replicas,
        "num_workers": num_workers,
        "dataset": config.dataset,
        "model": config.model,
        "global_batch_size": config.global_batch_size,
        "per_replica_batch_size": run.per_replica_batch_size,
        "learning_rate": models.scaled_learning_rate(
            config.learning_rate, config.global_batch_size, config.base_batch_size,
            config.lr_scaling),
        "epochs_completed": resumed_step // run.steps_per_epoch + len(history.get("loss", [])),
        "resumed_from_step": resumed_step,
        "steps_per_epoch": run.steps_per_epoch,
        "steps_per_execution": run.steps_per_execution,
        "mixed_precision": config.mixed_precision,
        "jit_compile": config.jit_compile,
        "train_seconds": sum(epoch_seconds),
        "epoch_seconds": [float(t) for t in epoch_seconds],  # this run's epochs
        "examples_per_second": (examples_per_epoch / statistics.median(steady)
                                if steady else None),  # None: nothing left to train
        "train_loss": history["loss"][-1] if history.get("loss") else None,
        "test_loss": results["loss"],
    }
    if config.task == "classification":
        metrics["train_accuracy"] = (history["accuracy"][-1] if history.get("accuracy")
                                     else None)
        metrics["test_accuracy"] = results["accuracy"]
    else:
        metrics["test_mae"] = results["mae"]
    if config.model_parallel:
        metrics.update(num_stages=model.num_stages, num_microbatches=model.num_microbatches,
                       partition_sizes=list(model.plan.sizes),
                       partition_balance=model.plan.balance)
    return {k: (float(v) if hasattr(v, "__float__") and not isinstance(v, (int, str, list))
                else v) for k, v in metrics.items()}
