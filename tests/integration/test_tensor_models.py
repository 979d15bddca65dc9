"""`recipes/train.py --tensor_parallel=T --model=module:function`: the user's
model (the keras-io text transformer of tests/corpus, its own
TransformerBlock) split over one pipeline stage of T devices, trained, and
the layers it split printed; what T does not split refused in one line."""

from __future__ import annotations

import json

import pytest

from tests._util import run_recipe_warm
from tests.integration.test_pipeline_outputs import reloaded_accuracy

OWN = ["--model=tests.corpus.text_transformer:build",
       "--dataset=tests.corpus.text_transformer:data", "--distribution=pipeline",
       "--num_stages=1", "--num_microbatches=2", "--global_batch_size=32", "--epochs=1",
       "--steps_per_epoch=6", "--num_virtual_devices=4"]


@pytest.mark.slow
def test_train_recipe_splits_the_users_transformer_block(tmp_path):
    result = run_recipe_warm("train", *OWN, "--tensor_parallel=2", f"--model_dir={tmp_path}")
    assert result.returncode == 0, result.stderr[-3000:]
    split = [line for line in result.stdout.splitlines() if "split over 2 devices" in line]
    assert len(split) == 1 and "transformer_block.att (MultiHeadAttention, 2 heads)" in split[0]
    assert ".ffn." in split[0] and "(Dense 32->32 + Dense 32->32)" in split[0]
    metrics = json.loads((tmp_path / "metrics.json").read_text())
    assert metrics["epochs_completed"] == 1
    assert metrics["test_accuracy"] > 0.6  # learned: the two classes are balanced
    # Saved joined: the weights load into the model the user's function builds.
    assert reloaded_accuracy(tmp_path / "model.weights.h5") == pytest.approx(
        metrics["test_accuracy"], abs=1e-6)


@pytest.mark.slow
def test_train_recipe_refuses_a_split_the_heads_do_not_allow(tmp_path):
    result = run_recipe_warm("train", *OWN, "--tensor_parallel=4", f"--model_dir={tmp_path}")
    assert result.returncode == 2, result.stderr[-3000:]
    lines = [line for line in result.stderr.splitlines() if "num_heads" in line]
    assert len(lines) == 1 and "transformer_block.att" in lines[0], result.stderr[-3000:]
    assert "Traceback" not in result.stderr
    assert not (tmp_path / "metrics.json").exists()
