"""The corpus (`tests/corpus`): published keras-io programs, their models as
published and their data synthetic, through every path tfmulti offers,
each compared with the program trained by plain Keras on one device (the
reference, `tests.corpus.harness.reference`: its source's compile and fit,
the same seed):

- mirrored: `tfmulti.train` in this process, MirroredStrategy over its 4
  virtual CPUs;
- 2 workers: one `tfmulti launch --num_workers 2` for the whole corpus
  (`tests/workers/corpus.py` trains each program in turn);
- pipeline: 2 stages, for the programs whose model is a chain of layers; the
  other (the VAE, a subclassed model) must refuse before training, in one
  line that says why, having written nothing;
- export: `tfmulti export` of the mirrored and the pipeline run folders, the
  SavedModel reloaded on one device predicts what the saved model.keras does,
  under the model's own input names; the reported test loss is the saved
  model's loss on the test split.

Tolerances (reasoned in `tests/corpus/harness.py`): the test loss within
0.15 + 30% of the reference's, the test accuracy within 0.15 of it and at
least 0.1 above chance (the majority class's share); they differ at all by
the batch order, per-replica BatchNormalization statistics and Dropout masks.
The programs take 1-2 epochs of a few hundred examples each.
"""

from __future__ import annotations

import json
import os
import sys

import numpy as np
import pytest

import tfmulti
from tests._util import REPO, WORKERS, launch_python
from tests.corpus import harness
from tests.corpus.harness import PROGRAMS

CHAINS = [name for name in PROGRAMS if harness.load(name).CHAIN]
NOT_CHAINS = [name for name in PROGRAMS if not harness.load(name).CHAIN]
# Why a program cannot take the pipeline: words its refusal must contain.
PIPELINE_REFUSALS = {"vae": r"(?i)subclassed"}


@pytest.fixture(scope="module")
def references():
    """Each program's reference, trained once, on demand."""
    cache = {}

    def get(name):
        if name not in cache:
            cache[name] = harness.reference(name)
        return cache[name]
    return get


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    """Each program trained by tfmulti once per distribution, on demand:
    (metrics, model_dir)."""
    cache = {}

    def get(name, distribution, **overrides):
        key = (name, distribution)
        if key not in cache:
            folder = str(tmp_path_factory.mktemp(f"{name}-{distribution}") / "run")
            config = tfmulti.TrainConfig(distribution=distribution, model_dir=folder,
                                         **harness.config_kwargs(name, **overrides))
            cache[key] = (tfmulti.train(config), folder)
        return cache[key]
    return get


@pytest.mark.slow
@pytest.mark.parametrize("name", PROGRAMS)
def test_mirrored_matches_plain_keras(name, runs, references):
    metrics, folder = runs(name, "mirrored")
    assert metrics["num_replicas"] == 4
    print(harness.assert_close(name, metrics, references(name), "mirrored x 4"))
    with open(os.path.join(folder, "metrics.json")) as f:
        assert json.load(f)["train_loss"] == pytest.approx(metrics["train_loss"])


@pytest.mark.slow
def test_callbacks_watching_val_loss_work(tmp_path):
    """The time series' published callbacks watch `val_loss` of its
    `validation_split=0.2`: tfmulti validates every epoch, so the checkpoint
    of the best model is written, as plain Keras writes it."""
    name = "timeseries_classification"
    module = harness.load(name)
    ref = harness.reference(name, callbacks=module.callbacks(tmp_path / "keras"))
    (tmp_path / "tfmulti").mkdir()
    metrics = tfmulti.train(
        tfmulti.TrainConfig(distribution="mirrored", **harness.config_kwargs(name)),
        callbacks=module.callbacks(tmp_path / "tfmulti"))
    assert (tmp_path / "keras" / "best_model.keras").exists()
    assert (tmp_path / "tfmulti" / "best_model.keras").exists()
    ref_val = ref["history"]["val_loss"][-1]
    assert abs(metrics["val_loss"] - ref_val) <= harness.LOSS_ABS + harness.LOSS_REL * ref_val, (
        metrics["val_loss"], ref_val)


@pytest.mark.slow
@pytest.mark.parametrize("name", CHAINS)
def test_pipeline_matches_plain_keras(name, runs, references):
    metrics, folder = runs(name, "pipeline", num_stages=2)
    assert metrics["distribution"] == "pipeline"
    print(harness.assert_close(name, metrics, references(name), "pipeline, 2 stages"))
    assert os.path.exists(os.path.join(folder, "model.keras"))


