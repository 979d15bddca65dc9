"""The corpus programs themselves (`tests/corpus`), without training: each
offers tfmulti's hooks, its data has the shapes its model takes and labels
of every class, and it keeps what the corpus is there for (the transformer's
layers take no `**kwargs`, the convnet's labels are one-hot, the VAE is
subclassed with its own `train_step`). The training is in
`tests/integration/test_corpus.py`."""

from __future__ import annotations

import inspect

import keras
import numpy as np
import pytest

from tfmulti.config import user_functions as hooks
from tests.corpus import harness
from tests.corpus.harness import PROGRAMS


def _built(name):
    module = harness.load(name)
    wanted = hooks.parameters(module.build)
    train = module.data(seed=0)
    train = train["train"] if isinstance(train, dict) else train[0]
    offered = {"seed": 0}
    if "input_shape" in wanted:
        offered["input_shape"] = train[0].shape[1:]
    return hooks.call(module.build, offered, "model"), module


@pytest.mark.parametrize("name", PROGRAMS)
def test_program_offers_hooks_and_what_plain_keras_needs(name):
    module = harness.load(name)
    assert hooks.resolve(f"tests.corpus.{name}:build", "model") is module.build
    assert hooks.resolve(f"tests.corpus.{name}:data", "dataset") is module.data
    assert set(hooks.parameters(module.data)) == {"seed"}
    assert "optimizer" in module.COMPILE and module.FIT["batch_size"] == harness.GLOBAL_BATCH
    assert isinstance(module.CHAIN, bool)
    config = harness.config_kwargs(name)
    assert config["model"] == f"tests.corpus.{name}:build" and config["seed"] == harness.SEED


@pytest.mark.parametrize("name", [n for n in PROGRAMS if n not in ("vae", "structured_data")])
def test_model_takes_its_data(name):
    """The model's output fits the labels' shape, on a few examples."""
    model, module = _built(name)
    (x, y), (x_test, y_test) = module.data(seed=0)
    assert x.shape[1:] == x_test.shape[1:] and y.shape[1:] == y_test.shape[1:]
    out = model(x[:4], training=False)
    assert tuple(out.shape)[0] == 4
    labels = np.asarray(y)
    if labels.ndim > 1 and labels.shape[1:] == tuple(out.shape)[1:]:  # one-hot, or images
        return
    assert tuple(out.shape)[-1] in (1, int(labels.max()) + 1)


@pytest.mark.parametrize("name", [n for n in PROGRAMS
                                  if "accuracy" in harness.load(n).COMPILE.get("metrics", ())])
def test_test_split_holds_every_class_and_chance_is_below_one(name):
    assert 0 < harness.chance(name) < 0.7


def test_the_convnet_has_one_hot_labels_and_its_own_num_classes_default():
    module = harness.load("mnist_convnet")
    (_, y), _ = module.data(seed=0)
    assert y.shape[1:] == (10,) and set(np.unique(y)) == {0.0, 1.0}
    assert inspect.signature(module.build).parameters["num_classes"].default == 10


def test_the_transformer_layers_take_no_kwargs_and_have_no_config():
    """The reason the transformer is in the corpus: layers as many users write
    them, which `from_config` cannot rebuild."""
    module = harness.load("text_transformer")
    for layer in (module.TransformerBlock, module.TokenAndPositionEmbedding):
        assert hooks.parameters(layer.__init__) is not None  # no **kwargs
        assert "get_config" not in vars(layer)


def test_the_vae_is_subclassed_with_its_own_train_step_and_no_labels():
    model, module = _built("vae")
    assert type(model).train_step is not keras.Model.train_step
    assert not isinstance(model, keras.Sequential) and type(model) is not keras.Model
    element = module.data(seed=0)["train"].element_spec
    assert tuple(element.shape) == (28, 28, 1)


def test_structured_data_is_a_dict_of_the_model_inputs():
    """(Building the model adapts 13 layers on the data: the integration
    tests build it.)"""
    module = harness.load("structured_data")
    features, labels = harness.held_out("structured_data")
    names = module.INTEGER_CATEGORICAL + module.STRING_CATEGORICAL + module.NUMERIC
    assert sorted(features) == sorted(names) and len(names) == 13
    assert features["thal"].dtype.kind in "OS"  # strings, looked up inside the model
    assert all(features[n].dtype == np.float32 for n in module.NUMERIC)
    assert set(np.unique(labels)) == {0, 1}


def test_the_comparison_holds_runs_to_the_stated_tolerances():
    ref = {"test_loss": 0.5, "test_accuracy": 0.8, "history": {"loss": [1.0, 0.6]}}
    line = harness.assert_close("mnist_convnet", {"test_loss": 0.6, "test_accuracy": 0.7}, ref,
                                "here")
    assert line.startswith("mnist_convnet here: test_loss 0.6000 vs plain Keras 0.5000")
    for far in ({"test_loss": 0.5 + harness.LOSS_ABS + harness.LOSS_REL * 0.5 + 0.01,
                 "test_accuracy": 0.8},
                {"test_loss": 0.5, "test_accuracy": 0.8 - harness.ACCURACY_MARGIN - 0.01}):
        with pytest.raises(AssertionError, match="vs plain Keras"):
            harness.assert_close("mnist_convnet", far, ref, "here")
    chance = harness.chance("mnist_convnet")  # a reference at chance does not excuse a run there
    at_chance = {"test_loss": 0.5, "test_accuracy": chance, "history": {}}
    with pytest.raises(AssertionError, match=r"chance"):
        harness.assert_close("mnist_convnet", {"test_loss": 0.5, "test_accuracy": chance},
                             at_chance, "here")


def test_without_a_test_split_the_training_loss_must_fall():
    ref = {"history": {"loss": [400.0, 300.0]}}
    harness.assert_close("vae", {"train_loss": 310.0}, ref, "here")
    with pytest.raises(AssertionError, match="not below plain Keras' first epoch"):
        harness.assert_close("vae", {"train_loss": 401.0}, ref, "here")
