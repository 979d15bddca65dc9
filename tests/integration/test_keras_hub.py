"""keras-hub's task models as keras-hub users fine-tune them, through tfmulti.

The programs (`tests/corpus/hub_*.py`) are the examples of keras-hub's own
docstrings, their preset downloads replaced by small random-initialized
backbones of the same classes:

- `hub_bert_token_ids`: a `BertTextClassifier` without a preprocessor, fed
  token ids, segment ids and a boolean padding mask;
- `hub_bert_text`: the same classifier with its `BertTextClassifierPreprocessor`,
  fed raw strings;
- `hub_gpt2_causal_lm`: a `GPT2CausalLM` with its preprocessor, fed raw text
  (no labels: the preprocessor makes them).

A keras-hub task overrides `fit`, `evaluate` and `predict` to run its
preprocessor over the data; tfmulti runs it in the input pipeline instead
(`tfmulti.models.own_fit`). Each run is compared with the program trained by
plain Keras on one device (keras-hub's own `fit`, the same seed:
`tests.corpus.harness.reference`): the test loss within the corpus' margin
and the test accuracy within `ACCURACY` of it. Each path is taken by the
programs that add something to it (a keras-hub task traces for seconds: every
run counts):

- the classifier on token ids (no preprocessor): `tfmulti train` on one
  device and on the pipeline's 2 stages (cut through the backbone), in this
  process;
- the classifier on raw strings (its preprocessor in the input pipeline,
  which also makes the boolean padding mask of the upstream MirroredStrategy
  crash): mirrored x 2 in this process, then 2 workers;
- the language model (its preprocessor makes the labels and the sample
  weights): 2 workers, each worker's share of the texts; its saved model
  generates text after it is loaded again.
"""

from __future__ import annotations

import json
import os

import keras
import numpy as np
import pytest

import tfmulti
from tests._util import WORKERS, cluster_python_warm
from tests.corpus import harness
from tfmulti import cli

ON_TWO_WORKERS = ("hub_bert_text", "hub_gpt2_causal_lm")
ACCURACY = 0.05
"""The largest difference in test accuracy from plain Keras on one device."""
ACCURACY_KEY = "test_sparse_categorical_accuracy"  # the tasks' own metric
MIRRORED = ("CPU:0", "CPU:1")
REPORTED = {"one_device": "OneDeviceStrategy", "mirrored": "MirroredStrategy",
            "pipeline": "pipeline", "multi_worker": "MultiWorkerMirroredStrategy"}
"""How metrics.json names each distribution."""
PROMPT, CONTINUATION = "a quick", "a quick fox"
"""The language model's texts are "a quick fox quick fox.": a model that learned
them continues the prompt with " fox" (greedy sampling)."""


@pytest.fixture(scope="module")
def references():
    """Each program trained once by plain Keras on one device, on demand."""
    cache = {}

    def get(name):
        if name not in cache:
            cache[name] = harness.reference(name)
        return cache[name]
    return get


def _assert_matches(name: str, metrics: dict, ref: dict, what: str) -> None:
    line = harness.assert_close(name, metrics, ref, what)
    got, want = metrics[ACCURACY_KEY], ref[ACCURACY_KEY]
    line += f", accuracy {got:.3f} vs {want:.3f}"
    print(line)
    assert abs(got - want) <= ACCURACY, line


def _generates(folder) -> str:
    """The language model saved in `folder`, loaded as keras-hub users load it,
    continuing `PROMPT` greedily."""
    loaded = keras.saving.load_model(os.path.join(folder, "model.keras"))
    assert loaded.preprocessor is not None  # saved with it, as keras-hub saves a task
    loaded.compile(sampler="greedy")  # keras-hub's own compile, not called by the load
    # No stop token: with its end token (id 0, which also pads) as the stop token,
    # keras-hub 0.32's generate adds nothing to the prompt, here as for the model
    # trained by keras-hub's own fit on one device.
    return loaded.generate(PROMPT, max_length=harness.load("hub_gpt2_causal_lm").SEQUENCE_LENGTH,
                           stop_token_ids=None)