@pytest.mark.slow
@pytest.mark.parametrize("name", NOT_CHAINS)
def test_pipeline_refuses_before_training(name, tmp_path, capsys):
    folder = tmp_path / "run"
    config = tfmulti.TrainConfig(distribution="pipeline", num_stages=2, model_dir=str(folder),
                                 **harness.config_kwargs(name))
    with pytest.raises(ValueError, match=PIPELINE_REFUSALS[name]) as refused:
        tfmulti.train(config)
    assert "\n" not in str(refused.value)
    assert not folder.exists() or not os.listdir(folder)
    assert "Epoch" not in capsys.readouterr().out


def _served(path, features):
    import tensorflow as tf

    loaded = tf.saved_model.load(path)
    signature = loaded.signatures["serving_default"]
    names = sorted(signature.structured_input_signature[1])
    if isinstance(features, dict):
        inputs = {k: tf.constant(v) for k, v in features.items()}
    else:
        inputs = {names[0]: tf.constant(features)}
    out = signature(**inputs)
    return names, np.asarray(next(iter(out.values())))


def _model_input_names(model):
    return sorted(t.name for t in model.inputs) if getattr(model, "inputs", None) else None


@pytest.mark.slow
@pytest.mark.parametrize("name", PROGRAMS)
def test_export_reloads_on_one_device(name, runs, tmp_path, capsys):
    """`tfmulti export` of each run folder (mirrored; pipeline for a chain):
    the SavedModel reloaded on one device predicts what model.keras predicts,
    under the model's own input names, whichever distribution trained it; the
    reported test loss is model.keras' loss on the test split."""
    import keras

    module = harness.load(name)
    held_out = harness.held_out(name)
    features = (held_out[0] if held_out is not None
                else np.stack(list(module.data(seed=harness.SEED)["train"]
                                   .take(8).as_numpy_iterator())))
    features = ({k: v[:8] for k, v in features.items()} if isinstance(features, dict)
                else features[:8])
    input_names = set()
    for distribution in ["mirrored"] + (["pipeline"] if module.CHAIN else []):
        metrics, folder = runs(name, distribution, **(
            {"num_stages": 2} if distribution == "pipeline" else {}))
        out = str(tmp_path / f"serving-{distribution}")
        code = tfmulti.cli.main(["export", "--model_dir", folder, "--output", out,
                                 "--model", f"tests.corpus.{name}"])
        assert code == 0, capsys.readouterr().err
        saved = keras.saving.load_model(os.path.join(folder, "model.keras"), compile=False)
        names, served = _served(out, features)
        np.testing.assert_allclose(served, np.asarray(saved.predict(features, verbose=0)),
                                   rtol=1e-5, atol=1e-5)
        own = _model_input_names(saved)
        if own is not None:
            assert names == own, (distribution, names, own)
        input_names.add(tuple(names))
        if held_out is not None:
            saved.compile(**module.COMPILE)
            results = saved.evaluate(*held_out, batch_size=harness.GLOBAL_BATCH, verbose=0,
                                     return_dict=True)
            assert metrics["test_loss"] == pytest.approx(results["loss"], rel=1e-4, abs=1e-5)
    assert len(input_names) == 1, input_names


@pytest.fixture(scope="module")
def two_workers(tmp_path_factory):
    """Every program trained on 2 workers, one launch for the whole corpus."""
    out = tmp_path_factory.mktemp("two-workers")
    code, output = launch_python([str(WORKERS / "corpus.py"), str(out), *PROGRAMS],
                                 startup_timeout=120)
    return code, output, out


@pytest.mark.cluster
@pytest.mark.parametrize("name", PROGRAMS)
def test_two_workers_match_plain_keras(name, two_workers, references):
    code, output, out = two_workers
    assert code == 0, output[-3000:]
    refused = out / f"{name}.refused"
    assert not refused.exists(), f"{name} refused on 2 workers: {refused.read_text()}"
    with open(out / name / "metrics.json") as f:
        metrics = json.load(f)
    assert metrics["num_replicas"] == 2
    print(harness.assert_close(name, metrics, references(name), "2 workers"))
    assert f"[worker 1] corpus: {name} trained" in output
