"""What `model.compile` and `model.fit` take on one device, taken by a tfmulti run:
a model function's own compile (several outputs, a loss and a loss weight per
output, metrics per output), Keras' per-output forms in the configuration,
per-example weights with a test split without them, and class weights.

(The pipeline's side: tests/unit/test_pipeline_keras_contract.py; whole
programs of these shapes, through every path: the corpus.)"""

from __future__ import annotations

import json

import keras
import numpy as np
import pytest

import tfmulti
from tests import two_outputs
from tests._util import cli_main
from tfmulti.config.train_config import TrainConfig
from tfmulti.training import outputs
from tfmulti.training.run import build_run

TWO = dict(model=two_outputs.build, dataset=two_outputs.data, global_batch_size=64, seed=0)
MIRRORED = dict(distribution="mirrored", devices=("CPU:0", "CPU:1"))


def _rate(model) -> float:
    return float(keras.ops.convert_to_numpy(model.optimizer.learning_rate))


def _names(value) -> dict:
    return {key: type(loss).__name__ for key, loss in value.items()}


# ------------------------------------------------------------------ the author's compile


def test_a_model_function_that_compiles_keeps_its_loss_weights_metrics_and_optimizer(capsys):
    run = build_run(TrainConfig(**TWO, **MIRRORED))
    model = run.model
    assert _names(model.loss) == {"priority": "BinaryCrossentropy",
                                  "department": "SparseCategoricalCrossentropy"}
    assert model._compile_config.config["loss_weights"] == {"priority": 1.0, "department": 0.2}
    assert model._compile_config.config["metrics"] == {"priority": ["accuracy"],
                                                       "department": ["accuracy"]}
    assert type(model.optimizer).__name__ == "RMSprop"
    assert _rate(model) == pytest.approx(2e-3)
    assert model.optimizer._distribution_strategy is run.strategy  # made under its scope
    assert model.steps_per_execution == run.steps_per_execution  # tfmulti's settings on top
    line = capsys.readouterr().out
    assert "training the model as your model function compiled it (RMSprop, loss {" in line
    assert "given here" not in line


def test_an_optimizer_or_learning_rate_given_replaces_the_authors_and_says_so(capsys):
    run = build_run(TrainConfig(**TWO, learning_rate=0.05))
    assert type(run.model.optimizer).__name__ == "RMSprop"  # the author's, at the given rate
    assert _rate(run.model) == pytest.approx(0.05)
    assert "; learning_rate given here replaces its own" in capsys.readouterr().out
    run = build_run(TrainConfig(**TWO, optimizer="sgd", loss_weights={"department": 3.0}))
    assert type(run.model.optimizer).__name__ == "SGD"
    assert _rate(run.model) == pytest.approx(1e-3)
    # an output left out of the given weights weighs 1, as Keras' default
    assert run.model._compile_config.config["loss_weights"] == {"department": 3.0,
                                                                "priority": 1.0}
    assert "optimizer and loss_weights given here replace its own" in capsys.readouterr().out


def test_without_a_compile_each_output_gets_the_loss_and_metric_of_its_labels():
    run = build_run(TrainConfig(**{**TWO, "model": two_outputs.build_plain}))
    assert run.info["task"] == {"priority": "classification", "department": "classification"}
    losses = run.model.loss
    assert _names(losses) == {"priority": "BinaryCrossentropy",  # the sigmoid head
                              "department": "SparseCategoricalCrossentropy"}
    assert losses["department"].from_logits and not losses["priority"].from_logits
    metrics = run.model._compile_config.config["metrics"]
    assert {key: type(m[0]).__name__ for key, m in metrics.items()} == {
        "priority": "BinaryAccuracy", "department": "SparseCategoricalAccuracy"}


def test_the_forms_of_keras_compile_in_the_configuration():
    config = TrainConfig(**{**TWO, "model": two_outputs.build_plain},
                         loss={"priority": "binary_crossentropy",
                               "department": "tests.own_model:smooth_loss"},
                         metrics=["accuracy"], loss_weights=[0.5, 2.0],
                         weighted_metrics={"priority": "auc"})
    model = build_run(config).model
    assert model.loss["priority"] == "binary_crossentropy"
    assert model.loss["department"].__name__ == "smooth_loss"  # the user's function, resolved
    compiled = model._compile_config.config
    # one list of metrics for two outputs: each output's (Keras would pair them by position)
    assert compiled["metrics"] == {"department": ["accuracy"], "priority": ["accuracy"]}
    assert compiled["loss_weights"] == [0.5, 2.0]
    assert compiled["weighted_metrics"] == {"priority": ["auc"]}


