"""A distributed training step for custom training loops (without `fit`).

`TrainStep(model, loss_fn, optimizer, strategy, global_batch_size=...)` is
the step TensorFlow's custom-training-loop guide writes by hand, done once:

* **Loss over the global batch**: each replica's per-example losses are
  summed and divided by the global batch size
  (`tf.nn.compute_average_loss`), regularization losses by the number of
  replicas (`tf.nn.scale_regularization_loss`), so the all-reduced (summed)
  gradients are those of the global batch's mean loss, on one device,
  MirroredStrategy or MultiWorkerMirroredStrategy alike.
* **Several steps per call**: `steps_per_execution` steps in one
  `tf.function` call, in the loop that `fit` uses with 2+ replicas
  (`tfmulti.runtime.keras_fixes.run_steps`); the loss is reduced once per call.
* **Gradient accumulation**: `accumulate_steps=k` applies one update per
  global batch in k micro-batches per replica, exactly as
  `tfmulti.models.accumulation.accumulate_gradients` does for `fit` (the same code).
* **Mixed precision**: the loss goes through `optimizer.scale_loss` and
  `apply_gradients` unscales, so a `keras.optimizers.LossScaleOptimizer`
  works.

`run(step, dataset_from, steps=...)` trains a number of global steps in
calls of the step, and with a backup (`tfmulti.training.backup.Backup`) resumes in the
middle of an epoch: it uses only the backup's `resume_point()`,
`restore(point)` and `save(step)`. A call whose loss is NaN or infinite stops
it before the next save (`tfmulti.training.callbacks.check_loss`).

Example (one device; the same code runs under any strategy):

    >>> import keras, numpy as np, tensorflow as tf
    >>> from tfmulti.training import loops
    >>> strategy = tf.distribute.get_strategy()
    >>> with strategy.scope():
    ...     model = keras.Sequential([keras.Input((3,)), keras.layers.Dense(1)])
    ...     optimizer = keras.optimizers.SGD(0.1)
    >>> step = loops.TrainStep(model, keras.losses.MeanSquaredError(reduction=None),
    ...                        optimizer, strategy, global_batch_size=8, steps_per_execution=2)
    >>> x, y = np.ones((32, 3), "float32"), np.ones((32, 1), "float32")
    >>> result = loops.run(step, lambda s: tf.data.Dataset.from_tensor_slices((x, y))
    ...                    .batch(8).repeat().skip(s), steps=4)
    >>> len(result.losses), int(optimizer.iterations)
    (2, 4)
"""

from __future__ import annotations

import dataclasses
from typing import Callable

import keras
import tensorflow as tf

from tfmulti.models.accumulation import sum_gradients
from tfmulti.runtime.keras_fixes import run_steps
from tfmulti.training.callbacks import check_loss
from tfmulti.utils import human

__all__ = ["LoopResult", "TrainStep", "run"]


