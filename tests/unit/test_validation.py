"""Validation like Keras (issue 28): `validation_split` (the last fraction of the
training examples, held out before shuffling) and a dataset function's
"validation" split, evaluated after every epoch under every distribution and
through the backup: `val_*` in the history and metrics.json, callbacks that
watch `val_loss` (EarlyStopping, ModelCheckpoint) work; its bounds and refusals."""

from __future__ import annotations

import json

import keras
import numpy as np
import pytest
import tensorflow as tf

from tests import own_model
from tfmulti.config import flags as config_flags
from tfmulti.config.train_config import TrainConfig
from tfmulti.data import catalog
from tfmulti.data.from_config import load_data
from tfmulti.data.validation import hold_out
from tfmulti.training.train import train

RUN = dict(dataset="synthetic", num_examples=320, global_batch_size=32, epochs=2, seed=0,
           verbose=0, validation_split=0.2)
TWO = ("CPU:0", "CPU:1")
"""The mirrored runs' devices: 2 replicas, not the 4 logical CPUs of the pytest
process. In-process MirroredStrategy steps hand off between one thread per
replica at every step and every all-reduce; on a loaded machine each hand-off
waits for a core (the CI saw 85 s of wall for 4 CPU-s), and 2 replicas
check the same cross-replica behaviour."""


# --------------------------------------------------------------------------- bounds


@pytest.mark.parametrize("value", [-0.1, 1, 1.0, 1.5, float("nan"), float("inf"), "0.2", True])
def test_validation_split_outside_0_1_refused(value):
    with pytest.raises(ValueError, match=r"^`validation_split` must be in \(0, 1\)"):
        TrainConfig(validation_split=value).validate()


@pytest.mark.parametrize("value", [0, 0.0, 1e-6, 0.2, 0.999])
def test_validation_split_in_0_1_or_0_accepted(value):
    TrainConfig(validation_split=value).validate()


def test_validation_split_is_a_recipe_flag():
    from absl import flags

    fv = flags.FlagValues()
    config_flags.define_absl_flags(fv)
    fv(["train.py", "--validation_split=0.25"])
    assert config_flags.config_from_absl(fv).validation_split == 0.25


# ------------------------------------------------------------------------- hold_out


def test_hold_out_keeps_the_last_examples_in_order_as_keras():
    x, y = np.arange(10, dtype=np.float32)[:, None], np.arange(10)
    train, validation = hold_out((x, y), 0.25)
    # Keras: split_at = floor(10 * 0.75) = 7, the last 3 held out.
    assert [int(b) for _, b in train] == list(range(7))
    assert [int(b) for _, b in validation] == [7, 8, 9]


def test_hold_out_refuses_data_of_unknown_size_and_an_empty_part():
    unknown = tf.data.Dataset.range(10).filter(lambda v: v >= 0)
    with pytest.raises(ValueError, match=r"size is unknown .* 'validation' split"):
        hold_out(unknown, 0.2)
    # Keras' rule: floor(4 x (1 - 0.8)) = 0 examples left to train on.
    with pytest.raises(ValueError, match=r"of 4 training examples leaves no training "
                                         r"examples; use a smaller fraction"):
        hold_out(tf.data.Dataset.range(4), 0.8)


def test_validation_split_refused_for_files_saying_why(tmp_path, monkeypatch):
    own_model.write_tfrecords(tmp_path, num_files=2, per_file=8)
    monkeypatch.setenv("OWN_MODEL_FILES", str(tmp_path / "part-*.tfrecord"))
    config = TrainConfig(dataset="tests.own_model:file_data", model="tests.own_model:build",
                         validation_split=0.2)
    with pytest.raises(ValueError, match=r"training data are files .* unknown until they are "
                                         r"read.* 'validation' split from the dataset"):
        load_data(config)


def _with_validation(seed=0):
    """A dataset function: own_model's examples, 512 to train, 128 to test and a
    "validation" split of 256."""
    return {"train": own_model.arrays(512, seed), "test": own_model.arrays(128, seed + 1),
            "validation": own_model.arrays(256, seed + 2)}


def test_a_validation_entry_and_validation_split_together_refused():
    with pytest.raises(ValueError, match=r"^`validation_split` \(0.2\) .* returns a "
                                         r"'validation' split too; use one of them"):
        load_data(TrainConfig(dataset=_with_validation, model=own_model.build,
                              validation_split=0.2))


def test_validation_split_holds_out_the_last_training_examples():
    config = TrainConfig(dataset="synthetic", num_examples=200, validation_split=0.25)
    run_data = load_data(config)
    full = catalog.load("synthetic", "train", num_examples=200)
    assert int(run_data.train.cardinality()) == 150
    assert "validation" not in run_data.info  # the run's inputs carry it
    held = [y.numpy() for _, y in run_data.validation]
    assert held == [y.numpy() for _, y in full.skip(150)]


# ---------------------------------------------------------------------- train + fit


def _held_out_loss(model_dir, num_examples=RUN["num_examples"], split=RUN["validation_split"]):
    """The saved model's loss and accuracy on the examples `validation_split` held out."""
    full = catalog.load("synthetic", "train", num_examples=num_examples)
    keep = int(np.floor(num_examples * (1 - split)))
    model = keras.models.load_model(model_dir / "model.keras")
    if not model.compiled:  # the unpartitioned pipeline is saved uncompiled: the mlp's loss
        model.compile(loss=keras.losses.SparseCategoricalCrossentropy(from_logits=True),
                      metrics=["accuracy"])
    return model.evaluate(full.skip(keep).batch(1000), return_dict=True, verbose=0)


