"""Keras callbacks tfmulti adds to a run.

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

import time

import keras

__all__ = ["EpochTimer"]


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
