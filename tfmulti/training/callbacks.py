"""Keras callbacks tfmulti adds to a run, and the stop on a non-finite loss.

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

from tfmulti.cluster import exit_codes
from tfmulti.training import backup as backup_lib

__all__ = ["EpochTimer", "NON_FINITE_LOSS", "NonFiniteLoss", "StopOnNonFiniteLoss",
           "check_loss"]

NON_FINITE_LOSS = exit_codes.NON_FINITE_LOSS
"""The exit code of a run stopped by a NaN or infinite training loss (65)."""


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
        loss = (logs or {}).get("loss")
        if loss is None:
            return
        steps = batch - self._begin + 1
        iterations = getattr(getattr(self.model, "optimizer", None), "iterations", None)
        last = (int(keras.ops.convert_to_numpy(iterations)) if iterations is not None
                else batch + 1)
        check_loss(loss, first_step=last - steps + 1, last_step=last, epoch=self._epoch,
                   backup_dir=self.backup_dir)
