"""True numbers and labels as users have them (issue 28): the default loss and
metrics are chosen from the layer that makes the user's output, under every
distribution (a pipeline's last stage is not the user's softmax); integer and
one-hot labels train without extra flags; a model function's own
`num_classes` default is never overridden by None; the reported test loss is
the loss the saved model has on the test split (mirrored on the 4 virtual
CPUs of tests/conftest.py, and a 2-stage pipeline).

The models are the corpus' keras-io programs (`tests/corpus`) where one fits,
else a few layers of the same kind; every run is a few steps.
"""

from __future__ import annotations

import os

import keras
import numpy as np
import pytest
import tensorflow as tf

import tfmulti
from tests.corpus import mnist_convnet, timeseries_classification
from tfmulti.config.train_config import TrainConfig
from tfmulti.models import builders
from tfmulti.parallel.pipeline import PipelineModel
from tfmulti.training.run import build_run
from tfmulti.training.train import train


def _functional(head, features=8):
    """Dense(16) on `features` features, then `head(h)` (the output)."""
    inputs = keras.Input((features,))
    h = keras.layers.Dense(16, activation="relu")(inputs)
    h = keras.layers.Dense(16, activation="relu")(h)
    return keras.Model(inputs, head(h))


def _softmax_dense(h):
    return keras.layers.Dense(3, activation="softmax")(h)


def _nested():
    inner = keras.Sequential([keras.Input((8,)), keras.layers.Dense(3),
                              keras.layers.Activation("softmax")])
    return keras.Sequential([keras.Input((8,)), inner])


OUTPUTS = {
    "softmax Dense": (lambda: _functional(_softmax_dense), "softmax"),
    "Softmax layer": (lambda: _functional(
        lambda h: keras.layers.Softmax()(keras.layers.Dense(3)(h))), "softmax"),
    "keras.ops.softmax": (lambda: _functional(
        lambda h: keras.ops.softmax(keras.layers.Dense(3)(h))), "softmax"),
    "a nested Sequential's Activation": (_nested, "softmax"),
    "logits": (lambda: _functional(keras.layers.Dense(3)), None),
    "sigmoid": (lambda: _functional(keras.layers.Dense(1, activation="sigmoid")), "sigmoid"),
    "pipeline of a softmax model": (lambda: PipelineModel(
        _functional(_softmax_dense), devices=["CPU:0", "CPU:1"]), "softmax"),
    "hybrid of a softmax model": (lambda: PipelineModel(
        _functional(_softmax_dense), num_replicas=2, num_stages=2), "softmax"),
}


@pytest.mark.parametrize("make, activation", OUTPUTS.values(), ids=list(OUTPUTS))
def test_the_default_loss_and_accuracy_follow_the_layer_that_makes_the_output(
        make, activation):
    model = make()
    assert builders.output_head(model)[0] == activation
    loss = builders.default_loss("classification", model)
    accuracy = builders.default_metrics("classification", model)[0]
    if activation == "sigmoid":
        assert isinstance(loss, keras.losses.BinaryCrossentropy) and not loss.from_logits
        assert isinstance(accuracy, keras.metrics.BinaryAccuracy)
    else:
        assert isinstance(loss, keras.losses.SparseCategoricalCrossentropy)
        assert loss.from_logits == (activation is None)  # probabilities after a softmax
        assert isinstance(accuracy, keras.metrics.SparseCategoricalAccuracy)
    assert accuracy.name == "accuracy"


def test_one_hot_labels_get_the_categorical_loss_and_accuracy():
    model = _functional(_softmax_dense)
    loss = builders.default_loss("classification", model, one_hot=True)
    assert isinstance(loss, keras.losses.CategoricalCrossentropy) and not loss.from_logits
    assert isinstance(builders.default_metrics("classification", model, one_hot=True)[0],
                      keras.metrics.CategoricalAccuracy)


def test_the_pipeline_compiles_the_users_softmax_with_a_loss_on_probabilities():
    run = build_run(TrainConfig(distribution="pipeline", num_stages=2,
                                model=timeseries_classification.build,
                                dataset=timeseries_classification.data, global_batch_size=64,
                                seed=0))
    assert isinstance(run.model, PipelineModel)
    assert isinstance(run.model.loss, keras.losses.SparseCategoricalCrossentropy)
    assert not run.model.loss.from_logits


# ------------------------------------------------------------------------ labels


