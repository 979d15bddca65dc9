"""The corpus programs themselves (`tests/corpus`), without training: each
offers tfmulti's hooks, its data has the shapes its model takes and labels
of every class, and it keeps what the corpus is there for (the transformer's
layers take no `**kwargs`, the convnet's labels are one-hot, the VAE is
subclassed with its own `train_step`, the GAN has no `call` and its own
`compile`, the ticket model's two outputs are compiled with a dict of losses
and loss weights, the fraud model's class weights are the source's, the
masked LSTM skips the padding, the MLP adds a loss of its own, the
segmentation's loader is a PyDataset that decodes files and flips image and
mask together); and the harness compares what each shape of program
reports. The training is in `tests/integration/test_corpus.py`."""

from __future__ import annotations

import inspect
import os

import keras
import numpy as np
import pytest

from tfmulti.config import user_functions as hooks
from tests.corpus import harness
from tests.corpus.harness import PROGRAMS


def _built(name):
    module = harness.load(name)
    wanted = hooks.parameters(module.build)
    offered = {"seed": 0}
    if "input_shape" in wanted:
        offered["input_shape"] = harness.input_shape(harness.splits(name)[0])
    return hooks.call(module.build, offered, "model"), module


def _metrics_compiled(name) -> tuple:
    compile_args = harness.load(name).COMPILE
    return tuple(compile_args.get("metrics", ())) if compile_args is not None else ()


def _head(values, n):
    """The first `n` rows of an array, or of each array of a dict."""
    if isinstance(values, dict):
        return {k: v[:n] for k, v in values.items()}
    return values[:n]


def _shapes(values) -> dict:
    """Each array's shape after the batch dimension, by name ("" for one array)."""
    values = values if isinstance(values, dict) else {"": values}
    return {k: tuple(np.shape(v)[1:]) for k, v in values.items()}


@pytest.mark.parametrize("name", PROGRAMS)
def test_program_offers_hooks_and_what_plain_keras_needs(name):
    module = harness.load(name)
    assert hooks.resolve(f"tests.corpus.{name}:build", "model") is module.build
    assert hooks.resolve(f"tests.corpus.{name}:data", "dataset") is module.data
    assert set(hooks.parameters(module.data)) == {"seed"}
    assert module.COMPILE is None or "optimizer" in module.COMPILE  # None: build compiles
    assert module.FIT["batch_size"] == harness.GLOBAL_BATCH
    assert isinstance(module.CHAIN, bool)
    config = harness.config_kwargs(name)
    assert config["model"] == f"tests.corpus.{name}:build" and config["seed"] == harness.SEED


@pytest.mark.parametrize("name", [n for n in PROGRAMS if harness.load(n).COMPILE is None])
def test_a_program_without_compile_arguments_builds_its_model_compiled(name):
    """What a user hands tfmulti when the compile is the author's own: the
    model compiled, with fresh optimizers at each call of the model function."""
    model, _ = _built(name)
    other, _ = _built(name)
    assert model.compiled and other.compiled
    optimizers = [v for v in vars(model).values() if isinstance(v, keras.optimizers.Optimizer)]
    assert optimizers, "no optimizer made by the model function's compile"
    assert not {id(v) for v in vars(other).values()} & {id(o) for o in optimizers}


@pytest.mark.parametrize("name", [n for n in PROGRAMS
                                  if n not in ("vae", "gan", "structured_data")])
def test_model_takes_its_data(name):
    """The model's output fits the labels' shape (each output its labels'),
    on a few examples."""
    model, _ = _built(name)
    (x, y), (x_test, y_test) = (harness.as_arrays(split) for split in harness.splits(name))
    assert _shapes(x) == _shapes(x_test) and _shapes(y) == _shapes(y_test)
    out = model(_head(x, 4), training=False)
    if isinstance(y, dict):  # several outputs, by name
        assert sorted(out) == sorted(y)
        assert {k: tuple(v.shape) for k, v in out.items()} == {
            k: (4, *shape) for k, shape in _shapes(y).items()}
        return
    assert tuple(out.shape)[0] == 4
    labels = np.asarray(y)
    if labels.ndim > 1 and labels.shape[1:] == tuple(out.shape)[1:]:  # one-hot, or images
        return
    assert tuple(out.shape)[-1] in (1, int(labels.max()) + 1)


