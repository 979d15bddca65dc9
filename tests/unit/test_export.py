"""SavedModel export (tfmulti.training.export, `tfmulti export`): a model trained under a
strategy or as a pipeline serves on one device like the trained model.

The multi-worker case is in tests/integration/test_backup.py's faked-SLURM cluster test
(its workers export at the end of training)."""

from __future__ import annotations

import os
import re

import numpy as np
import pytest

from tests._util import cli_main, file_tree
from tests.workers import user_model
from tfmulti import cli
from tfmulti.config.train_config import TrainConfig
from tfmulti.models.rebuild import FIX
from tfmulti.training import export

X, Y = user_model.examples(40, seed=2)


def _served(path, inputs):
    """Predictions of the SavedModel at `path`, loaded afresh, on one device."""
    import keras
    import tensorflow as tf

    with tf.device("/CPU:0"):
        loaded = tf.saved_model.load(path)  # kept: its variables live as long as it does
        served = loaded.serve(inputs).numpy()
        layer = keras.layers.TFSMLayer(path, call_endpoint="serve")(inputs).numpy()
    np.testing.assert_array_equal(served, layer)
    return served


@pytest.mark.slow  # seconds of training: the full suite's, not the fast tier's
def test_a_mirrored_model_serves_on_one_device_like_the_trained_one(tmp_path):
    import keras

    import tfmulti

    strategy = tfmulti.get_strategy("mirrored", devices=["CPU:0", "CPU:1"])
    with strategy.scope():
        model = user_model.functional_model()
        model.compile(keras.optimizers.Adam(0.05),
                      keras.losses.SparseCategoricalCrossentropy(from_logits=True))
    inputs = user_model.as_inputs(X)
    model.fit(inputs, Y, batch_size=8, epochs=2, verbose=0)
    trained = model.predict(inputs, verbose=0)
    path = export.saved_model(model, str(tmp_path / "serving"))
    assert path == str(tmp_path / "serving")
    np.testing.assert_allclose(_served(path, inputs), trained, atol=1e-6, rtol=0)
    assert sorted(os.listdir(tmp_path)) == ["serving"]  # no temporary directory left
    with strategy.scope(), pytest.raises(RuntimeError, match=r"call it outside "
                                                             r"`strategy.scope\(\)`"):
        export.saved_model(model, str(tmp_path / "again"))


@pytest.mark.parametrize("replicas", [1, 2])
def test_a_pipeline_serves_as_its_unpartitioned_model(tmp_path, replicas):
    """A PipelineModel (2 stages), and a hybrid (2 replicas x 2 stages)."""
    import keras

    from tfmulti.parallel import PipelineModel

    keras.utils.set_random_seed(4)
    layers = [keras.layers.Dense(16, activation="relu"), keras.layers.Dense(3)]
    model = PipelineModel(layers, input_shape=(8,), num_replicas=replicas, num_microbatches=2,
                          devices=[f"CPU:{i}" for i in range(2 * replicas)])
    model.compile(keras.optimizers.Adam(0.05),
                  keras.losses.SparseCategoricalCrossentropy(from_logits=True))
    model.fit(X, Y, batch_size=8, epochs=2, verbose=0)
    trained = model.predict(X, batch_size=8, verbose=0)
    path = export.saved_model(model, str(tmp_path / "serving"))
    np.testing.assert_allclose(_served(path, X), trained, atol=1e-6, rtol=0)


def _dense(seed: int):
    import keras

    keras.utils.set_random_seed(seed)
    return keras.Sequential([keras.Input((8,)), keras.layers.Dense(3)])