def test_one_hot_labels_and_a_num_classes_default_need_no_flags(capsys):
    """keras-io's mnist_convnet: `build(input_shape, num_classes=10)` and labels
    from `keras.utils.to_categorical`, nothing said about classes or task."""
    run = build_run(TrainConfig(distribution="mirrored", model=mnist_convnet.build,
                                dataset=mnist_convnet.data, global_batch_size=64, seed=0))
    assert run.info["task"] == "classification" and run.info["num_classes"] == 10
    assert run.model.output_shape == (None, 10)
    assert isinstance(run.model.loss, keras.losses.CategoricalCrossentropy)
    assert not run.model.loss.from_logits
    assert "read the labels once" not in capsys.readouterr().out  # the width says it


def _images(labels):
    rng = np.random.default_rng(0)
    return rng.random((len(labels), 6), dtype=np.float32), labels


def _dense_model(input_shape, num_classes=10):
    return keras.Sequential([keras.Input(input_shape),
                             keras.layers.Dense(num_classes, activation="softmax")])


@pytest.mark.parametrize("labels, given, classes", [
    (np.arange(64) % 7, None, 10),  # class ids, none given: the function's default
    (np.arange(64) % 7, 7, 7),  # the dataset function's
    (np.eye(5, dtype=np.float32)[np.arange(64) % 5], None, 5),  # one-hot: the labels' width
    (np.eye(5, dtype=np.int32)[np.arange(64) % 5], None, 5),  # integer one-hot too
])
def test_the_classes_a_model_function_gets(labels, given, classes, capsys):
    def dataset():
        return {"train": _images(labels), "test": None,
                **({"num_classes": given} if given else {})}

    run = build_run(TrainConfig(distribution="one_device", model=_dense_model, dataset=dataset,
                                global_batch_size=16))
    assert run.model.output_shape == (None, classes)
    assert run.info["task"] == "classification"
    one_hot = labels.ndim == 2
    assert isinstance(run.model.loss, keras.losses.CategoricalCrossentropy if one_hot
                      else keras.losses.SparseCategoricalCrossentropy)
    assert "read the labels once" not in capsys.readouterr().out
    run.model.fit(**run.train_input.fit_kwargs(), epochs=1, verbose=0)


def test_one_hot_labels_said_to_be_a_classification_need_no_num_classes():
    """The dataset function says `task`, not `num_classes`; the model function
    requires `num_classes`: the labels' width."""
    def build(input_shape, num_classes):
        return _dense_model(input_shape, num_classes)

    labels = np.eye(4, dtype=np.float32)[np.arange(64) % 4]
    run = build_run(TrainConfig(distribution="one_device", model=build, global_batch_size=16,
                                dataset=lambda: {"train": _images(labels),
                                                 "task": "classification"}))
    assert run.model.output_shape == (None, 4) and run.info["num_classes"] == 4


@pytest.mark.parametrize("task, expected, classes", [
    (None, "regression", None),  # files are not read before training: float labels
    ("classification", "classification", 3),  # said so: their width
])
def test_float_label_rows_read_from_files(task, expected, classes, tmp_path):
    path = tmp_path / "rows.csv"
    path.write_text("".join(f"{i % 3 == 0:d},{i % 3 == 1:d},{i % 3 == 2:d}\n"
                            for i in range(48)))

    def parse(line):
        row = tf.strings.to_number(tf.strings.split(line, ","))
        return tf.reshape(row, (3,)), tf.reshape(row, (3,))

    def dataset():
        files = tfmulti.data.from_files(str(path), parse, reader="text")
        return {"train": files, **({"task": task} if task else {})}

    run = build_run(TrainConfig(distribution="one_device", dataset=dataset, steps_per_epoch=2,
                                model=lambda input_shape: _dense_model(input_shape, 3),
                                global_batch_size=16))
    assert run.info["task"] == expected and run.info["num_classes"] == classes
    assert isinstance(run.model.loss, keras.losses.MeanSquaredError if task is None
                      else keras.losses.CategoricalCrossentropy)


def test_a_num_classes_default_is_kept_for_regression():
    def dataset():
        return _images(np.linspace(0, 1, 64, dtype=np.float32)), None

    def build(input_shape, num_classes=3):
        return keras.Sequential([keras.Input(input_shape), keras.layers.Dense(num_classes),
                                 keras.layers.Dense(1)])

    run = build_run(TrainConfig(distribution="one_device", model=build, dataset=dataset,
                                global_batch_size=16))
    assert run.info["task"] == "regression" and run.model.layers[0].units == 3


