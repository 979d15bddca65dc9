"""The benchmarks' instruments: what the suites hold tfmulti against, and their clocks.

* `CustomLoop`: a hand-written `tf.distribute` training loop, the reference
  `fit` is held to (the overhead suite);
* `costly_batch_map`: a deterministic per-batch host cost of tunable size
  (the streaming suite);
* `InterleavedClock`: `time_fit`'s epoch clock, running other work between
  the timed epochs (the overhead suite interleaves the loop there);
* `EpochStepTimer`: seconds per step of each epoch, from its begin to its
  end, and `interleaved_step_seconds`, several models timed in turn by it
  (the pipeline and tensor suites);
* `TimeToAccuracy`: the clock of a race to a test accuracy (the baseline
  suite).

This module imports TensorFlow: import it inside a worker process, after
its devices and threads are configured.
"""

from __future__ import annotations

import statistics
import time
from typing import Callable

import keras
import numpy as np
import tensorflow as tf

from tfmulti.utils import checks
from tfmulti.insight.timing import EpochClock
from tfmulti.training.callbacks import EpochTimer

__all__ = ["CustomLoop", "EpochStepTimer", "InterleavedClock", "TimeToAccuracy",
           "costly_batch_map", "interleaved_step_seconds"]


class CustomLoop:
    """A hand-written `tf.distribute` training loop: the reference `fit` is held to.

    It follows TensorFlow's "Custom training with tf.distribute.Strategy"
    tutorial: per-example sparse cross-entropy on logits averaged over the
    global batch (`tf.nn.compute_average_loss`), gradients applied inside
    `strategy.run` (the optimizer all-reduces them), accuracy tracked, and
    `steps_per_execution` steps per `tf.function` call over a distributed
    iterator (a `tf.range` loop, no Python between steps). It does the work
    of `fit` on a model compiled by `tfmulti.models.builders.compile_model` for
    classification: with SGD both reach the same weights (benchmarks/tests/test_bench.py).

    Args:
        model: a classifier built under `strategy` (logits out).
        strategy: the strategy the model was built under.
        optimizer: a Keras optimizer created under `strategy.scope()`.
        global_batch_size: examples per step over all replicas.
        steps_per_execution: training steps per `tf.function` call.
    """

    def __init__(self, model: keras.Model, strategy: tf.distribute.Strategy,
                 optimizer: keras.optimizers.Optimizer, global_batch_size: int,
                 steps_per_execution: int):
        checks.positive_int("global_batch_size", global_batch_size)
        checks.positive_int("steps_per_execution", steps_per_execution)
        self.model, self.strategy, self.optimizer = model, strategy, optimizer
        self.global_batch_size = global_batch_size
        self.steps_per_execution = steps_per_execution
        with strategy.scope():
            self.accuracy = keras.metrics.SparseCategoricalAccuracy(name="accuracy")
            # Slots before the first call: variables created inside a
            # tf.function's loop would need a conditional initialisation.
            optimizer.build(model.trainable_variables)
        self._loss = keras.losses.SparseCategoricalCrossentropy(from_logits=True,
                                                                reduction="none")
        self._run = tf.function(self._steps)

    def __repr__(self) -> str:
        return (f"CustomLoop(model={self.model.name!r}, replicas="
                f"{self.strategy.num_replicas_in_sync}, global_batch_size="
                f"{self.global_batch_size}, steps_per_execution={self.steps_per_execution})")

    def _step(self, x, y):
        with tf.GradientTape() as tape:
            logits = self.model(x, training=True)
            loss = tf.nn.compute_average_loss(self._loss(y, logits),
                                              global_batch_size=self.global_batch_size)
        grads = tape.gradient(loss, self.model.trainable_variables)
        self.optimizer.apply_gradients(zip(grads, self.model.trainable_variables))
        self.accuracy.update_state(y, logits)
        return loss

    def _steps(self, iterator):
        total = tf.constant(0.0)
        for _ in tf.range(self.steps_per_execution):
            x, y = next(iterator)
            per_replica = self.strategy.run(self._step, args=(x, y))
            total += self.strategy.reduce("SUM", per_replica, axis=None)
        return total / self.steps_per_execution

    def train(self, iterator, calls: int) -> float:
        """Runs `calls` calls of `steps_per_execution` steps; returns the last
        call's mean loss (a float, so the work is done when this returns)."""
        checks.positive_int("calls", calls)
        loss = None
        for _ in range(calls):
            loss = self._run(iterator)
        return float(loss)


def costly_batch_map(rounds: int, width: int = 128, seed: int = 0) -> Callable:
    """A deterministic, CPU-heavy per-batch transform with a tunable cost.

    Each round maps the flattened features through a fixed random projection
    to `width` units and back (two matmuls and a tanh), so the cost grows
    linearly with `rounds`; the output has the input's shape and dtype and
    depends only on the input. For `data.distribute(batch_map_fn=...)`: it
    runs after the cache, every epoch, like augmentation. Rounds 0: identity.
    """
    checks.non_negative_int("rounds", rounds)
    checks.positive_int("width", width)
    rng = np.random.default_rng(seed)
    cache: dict[int, tuple[np.ndarray, np.ndarray]] = {}

    def fn(x, y):
        if rounds == 0:
            return x, y
        features = int(np.prod(x.shape[1:]))
        if features not in cache:
            cache[features] = (
                (rng.standard_normal((features, width)) / np.sqrt(features)).astype(np.float32),
                (rng.standard_normal((width, features)) / np.sqrt(width)).astype(np.float32))
        down, up = (tf.constant(w) for w in cache[features])
        z = tf.reshape(tf.cast(x, tf.float32), [-1, features])
        for _ in range(rounds):
            z = tf.tanh(tf.matmul(tf.tanh(tf.matmul(z, down)), up))
        return tf.cast(tf.reshape(z, [-1, *x.shape[1:]]), x.dtype), y

    return fn