def test_an_existing_output_is_refused_unless_overwrite_and_a_failed_export_leaves_nothing(
        tmp_path, monkeypatch):
    import keras

    path = str(tmp_path / "serving")
    first, second = _dense(1), _dense(2)
    export.saved_model(first, path)
    before = file_tree(path)
    with pytest.raises(ValueError, match=r"serving exists; pass another output directory, or "
                                         r"set `overwrite` to replace it"):
        export.saved_model(second, path)
    assert file_tree(path) == before

    def broken_export(self, filepath, *args, **kwargs):
        os.makedirs(filepath)
        open(os.path.join(filepath, "saved_model.pb"), "w").close()  # half written
        raise OSError("No space left on device")

    real_export = keras.Model.export
    monkeypatch.setattr(keras.Model, "export", broken_export)
    with pytest.raises(OSError, match="No space left"):
        export.saved_model(second, path, overwrite=True)
    assert file_tree(path) == before  # the old export, untouched
    with pytest.raises(OSError, match="No space left"):
        export.saved_model(second, str(tmp_path / "new"))
    assert sorted(os.listdir(tmp_path)) == ["serving"]  # no partial output, no temporary dir
    monkeypatch.setattr(keras.Model, "export", real_export)
    export.saved_model(second, path, overwrite=True)
    np.testing.assert_allclose(_served(path, X), second.predict(X, verbose=0), atol=1e-6)
    assert sorted(os.listdir(tmp_path)) == ["serving"]


_USER_MODULE = '''
import keras


@keras.saving.register_keras_serializable(package="tfmulti_test_user")
class Scale(keras.layers.Layer):
    """A custom layer: x * a learned scale."""

    def build(self, input_shape):
        self.scale = self.add_weight(shape=(input_shape[-1],), initializer="ones")

    def call(self, x):
        return x * self.scale


def build():
    keras.utils.set_random_seed(5)
    return keras.Sequential([keras.Input((8,)), keras.layers.Dense(3), Scale()])
'''


def test_the_export_command(tmp_path, monkeypatch, capsys):
    """`tfmulti export --model_dir DIR --output DIR`: a run's model.keras with a
    custom layer, found through --model (the module on the current directory);
    bad input is one line and exit 2, with nothing written."""
    import sys

    import keras

    monkeypatch.chdir(tmp_path)
    (tmp_path / "user_layers.py").write_text(_USER_MODULE)
    monkeypatch.syspath_prepend(str(tmp_path))
    import user_layers  # noqa: E402  (written just above)

    model = user_layers.build()
    model.layers[-1].scale.assign(np.arange(1, 4, dtype=np.float32))
    os.makedirs("run")
    model.save("run/model.keras")
    expected = model.predict(X, verbose=0)
    # As in a fresh process: the custom layer is not registered until --model imports it.
    keras.saving.get_custom_objects().pop("tfmulti_test_user>Scale")
    del sys.modules["user_layers"]
    monkeypatch.setattr(sys, "path", [p for p in sys.path if p != str(tmp_path)])

    def run(*args):
        code = cli.main(["export", *args])
        out, err = capsys.readouterr()
        return code, out, err

    code, _, err = run("--model_dir", "run", "--output", "serving")
    assert code == 2 and err.count("\n") == 1, err
    assert err == ("tfmulti export: error: cannot load run/model.keras: the class Scale is not "
                   "known; pass --model=MODULE with the module that defines it "
                   "(user_layers).\n")
    assert not os.path.exists("serving")
    code, out, err = run("--model_dir", "run", "--output", "serving",
                         "--model", "user_layers:build")
    assert code == 0, err
    assert out == "tfmulti export: wrote a SavedModel to " \
                  f"{tmp_path / 'serving'} (signature serving_default, endpoint serve)\n"
    np.testing.assert_allclose(_served(str(tmp_path / "serving"), X), expected, atol=1e-6)
    for args, message in [
        (("--model_dir", "run", "--output", "serving"),
         "serving exists; pass another output directory, or set --overwrite to replace it."),
        (("--model_dir", "nowhere", "--output", "other"),
         "--model_dir 'nowhere' has no model.keras; pass the directory a training run wrote"),
        (("--model_dir", "run", "--output", "other", "--model", "no_such_module"),
         "--model 'no_such_module': cannot import 'no_such_module'"),
    ]:
        code, _, err = run(*args)
        assert code == 2 and message in err and err.count("\n") == 1, err
    assert {"other", "nowhere"}.isdisjoint(os.listdir(tmp_path))  # nothing written
    code, _, err = run("--model_dir", "run", "--output", "serving", "--overwrite",
                       "--model", "user_layers")
    assert code == 0, err


