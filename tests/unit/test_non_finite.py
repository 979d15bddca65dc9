"""A NaN or infinite training loss stops training (issue 27, finding 5): one line
naming the steps, the value and the last good backup, `NonFiniteLoss` (exit code 65),
nothing saved from the NaN weights: no backup after it, no model.keras or
metrics.json. Under `fit` (tfmulti.train on one device, mirrored with several steps
per call, a pipeline; `backup.fit`) and in the custom loop (`loops.run`).

(The recipe's exit code and its one line on stderr: tests/integration/test_non_finite.py.)
"""

from __future__ import annotations

import math
import os

import keras
import numpy as np
import pytest
import tensorflow as tf

from tests._util import file_tree
from tfmulti.config.train_config import TrainConfig
from tfmulti.training import backup, loops
from tfmulti.training.callbacks import (NON_FINITE_LOSS, NonFiniteLoss, StopOnNonFiniteLoss,
                                        check_loss)
from tfmulti.training.train import train

NAN_FROM_STEP = 3  # the first global step (counted from 1) whose batch holds NaN labels
BATCH = 16


def nan_regression_data(seed=0, num_examples=256):
    """A dataset function: regression data with a NaN label in every fourth example."""
    rng = np.random.default_rng(seed)
    x = rng.random((num_examples, 16), dtype=np.float32)
    y = x.sum(axis=1)
    y[::4] = np.nan
    return (tf.data.Dataset.from_tensor_slices((x, y)),
            tf.data.Dataset.from_tensor_slices((x[:64], y[:64])))


def _stream(step):
    """Global batches in order, positioned at `step`: finite labels up to step
    NAN_FROM_STEP - 1, NaN labels from then on."""
    x = np.random.default_rng(1).random((8 * BATCH, 4), dtype=np.float32)
    y = x.sum(axis=1, keepdims=True)
    y[(NAN_FROM_STEP - 1) * BATCH:] = np.nan
    return tf.data.Dataset.from_tensor_slices((x, y)).batch(BATCH).repeat().skip(step)


def _model(steps_per_execution=1):
    keras.utils.set_random_seed(0)
    model = keras.Sequential([keras.Input((4,)), keras.layers.Dense(1)])
    model.compile(keras.optimizers.SGD(0.01), "mse", steps_per_execution=steps_per_execution)
    return model


def _steps_and_finite(backup_dir) -> dict[int, bool]:
    """Each checkpoint's step in `backup_dir`, and whether all its float values are finite."""
    found = {}
    for prefix in backup.checkpoints(str(backup_dir)):
        reader = tf.train.load_checkpoint(prefix)
        values = [reader.get_tensor(name) for name in reader.get_variable_to_shape_map()]
        found[int(prefix.rsplit("-", 1)[1])] = all(
            np.isfinite(v).all() for v in values
            if isinstance(v, np.ndarray) and v.dtype.kind == "f")
    return found


def _one_error_line(capsys) -> str:
    """The one line on stderr (besides the note of the Keras fixes a strategy applies)."""
    lines = [line for line in capsys.readouterr().err.splitlines()
             if not line.startswith("tfmulti: Keras fixes active: ")]
    assert len(lines) == 1 and lines[0].startswith("tfmulti: error: the training loss is "), \
        lines
    return lines[0]


@pytest.mark.parametrize("fields", [
    dict(distribution="one_device"),
    dict(distribution="mirrored", devices=("CPU:0", "CPU:1"), steps_per_execution=4),
    dict(distribution="pipeline", devices=("CPU:0", "CPU:1"), num_stages=2,
         num_microbatches=2),
], ids=["one_device", "mirrored_4_steps_per_call", "pipeline"])
def test_nan_regression_labels_stop_the_run_and_publish_nothing(tmp_path, capsys, fields):
    """The issue's reproduction: NaN labels trained into NaN weights, published them
    with a metrics.json of bare NaN, and exited 0."""
    model_dir, backup_dir = tmp_path / "run", tmp_path / "backup"
    config = TrainConfig(model="regression", dataset=nan_regression_data, num_examples=256,
                         global_batch_size=32, epochs=2, seed=0, verbose=0,
                         model_dir=str(model_dir), backup_dir=str(backup_dir),
                         backup_every_steps=4, **fields)
    with pytest.raises(NonFiniteLoss) as stopped:
        train(config)
    assert stopped.value.code == NON_FINITE_LOSS == 65
    err = _one_error_line(capsys)
    assert str(stopped.value) in err and "at epoch 1, global step" in err
    assert "look for NaN or infinite values in the features and labels" in err
    assert {"model.keras", "metrics.json"}.isdisjoint(os.listdir(model_dir))
    assert all(_steps_and_finite(backup_dir).values())  # no backup of NaN weights


