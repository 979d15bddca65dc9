"""An experiment tracker as a Keras callback: one JSON line per epoch.

Written as a user would, for `--callbacks=jsonl_logger:callbacks` (run from
this folder, or with it on PYTHONPATH). It runs offline; a hosted tracker
(MLflow, Weights & Biases, ...) takes the same place: log where `is_chief`.
"""

import json
import os
import time

import keras


class JsonLinesLogger(keras.callbacks.Callback):
    """Appends `{"epoch": N, "seconds": S, "loss": ..., ...}` to `path` after each
    epoch: the epoch's metrics as `fit` reports them (val_* too, with validation)."""

    def __init__(self, path):
        super().__init__()
        self.path = path
        self.file = None

    def on_train_begin(self, logs=None):
        # The file is opened when training begins, not in __init__: tfmulti makes the
        # callbacks before it claims model_dir, which must hold no file of yours then.
        self.file = open(self.path, "a")

    def on_epoch_begin(self, epoch, logs=None):
        self.start = time.monotonic()

    def on_epoch_end(self, epoch, logs=None):
        line = {"epoch": epoch + 1, "seconds": round(time.monotonic() - self.start, 3)}
        line.update({name: float(value) for name, value in (logs or {}).items()})
        self.file.write(json.dumps(line) + "\n")
        self.file.flush()

    def on_train_end(self, logs=None):
        self.file.close()


def callbacks(model_dir, is_chief):
    """tfmulti calls this on every worker; only the chief logs (the others would
    write the same metrics again)."""
    if not is_chief:
        return []
    return [JsonLinesLogger(os.path.join(model_dir or ".", "metrics.jsonl"))]