def test_the_model_module_is_found_without_shadowing_the_standard_library(tmp_path, monkeypatch):
    """Issue 27: `--model=MODULE` for export put the current directory first on sys.path
    for the rest of the process; a `configparser.py` there then replaced the standard
    library's. The user's module is still found in the current directory."""
    import sys

    monkeypatch.chdir(tmp_path)
    (tmp_path / "configparser.py").write_text("RAN = True\n")
    (tmp_path / "export_layers.py").write_text("import configparser\nPARSER = configparser\n")
    monkeypatch.setattr(sys, "path", [p for p in sys.path if p not in ("", str(tmp_path))])
    for name in ("configparser", "export_layers"):
        monkeypatch.delitem(sys.modules, name, raising=False)
    export.import_model_module("export_layers:build")
    standard = os.path.dirname(os.__file__)
    assert os.path.dirname(sys.modules["export_layers"].PARSER.__file__) == standard
    monkeypatch.delitem(sys.modules, "configparser")
    import configparser  # any later import in the process
    assert not hasattr(configparser, "RAN") and hasattr(configparser, "ConfigParser")


# ----------------------------------------------- a model Keras cannot rebuild from its file

TX = "tests.corpus.text_transformer"


def _text_transformer_run(folder, *, weights_only: bool = False, input_shape=(64,)):
    """A run folder of keras-io's text transformer (tests/corpus: its layers take no
    **kwargs and have no get_config, as published): model.keras, or
    model.weights.h5 alone, and a metrics.json that records the input shape
    (None: not recorded). Returns the model's predictions on its test split."""
    import json

    from tests.corpus import text_transformer as tx

    model = tx.build((tx.MAXLEN,))
    os.makedirs(folder)
    model.save_weights(os.path.join(folder, "model.weights.h5")) if weights_only \
        else model.save(os.path.join(folder, "model.keras"))
    recorded = {"model": "tests.corpus.text_transformer:build"}
    if input_shape is not None:
        recorded["input_shape"] = list(input_shape)
    with open(os.path.join(folder, "metrics.json"), "w") as f:
        json.dump(recorded, f)
    (_, _), (x_test, _) = tx.data()
    x = x_test[:8].astype(np.float32)  # the model's Input is float32, as published
    return x, model.predict(x, verbose=0)


def test_export_names_the_layer_that_cannot_be_rebuilt_and_what_to_add(tmp_path, capsys,
                                                                      monkeypatch):
    """Issue 28: `tfmulti export --model tx` said "pass --model=MODULE", which was
    passed; the line names the layer, the cause and the three fixes. With the model
    function (`--model=MODULE:FUNCTION`) the model is built again and given the
    saved weights."""
    monkeypatch.chdir(tmp_path)
    x, expected = _text_transformer_run("run")
    module = "tests.corpus.text_transformer"
    prefix = "tfmulti export: error: cannot load run/model.keras: "
    code, err, out = cli_main(["export", "--model_dir=run", "--output=serving"], capsys)
    assert (code, out) == (2, "") and err == [
        f"{prefix}the classes TokenAndPositionEmbedding, TransformerBlock are not known; pass "
        f"--model=MODULE with the module that defines them ({module})."]
    code, err, out = cli_main(["export", "--model_dir=run", "--output=serving",
                               f"--model={module}"], capsys)
    assert (code, out) == (2, "") and len(err) == 1, err
    # The layer's name is Keras' own (numbered after the models built before it).
    named = re.sub(r"'token_and_position_embedding_\d+'", "'token_and_position_embedding'",
                   err[0])
    assert named.startswith(
        f"{prefix}layer TokenAndPositionEmbedding 'token_and_position_embedding' (module "
        f"{module}; also TransformerBlock) cannot be rebuilt from its saved config: "
        "TokenAndPositionEmbedding.__init__() got an unexpected keyword argument 'trainable'; "
        f"in class TokenAndPositionEmbedding, {FIX}; or export with "
        f"--model={module}:FUNCTION"), err
    assert "**kwargs" in FIX and "get_config()" in FIX and \
        "@keras.saving.register_keras_serializable()" in FIX
    assert sorted(os.listdir(tmp_path)) == ["run"]  # nothing written
    code, err, out = cli_main(["export", "--model_dir=run", "--output=serving",
                               f"--model={module}:build"], capsys)
    assert code == 0, err
    np.testing.assert_allclose(_served(str(tmp_path / "serving"), x), expected, atol=1e-6)


