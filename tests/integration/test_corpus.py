"""The corpus (`tests/corpus`): published keras-io programs, their models as
published and their data synthetic, through every path tfmulti offers,
each compared with the program trained by plain Keras on one device (the
reference, `tests.corpus.harness.reference`: its source's compile and fit,
the same seed):

- mirrored: `tfmulti.train` in this process, MirroredStrategy over 2 of its 4
  virtual CPUs (`MIRRORED`);
- 2 workers: one 2-worker cluster for the whole corpus (`tests/workers/corpus.py`
  trains each program in turn; each worker started with its TF_CONFIG);
- pipeline: 2 stages, for the programs whose model is a chain of layers; the
  other (the VAE, a subclassed model) must refuse before training, in one
  line that says why, having written nothing;
- export: `tfmulti export` of each mirrored and pipeline run folder, the
  SavedModel loaded on one device: its loss on the test split is the test
  loss tfmulti reported, its input names the model's own.

Tolerances (reasoned in `tests/corpus/harness.py`): the test loss within
0.15 + 30% of the reference's, the test accuracy within 0.15 of it and at
least 0.1 above chance (the majority class's share); they differ at all by
the batch order, per-replica BatchNormalization statistics and Dropout masks.
The programs take 1-2 epochs of a few hundred examples each, as their
dataset functions return them: arrays, datasets, or (the segmentation) a
`keras.utils.PyDataset` that plain Keras' `fit` takes as it is.
"""

from __future__ import annotations

import inspect
import json
import os
import re

import keras
import numpy as np
import pytest

import tfmulti
from tfmulti import cli
from tfmulti.config import user_functions as hooks
from tfmulti.training import export
from tests._util import WORKERS, cluster_python_warm
from tests.corpus import harness
from tests.corpus.harness import PROGRAMS

MIRRORED = ("CPU:0", "CPU:1")
"""The mirrored runs' devices: 2 replicas. In-process MirroredStrategy hands each
step and all-reduce between one thread per replica; on a loaded machine each
hand-off waits for a core, so 4 replicas took several times the wall of 2 (the
text transformer 90 s) for the same cross-replica checks: split batches, summed
gradients, per-replica BatchNormalization statistics and Dropout masks."""
CHAINS = [name for name in PROGRAMS if harness.load(name).CHAIN]
NOT_CHAINS = [name for name in PROGRAMS if not harness.load(name).CHAIN]
LIGHT = [name for name in PROGRAMS if not getattr(harness.load(name), "HEAVY", False)]
"""The programs this module trains. A heavy program's compile costs seconds on every path:
tests/integration/test_corpus_heavy.py runs it through these tests (beside this module: the
suite gives each module to one test process), except the 2-worker cluster and the
pipeline's export."""
# Why a program cannot take the pipeline: words its refusal must contain.
PIPELINE_REFUSALS = {"vae": r"(?i)subclassed", "gan": r"(?i)subclassed",
                     "basic_ranking": r"(?i)subclassed",
                     "collaborative_filtering": r"(?i)subclassed",
                     "dcn_criteo": r"(?i)subclassed"}
# Why a program cannot be exported: words its refusal must contain.
EXPORT_REFUSALS = {"gan": r"has no call\(\) of its own, so it has nothing to serve"}


def _callbacks(module, folder):
    """The program's own callbacks (the time series' watch `val_loss`), writing under `folder`."""
    if not hasattr(module, "callbacks"):
        return []
    os.makedirs(folder)
    return module.callbacks(folder)


@pytest.fixture(scope="module")
def references(tmp_path_factory):
    """Each program's reference, trained once, on demand, with its own callbacks."""
    cache = {}

    def get(name):
        if name not in cache:
            folder = str(tmp_path_factory.mktemp(f"{name}-keras") / "callbacks")
            cache[name] = harness.reference(name, _callbacks(harness.load(name), folder))
            cache[name]["callbacks_dir"] = folder
        return cache[name]
    return get


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    """Each program trained by tfmulti once per distribution, on demand, with
    its own callbacks: (metrics, model_dir); the callbacks write next to
    model_dir, in `callbacks`."""
    cache = {}

    def get(name, distribution, **overrides):
        key = (name, distribution)
        if key not in cache:
            base = tmp_path_factory.mktemp(f"{name}-{distribution}")
            if distribution == "mirrored":
                overrides = {"devices": MIRRORED, **overrides}
            config = tfmulti.TrainConfig(distribution=distribution, model_dir=str(base / "run"),
                                         **harness.config_kwargs(name, **overrides))
            callbacks = _callbacks(harness.load(name), str(base / "callbacks"))
            cache[key] = (tfmulti.train(config, callbacks=callbacks), str(base / "run"))
        return cache[key]
    return get