def test_one_output_compiled_with_a_loss_dict_by_its_name_is_taken(capsys):
    """Keras takes a dict by the output's name for a model of one output."""
    def build():
        x = keras.Input((4,))
        model = keras.Model(x, keras.layers.Dense(1, name="score")(x))
        model.compile(optimizer="sgd", loss={"score": "mse"}, metrics={"score": ["mae"]})
        return model

    run = build_run(TrainConfig(model=build, dataset=two_outputs.rare_data,
                                global_batch_size=64))
    assert run.model.loss == {"score": "mse"}
    assert "as your model function compiled it (SGD, loss {score: mse}" in capsys.readouterr().out


@pytest.mark.parametrize("fields, message", [
    (dict(loss_weights={"prio": 1.0}), r"^`loss_weights` names \['prio'\], which is no output "
                                       r"of the model; its outputs are \['department', "
                                       r"'priority'\]\.$"),
    (dict(loss={"priority": "mse", "dept": "mse"}), r"^`loss` names \['dept'\]"),
    (dict(loss_weights=[1.0]), r"^`loss_weights` gives 1 values for the model's 2 outputs "
                               r"\['department', 'priority'\]; give one each"),
    (dict(metrics={"priority": ["accurac"]}), r"`metrics` lists 'accurac', which is not a "
                                              r"Keras metric name"),
])
def test_a_per_output_value_that_fits_no_output_is_one_line_before_training(
        fields, message, tmp_path):
    config = TrainConfig(**TWO, model_dir=str(tmp_path / "run"), **fields)
    with pytest.raises(ValueError, match=message) as refused:
        tfmulti.train(config)
    assert "\n" not in str(refused.value)
    assert not (tmp_path / "run").exists()


# --------------------------------------------------------------------- runs of two outputs


@pytest.mark.slow  # seconds of training: the full suite's, not the fast tier's
def test_two_outputs_under_mirrored_report_each_output_and_the_saved_models_loss(tmp_path):
    folder = tmp_path / "run"
    metrics = tfmulti.train(TrainConfig(**TWO, **MIRRORED, epochs=2, verbose=0,
                                        model_dir=str(folder)))
    assert metrics["outputs"] == ["department", "priority"]
    for name in ("loss", "priority_loss", "department_loss", "priority_accuracy",
                 "department_accuracy"):
        assert f"test_{name}" in metrics and f"train_{name}" in metrics
    saved = keras.models.load_model(folder / "model.keras")
    x, y = two_outputs.data()[1]
    evaluated = saved.evaluate(x, y, batch_size=64, verbose=0, return_dict=True)
    assert metrics["test_loss"] == pytest.approx(evaluated["loss"], rel=0.01)
    assert json.loads((folder / "metrics.json").read_text())["test_loss"] == metrics["test_loss"]
    line = outputs.summary_line(metrics)
    assert line.startswith("tfmulti: test_loss=")
    assert ", test_department_accuracy=" in line and ", test_priority_accuracy=" in line


# ------------------------------------------------------------------------------- weights


def _rare_share(config: TrainConfig, folder) -> float:
    """The share of the unweighted test split a trained run calls rare."""
    tfmulti.train(config.replace(model_dir=str(folder), epochs=3, verbose=0))
    x, _ = two_outputs.rare_data()[1]
    predicted = keras.models.load_model(folder / "model.keras").predict(x, verbose=0)
    return float(np.mean(predicted[:, 0] > 0.5))


@pytest.mark.slow  # trains 6 small models (about 10 s)
@pytest.mark.parametrize("distribution", ["mirrored", "pipeline"])
def test_weights_change_what_the_model_learns(distribution, tmp_path):
    """An imbalanced task (the rare class about 6 %): trained with the rare
    class weighted 10x, by per-example weights beside a test split without
    them or by `class_weight`, the model calls many more examples rare than
    trained unweighted; both weightings train the same model."""
    layout = MIRRORED if distribution == "mirrored" else dict(distribution="pipeline",
                                                               num_stages=2)
    base = TrainConfig(model=two_outputs.rare, dataset=two_outputs.rare_data, seed=0,
                       global_batch_size=64, **layout)
    plain = _rare_share(base, tmp_path / "plain")
    weighted = _rare_share(base.replace(dataset=two_outputs.rare_weighted), tmp_path / "w")
    by_class = _rare_share(base.replace(class_weight={1: two_outputs.RARE_WEIGHT}),
                           tmp_path / "cw")
    truth = float(np.mean(two_outputs.rare_data()[1][1]))
    assert plain < truth / 2 < 2 * truth < weighted, (plain, truth, weighted)
    assert by_class == pytest.approx(weighted, abs=1 / 512)