@pytest.mark.parametrize("fields", [
    dict(distribution="one_device"),
    dict(distribution="mirrored", devices=TWO),
    dict(distribution="pipeline", devices=TWO, num_microbatches=2),
    dict(distribution="hybrid", num_replicas=2, num_microbatches=2),
    dict(distribution="mirrored", devices=TWO, backup="yes"),
], ids=["one_device", "mirrored", "pipeline", "hybrid", "mirrored_backup"])
@pytest.mark.slow  # trains for seconds: not in make test-fast
def test_val_metrics_are_the_saved_models_on_the_held_out_examples(tmp_path, fields):
    fields = dict(fields)
    if fields.pop("backup", None):
        fields["backup_dir"] = str(tmp_path / "backup")
    history = keras.callbacks.History()
    metrics = train(TrainConfig(**RUN, **fields, model_dir=str(tmp_path / "run")),
                    callbacks=[history])
    assert len(history.history["val_loss"]) == 2 and len(history.history["val_accuracy"]) == 2
    written = json.loads((tmp_path / "run" / "metrics.json").read_text())
    assert written["val_loss"] == metrics["val_loss"] == pytest.approx(
        history.history["val_loss"][-1])
    # 320 x 0.8 = 256 training examples: 8 steps of 32.
    assert metrics["steps_per_epoch"] == 8 and metrics["epochs_completed"] == 2
    want = _held_out_loss(tmp_path / "run")
    assert metrics["val_loss"] == pytest.approx(want["loss"], rel=1e-4)
    assert metrics["val_accuracy"] == pytest.approx(want["accuracy"], abs=1e-6)
    assert metrics["test_loss"] > 0  # the test split is still evaluated after validating


@pytest.mark.slow  # trains for seconds: not in make test-fast
def test_a_run_resumed_at_its_end_reports_the_last_val_metrics(tmp_path):
    run = dict(RUN, distribution="one_device", model_dir=str(tmp_path / "run"),
               backup_dir=str(tmp_path / "backup"), keep_backup=True)  # as if killed
    first = train(TrainConfig(**run))
    for name in ("metrics.json", "model.keras"):  # killed before they were published
        (tmp_path / "run" / name).unlink()
    again = train(TrainConfig(**run))
    assert again["resumed_from_step"] == 16
    for name in ("val_loss", "val_accuracy", "train_loss"):
        assert again[name] == pytest.approx(first[name], rel=1e-5), name


@pytest.mark.slow  # trains for seconds: not in make test-fast
def test_a_validation_entry_is_evaluated_every_epoch_under_mirrored(tmp_path):
    metrics = train(TrainConfig(distribution="mirrored", devices=TWO,
                                dataset=_with_validation, model=own_model.build,
                                global_batch_size=128, epochs=2, verbose=0,
                                model_dir=str(tmp_path / "run")))
    x, y = own_model.arrays(256, 2)
    model = keras.models.load_model(tmp_path / "run" / "model.keras")
    want = model.evaluate(x, y, batch_size=256, return_dict=True, verbose=0)
    assert metrics["val_loss"] == pytest.approx(want["loss"], rel=1e-4)
    assert metrics["steps_per_epoch"] == 4  # the 512 training examples, all of them


@pytest.mark.slow  # trains for seconds: not in make test-fast
def test_a_validation_split_of_files_is_read_to_its_end_every_epoch(tmp_path, recwarn):
    """A "validation" entry of files (size unknown): every epoch reads them all,
    without Keras' "ran out of data" warning at each end."""
    import tfmulti

    own_model.write_tfrecords(tmp_path, num_files=2, per_file=40)
    files = tfmulti.data.from_files(str(tmp_path / "part-*.tfrecord"), own_model.parse)
    history = keras.callbacks.History()
    metrics = train(TrainConfig(
        distribution="mirrored", devices=TWO, model=own_model.build, global_batch_size=64,
        epochs=2, verbose=0,
        dataset=lambda: {"train": own_model.arrays(512, 0), "validation": files}),
        callbacks=[history])
    x, y = own_model.arrays(80, 0)  # the files' 80 examples
    model = history.model
    want = model.evaluate(x, y, batch_size=80, return_dict=True, verbose=0)
    assert len(history.history["val_loss"]) == 2
    assert metrics["val_loss"] == pytest.approx(want["loss"], rel=1e-4)
    assert not [w for w in recwarn if "ran out of data" in str(w.message)]


@pytest.mark.slow  # trains for seconds: not in make test-fast
def test_callbacks_watching_val_loss_work(tmp_path, recwarn):
    """EarlyStopping on val_loss stops; ModelCheckpoint(save_best_only, monitor=
    "val_loss") writes the best epoch's model (both warned that val_loss was not
    available, and did nothing, without validation data)."""
    # min_delta=10: no epoch improves val_loss that much, so the second one stops.
    stop = keras.callbacks.EarlyStopping(monitor="val_loss", patience=1, min_delta=10.0)
    path = tmp_path / "best.keras"
    checkpoint = keras.callbacks.ModelCheckpoint(path, monitor="val_loss", save_best_only=True)
    metrics = train(TrainConfig(**{**RUN, "epochs": 5}, devices=TWO),  # auto: mirrored
                    callbacks=[stop, checkpoint])
    assert metrics["epochs_completed"] == 2 and stop.stopped_epoch == 1
    assert path.is_file() and checkpoint.best <= metrics["val_loss"]
    assert not [w for w in recwarn if "val_loss" in str(w.message)]  # no "not available"
