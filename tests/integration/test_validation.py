"""`recipes/train.py --validation_split`: a bad value, or one the data cannot
honour, is one line and exit 2, with nothing written (the in-process tests of
validation are in tests/unit/test_validation.py; 2 workers validating, in
tests/integration/test_launcher.py)."""

from __future__ import annotations

import pytest

from tests import own_model
from tests._util import run_recipe, run_recipe_warm

pytestmark = pytest.mark.slow


def test_a_validation_split_outside_0_1_is_one_line_before_tensorflow(tmp_path):
    model_dir = tmp_path / "run"
    result = run_recipe("train", "--validation_split=1.5", f"--model_dir={model_dir}",
                        timeout=60)
    assert result.returncode == 2
    assert result.stderr.splitlines() == [
        "train.py: error: --validation_split must be in (0, 1), the fraction of the training "
        "examples held out (0: none), got 1.5; e.g. 0.2 holds out the last 20%."]
    assert result.stdout == "" and not model_dir.exists()


def test_a_validation_split_of_files_is_one_line_saying_why(tmp_path):
    own_model.write_tfrecords(tmp_path, num_files=2, per_file=8)
    model_dir = tmp_path / "run"
    result = run_recipe_warm("train", "--dataset=tests.own_model:file_data",
                             "--model=tests.own_model:build", "--validation_split=0.2",
                             f"--model_dir={model_dir}", timeout=120,
                             env={"OWN_MODEL_FILES": str(tmp_path / "part-*.tfrecord")})
    assert result.returncode == 2, result.stderr[-2000:]
    errors = [line for line in result.stderr.splitlines() if line.startswith("train.py: error:")]
    assert len(errors) == 1, result.stderr[-2000:]
    assert errors[0].startswith("train.py: error: --validation_split (0.2) holds out the last "
                                "examples of the training data, but the training data are files")
    assert "return a 'validation' split from the dataset function instead" in errors[0]
    assert "Traceback" not in result.stderr and not model_dir.exists()


def test_the_timeseries_example_validates_as_plain_keras(tmp_path, recwarn):
    """The keras-io time-series classifier (tests/corpus), its published callbacks
    all on val_loss, `validation_split=0.2` as published: the held-out examples
    are Keras' (the last 20%: the saved model's loss on them is the reported
    val_loss), the callbacks act without warning, and val_loss agrees with plain
    Keras' within the corpus' tolerance. (Trains 2 short epochs twice: slow.)

    One device: under MirroredStrategy each replica's BatchNormalization updates
    its own copy of the moving statistics (the copies drift apart), and the saved
    model holds the first replica's, so every figure evaluated during a mirrored
    run (val_loss and test_loss alike) differs from the saved model's, by about
    1% for this model; the mirrored validation itself is held exact for a model
    without BatchNormalization in tests/unit/test_validation.py."""
    import keras

    from tests.corpus import harness
    from tfmulti.config.train_config import TrainConfig
    from tfmulti.training.train import train

    name = "timeseries_classification"
    module = harness.load(name)
    config = TrainConfig(**harness.config_kwargs(name), distribution="one_device",
                         model_dir=str(tmp_path / "run"))
    assert config.validation_split == 0.2
    metrics = train(config, callbacks=module.callbacks(tmp_path))
    assert not [w for w in recwarn if "val_loss" in str(w.message)]  # "not available"
    assert (tmp_path / "best_model.keras").is_file()  # ModelCheckpoint(monitor="val_loss")
    (x, y), _ = module.data(seed=harness.SEED)
    keep = int(len(x) * 0.8)  # Keras: the last 20% of the examples, before shuffling
    saved = keras.models.load_model(tmp_path / "run" / "model.keras")
    want = saved.evaluate(x[keep:], y[keep:], batch_size=256, verbose=0, return_dict=True)
    assert metrics["val_loss"] == pytest.approx(want["loss"], rel=1e-4)
    assert metrics["val_accuracy"] == pytest.approx(want["accuracy"], abs=1e-6)
    reference = harness.reference(name)["history"]["val_loss"][-1]
    assert abs(metrics["val_loss"] - reference) <= (harness.LOSS_ABS
                                                    + harness.LOSS_REL * reference), (
        metrics["val_loss"], reference)
