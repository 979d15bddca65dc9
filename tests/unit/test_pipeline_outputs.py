"""Nothing trained is lost (issue 28, deliver 1): a pipeline's unpartitioned
model is the user's own model (no `clone_model`, no `from_config`), and a run
whose model would not load back from a model.keras (a layer of the user's
without `**kwargs`, as keras-io's `TokenAndPositionEmbedding`) says so before
training and saves its weights, with one line on how to reload them; a save
that fails at the end falls back to the weights too.

In-process, on the virtual CPUs of tests/conftest.py, with the corpus's text
transformer (tests/corpus/text_transformer.py, its layers as published). The
recipe run is in tests/integration/test_pipeline_outputs.py.
"""

from __future__ import annotations

import json
import os

import keras
import numpy as np
import pytest

from tests.corpus import text_transformer as tx
from tfmulti.config.train_config import TrainConfig
from tfmulti.parallel import PipelineModel
from tfmulti.models import rebuild
from tfmulti.training import outputs
from tfmulti.training.train import train

SEQ = (tx.MAXLEN,)
TINY = dict(model=tx.build, dataset=tx.data, loss="sparse_categorical_crossentropy",
            global_batch_size=64, epochs=1, steps_per_epoch=2, seed=0, verbose=0)


def _trained_pipeline(model, **kwargs) -> PipelineModel:
    (x, y), _ = tx.data()
    pipeline = PipelineModel(model, devices=["CPU:0", "CPU:1"], num_microbatches=2, **kwargs)
    pipeline.compile(optimizer="adam", loss="sparse_categorical_crossentropy")
    pipeline.fit(x[:64], y[:64], batch_size=32, epochs=1, verbose=0)
    return pipeline


@pytest.mark.slow  # trains for seconds: not in make test-fast
def test_to_model_is_the_users_model_and_its_weights_reload_into_a_fresh_build(tmp_path):
    """Finding 1: to_model() cloned the model (TypeError on the layer without
    **kwargs); now it is the model given, trained, and its weights load into the
    model the user's function builds again, with the pipeline's predictions."""
    model = tx.build(SEQ)
    pipeline = _trained_pipeline(model)
    assert pipeline.to_model() is model
    assert pipeline.given is model
    named = pipeline.to_model(name="renamed")  # a new model over the same layers
    assert named.name == "renamed" and [id(l) for l in named.layers] == [
        id(l) for l in model.layers]
    path = str(tmp_path / "model.weights.h5")
    model.save_weights(path)
    fresh = tx.build(SEQ)
    fresh.load_weights(path)
    x = tx.data()[1][0][:32]
    np.testing.assert_allclose(fresh.predict(x, verbose=0), pipeline.predict(x, verbose=0),
                               atol=1e-6)


def test_to_sequential_of_layers_is_a_sequential_of_those_layers_and_round_trips(tmp_path):
    """A stack given as a list of layers: a Sequential of the same layer objects,
    after its Input; a plain-layer model saves and loads as .keras."""
    layers = [keras.layers.Dense(8, activation="relu"), keras.layers.Dense(3)]
    pipeline = PipelineModel(layers, input_shape=(4,), devices=["CPU:0", "CPU:1"])
    pipeline.compile(optimizer="sgd", loss="mse")
    x, y = np.ones((8, 4), np.float32), np.zeros((8, 3), np.float32)
    pipeline.fit(x, y, batch_size=8, epochs=1, verbose=0)
    plain = pipeline.to_sequential()
    assert isinstance(plain, keras.Sequential) and plain.layers == layers
    assert plain.name == "pipeline_sequential" and pipeline.to_model(name="mine").name == "mine"
    plain.save(tmp_path / "model.keras")
    loaded = keras.saving.load_model(tmp_path / "model.keras")
    np.testing.assert_allclose(loaded.predict(x, verbose=0), pipeline.predict(x, verbose=0),
                               atol=1e-6)
    given = keras.Sequential([keras.Input((4,)), keras.layers.Dense(3), keras.layers.Dense(3)],
                             name="given")
    pipeline = PipelineModel(given, devices=["CPU:0", "CPU:1"])
    pipeline.predict(x, verbose=0)  # builds the stages
    assert pipeline.to_sequential() is given and pipeline.to_model() is given