@pytest.mark.slow
@pytest.mark.parametrize("distribution", ["one_device", "pipeline"])
def test_a_classifier_on_token_ids_trains_as_plain_keras(distribution, references, tmp_path,
                                                         capsys):
    """`tfmulti train --model=M:build` with a keras-hub classifier: its `fit`
    override would be handed tfmulti's distributed dataset (which it cannot
    read), so tfmulti trains it with Keras' own."""
    name = "hub_bert_token_ids"
    folder = tmp_path / "run"
    kwargs = harness.config_kwargs(name)
    args = ["train", f"--distribution={distribution}", f"--model_dir={folder}",
            *(f"--{key}={value}" for key, value in kwargs.items())]
    if distribution == "pipeline":
        args.append("--num_stages=2")
    assert cli.main(args) == 0
    out = capsys.readouterr().out
    assert "BertTextClassifier overrides fit to prepare its own input: it has no preprocessor" \
        in out, out[-2000:]
    if distribution == "pipeline":  # its sequence length, open in the model, from the data
        assert ("leaves a dimension of its activations open: counted at the training data's "
                "input shapes, padding_mask (32,), segment_ids (32,), token_ids (32,)") in out
        # The cut goes through the backbone (a model in the model): a transformer layer
        # on each stage.
        stages = [line for line in out.splitlines() if line.startswith(("0 ", "1 "))][:2]
        assert "transformer_layer_0" in stages[0] and "transformer_layer_1" in stages[1], out
    metrics = json.loads((folder / "metrics.json").read_text())
    assert metrics["distribution"] == REPORTED[distribution]
    _assert_matches(name, metrics, references(name), distribution)
    assert (folder / "model.keras").exists()


@pytest.mark.slow
def test_a_classifier_with_its_preprocessor_trains_from_raw_strings(references, tmp_path):
    """`tfmulti.train` on 2 mirrored replicas, the preprocessor in the input
    pipeline."""
    name = "hub_bert_text"
    folder = tmp_path / "run"
    metrics = tfmulti.train(tfmulti.TrainConfig(
        distribution="mirrored", devices=MIRRORED, model_dir=str(folder),
        **harness.config_kwargs(name)))
    assert metrics["num_replicas"] == len(MIRRORED)
    _assert_matches(name, metrics, references(name), "mirrored x 2")
    # Saved with its preprocessor: the loaded model classifies raw strings.
    loaded = keras.saving.load_model(folder / "model.keras")
    words = harness.load(name).WORDS
    sentences = np.array([" ".join(words[0]) + ".", " ".join(words[1]) + "."])
    assert np.argmax(loaded.predict(sentences, verbose=0), axis=-1).tolist() == [0, 1]


@pytest.mark.slow
@pytest.mark.parametrize("distribution", ["mirrored", "pipeline"])
def test_estimate_memory_sizes_what_the_preprocessor_makes(distribution, capsys):
    """The classifier takes raw strings: its memory is estimated on the token
    ids its preprocessor makes of the first examples (16 per sentence), which
    the pipeline's table also needs for the sequence length its model leaves
    open."""
    name = "hub_bert_text"
    args = ["estimate-memory", f"--distribution={distribution}", "--num_virtual_devices=2",
            f"--model=tests.corpus.{name}:build", f"--dataset=tests.corpus.{name}:data",
            "--global_batch_size=32", "--json"]
    if distribution == "pipeline":
        args.append("--num_stages=2")
    assert cli.main(args) == 0
    estimate = json.loads(capsys.readouterr().out)
    assert [row["device"] for row in estimate["devices"]] == [0, 1]
    assert all(row["activations"] > 0 for row in estimate["devices"]), estimate["devices"]
    if distribution == "pipeline":
        assert estimate["input_shapes_from_data"] == {
            "token_ids": [16], "segment_ids": [16], "padding_mask": [16]}


@pytest.fixture(scope="module")
def two_workers(tmp_path_factory):
    """The programs trained on 2 workers, one cluster for both."""
    out = tmp_path_factory.mktemp("two-workers")
    code, output = cluster_python_warm([str(WORKERS / "corpus.py"), str(out), *ON_TWO_WORKERS])
    return code, output, out


@pytest.mark.cluster
@pytest.mark.timeout(600)  # the first one starts the cluster that trains both
@pytest.mark.parametrize("name", ON_TWO_WORKERS)
def test_two_workers_match_plain_keras(name, two_workers, references):
    code, output, out = two_workers
    assert code == 0, output[-4000:]
    refused = out / f"{name}.refused"
    assert not refused.exists(), f"{name} refused on 2 workers: {refused.read_text()}"
    metrics = json.loads((out / name / "metrics.json").read_text())
    assert metrics["num_replicas"] == 2
    assert metrics["distribution"] == REPORTED["multi_worker"]
    _assert_matches(name, metrics, references(name), "2 workers")
    assert f"[worker 1] corpus: {name} trained" in output
    if name == "hub_gpt2_causal_lm":
        assert _generates(out / name).startswith(CONTINUATION)