class InterleavedClock(EpochClock):
    """`time_fit`'s epoch clock that calls `work()` after each epoch, outside
    the timed spans: another measurement interleaved with fit's epochs, so
    that a machine's drift hits both alike.

    Example:
        timing.time_fit(model, dist, steps, epochs=5, clock=InterleavedClock(loop_block))
    """

    def __init__(self, work: Callable[[], None]):
        super().__init__()
        if not callable(work):
            raise ValueError(f"`work` must be callable, got {work!r}.")
        self._work = work

    def between_epochs(self) -> None:
        self._work()


class EpochStepTimer(EpochTimer):
    """Seconds per step of each epoch, from its begin to its end, appended to
    `seconds_per_step` (a list that may be shared and cleared by the caller).

    Args:
        steps: steps per epoch.
        seconds_per_step: where to append; default a new list.
    """

    def __init__(self, steps: int, seconds_per_step: list | None = None):
        super().__init__(seconds_per_step)
        self.steps = checks.positive_int("steps", steps)

    @property
    def seconds_per_step(self) -> list:
        return self.seconds

    def _elapsed(self, seconds: float) -> float:
        return seconds / self.steps


def interleaved_step_seconds(models: dict, dataset, steps: int, repeats: int,
                             epochs: int) -> dict:
    """Seconds per training step of compiled models, interleaved so that a
    machine's drift hits them alike: each model trains one epoch first
    (builds, traces), then per repeat every model trains `epochs` epochs of
    `steps` steps in turn; a repeat's figure is its median epoch's.

    Returns:
        name -> one figure per repeat.
    """
    for model in models.values():
        model.fit(dataset, steps_per_epoch=steps, epochs=1, verbose=0)
    results = {name: [] for name in models}
    times: list[float] = []
    for _ in range(repeats):
        for name, model in models.items():
            times.clear()
            model.fit(dataset, steps_per_epoch=steps, epochs=epochs, verbose=0,
                      callbacks=[EpochStepTimer(steps, times)])
            results[name].append(statistics.median(times))
    return results


class TimeToAccuracy:
    """Clock of a time-to-accuracy run: training time per epoch (up to the
    evaluation), wall time at each evaluation, first crossing of `target`.

    `start()` starts the clock; `callback(accuracy_of)` is the Keras callback
    that records each epoch, evaluating with `accuracy_of(logs)` and stopping
    training at the first epoch reaching `target`; `result(examples)` is the
    record.
    """

    def __init__(self, target: float):
        self.target = checks.finite_number("target", target, minimum=0)
        self.t0 = None
        self.train_seconds: list[float] = []
        self.accuracy: list[float] = []
        self.wall: list[float] = []
        self.time_to_accuracy = None

    def start(self) -> None:
        self.t0 = time.perf_counter()
        self.train_seconds, self.accuracy, self.wall = [], [], []
        self.time_to_accuracy = None

    def callback(self, accuracy_of: Callable[[dict], float]) -> keras.callbacks.Callback:
        if self.t0 is None:
            raise RuntimeError("TimeToAccuracy.callback needs start() first.")
        return _RaceCallback(self, accuracy_of)

    def result(self, examples_per_epoch: int) -> dict:
        return {"time_to_accuracy": self.time_to_accuracy,
                "epochs_to_accuracy": len(self.accuracy) if self.time_to_accuracy else None,
                "accuracy_per_epoch": self.accuracy, "wall_seconds_per_epoch": self.wall,
                "train_seconds_per_epoch": self.train_seconds,
                "examples_per_second": (examples_per_epoch / self.train_seconds[1]
                                        if len(self.train_seconds) > 1 else None)}


class _RaceCallback(keras.callbacks.Callback):
    def __init__(self, race: TimeToAccuracy, accuracy_of):
        super().__init__()
        self._race, self._accuracy_of = race, accuracy_of
        self._begin, self._trained = None, False

    def _end_training(self):
        if not self._trained:
            self._race.train_seconds.append(time.perf_counter() - self._begin)
            self._trained = True

    def on_epoch_begin(self, epoch, logs=None):
        self._begin = time.perf_counter()
        self._trained = False

    def on_test_begin(self, logs=None):  # fit's own validation starts
        self._end_training()

    def on_epoch_end(self, epoch, logs=None):
        self._end_training()
        race = self._race
        accuracy = float(self._accuracy_of(logs))
        race.accuracy.append(accuracy)
        race.wall.append(time.perf_counter() - race.t0)
        if accuracy >= race.target and race.time_to_accuracy is None:
            race.time_to_accuracy = race.wall[-1]
            self.model.stop_training = True