def test_class_weights_are_the_sample_weights_keras_makes(capsys):
    run = build_run(TrainConfig(model=two_outputs.rare, dataset=two_outputs.rare_data,
                                global_batch_size=64, class_weight="balanced"))
    _, y, w = next(iter(run.train_data.batch(2048)))
    y = np.asarray(y)
    counts = np.bincount(y)
    np.testing.assert_allclose(np.asarray(w), len(y) / (2 * counts[y]), rtol=1e-6)
    assert "read the labels once for class_weight 'balanced': class 0 " in capsys.readouterr().out


@pytest.mark.parametrize("fields, message", [
    (dict(dataset=two_outputs.rare_weighted, class_weight={1: 2.0}),
     r"`class_weight` and the sample weights the training split carries do not go together"),
    (dict(model=two_outputs.build, dataset=two_outputs.data, class_weight={1: 2.0}),
     r"`class_weight` weighs a model with one output"),
])
def test_class_weights_refused_where_keras_refuses_them(fields, message):
    config = TrainConfig(**{**dict(model=two_outputs.rare, dataset=two_outputs.rare_data,
                                   global_batch_size=64), **fields})
    with pytest.raises(ValueError, match=message):
        build_run(config)


# ------------------------------------------------------------------ the command line


@pytest.mark.slow  # trains twice (about 8 s)
@pytest.mark.parametrize("distribution", [["--distribution=mirrored"],
                                          ["--distribution=pipeline", "--num_stages=2"]])
def test_tfmulti_train_of_a_compiled_two_output_model(distribution, tmp_path, capsys):
    """`tfmulti train --model=M:build --dataset=M:data` of a model function that
    compiles two outputs (dict losses, loss weights, per-output metrics): the
    reported test loss is the saved model's compiled loss on the test split.
    (2 workers: tests/integration/test_wheel.py's launch of `tfmulti train`.)"""
    folder = tmp_path / "run"
    code, err, out = cli_main(["train", "--model=tests.two_outputs:build",
                               "--dataset=tests.two_outputs:data", *distribution,
                               "--global_batch_size=64", "--epochs=2", "--verbose=0",
                               f"--model_dir={folder}"], capsys)
    assert code == 0, err
    metrics = json.loads((folder / "metrics.json").read_text())
    saved = keras.models.load_model(folder / "model.keras")
    x, y = two_outputs.data()[1]
    evaluated = saved.evaluate(x, y, batch_size=64, verbose=0, return_dict=True)
    assert metrics["test_loss"] == pytest.approx(evaluated["loss"], rel=0.01)
    assert out.splitlines()[-1] == outputs.summary_line(metrics)
    assert "training the model as your model function compiled it (RMSprop" in out


def test_estimate_memory_of_a_compiled_two_output_model_counts_its_own_optimizer(capsys):
    """`tfmulti estimate-memory` of the model function that compiles with RMSprop
    (one slot a weight): its slots, not Adam's two; Adam's where given."""
    flags = ["estimate-memory", "--model=tests.two_outputs:build",
             "--dataset=tests.two_outputs:data", "--global_batch_size=64", "--json"]
    code, err, out = cli_main([*flags, "--distribution=pipeline", "--num_stages=2"], capsys)
    assert code == 0, err
    estimate = json.loads(out)
    assert estimate["optimizer"] == "rmsprop"
    first, last = estimate["devices"]
    assert last["optimizer_slots"] == last["parameters"] > 0  # one slot a weight
    code, err, out = cli_main([*flags, "--optimizer=adam", "--distribution=mirrored",
                               "--num_virtual_devices=2"], capsys)
    assert code == 0, err
    row = json.loads(out)["devices"][0]
    assert row["optimizer_slots"] == 2 * row["parameters"]


def test_the_default_metrics_are_made_under_the_strategys_scope():
    """Their variables are the strategy's, so that the replicas' (and the
    workers') counts are summed; made outside, each worker logged its own."""
    import tensorflow as tf

    run = build_run(TrainConfig(**{**TWO, "model": two_outputs.build_plain}, **MIRRORED))
    metrics = run.model._compile_config.config["metrics"]
    for metric in (m for per_output in metrics.values() for m in per_output):
        assert metric.variables and all(
            isinstance(v.value, tf.distribute.DistributedValues) for v in metric.variables)