def test_export_of_a_run_that_saved_the_weights_only(tmp_path, capsys, monkeypatch):
    """A run whose model cannot be saved whole writes model.weights.h5: its model
    function builds the model again with the shape the run recorded; without the
    function, or without a recorded shape, one line says what to pass."""
    monkeypatch.chdir(tmp_path)
    x, expected = _text_transformer_run("run", weights_only=True)
    _text_transformer_run("unrecorded", weights_only=True, input_shape=None)
    module = "tests.corpus.text_transformer"
    for argv, message in [
        (["--model_dir=run", f"--model={module}"],
         "run holds the weights only (model.weights.h5: its model could not be saved whole); "
         "pass --model=MODULE:FUNCTION, the model function the run trained, to build it "
         "again."),
        (["--model_dir=unrecorded", f"--model={module}:build"],
         f"--model '{module}:build' takes `input_shape`, which unrecorded does not record "
         "(no metrics.json input_shape, no run file naming the data)"),
        (["--model_dir=run", f"--model={module}:data"],
         f"--model '{module}:data' returned tuple; expected a keras.Model."),
    ]:
        code, err, out = cli_main(["export", *argv, "--output=serving"], capsys)
        assert (code, out, len(err)) == (2, "", 1), err
        assert err[0].startswith(f"tfmulti export: error: {message}"), err
    assert sorted(os.listdir(tmp_path)) == ["run", "unrecorded"]
    code, err, out = cli_main(["export", "--model_dir=run", "--output=serving",
                               f"--model={module}:build"], capsys)
    assert code == 0, err
    np.testing.assert_allclose(_served(str(tmp_path / "serving"), x), expected, atol=1e-6)


# ------------------------------------------------------------- serving names (issue 28)

def _signature_inputs(path) -> list[str]:
    import tensorflow as tf

    loaded = tf.saved_model.load(path)
    return sorted(loaded.signatures["serving_default"].structured_input_signature[1])


def _own_model():
    from tests import own_model

    x, y = own_model.arrays(16)
    return (lambda: own_model.build({k: (w,) for k, w in own_model.FEATURES.items()}), x, y,
            "sparse_categorical_crossentropy", ["extra", "pixels"])


def _unnamed_input():
    import keras

    def build():
        inputs = keras.Input((8,))  # unnamed
        return keras.Model(inputs, keras.layers.Dense(3)(keras.layers.Dense(16)(inputs)))

    return build, X[:16], Y[:16], keras.losses.SparseCategoricalCrossentropy(from_logits=True), \
        ["input_layer"]


@pytest.mark.slow  # trains for seconds: not in make test-fast
@pytest.mark.parametrize("case", [_own_model, _unnamed_input], ids=["named", "unnamed"])
def test_serving_input_names_are_the_models_whichever_distribution_trained_it(tmp_path, case):
    """Issue 28: the signature's input was `input_layer` after mirrored training and
    `keras_tensor` after pipeline training, for the same model. The same model
    function, trained one step mirrored and as a pipeline, exports (directly and
    through the run's model.keras) with its own Input names: named Inputs keep theirs
    (tests/own_model.py), an unnamed one has Keras' own default, `input_layer`."""
    import keras

    import tfmulti
    from tfmulti.parallel import PipelineModel

    build, x, y, loss, expected = case()

    def trained_mirrored():
        strategy = tfmulti.get_strategy("mirrored", devices=["CPU:0", "CPU:1"])
        with strategy.scope():
            model = build()
            model.compile("sgd", loss)
        return model

    def trained_pipeline():
        with keras.device("CPU:0"):
            model = build()
        pipeline = PipelineModel(model, devices=["CPU:0", "CPU:1"], num_microbatches=2)
        pipeline.compile("sgd", loss)
        return pipeline

    names = {}
    for distribution, make in (("mirrored", trained_mirrored), ("pipeline", trained_pipeline)):
        model = make()
        model.fit(x, y, batch_size=16, epochs=1, verbose=0)  # one step
        names[distribution] = _signature_inputs(
            export.saved_model(model, str(tmp_path / distribution)))
        run = tmp_path / f"{distribution}-run"
        os.makedirs(run)
        (model.to_model() if distribution == "pipeline" else model).save(run / "model.keras")
        names[f"{distribution} run"] = _signature_inputs(
            export.from_model_dir(str(run), str(tmp_path / f"{distribution}-served")))
    assert names == dict.fromkeys(names, expected)