@pytest.mark.parametrize("steps_per_execution, where", [
    (1, f"global step {NAN_FROM_STEP}"),
    (2, f"global steps {NAN_FROM_STEP}-{NAN_FROM_STEP + 1} (one call of 2 steps)"),
])
def test_fit_stops_at_the_first_nan_step_and_names_the_last_good_backup(
        tmp_path, capsys, steps_per_execution, where):
    """`backup.fit` with the callback first: the backup at step 2 stays the newest
    (no save of the NaN weights), and the line names it."""
    with pytest.raises(NonFiniteLoss):
        backup.fit(_model(steps_per_execution), _stream, epochs=2, steps_per_epoch=4,
                   backup_dir=str(tmp_path), save_every_steps=2, verbose=0,
                   callbacks=[StopOnNonFiniteLoss(str(tmp_path))])
    assert _steps_and_finite(tmp_path) == {2: True}
    err = _one_error_line(capsys)
    assert f"the training loss is nan at epoch 1, {where}; " in err
    assert f"the last good backup is {tmp_path}/tfmulti-ckpt-2 (global step 2)" in err


def test_keras_terminate_on_nan_alone_would_go_on_to_publish(tmp_path):
    """Why tfmulti has its own callback: Keras's TerminateOnNaN ends `fit` normally
    (stop_training), so the caller goes on to save the NaN model."""
    model = _model()
    model.fit(_stream(0), epochs=1, steps_per_epoch=4, verbose=0, shuffle=False,
              callbacks=[keras.callbacks.TerminateOnNaN()])
    assert np.isnan(model.get_weights()[0]).all()


def test_the_custom_loop_stops_before_saving_the_nan_weights(tmp_path, capsys):
    strategy = tf.distribute.get_strategy()
    model = _model()
    step = loops.TrainStep(model, keras.losses.MeanSquaredError(reduction=None),
                           model.optimizer, strategy, global_batch_size=BATCH)
    with pytest.raises(NonFiniteLoss):
        loops.run(step, _stream, steps=6, backup=backup.Backup(str(tmp_path), model),
                  save_every=2)
    assert _steps_and_finite(tmp_path) == {2: True}
    err = _one_error_line(capsys)
    assert f"the training loss is nan at global step {NAN_FROM_STEP}; " in err
    assert f"the last good backup is {tmp_path}/tfmulti-ckpt-2 (global step 2)" in err


def test_check_loss(tmp_path, capsys):
    check_loss(np.float32(0.5), first_step=1, last_step=1)  # finite: nothing
    check_loss(tf.constant(1e30), first_step=1, last_step=1)
    assert capsys.readouterr().err == ""
    before = file_tree(tmp_path)
    with pytest.raises(NonFiniteLoss, match=r"^error: the training loss is inf at epoch 3, "
                                            r"global steps 5-8 \(one call of 4 steps\); "
                                            r"training stopped with exit code 65 and saved "
                                            r"nothing from this step on; no backup was saved "
                                            rf"in {tmp_path} before it; look for NaN"):
        check_loss(math.inf, first_step=5, last_step=8, epoch=2, backup_dir=str(tmp_path))
    assert file_tree(tmp_path) == before  # the message only reads the backup
    with pytest.raises(NonFiniteLoss, match=r"loss is nan at global step 7; training stopped "
                                            r"with exit code 65 and saved nothing from this "
                                            r"step on; look for NaN"):
        check_loss(tf.constant(float("nan")), first_step=7, last_step=7)
    assert capsys.readouterr().err.count("\n") == 2


def test_a_backup_dir_that_cannot_be_listed_still_ends_in_the_loss_line(tmp_path, monkeypatch,
                                                                        capsys):
    def unreadable(backup_dir):
        raise PermissionError(13, "Permission denied", backup_dir)

    monkeypatch.setattr(backup, "checkpoints", unreadable)
    with pytest.raises(NonFiniteLoss, match=rf"the backups in {tmp_path} cannot be listed "
                                            r"\(\[Errno 13\] Permission denied"):
        check_loss(float("nan"), first_step=1, last_step=1, backup_dir=str(tmp_path))
    assert capsys.readouterr().err.count("\n") == 1
