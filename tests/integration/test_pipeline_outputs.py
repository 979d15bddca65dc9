"""Nothing trained is lost, through recipes/train.py (issue 28, deliver 1): the
pipeline run of a user's model whose layers take no `**kwargs` (the corpus's
text transformer, as published) used to train, then die in `to_model()` with a
traceback and nothing written. (The in-process tests are in
tests/unit/test_pipeline_outputs.py.)
"""

from __future__ import annotations

import json

import pytest

from tests._util import run_recipe_warm


@pytest.mark.slow
def test_a_pipeline_run_of_a_users_model_without_kwargs_ends_with_its_outputs(tmp_path):
    model_dir = tmp_path / "run"
    result = run_recipe_warm(
        "train", "--distribution=pipeline", "--num_virtual_devices=2", "--num_stages=2",
        "--num_microbatches=2", "--model=tests.corpus.text_transformer:build",
        "--dataset=tests.corpus.text_transformer:data", "--global_batch_size=64",
        "--epochs=1", "--steps_per_epoch=2", "--verbose=0", f"--model_dir={model_dir}")
    assert result.returncode == 0, result.stderr[-3000:]
    assert "Traceback" not in result.stderr
    metrics = json.loads((model_dir / "metrics.json").read_text())
    assert metrics["distribution"] == "pipeline" and metrics["epochs_completed"] == 1
    path = model_dir / "model.weights.h5"
    saved = [line for line in result.stdout.splitlines()
             if line.startswith("tfmulti: saved the model's weights only")]
    assert len(saved) == 1 and "layer TokenAndPositionEmbedding" in saved[0], result.stdout
    assert saved[0].endswith(f"(tests.corpus.text_transformer:build), then call "
                             f"model.load_weights({str(path)!r})")
    assert not (model_dir / "model.keras").exists()
    assert reloaded_accuracy(path) == pytest.approx(metrics["test_accuracy"], abs=1e-6)


def reloaded_accuracy(path) -> float:
    """The test accuracy of the text transformer's saved weights, loaded into
    the model its function builds again."""
    from tests.corpus import text_transformer as tx

    model = tx.build((tx.MAXLEN,))
    model.load_weights(str(path))
    model.compile(loss="sparse_categorical_crossentropy", metrics=["accuracy"])
    _, (x_test, y_test) = tx.data()
    return model.evaluate(x_test, y_test, verbose=0, return_dict=True)["accuracy"]