@pytest.mark.parametrize("name", [n for n in PROGRAMS if "accuracy" in _metrics_compiled(n)])
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


def test_the_gan_has_no_call_and_its_own_compile():
    """What the GAN is in the corpus for: `fit` of a model that cannot be
    called, compiled through a `compile` whose arguments are the author's, with
    two optimizers and two loss trackers; images without labels."""
    model, module = _built("gan")
    assert type(model).call is keras.Model.call  # no call of its own
    assert list(inspect.signature(module.GAN.compile).parameters) == [
        "self", "d_optimizer", "g_optimizer", "loss_fn"]
    assert type(model).train_step is not keras.Model.train_step
    assert model.d_optimizer is not model.g_optimizer
    assert model.loss_fn.get_config()["from_logits"] is True
    assert [m.name for m in model.metrics] == ["d_loss", "g_loss"]
    split = module.data(seed=0)
    assert split["test"] is None and tuple(split["train"].element_spec.shape) == (28, 28, 1)
    with pytest.raises(ValueError, match="gan has no test split"):
        harness.chance("gan")


def test_the_ticket_model_has_named_inputs_and_outputs_and_a_loss_per_output():
    """Two outputs compiled with a dict of losses (both from logits: the heads
    have no activation) and a dict of loss weights; the data is a dict by
    input name and a dict of labels by output name."""
    model, module = _built("functional_api_multi_io")
    assert sorted(model.output) == ["department", "priority"]
    assert sorted(model.loss) == ["department", "priority"]
    assert all(loss.get_config()["from_logits"] for loss in model.loss.values())
    assert model.get_compile_config()["loss_weights"] == {"priority": 1.0, "department": 0.2}
    assert [layer.activation.__name__ for layer in
            (model.get_layer("priority"), model.get_layer("department"))] == ["linear"] * 2
    features, labels = harness.held_out("functional_api_multi_io")
    assert sorted(features) == sorted(t.name for t in model.inputs) == ["body", "tags", "title"]
    assert set(labels["department"].sum(axis=1)) == {1.0}  # one-hot
    assert set(labels["department"].argmax(axis=1)) == set(range(module.num_departments))
    assert 0 <= labels["priority"].min() < labels["priority"].max() <= 1  # soft labels
    assert 0 < harness.chance("functional_api_multi_io", "department") < 0.5
    with pytest.raises(ValueError, match="several outputs .*name one of them"):
        harness.chance("functional_api_multi_io")


def test_the_fraud_model_has_the_source_class_weights_of_its_rare_class():
    """The class weights are the source's, 1 / count of each class in the
    training labels, given to Keras' fit and to tfmulti alike; the positive
    class is rare in both splits; the compile arguments are fresh at each access."""
    module = harness.load("imbalanced_classification")
    (x, y), (_, y_test) = module.data(seed=0)
    counts = np.bincount(y[:, 0])
    assert module.FIT["class_weight"] == {0: 1 / counts[0], 1: 1 / counts[1]}
    assert harness.config_kwargs("imbalanced_classification")["class_weight"] == (
        module.FIT["class_weight"])
    assert x.shape[1:] == (30,) and abs(x.mean()) < 1e-3  # standardized, as the source
    for labels in (y, y_test):
        assert 0.05 <= labels.mean() <= 0.1 and set(np.unique(labels)) == {0, 1}
    first, second = module.COMPILE, module.COMPILE
    assert first["optimizer"] is not second["optimizer"]
    assert [m.name for m in first["metrics"]] == ["fn", "fp", "tn", "tp", "precision", "recall"]


