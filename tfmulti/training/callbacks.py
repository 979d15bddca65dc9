"""Keras callbacks tfmulti adds to a run, and the stop on a non-finite loss.

`ProfileSteps` writes a TensorBoard profile of a range of global steps
(`profile_steps`), counted by the optimizer's iterations, so that the range
means the same steps with several steps per call and in a resumed run.

A training loss that turns NaN or infinite (NaN in the data, a diverging
learning rate) stops training at once (`StopOnNonFiniteLoss` under `fit`,
`tfmulti.training.loops.run` in a custom loop): one line on stderr names the
steps, the value and the last good backup, and `NonFiniteLoss` (a
`SystemExit` with code `NON_FINITE_LOSS`, 65) ends the process, so nothing
after it (a backup, `model.keras`, `metrics.json`) is written from NaN weights.

Example:
    >>> import keras, numpy as np
    >>> from tfmulti.training.callbacks import EpochTimer
    >>> model = keras.Sequential([keras.Input((2,)), keras.layers.Dense(1)])
    >>> model.compile("sgd", "mse")
    >>> timer = EpochTimer()
    >>> _ = model.fit(np.zeros((8, 2)), np.zeros(8), epochs=2, verbose=0, callbacks=[timer])
    >>> len(timer.seconds)
    2
"""

from __future__ import annotations

import math
import os
import sys
import time

import keras
import tensorflow as tf

from tfmulti.cluster import exit_codes
from tfmulti.data.service import ServiceWatch
from tfmulti.training import backup as backup_lib

__all__ = ["EpochTimer", "WatchService", "NON_FINITE_LOSS", "NonFiniteLoss", "ProfileSteps",
           "StopOnNonFiniteLoss", "check_loss"]

NON_FINITE_LOSS = exit_codes.NON_FINITE_LOSS
"""The exit code of a run stopped by a NaN or infinite training loss (65)."""


class WatchService(keras.callbacks.Callback):
    """Stops the process when a training step waits longer than its timeout
    for its batch from the tf.data service (`tfmulti.data.service.ServiceWatch`)."""

    def __init__(self, address: str, timeout_s: float):
        super().__init__()
        self.address, self.timeout_s = address, timeout_s
        self._watch = None

    def on_train_begin(self, logs=None):
        self._watch = ServiceWatch(self.address, self.timeout_s).start()

    def _progress(self, *_, **__):
        if self._watch is not None:
            self._watch.progress()

    on_train_batch_end = on_test_batch_end = on_epoch_end = on_test_end = _progress

    def on_train_end(self, logs=None):
        if self._watch is not None:
            self._watch.stop()
            self._watch = None


class EpochTimer(keras.callbacks.Callback):
    """Wall time of each epoch, from its begin to its end, appended to
    `seconds` (a list that may be shared with the caller; default a new one)."""

    def __init__(self, seconds: list | None = None):
        super().__init__()
        self.seconds = [] if seconds is None else seconds
        self._begin = None

    def on_epoch_begin(self, epoch, logs=None):
        self._begin = time.perf_counter()

    def on_epoch_end(self, epoch, logs=None):
        self.seconds.append(self._elapsed(time.perf_counter() - self._begin))

    def _elapsed(self, seconds: float) -> float:
        """What is recorded for an epoch of `seconds` (a subclass may rescale it)."""
        return seconds


class NonFiniteLoss(SystemExit):
    """The training loss became NaN or infinite: training stopped, and the
    process exits with `NON_FINITE_LOSS` (65) unless the caller catches it.
    `str()` is the one-line message (already printed on stderr)."""

    code_on_exit = NON_FINITE_LOSS

    def __init__(self, message: str):
        super().__init__(self.code_on_exit)
        self.message = message

    def __str__(self) -> str:
        return self.message


def _last_backup(backup_dir: str) -> str:
    """Where the newest checkpoint in `backup_dir` is, in words (for the message)."""
    try:
        newest = backup_lib.checkpoints(backup_dir)
    except OSError as e:  # the loss's line still comes first, naming what failed here
        return f"the backups in {backup_dir} cannot be listed ({e})"
    if not newest:
        return f"no backup was saved in {backup_dir} before it"
    step = os.path.basename(newest[0]).rsplit("-", 1)[-1]
    return f"the last good backup is {newest[0]} (global step {step})"


def check_loss(loss, *, first_step: int, last_step: int, epoch: int | None = None,
               backup_dir: str | None = None) -> None:
    """Stops training when `loss` (a number or scalar tensor: the mean loss of
    global steps `first_step` to `last_step`, or of the epoch so far) is NaN or
    infinite; does nothing when it is finite.

    Args:
        loss: the training loss.
        first_step, last_step: the global steps (counted from 1) it covers last.
        epoch: the epoch (counted from 0), when there are epochs.
        backup_dir: the run's backup directory, whose newest checkpoint the
            message names.

    Raises:
        NonFiniteLoss: the loss is NaN or infinite (its line is printed on
            stderr first).
    """
    value = float(loss)
    if math.isfinite(value):
        return
    where = (f"global step {last_step}" if first_step >= last_step else
             f"global steps {first_step}-{last_step} (one call of "
             f"{last_step - first_step + 1} steps)")
    if epoch is not None:
        where = f"epoch {epoch + 1}, {where}"
    message = (f"error: the training loss is {value} at {where}; training stopped with exit "
               f"code {NON_FINITE_LOSS} and saved nothing from this step on"
               + (f"; {_last_backup(backup_dir)}" if backup_dir else "")
               + "; look for NaN or infinite values in the features and labels, or lower "
               "the learning rate.")
    print(f"tfmulti: {message}", file=sys.stderr, flush=True)
    raise NonFiniteLoss(message)