class TrainStep:
    """A distributed training step for a custom loop: call it on an iterator.

    Args:
        model: a built Keras model (any kind), created under `strategy.scope()`.
        loss_fn: (y_true, y_pred) -> one loss per example (shape [batch];
            trailing axes are averaged), e.g. a Keras loss with
            `reduction=None` or a plain function.
        optimizer (keras.optimizers.Optimizer): a Keras optimizer created under `strategy.scope()`
            (a `LossScaleOptimizer` for mixed float16).
        strategy (tf.distribute.Strategy | None): the model's strategy; None: the current one.
        global_batch_size: rows per update over all replicas (the batch of the
            dataset before distribution); divisible by replicas x
            `accumulate_steps`.
        steps_per_execution: training steps per `tf.function` call (default 1).
        accumulate_steps: micro-batches per update (default 1: none); each
            replica's batch is split into this many contiguous micro-batches,
            their gradients summed and applied once.

    Raises:
        ValueError: a count that is not a positive integer, a global batch not
            divisible by replicas x `accumulate_steps`, a model that is not
            built, or a model or optimizer created outside `strategy.scope()`.
    """

    def __init__(self, model: keras.Model, loss_fn: Callable, optimizer, strategy=None, *,
                 global_batch_size: int, steps_per_execution: int = 1,
                 accumulate_steps: int = 1):
        strategy = strategy or tf.distribute.get_strategy()
        for name, value in (("global_batch_size", global_batch_size),
                            ("steps_per_execution", steps_per_execution),
                            ("accumulate_steps", accumulate_steps)):
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                raise ValueError(f"`{name}` must be an integer >= 1, got {value!r}.")
        replicas = strategy.num_replicas_in_sync
        if global_batch_size % (replicas * accumulate_steps):
            raise ValueError(
                f"`global_batch_size` ({global_batch_size}) must be divisible by the "
                f"{human.count(replicas, 'replica')} x accumulate_steps ({accumulate_steps}); "
                f"use a "
                f"multiple of {replicas * accumulate_steps}.")
        if not model.built or not model.trainable_variables:
            raise ValueError(f"The model {model.name!r} has no variables yet; build it first "
                             f"(keras.Input, or call it on a batch under strategy.scope()).")
        _check_same_strategy(model, optimizer, strategy)
        self.model = model
        self.loss_fn = loss_fn
        self.optimizer = optimizer
        self.strategy = strategy
        self.global_batch_size = global_batch_size
        self.steps_per_execution = steps_per_execution
        self.accumulate_steps = accumulate_steps
        if not optimizer.built:
            with strategy.scope():
                optimizer.build(model.trainable_variables)
        self._function = tf.function(self._steps, autograph=False)

    def __repr__(self) -> str:
        return (f"TrainStep(model={self.model.name!r}, replicas="
                f"{self.strategy.num_replicas_in_sync}, global_batch_size="
                f"{self.global_batch_size}, steps_per_execution={self.steps_per_execution}, "
                f"accumulate_steps={self.accumulate_steps})")

    def distribute(self, dataset):
        """`dataset` ready for `__call__`: a `tf.data.Dataset` of global
        batches is distributed with `strategy.experimental_distribute_dataset`;
        a distributed dataset (or a `tfmulti.data.DistributedInput`) is
        returned as it is."""
        if isinstance(dataset, tf.data.Dataset):
            return self.strategy.experimental_distribute_dataset(dataset)
        return getattr(dataset, "dataset", dataset)

    def __call__(self, iterator, steps: int | None = None) -> tf.Tensor:
        """Trains up to `steps` (default `steps_per_execution`) global steps
        on batches from `iterator` (over `distribute(dataset)`).

        Returns:
            The mean over the steps run of each step's global mean loss.

        Raises:
            StopIteration: the iterator had no batch left.
        """
        steps = self.steps_per_execution if steps is None else steps
        if isinstance(steps, bool) or not isinstance(steps, int) or steps < 1:
            raise ValueError(f"`steps` must be an integer >= 1, got {steps!r}.")
        try:
            return self._function(iterator, steps)
        except tf.errors.OutOfRangeError:
            raise StopIteration from None

    def _steps(self, iterator, steps: int):
        done, totals = run_steps(
            lambda data, total: self.strategy.run(self._replica_step, args=(data, total)),
            iterator, steps, outputs=tf.constant(0.0))
        total = self.strategy.reduce(tf.distribute.ReduceOp.SUM, totals, axis=None)
        return total / tf.cast(done, total.dtype)

    def _replica_step(self, data, total):
        model, optimizer, k = self.model, self.optimizer, self.accumulate_steps

        def loss_fn(chunk):
            x, y, sample_weight = chunk
            y_pred = model(x, training=True)
            per_example = tf.cast(self.loss_fn(y, y_pred), tf.float32)
            if per_example.shape.rank == 0:
                raise ValueError(
                    "`loss_fn` returned one value for the whole batch; it must return one "
                    "loss per example (a Keras loss with reduction=None, or a function "
                    "without the mean over the batch).")
            if per_example.shape.rank > 1:
                axes = list(range(1, per_example.shape.rank))
                per_example = tf.reduce_mean(per_example, axis=axes)
            loss = tf.nn.compute_average_loss(per_example, sample_weight=sample_weight,
                                              global_batch_size=self.global_batch_size)
            if model.losses:
                regularization = tf.add_n([tf.cast(v, tf.float32) for v in model.losses])
                loss += tf.nn.scale_regularization_loss(regularization) / k
            return optimizer.scale_loss(loss), loss

        variables = model.trainable_variables
        gradients, loss = sum_gradients(
            loss_fn, keras.utils.unpack_x_y_sample_weight(data), variables, k)
        optimizer.apply_gradients(zip(gradients, variables))
        return total + loss