def test_the_masked_lstm_skips_the_padding():
    """The embedding makes a mask of the non-zero ids, the guide's own layer
    passes it on, and the LSTM skips the masked steps: more padding leaves the
    output as it was. The data is padded at the end, to lengths that vary."""
    model, module = _built("masking_and_padding")
    embedding = next(layer for layer in model.layers if isinstance(layer, keras.layers.Embedding))
    assert embedding.mask_zero and module.MyActivation(name="a").supports_masking
    (x, _), _ = module.data(seed=0)
    lengths = (x != 0).sum(axis=1)
    assert lengths.min() < lengths.max() == module.MAXLEN
    assert all((row[n:] == 0).all() and (row[:n] != 0).all() for row, n in zip(x, lengths))
    # sequences of 30-40 words: 8-18 padded steps, which an LSTM without the mask
    # would read (after many more, its state forgets where it started)
    few = x[(lengths >= 30) & (lengths <= 40)][:4]
    trimmed = few[:, :40]
    longer = np.concatenate([few, np.zeros((4, 16), np.int32)], axis=1)
    for other in (trimmed, longer):
        np.testing.assert_allclose(model(other), model(few), rtol=1e-5, atol=1e-6)
    unmasked = few.copy()
    unmasked[unmasked == 0] = 1  # the same steps, not padding: the output changes
    assert not np.allclose(model(few), model(unmasked), atol=1e-6)


def test_the_segmentation_s_py_dataset_decodes_files_and_flips_image_and_mask_together():
    """The source's loader, a PyDataset that decodes image and trimap files in
    Python: masks of the classes 0, 1, 2 (the trimaps' 1, 2, 3 less one), the
    pet bright over a dark background; the training loader flips some images
    with their masks and leaves the others, the test loader reads the files as
    they are, the same every time."""
    module = harness.load("oxford_pets_segmentation")
    train, test = harness.splits("oxford_pets_segmentation")
    assert type(train) is type(test) is module.OxfordPets
    assert isinstance(train, keras.utils.PyDataset) and (len(train), len(test)) == (16, 4)
    assert os.path.exists(train.input_img_paths[0]) and train.target_img_paths[0].endswith(".png")
    x, y = train[0]
    assert x.shape == (32, *module.img_size, 3) and y.shape == (32, *module.img_size, 1)
    pet, background = x[y[..., 0] == 0], x[y[..., 0] == 1]
    assert set(np.unique(y)) == {0, 1, 2} and pet.mean() > 3 * background.mean()
    plain = module.OxfordPets(train.batch_size, train.img_size, train.input_img_paths,
                              train.target_img_paths)
    x_kept, y_kept = plain[0]
    same = [np.array_equal(x[j], x_kept[j]) and np.array_equal(y[j], y_kept[j])
            for j in range(32)]
    mirrored = [np.array_equal(x[j], x_kept[j, :, ::-1]) and
                np.array_equal(y[j], y_kept[j, :, ::-1]) for j in range(32)]
    assert all(a or b for a, b in zip(same, mirrored)) and not all(same) and not all(mirrored)
    first, again = test[1], test[1]
    assert all(np.array_equal(a, b) for a, b in zip(first, again))


def test_the_mlp_adds_the_activity_loss_of_its_own_layer():
    """The guide's pass-through layer adds 0.1 x the sum of dense_1's
    activations over the whole batch to the model's losses."""
    model, module = _built("built_in_methods_add_loss")
    (x, _), _ = module.data(seed=0)
    model(x[:4])
    (added,) = model.losses
    kernel, bias = model.get_layer("dense_1").get_weights()
    activations = np.maximum(x[:4] @ kernel + bias, 0)
    assert float(added) == pytest.approx(0.1 * activations.sum(), rel=1e-4)


def test_several_outputs_are_compared_output_by_output():
    ref = {"test_loss": 0.34, "test_priority_loss": 0.33, "test_department_loss": 0.08,
           "history": {"loss": [0.7, 0.45]}}
    run = {"test_loss": 0.35, "test_priority_loss": 0.33, "test_department_loss": 0.07}
    line = harness.assert_close("functional_api_multi_io", run, ref, "here")
    assert line == ("functional_api_multi_io here: test_loss 0.3500 vs plain Keras 0.3400, "
                    "department_loss 0.0700 vs 0.0800, priority_loss 0.3300 vs 0.3300")
    with pytest.raises(AssertionError, match="department_loss 0.5000 vs 0.0800"):
        harness.assert_close("functional_api_multi_io", {**run, "test_department_loss": 0.5},
                             ref, "here")
    chance = harness.chance("functional_api_multi_io", "department")
    with pytest.raises(AssertionError, match=rf"department_accuracy 0.300 vs 0.900 \(chance "
                                             rf"{chance:.3f}\)"):
        harness.assert_close("functional_api_multi_io", {**run, "test_department_accuracy": 0.3},
                             {**ref, "test_department_accuracy": 0.9}, "here")