class StopOnNonFiniteLoss(keras.callbacks.Callback):
    """Stops `fit` at the first call of steps whose training loss is NaN or
    infinite (`check_loss`: one line, then `NonFiniteLoss`).

    The `loss` of `fit`'s logs is the mean of the epoch so far, so a
    non-finite step keeps it non-finite: with `steps_per_execution` > 1 the
    step is found within the call that ran it. Put this callback before those
    that save (a backup, `ModelCheckpoint`): they then never save the NaN
    weights. Keras's `TerminateOnNaN` only sets `stop_training`, after which
    the caller would save and publish the NaN model.

    Args:
        backup_dir: the run's backup directory (named in the message), or None.
    """

    def __init__(self, backup_dir: str | None = None):
        super().__init__()
        self.backup_dir = backup_dir
        self._epoch = None
        self._begin = 0

    def on_epoch_begin(self, epoch, logs=None):
        self._epoch = epoch

    def on_train_batch_begin(self, batch, logs=None):
        self._begin = batch

    def on_train_batch_end(self, batch, logs=None):
        logs = logs or {}
        # Keras' "loss"; a train_step of the user's may log only losses of its
        # own (a GAN's d_loss and g_loss): each is checked.
        losses = [logs["loss"]] if "loss" in logs else [
            value for name, value in sorted(logs.items()) if name.endswith("_loss")]
        if not losses:
            return
        steps = batch - self._begin + 1
        iterations = getattr(getattr(self.model, "optimizer", None), "iterations", None)
        last = int(keras.ops.convert_to_numpy(iterations)) if iterations is not None else 0
        if last < steps:  # an optimizer the model's own train_step does not use
            last = batch + 1
        for loss in losses:
            if getattr(loss, "shape", ()) in ((), None):
                check_loss(loss, first_step=last - steps + 1, last_step=last,
                           epoch=self._epoch, backup_dir=self.backup_dir)


def _global_step(model) -> int:
    """The optimizer updates made so far (the global step)."""
    return int(keras.ops.convert_to_numpy(model.optimizer.iterations))


class ProfileSteps(keras.callbacks.Callback):
    """Profiles global steps `first` to `last` (counted from 1) with
    TensorFlow's profiler into `log_dir` (its `plugins/profile/<run>/`, which
    TensorBoard's Profile tab reads).

    Keras calls callbacks once per `tf.function` call of `steps_per_execution`
    steps, so the profile covers the whole calls that hold the range. Steps
    are the optimizer's iterations, so a resumed run profiles the same steps
    (none, when it resumes past them). A profiler that cannot start (another
    one runs in this process) costs one line, not the run.

    Args:
        log_dir: where the profiler writes.
        first, last: the global steps to profile.
        steps_per_execution: the steps of one call.
        shown_dir: the folder the message names (default `log_dir`), for logs
            that are moved there at the end.
    """

    def __init__(self, log_dir: str, first: int, last: int, *, steps_per_execution: int = 1,
                 shown_dir: str | None = None):
        super().__init__()
        self.log_dir, self.first, self.last = log_dir, first, last
        self.steps_per_execution = steps_per_execution
        self.shown_dir = shown_dir or log_dir
        self._from = None  # the first step profiled, while tracing
        self._done = False

    def on_train_batch_begin(self, batch, logs=None):
        if self._done or self._from is not None:
            return
        done = _global_step(self.model)
        if done >= self.last:  # resumed past the range
            self._done = True
        elif done + self.steps_per_execution >= self.first:  # this call reaches the range
            try:
                tf.profiler.experimental.start(self.log_dir)
            except Exception as e:  # pylint: disable=broad-except  (the profiler's own errors)
                print(f"tfmulti: warning: the profile of steps {self.first}-{self.last} was "
                      f"not written: the profiler did not start ({type(e).__name__}: {e})",
                      file=sys.stderr, flush=True)
                self._done = True
                return
            self._from = done + 1

    def on_train_batch_end(self, batch, logs=None):
        if self._from is not None and _global_step(self.model) >= self.last:
            self._stop()

    def on_train_end(self, logs=None):
        if self._from is not None:  # training ended inside the range (a callback stopped it)
            self._stop()

    def _stop(self) -> None:
        last = _global_step(self.model)
        tf.profiler.experimental.stop()
        print(f"tfmulti: profiled global steps {self._from}-{last} into "
              f"{os.path.join(self.shown_dir, 'plugins', 'profile')} (TensorBoard's Profile "
              f"tab)", flush=True)
        self._from, self._done = None, True