@pytest.mark.slow
@pytest.mark.parametrize("name", LIGHT)
def test_mirrored_matches_plain_keras(name, runs, references):
    metrics, folder = runs(name, "mirrored")
    assert metrics["num_replicas"] == len(MIRRORED)
    print(harness.assert_close(name, metrics, references(name), "mirrored x 2"))
    with open(os.path.join(folder, "metrics.json")) as f:
        written = json.load(f)
    # The last epoch's logs: `loss` and the metrics, or a train step's own (the GAN's).
    trained = [k for k in metrics if k.startswith("train_") and k != "train_seconds"]
    assert trained and {k: written[k] for k in trained} == pytest.approx(
        {k: metrics[k] for k in trained})


LAZY = {"basic_ranking": "Adagrad", "collaborative_filtering": "Adam", "dcn_criteo": "AdamW"}
"""The recommenders, by optimizer. Adagrad's lazy update is its dense one (an
untouched row's gradient is zero, so the dense update leaves it too); Adam's
is not (its moments keep moving a row the batch did not touch), nor AdamW's
(its moments, and its weight decay shrinks every row every step)."""


@pytest.mark.slow
@pytest.mark.parametrize("name", [name for name in sorted(LAZY) if name in LIGHT])
def test_lazy_updates_train_the_recommenders(name, runs, references, tmp_path, capsys):
    """`sparse_updates='lazy'` on the published recommenders, mirrored: only the
    rows a batch touched are updated; where the optimizer's dense update leaves
    the others as they are, the run ends where the dense run ends; tables whose
    regularizer makes their gradient dense are named, updated densely; and the
    run trains as plain Keras does."""
    dense, _ = runs(name, "mirrored")
    config = tfmulti.TrainConfig(distribution="mirrored", devices=MIRRORED,
                                 model_dir=str(tmp_path / "run"),
                                 **harness.config_kwargs(name, sparse_updates="lazy"))
    lazy = tfmulti.train(config)
    said = [line for line in capsys.readouterr().out.splitlines()
            if line.startswith("tfmulti: sparse_updates=lazy:")]
    assert said[0].startswith(f"tfmulti: sparse_updates=lazy: {LAZY[name]} updates only the "
                              "rows"), said
    if name == "collaborative_filtering":  # its two vector tables carry l2(1e-6)
        dense_tables = (
            "tfmulti: sparse_updates=lazy: tables user_embedding (embeddings_regularizer), "
            "movie_embedding (embeddings_regularizer) update every row every step all the "
            "same (a regularizer's gradient covers the whole table; a constraint is applied "
            "to it whole after each update); drop them for lazy updates of these tables")
        assert said[1:] == [dense_tables], said
    else:
        assert said[1:] == [], said
    if LAZY[name] == "Adagrad":  # the one whose lazy update is its dense one
        assert lazy["test_loss"] == pytest.approx(dense["test_loss"], rel=1e-4)
    print(harness.assert_close(name, lazy, references(name), "mirrored x 2, lazy"))


@pytest.mark.slow
@pytest.mark.parametrize("name", [name for name in sorted(LAZY) if name in LIGHT])
def test_sharded_tables_train_the_recommenders(name, runs, tmp_path, capsys):
    """`shard_embeddings=True` on the published recommenders (subclassed
    models; the MovieLens one's regularized tables read whole for their
    penalty; the DCN's 39 tables, each of more rows than the 2 replicas),
    mirrored: every table split by rows, named in one line, and the test loss
    of the unsharded run."""
    whole, _ = runs(name, "mirrored")
    capsys.readouterr()
    config = tfmulti.TrainConfig(distribution="mirrored", devices=MIRRORED,
                                 model_dir=str(tmp_path / "run"),
                                 **harness.config_kwargs(name, shard_embeddings=True))
    sharded = tfmulti.train(config)
    said = [line for line in capsys.readouterr().out.splitlines()
            if line.startswith("tfmulti: shard_embeddings:")]
    tables = {"basic_ranking": 2, "collaborative_filtering": 4, "dcn_criteo": 39}[name]
    assert len(said) == 1 and said[0].count(" x ") == tables, said
    assert sharded["test_loss"] == pytest.approx(whole["test_loss"], rel=1e-5)