def test_class_weights_are_checked_on_the_weighted_training_loss_and_recall():
    ref = {"test_loss": 0.12, "test_recall": 1.0, "history": {"loss": [5e-4, 1.6e-4]}}
    run = {"test_loss": 0.19, "test_recall": 0.96, "train_loss": 9e-5}
    line = harness.assert_close("imbalanced_classification", run, ref, "here")
    assert line.endswith("weighted train_loss 9e-05 vs 0.00016, recall 0.960 vs 1.000")
    unweighted = {"test_loss": 0.04, "test_recall": 0.93, "train_loss": 0.05}
    with pytest.raises(AssertionError, match="weighted train_loss 0.05 vs 0.00016"):
        harness.assert_close("imbalanced_classification", unweighted, ref, "here")
    with pytest.raises(AssertionError, match="recall 0.700 vs 1.000"):
        harness.assert_close("imbalanced_classification", {**run, "test_recall": 0.7}, ref,
                             "here")


def test_the_chance_loss_is_the_entropy_of_the_class_shares():
    assert harness.chance_loss("mnist_convnet") == pytest.approx(np.log(10), abs=0.05)
    _, masks = harness.held_out("oxford_pets_segmentation")  # per pixel
    shares = np.bincount(masks.reshape(-1)) / masks.size
    assert harness.chance_loss("oxford_pets_segmentation") == pytest.approx(
        -(shares * np.log(shares)).sum())


def test_a_program_comparing_its_training_loss_must_have_learned_in_training():
    """The segmentation's inference-mode test loss lags its training: its
    training loss is also compared, and must be below the chance loss."""
    name = "oxford_pets_segmentation"
    floor = harness.chance_loss(name)
    ref = {"test_loss": 0.7, "history": {"loss": [2.9, 0.5]}}
    line = harness.assert_close(name, {"test_loss": 0.75, "train_loss": 0.55}, ref, "here")
    assert line == (f"{name} here: test_loss 0.7500 vs plain Keras 0.7000, "
                    f"train_loss 0.5500 vs 0.5000 (chance {floor:.4f})")
    with pytest.raises(AssertionError, match="train_loss 0.9000 vs 0.5000"):
        harness.assert_close(name, {"test_loss": 0.75, "train_loss": 0.9}, ref, "here")
    near_chance = {"test_loss": 0.7, "history": {"loss": [2.9, floor - 0.1]}}
    with pytest.raises(AssertionError, match=rf"train_loss {floor + 0.01:.4f} vs "):
        harness.assert_close(name, {"test_loss": 0.75, "train_loss": floor + 0.01},
                             near_chance, "here")


def test_without_a_loss_in_the_logs_each_of_them_must_be_there_and_finite():
    ref = {"history": {"d_loss": [0.68, 0.65], "g_loss": [0.73, 0.75]}}
    line = harness.assert_close("gan", {"train_d_loss": 0.66, "train_g_loss": 0.74}, ref, "here")
    assert line == ("gan here: train_d_loss 0.6600 vs plain Keras 0.6500, "
                    "train_g_loss 0.7400 vs plain Keras 0.7500")
    with pytest.raises(AssertionError, match="no train_g_loss in the run's metrics"):
        harness.assert_close("gan", {"train_d_loss": 0.66, "train_loss": 0.7}, ref, "here")
    with pytest.raises(AssertionError, match="train_g_loss nan"):
        harness.assert_close("gan", {"train_d_loss": 0.66, "train_g_loss": float("nan")}, ref,
                             "here")