@pytest.mark.slow  # trains for seconds: not in make test-fast
@pytest.mark.parametrize("replicas,stages,shards", [(1, 2, 2), (2, 2, 1)])
def test_the_builtin_transformer_and_a_hybrid_still_save_and_load(tmp_path, replicas, stages,
                                                                  shards):
    """Their unpartitioned model (the layers the stages train, on their devices)
    saves as .keras and loads with the pipeline's predictions."""
    from tfmulti.parallel import build_parallel_transformer

    pipeline = build_parallel_transformer(num_replicas=replicas, num_stages=stages,
                                          tensor_parallel=shards, num_microbatches=2, seq_len=8,
                                          d_model=16, num_heads=4, num_layers=1, seed=0)
    pipeline.compile(optimizer="adam", loss=keras.losses.SparseCategoricalCrossentropy(True))
    tokens = np.random.default_rng(0).integers(0, 256, (16, 8)).astype("int32")
    pipeline.fit(tokens, tokens, batch_size=16, epochs=1, verbose=0)
    assert pipeline.to_model() is pipeline.given
    plain = pipeline.to_model(name="transformer")  # as the recipe saves it
    plain.save(tmp_path / "model.keras")
    loaded = keras.saving.load_model(tmp_path / "model.keras")
    np.testing.assert_allclose(loaded.predict(tokens, verbose=0),
                               pipeline.predict(tokens, verbose=0), atol=1e-5)


class _Scale(keras.layers.Layer):
    def __init__(self, factor):  # no **kwargs, as published examples often are
        super().__init__()
        self.factor = factor

    def call(self, x):
        return x * self.factor


class _BadConfig(keras.layers.Layer):
    def get_config(self):
        raise RuntimeError("not today")

    def call(self, x):
        return x


def _functional(layer):
    inputs = keras.Input((2,))
    return keras.Model(inputs, layer(keras.layers.Dense(2)(inputs)))


def test_rebuild_problem_names_the_layer_and_the_cause():
    problem = rebuild.rebuild_problem(tx.build(SEQ))
    assert problem.startswith("layer TokenAndPositionEmbedding 'token_and_position_embedding")
    assert "(also TransformerBlock): it cannot be rebuilt from its config " in problem
    assert problem.endswith("got an unexpected keyword argument 'trainable')")
    assert "get_config() raises RuntimeError (not today)" in rebuild.rebuild_problem(
        _functional(_BadConfig()))
    assert "layer _Scale " in rebuild.rebuild_problem([keras.layers.Dense(2), _Scale(2.0)])
    assert rebuild.rebuild_problem(_functional(keras.layers.Dense(3))) is None


class _Trained(keras.callbacks.Callback):
    """Keeps the model `train` trained, to compare its predictions."""

    def on_train_end(self, logs=None):
        self.trained = self.model


def _assert_the_weights_reload(model_dir, trained, fresh, x) -> None:
    """model.weights.h5 and metrics.json, no model.keras, as the run file
    records; loaded into the model built again, the trained model's predictions."""
    assert outputs.published_model(str(model_dir)) == "model.weights.h5"
    assert sorted(n for n in os.listdir(model_dir) if not n.startswith(".")) == [
        "logs", "metrics.json", "model.weights.h5"]
    record = outputs.read_record(str(model_dir))
    assert record.finished and "model.keras" not in record.published
    assert {"metrics.json", "model.weights.h5"} <= set(record.published)
    fresh.load_weights(str(model_dir / "model.weights.h5"))
    np.testing.assert_allclose(fresh.predict(x, verbose=0), trained.predict(x, verbose=0),
                               atol=1e-5)