@pytest.mark.slow
def test_callbacks_watching_val_loss_work(runs, references):
    """The time series' published callbacks watch `val_loss` of its
    `validation_split=0.2`: tfmulti validates every epoch, so the checkpoint
    of the best model is written, as plain Keras writes it, and the
    validation loss agrees with plain Keras'."""
    name = "timeseries_classification"
    metrics, folder = runs(name, "mirrored")
    ref = references(name)
    assert os.path.exists(os.path.join(ref["callbacks_dir"], "best_model.keras"))
    assert os.path.exists(os.path.join(os.path.dirname(folder), "callbacks", "best_model.keras"))
    ref_val = ref["history"]["val_loss"][-1]
    assert abs(metrics["val_loss"] - ref_val) <= harness.LOSS_ABS + harness.LOSS_REL * ref_val, (
        metrics["val_loss"], ref_val)


@pytest.mark.slow
@pytest.mark.parametrize("name", [name for name in CHAINS if name in LIGHT])
def test_pipeline_matches_plain_keras(name, runs, references):
    metrics, folder = runs(name, "pipeline", num_stages=2)
    assert metrics["distribution"] == "pipeline"
    print(harness.assert_close(name, metrics, references(name), "pipeline, 2 stages"))
    # the model whole, or (layers that cannot be rebuilt from their config) its weights
    assert {"model.keras", "model.weights.h5"} & set(os.listdir(folder)), os.listdir(folder)


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


def _serve(path, features, batch: int | None = None) -> tuple[list[str], np.ndarray | dict]:
    """The SavedModel at `path` loaded on one device: its serving signature's
    input names, and what it returns for `features` (a dict by input name, or
    one array for a single input), all in one call or in batches of `batch`:
    one array, or a dict by output name for a model of several outputs."""
    import tensorflow as tf

    loaded = tf.saved_model.load(path)
    signature = loaded.signatures["serving_default"]
    specs = signature.structured_input_signature[1]
    if not isinstance(features, dict):
        (only,) = specs
        features = {only: features}
    inputs = {}
    for name, spec in specs.items():
        value = np.asarray(features[name])
        if value.ndim == len(spec.shape) - 1:  # a column of scalars for an Input of shape (1,)
            value = value[..., None]
        inputs[name] = tf.constant(value, dtype=spec.dtype)
    size = len(next(iter(inputs.values())))
    step = batch or size
    calls = [signature(**{k: v[i:i + step] for k, v in inputs.items()})
             for i in range(0, size, step)]
    served = {name: np.concatenate([np.asarray(c[name]) for c in calls]) for name in calls[0]}
    return sorted(specs), (next(iter(served.values())) if len(served) == 1 else served)


def _base(name: str) -> str:
    """An input's name without the suffix Keras adds to make it unique in a process."""
    return re.sub(r"_\d+$", "", name)


def _own_input_names(name: str) -> list[str] | None:
    """The names of the program's model's `Input`s (its InputLayers: what
    `keras.Input(name=...)` names), built afresh, without their uniquifying
    suffix; None for a subclassed model, which has no Inputs of its own."""
    module = harness.load(name)
    offered = {"seed": harness.SEED}
    if "input_shape" in inspect.signature(module.build).parameters:
        offered["input_shape"] = harness.held_out(name)[0].shape[1:]
    model = hooks.call(module.build, offered, "model")
    try:
        inputs = model.inputs
    except (AttributeError, ValueError):
        inputs = None
    if not inputs:  # subclassed
        return None
    # Keras keeps the layer that made a tensor in its (private) history only.
    return sorted(_base(t._keras_history.operation.name) for t in inputs)


def _loss(module, folder: str, labels, served):
    """The program's compiled loss of `served` (what the SavedModel returned)
    against `labels`: the loss its source compiles, or (a model function that
    compiles) the run's saved model's compiled loss, its weights per output
    included, or where the run saved weights only, the model function's."""
    if module.COMPILE is not None:
        labels = np.asarray(labels)
        if labels.size == served.size:  # one label per output unit: (n,) for (n, 1)
            labels = labels.reshape(served.shape)
        return np.mean(keras.losses.get(module.COMPILE["loss"])(labels, served))
    path = os.path.join(folder, "model.keras")
    # A model saved as weights only (a subclassed one without get_config): the
    # model function's own compile, as the author wrote it.
    compiled = keras.models.load_model(path) if os.path.exists(path) else module.build()
    return compiled.compute_loss(y=labels, y_pred=served)


