"""The logging hooks as a user runs them: `tfmulti train --callbacks=...
--no-tensorboard` from the folder of the docs' tracker, a bad hook's one line and
exit code, and the tracker under a 2-worker cluster, where only the chief logs.
(The rules and in-process runs are in tests/unit/test_logging_hooks.py.)"""

from __future__ import annotations

import json
import os

import pytest

from tests._util import REPO, cluster_python_warm, file_tree, run_python_warm

EXAMPLES = REPO / "docs" / "examples"
TINY = ["--dataset=synthetic", "--num_examples=512", "--global_batch_size=64", "--epochs=2"]


def _epochs(path) -> list[int]:
    return [json.loads(line)["epoch"] for line in path.read_text().splitlines()]


@pytest.mark.slow
def test_tfmulti_train_runs_the_tracker_without_tensorboard(tmp_path):
    model_dir = tmp_path / "run"
    result = run_python_warm(["-m", "tfmulti.cli", "train", *TINY, "--distribution=one_device",
                              "--callbacks=jsonl_logger:callbacks", "--no-tensorboard",
                              f"--model_dir={model_dir}"], timeout=300, cwd=EXAMPLES)
    assert result.returncode == 0, result.stderr[-3000:]
    assert _epochs(model_dir / "metrics.jsonl") == [1, 2]
    assert not (model_dir / "logs").exists()


@pytest.mark.slow
def test_tfmulti_train_refuses_a_missing_tracker_in_one_line(tmp_path):
    model_dir = tmp_path / "run"
    model_dir.mkdir()
    (model_dir / "notes.txt").write_text("mine")
    result = run_python_warm(["-m", "tfmulti.cli", "train", *TINY,
                              "--callbacks=no_such_tracker:callbacks",
                              f"--model_dir={model_dir}"], timeout=300, cwd=tmp_path)
    assert result.returncode == 2, result.stderr[-3000:]
    errors = [line for line in result.stderr.splitlines() if "error:" in line]
    assert len(errors) == 1 and "Traceback" not in result.stderr, result.stderr[-3000:]
    assert "--callbacks 'no_such_tracker:callbacks': no module named 'no_such_tracker'" \
        in errors[0]
    assert file_tree(model_dir) == {"notes.txt": b"mine"}


_TRACKED = """
import json, sys
sys.path.insert(0, {examples!r})
import jsonl_logger
import keras


class Dump(keras.callbacks.Callback):
    def __init__(self, path):
        super().__init__()
        self.path = path

    def on_epoch_end(self, epoch, logs=None):
        with open(self.path, "a") as f:
            f.write(json.dumps({{k: float(v) for k, v in logs.items()}}, sort_keys=True) + "\\n")


def callbacks(model_dir, is_chief, worker_index):
    return [*jsonl_logger.callbacks(model_dir, is_chief),
            Dump({out!r} + f"/worker{{worker_index}}.jsonl")]
"""


@pytest.mark.cluster
def test_only_the_chief_logs_in_a_cluster(tmp_path):
    """The function runs on both workers, which see the same epoch metrics (so
    EarlyStopping decides alike on each); the docs' tracker logs where
    `is_chief`, so each epoch is one line, not one per worker."""
    model_dir, out = tmp_path / "run", tmp_path / "out"
    out.mkdir()
    (tmp_path / "tracked.py").write_text(_TRACKED.format(examples=str(EXAMPLES), out=str(out)))
    code, output = cluster_python_warm(
        ["-m", "tfmulti.cli", "train", *TINY, "--distribution=multi_worker",
         "--validation_split=0.25", "--callbacks=tracked:callbacks", f"--model_dir={model_dir}"],
        cwd=tmp_path)  # the workers' folder, where the tracker's module is
    assert code == 0, output[-4000:]
    assert _epochs(model_dir / "metrics.jsonl") == [1, 2]
    assert json.loads((model_dir / "metrics.json").read_text())["num_workers"] == 2
    seen = [(out / f"worker{i}.jsonl").read_text().splitlines() for i in (0, 1)]
    assert len(seen[0]) == 2 and seen[0] == seen[1]
    assert "val_loss" in json.loads(seen[0][-1])