@pytest.mark.slow  # trains for seconds: not in make test-fast
def test_a_pipeline_run_of_a_model_that_cannot_be_reloaded_saves_its_weights(tmp_path, capsys):
    """The issue's run: the pipeline trained, then died in to_model() with
    nothing written. Now: one line before training (the layer, the cause and
    the fix), the weights and metrics.json at the end, one line on reloading."""
    model_dir, kept = tmp_path / "run", _Trained()
    config = TrainConfig(distribution="pipeline", devices=("CPU:0", "CPU:1"),
                         num_microbatches=2, model_dir=str(model_dir), **TINY)
    metrics = train(config, callbacks=[kept])
    assert json.loads((model_dir / "metrics.json").read_text()) == metrics
    lines = capsys.readouterr().out.splitlines()
    before = [i for i, line in enumerate(lines) if "will save the model's weights only" in line]
    assert len(before) == 1
    assert lines[before[0]].startswith(
        "tfmulti: this run will save the model's weights only (model.weights.h5, not "
        "model.keras): layer TokenAndPositionEmbedding ")
    assert lines[before[0]].endswith(
        f"unexpected keyword argument 'trainable'); to save it whole, in its class, "
        f"{rebuild.FIX}, then restart")
    path = str(model_dir / "model.weights.h5")
    after = [i for i, line in enumerate(lines) if line.startswith("tfmulti: saved the model's")]
    assert len(after) == 1 and before[0] < after[0]
    assert lines[after[0]].startswith(
        f"tfmulti: saved the model's weights only, to {path} (model.keras would not load back: "
        "layer TokenAndPositionEmbedding ")
    assert lines[after[0]].endswith(
        f"; to reload them, build the model with the run's model function "
        f"({config.model_name}), then call model.load_weights({path!r})")
    assert f"tfmulti: wrote metrics.json, model.weights.h5 and logs/ to {model_dir}" in lines
    assert not any("Traceback" in line for line in lines)
    _assert_the_weights_reload(model_dir, kept.trained, tx.build(SEQ), tx.data()[1][0][:32])


@pytest.mark.slow  # trains for seconds: not in make test-fast
def test_a_save_that_fails_at_the_end_falls_back_to_the_weights(tmp_path, capsys, monkeypatch):
    """Done-when: a failure forced at the end of training (saving the model raises,
    although its configs round-trip) still leaves the weights, reloadable, and
    metrics.json; the run file records only what was written."""
    from tfmulti.models.builders import build_model

    model_dir, kept = tmp_path / "run", _Trained()

    def broken_save(self, *args, **kwargs):
        raise TypeError("simulated: cannot serialize this")

    monkeypatch.setattr(keras.Model, "save", broken_save)
    metrics = train(TrainConfig(distribution="one_device", model="mlp", dataset="synthetic",
                                num_examples=256, global_batch_size=64, epochs=1, seed=0,
                                verbose=0, model_dir=str(model_dir)), callbacks=[kept])
    assert json.loads((model_dir / "metrics.json").read_text()) == metrics
    out = capsys.readouterr().out
    path = str(model_dir / "model.weights.h5")
    assert (f"tfmulti: saved the model's weights only, to {path} (model.keras could not be "
            "written: saving it raised TypeError (simulated: cannot serialize this)); to reload "
            "them, build the model with the run's model function (mlp), then call "
            f"model.load_weights({path!r})") in out.splitlines()
    assert "will save the model's weights only" not in out  # its configs round-trip
    x = np.random.default_rng(0).random((16, 28, 28, 1)).astype(np.float32)
    _assert_the_weights_reload(model_dir, kept.trained,
                               build_model("mlp", input_shape=(28, 28, 1)), x)


def _write(names, content="new"):
    def write(stage):
        for name in names:
            with open(os.path.join(stage, name), "w") as f:
                f.write(f"{name} of the {content} run")
    return write