def _added_loss(module, folder: str, features, labels, batch: int) -> float | None:
    """For a model whose layers add losses (`add_loss`, regularizers), the added
    term in its one-device test loss: the saved model's `evaluate` less the
    compiled loss of its predictions, at batches of `batch`. (On N replicas Keras scales each
    replica's added term by 1/N, so a term summed over the batch counts less
    there: between 0 and this.) None for a model that adds none."""
    path = os.path.join(folder, "model.keras")
    weights = os.path.join(folder, export.WEIGHTS_FILE)
    if module.COMPILE is None:
        return None
    if os.path.exists(path):
        saved = keras.models.load_model(path, custom_objects=export.user_objects(module))
    elif os.path.exists(weights):  # a subclassed model without get_config: built again
        saved = export.rebuild(folder, f"{module.__name__}:build", weights)
    else:
        return None
    saved(features[:2] if not isinstance(features, dict) else
          {k: v[:2] for k, v in features.items()}, training=False)
    if not saved.losses:
        return None
    saved.compile(loss=module.COMPILE["loss"])
    evaluated = saved.evaluate(features, labels, batch_size=batch, verbose=0,
                               return_dict=True)["loss"]
    predicted = saved.predict(features, batch_size=batch, verbose=0)
    return float(evaluated) - float(_loss(module, folder, labels, predicted))


EXPORTS = ([(name, "mirrored") for name in LIGHT]
           + [(name, "pipeline") for name in CHAINS if name in LIGHT])


@pytest.mark.slow
@pytest.mark.parametrize("name,distribution", EXPORTS)
def test_export_serves_the_trained_model(name, distribution, runs, tmp_path, capsys):
    """`tfmulti export` of a run folder, the SavedModel loaded on one device:
    its predictions on the test split have the loss tfmulti reported (the
    reported test loss is the trained model's, and the export is that
    model), and its input names are the model's own Inputs' names, whichever
    distribution trained it. A model without a `call` of its own (the GAN)
    is refused in one line: it has nothing to serve."""
    module = harness.load(name)
    held_out = harness.held_out(name)
    metrics, folder = runs(name, distribution,
                           **({"num_stages": 2} if distribution == "pipeline" else {}))
    out = str(tmp_path / "serving")
    code = cli.main(["export", "--model_dir", folder, "--output", out,
                     "--model", f"tests.corpus.{name}:build"])
    if name in EXPORT_REFUSALS:
        assert code == 2
        (line,) = capsys.readouterr().err.strip().splitlines()
        assert re.search(EXPORT_REFUSALS[name], line), line
        assert not os.path.exists(out)
        return
    assert code == 0, capsys.readouterr().err
    if held_out is None:  # the VAE: images in, images out
        images = np.stack(list(module.data(seed=harness.SEED)["train"].take(8)
                               .as_numpy_iterator()))
        names, served = _serve(out, images)
        assert served.shape == images.shape
    else:
        features, labels = held_out
        # A model whose prediction depends on its batch (BATCH_DEPENDENT) was
        # evaluated in batches of the run's per-replica size, in order: served so.
        batch = (metrics["per_replica_batch_size"] if getattr(module, "BATCH_DEPENDENT", False)
                 else None)
        names, served = _serve(out, features, batch)
        loss = float(_loss(module, folder, labels, served))
        added = _added_loss(module, folder, features, labels, batch or harness.GLOBAL_BATCH)
        # The run's loss is Keras' from the logits a sigmoid or softmax output
        # carries, the served one from its probabilities (clipped at 1e-7): they
        # differ only where an example's probability is that close to 0 or 1.
        if added is None:
            assert loss == pytest.approx(metrics["test_loss"], rel=1e-3, abs=1e-6)
        else:  # the reported loss also holds the model's added term, up to one device's
            assert -1e-5 <= metrics["test_loss"] - loss <= added + 1e-5, (
                metrics["test_loss"], loss, added)
    own = _own_input_names(name)
    if own is not None:
        assert sorted(_base(n) for n in names) == own


@pytest.fixture(scope="module")
def two_workers(tmp_path_factory):
    """Every program trained on 2 workers, one cluster for the whole corpus."""
    out = tmp_path_factory.mktemp("two-workers")
    code, output = cluster_python_warm([str(WORKERS / "corpus.py"), str(out), *LIGHT])
    return code, output, out


@pytest.mark.cluster
@pytest.mark.timeout(600)  # the first one launches the cluster that trains all six
@pytest.mark.parametrize("name", LIGHT)
def test_two_workers_match_plain_keras(name, two_workers, references):
    code, output, out = two_workers
    # A worker that dies takes the other one down with it ("tasks stopped sending
    # heartbeats"): the message shows each worker's last lines, not only the end.
    assert code == 0, "\n".join(
        "\n".join([line for line in output.splitlines() if line.startswith(f"[worker {i}]")][-25:])
        for i in (1, 0)) + "\n" + output[-600:]
    refused = out / f"{name}.refused"
    assert not refused.exists(), f"{name} refused on 2 workers: {refused.read_text()}"
    with open(out / name / "metrics.json") as f:
        metrics = json.load(f)
    assert metrics["num_replicas"] == 2
    print(harness.assert_close(name, metrics, references(name), "2 workers"))
    assert f"[worker 1] corpus: {name} trained" in output