def test_class_ids_are_still_counted_for_a_function_without_a_default(capsys):
    def build(input_shape, num_classes):
        return _dense_model(input_shape, num_classes)

    run = build_run(TrainConfig(distribution="one_device", model=build,
                                dataset=lambda: (_images(np.arange(64) % 7), None),
                                global_batch_size=16))
    assert run.model.output_shape == (None, 7) and "7 classes" in capsys.readouterr().out


@pytest.mark.parametrize("labels, model, match", [
    (np.eye(5, dtype=np.float32)[np.arange(64) % 5],
     lambda input_shape: _dense_model(input_shape, 10),
     r"^the training split's labels have shape \(5,\) per example, but the categorical "
     r"cross-entropy takes one-hot rows shaped like the model's output \(None, 10\); give the "
     r"model 5 outputs"),
    (np.arange(64) % 3,
     lambda input_shape: keras.Sequential([keras.Input(input_shape),
                                           keras.layers.Dense(1, activation="sigmoid")]),
     r"^the training split holds label 2, but the model ends in a sigmoid \(a binary or "
     r"multi-label classifier\), which takes labels 0 to 1; for 3 classes .*Dense\(3, "
     r"activation='softmax'\)"),
])
def test_labels_the_models_loss_cannot_take_are_refused_in_one_line(labels, model, match):
    with pytest.raises(ValueError, match=match):
        build_run(TrainConfig(distribution="one_device", model=model,
                              dataset=lambda: (_images(labels), None), global_batch_size=16))


@pytest.mark.parametrize("labels, match", [
    (np.arange(64) % 4, r"^the training split holds label 3, outside the model's 3 classes"),
    (np.eye(4, dtype=np.float32)[np.arange(64) % 4],
     r"^the training split's labels have shape \(4,\) per example, but the categorical "
     r"cross-entropy takes one-hot rows shaped like the model's output \(None, 3\)"),
])
def test_a_pipelines_labels_are_checked_against_the_users_output(labels, match):
    with pytest.raises(ValueError, match=match):
        build_run(TrainConfig(distribution="pipeline", num_stages=2, global_batch_size=16,
                              model=lambda: _functional(_softmax_dense, features=6),
                              dataset=lambda: (_images(labels), None)))


def test_soft_labels_are_not_one_hot():
    rows = np.full((64, 4), 0.25, dtype=np.float32)
    run = build_run(TrainConfig(distribution="one_device",
                                model=lambda input_shape: _dense_model(input_shape, 4),
                                dataset=lambda: (_images(rows), None), global_batch_size=16))
    assert run.info["task"] == "regression"  # as before: float labels, no one-hot rows


# ------------------------------------------------------------------- true numbers


@pytest.mark.parametrize("program, distribution", [
    (timeseries_classification, "pipeline"),  # class ids, softmax, BatchNormalization
    (mnist_convnet, "pipeline"),  # one-hot labels, softmax, num_classes=10 by default
    (mnist_convnet, "mirrored"),
    (mnist_convnet, "hybrid"),  # 2 pipelines of 2 stages
])
@pytest.mark.slow  # trains for seconds: not in make test-fast
def test_the_reported_test_loss_is_the_saved_models_loss_on_the_test_split(
        program, distribution, tmp_path):
    """The saved model.keras, compiled with the program's published loss and
    evaluated on the test split on one device, has the test loss the run
    reported (mirrored over the 4 virtual devices; 2 pipeline stages; 2
    pipelines of 2 stages)."""
    model_dir = tmp_path / "run"
    metrics = train(TrainConfig(distribution=distribution, num_stages=2, model=program.build,
                                dataset=program.data, global_batch_size=64, epochs=1,
                                steps_per_epoch=2, seed=0, model_dir=str(model_dir),
                                verbose=0))
    assert metrics["num_replicas"] == {"mirrored": 4, "hybrid": 2}.get(distribution, 1)
    saved = keras.saving.load_model(os.path.join(model_dir, "model.keras"), compile=False)
    saved.compile(loss=program.COMPILE["loss"], metrics=["accuracy"])
    (_, _), (x, y) = program.data()
    true = saved.evaluate(x, y, batch_size=64, return_dict=True, verbose=0)
    assert metrics["test_loss"] == pytest.approx(true["loss"], rel=1e-4, abs=1e-6)
    assert metrics["test_accuracy"] == pytest.approx(true["accuracy"], abs=1e-6)