def test_weights_replace_a_runs_model_keras_and_a_foreign_one_is_refused(tmp_path):
    """The run file records model.weights.h5 as a published output: `overwrite`
    replaces it (and a model.keras of the run before), and refuses one no run wrote."""
    folder = str(tmp_path / "run")
    outputs.claim(folder, {"run": 1}, overwrite=False, resumable=False)
    outputs.publish(folder, {"run": 1}, _write(["metrics.json", "model.keras"], "old"))
    outputs.claim(folder, {"run": 2}, overwrite=True, resumable=False)
    outputs.publish(folder, {"run": 2}, _write(["metrics.json", "model.weights.h5"]),
                    model_file="model.weights.h5")
    assert sorted(os.listdir(folder)) == [".tfmulti-run.json", "metrics.json",
                                          "model.weights.h5"]
    assert outputs.read_record(folder).published == ["metrics.json", "model.weights.h5"]
    outputs.claim(folder, {"run": 3}, overwrite=True, resumable=False)  # replaces it in turn
    outputs.publish(folder, {"run": 3}, _write(["metrics.json", "model.keras"]))
    assert outputs.published_model(folder) == "model.keras"
    assert not os.path.exists(os.path.join(folder, "model.weights.h5"))
    (tmp_path / "run" / "model.weights.h5").write_text("the user's weights")
    with pytest.raises(ValueError, match=r"holds model.weights.h5, which no tfmulti run wrote"):
        outputs.claim(folder, {"run": 4}, overwrite=True, resumable=False)
    with pytest.raises(ValueError, match=r"`model_file` must be one of"):
        outputs.publish(folder, {"run": 3}, _write([]), model_file="model.h5")


def test_a_write_that_raises_leaves_the_run_file_as_it_was(tmp_path):
    """Nothing was renamed: the run file is as before, so publishing the weights
    instead records only them (no model.keras recorded, the old one removed)."""
    folder = str(tmp_path / "run")
    outputs.claim(folder, {"run": 1}, overwrite=False, resumable=False)
    outputs.publish(folder, {"run": 1}, _write(["metrics.json", "model.keras"], "old"))
    outputs.claim(folder, {"run": 2}, overwrite=True, resumable=True)
    claimed = outputs.read_record(folder)

    def failing(stage):
        raise TypeError("cannot serialize")

    with pytest.raises(TypeError, match="cannot serialize"):
        outputs.publish(folder, {"run": 2}, failing)
    assert outputs.read_record(folder) == claimed
    outputs.publish(folder, {"run": 2}, _write(["metrics.json", "model.weights.h5"]),
                    model_file="model.weights.h5")
    assert outputs.read_record(folder).published == ["metrics.json", "model.weights.h5"]
    assert sorted(os.listdir(folder)) == [".tfmulti-run.json", "metrics.json",
                                          "model.weights.h5"]


@pytest.mark.slow  # trains for seconds: not in make test-fast
def test_a_finished_run_that_saved_its_weights_is_not_trained_again(tmp_path, capsys):
    """A resumable run finds its published outputs by model.weights.h5 as well as
    by model.keras: run again, it reports the metrics it wrote, trains nothing."""
    config = TrainConfig(distribution="one_device", model_dir=str(tmp_path / "run"),
                         backup_dir=str(tmp_path / "backup"), **TINY)
    metrics = train(config)
    assert outputs.published_model(config.model_dir) == "model.weights.h5"
    capsys.readouterr()
    assert train(config) == metrics
    assert "tfmulti: this run has finished already" in capsys.readouterr().out


def test_a_hybrid_of_layers_that_cannot_be_copied_is_refused_in_one_line_before_training():
    """Replicas 1+ are copies (rebuilt from configs): a layer without **kwargs
    made a 40-line TypeError; now a ValueError naming the layer and the fix."""
    with pytest.raises(ValueError, match=r"^the hybrid's replicas 1\+ are copies of replica 0's "
                                         r"stages, .* and layer TokenAndPositionEmbedding .*"
                                         r"unexpected keyword argument 'trainable'\); in its "
                                         r"class, take \*\*kwargs .* train one replica"):
        PipelineModel(tx.build(SEQ), devices=["CPU:0", "CPU:1", "CPU:2", "CPU:3"],
                      num_replicas=2)