@pytest.mark.slow  # trains for seconds: not in make test-fast
def test_export_of_a_pipeline_run_that_saved_the_weights_only(tmp_path, capsys, monkeypatch):
    """The run the issue reports: keras-io's text transformer (layers without
    **kwargs) trained as a pipeline saves model.weights.h5; `tfmulti export
    --model=MODULE:FUNCTION` builds it again from the data its run file names and
    serves the trained weights."""
    from tests.corpus import text_transformer as tx
    from tfmulti.training.train import train

    monkeypatch.chdir(tmp_path)
    train(TrainConfig(model=f"{TX}:build", dataset=f"{TX}:data", distribution="pipeline",
                      num_stages=2, num_microbatches=2, devices=("CPU:0", "CPU:1"),
                      global_batch_size=64, epochs=1, steps_per_epoch=2, seed=0, verbose=0,
                      model_dir="run"))
    capsys.readouterr()
    assert os.path.isfile("run/model.weights.h5") and not os.path.exists("run/model.keras")
    code, err, out = cli_main(["export", "--model_dir=run", "--output=serving",
                               f"--model={TX}"], capsys)
    assert (code, len(err)) == (2, 1) and err[0].endswith(
        "holds the weights only (model.weights.h5: its model could not be saved whole); pass "
        f"--model=MODULE:FUNCTION, the model function the run trained ({TX}:build), to build "
        "it again."), err
    code, err, out = cli_main(["export", "--model_dir=run", "--output=serving",
                               f"--model={TX}:build"], capsys)
    assert code == 0, err
    trained = tx.build((tx.MAXLEN,))
    trained.load_weights("run/model.weights.h5")
    x = tx.data()[1][0][:8].astype(np.float32)
    np.testing.assert_allclose(_served(str(tmp_path / "serving"), x),
                               trained.predict(x, verbose=0), atol=1e-6)
    assert _signature_inputs(str(tmp_path / "serving")) == ["input_layer"]


def test_export_of_a_subclassed_model_saved_as_weights(tmp_path, capsys, monkeypatch):
    """keras-io's VAE (a subclassed model whose get_config cannot be written: a run
    saves its weights): its function takes no shapes, so the model is built on one
    example of the data its run file names, then given the weights."""
    import json

    from tests.corpus import vae
    from tests.corpus.synthetic import band_images
    from tfmulti.training import outputs

    monkeypatch.chdir(tmp_path)
    images = band_images(4, np.random.default_rng(0))
    model = vae.build()
    model(images, training=False)
    os.makedirs("run")
    model.save_weights("run/model.weights.h5")
    with open(os.path.join("run", outputs.RUN_FILE), "w") as f:
        json.dump({"config": {"model": "tests.corpus.vae:build", "seed": 0,
                              "dataset": "tests.corpus.vae:data"},
                   "published": ["model.weights.h5"], "finished": True}, f)
    code, err, out = cli_main(["export", "--model_dir=run", "--output=serving",
                               "--model=tests.corpus.vae:build"], capsys)
    assert code == 0, err
    import tensorflow as tf

    # Its decoder draws z at random: the served weights are compared, and it serves.
    loaded = tf.saved_model.load(str(tmp_path / "serving"))
    assert loaded.serve(images).shape == images.shape
    np.testing.assert_allclose(
        sorted(float(np.sum(v.numpy())) for v in loaded.trainable_variables),
        sorted(float(np.sum(v.numpy())) for v in model.trainable_weights), rtol=1e-6)