def _check_same_strategy(model, optimizer, strategy) -> None:
    default = not tf.distribute.has_strategy() and strategy is tf.distribute.get_strategy()
    built_under = getattr(model, "_distribute_strategy", None)
    if built_under is not strategy and not (default and built_under is None):
        raise ValueError(f"The model {model.name!r} was not built under this strategy's "
                         f"scope; build it inside `with strategy.scope():`.")
    inner = getattr(optimizer, "inner_optimizer", optimizer)  # a LossScaleOptimizer's
    if getattr(inner, "_distribution_strategy", strategy) is not strategy:
        raise ValueError("The optimizer was not created under this strategy's scope; create "
                         "it inside `with strategy.scope():`.")


@dataclasses.dataclass(frozen=True)
class LoopResult:
    """What `run` did: the mean loss of each call, and where it started."""

    losses: list[float]
    resumed_step: int
    steps: int


def run(train_step: TrainStep, dataset_from: Callable[[int], object], *, steps: int,
        backup=None, save_every: int | None = None) -> LoopResult:
    """Trains global steps up to `steps` in calls of `train_step`, resuming
    from `backup`.

    Args:
        train_step: the step.
        dataset_from: global step s -> the training data positioned at s (the
            batches an uninterrupted run trains from step s on), as a
            `tf.data.Dataset` of global batches, a distributed dataset or a
            `tfmulti.data.DistributedInput` (`distribute(..., skip_steps=s)`).
            It must not run out before `steps`.
        steps: the global step to train up to (not the number of steps left).
        backup (Backup | None): None, or an object with `resume_point()` (-> a point with a
            `.step`), `restore(point)` and `save(step)`, such as
            `tfmulti.training.backup.Backup`; every worker calls them at the same steps.
        save_every: with a backup, save after the call that reaches each
            multiple of this many steps (default: after every call), and at
            `steps`.

    Returns:
        A `LoopResult`.

    Raises:
        ValueError: `steps` or `save_every` not a positive integer, or a
            backup that is already past `steps`.
        tfmulti.training.callbacks.NonFiniteLoss: a call's loss was NaN or
            infinite (a `SystemExit` with code 65, after one line on stderr
            naming the steps and the backup's newest checkpoint); nothing was
            saved after the last finite call.
    """
    for name, value in (("steps", steps), ("save_every", save_every or 1)):
        if isinstance(value, bool) or not isinstance(value, int) or value < 1:
            raise ValueError(f"`{name}` must be an integer >= 1, got {value!r}.")
    start = 0
    if backup is not None:
        point = backup.resume_point()
        if point.step > steps:
            raise ValueError(f"The backup is at step {point.step}, past `steps` ({steps}); "
                             f"pass steps >= {point.step} or another backup directory.")
        backup.restore(point)
        start = point.step
    iterator = iter(train_step.distribute(dataset_from(start)))
    every = save_every or train_step.steps_per_execution
    losses, step = [], start
    while step < steps:
        n = min(train_step.steps_per_execution, steps - step)
        loss = float(train_step(iterator, n))
        # A NaN or infinite loss stops here, before a backup saves the weights it made.
        check_loss(loss, first_step=step + 1, last_step=step + n,
                   backup_dir=getattr(backup, "backup_dir", None))
        losses.append(loss)
        previous, step = step, step + n
        if backup is not None and (step == steps or step // every > previous // every):
            backup.save(step)
    return LoopResult(losses=losses, resumed_step=start, steps=step)
