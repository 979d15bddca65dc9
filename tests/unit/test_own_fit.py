"""A model whose `fit` prepares its own input (`tfmulti.models.own_fit`): its
`preprocess_samples` runs in tfmulti's input pipeline, on every split, and
Keras' own `fit` and `evaluate` train it; a `fit` override of another kind is
called as it is. keras-hub's task models, which follow this protocol, are
trained in tests/integration/test_keras_hub.py."""

from __future__ import annotations

import keras
import numpy as np
import pytest
import tensorflow as tf

import tfmulti
from tfmulti.data import checks
from tfmulti.models import own_fit

BUILT: list = []  # the models the model functions below made, newest last


class Squares(keras.Sequential):
    """Takes one number per example and prepares (x, x²) itself, as a keras-hub
    task prepares token ids from text: its `fit` and `evaluate` would read no
    distributed dataset."""

    def fit(self, *args, **kwargs):
        raise RuntimeError("Squares.fit called with tfmulti's distributed dataset")

    def evaluate(self, *args, **kwargs):
        raise RuntimeError("Squares.evaluate called with tfmulti's distributed dataset")

    def preprocess_samples(self, x, y=None, sample_weight=None):
        x = tf.concat([x, x * x], axis=-1)
        return keras.utils.pack_x_y_sample_weight(x, y, sample_weight)


class CountsItsFits(keras.Sequential):
    """Overrides `fit` for its own reasons, then calls Keras'."""

    calls = 0

    def fit(self, *args, **kwargs):
        type(self).calls += 1
        return super().fit(*args, **kwargs)


def build_squares():
    model = Squares([keras.Input((2,)), keras.layers.Dense(8, activation="relu"),
                     keras.layers.Dense(2)])
    BUILT.append(model)
    return model


def build_counting():
    model = CountsItsFits([keras.Input((1,)), keras.layers.Dense(2)])
    BUILT.append(model)
    return model


def numbers():
    """Label 1 where |x| > 1: learnable from x² alone."""
    rng = np.random.default_rng(0)
    x = rng.uniform(-2, 2, size=(512, 1)).astype("float32")
    y = (np.abs(x[:, 0]) > 1).astype("int32")
    return (x[:384], y[:384]), (x[384:], y[384:])


def test_the_protocol_is_a_fit_override_with_preprocess_samples():
    assert own_fit.preprocessing(build_squares()) is not None
    assert own_fit.preprocessing(build_counting()) is None  # its own fit takes the data
    assert own_fit.preprocessing(keras.Sequential([keras.Input((1,))])) is None
    assert own_fit.describe(build_counting()) is None
    assert "Squares overrides fit to prepare its own input: it has no preprocessor" in \
        own_fit.describe(build_squares())


@pytest.mark.slow
def test_a_model_that_prepares_its_input_trains_on_its_prepared_batches_on_every_split(capsys):
    metrics = tfmulti.train(tfmulti.TrainConfig(
        model=build_squares, dataset=numbers, distribution="mirrored", devices=("CPU:0", "CPU:1"),
        validation_split=0.25, epochs=4, global_batch_size=32, learning_rate=0.05, seed=0,
        verbose=0))
    assert "Squares overrides fit to prepare its own input" in capsys.readouterr().out
    assert metrics["test_accuracy"] >= 0.85 and metrics["val_accuracy"] >= 0.85, metrics
    model = BUILT[-1]
    assert not {"fit", "evaluate", "predict"} & set(vars(model))  # its own methods again
    with pytest.raises(RuntimeError, match="Squares.fit called"):
        model.fit(np.zeros((2, 1)), np.zeros(2))


@pytest.mark.slow
def test_a_fit_override_of_another_kind_is_called_as_it_is():
    CountsItsFits.calls = 0
    tfmulti.train(tfmulti.TrainConfig(model=build_counting, dataset=numbers, epochs=1,
                                      global_batch_size=64, verbose=0))
    assert CountsItsFits.calls == 1


def test_the_first_inputs_are_what_the_model_makes_of_the_first_examples():
    (x, y), _ = numbers()
    dataset = tf.data.Dataset.from_tensor_slices((x, y))
    prepared = checks.first_inputs(dataset, own_fit.preprocessing(build_squares()))
    np.testing.assert_allclose(prepared, np.concatenate([x[:2], x[:2] ** 2], axis=1))
    np.testing.assert_array_equal(checks.first_inputs(dataset), x[:2])  # no preparation


def test_first_inputs_of_differing_shapes_are_refused_naming_them():
    ragged = tf.data.Dataset.from_generator(
        lambda: iter([np.zeros(3, "int32"), np.zeros(5, "int32")]),
        output_signature=tf.TensorSpec((None,), tf.int32))
    with pytest.raises(ValueError, match=r"the training split's features differ in shape "
                                         r"between examples \(\(3,\), \(5,\)\)"):
        checks.first_inputs(ragged)
