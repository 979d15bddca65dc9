"""recipes/train.py on NaN regression labels from the user's dataset hook (issue 27,
findings 4 and 5), in a process of its own run from the hook's folder (forked
from the warm server of tests/_util.py: TensorFlow imported, `configparser`
not): one line, exit code 65, no traceback, nothing published; the hook's
module is found in the current directory while a `configparser.py` next to it
never replaces the standard library's.

(In-process, for each distribution, fit and the custom loop: tests/unit/test_non_finite.py.)
"""

from __future__ import annotations

import os

import pytest

from tests._util import RECIPES, cluster_python_warm, run_python_warm

_HOOK = '''
import configparser  # the standard library's, never the configparser.py next to this file

import numpy as np
import tensorflow as tf

PARSER = configparser.ConfigParser  # the stub below has none


def data(seed=0, num_examples=256):
    rng = np.random.default_rng(seed)
    x = rng.random((num_examples, 16), dtype=np.float32)
    y = x.sum(axis=1)
    y[::4] = np.nan  # NaN regression labels
    return (tf.data.Dataset.from_tensor_slices((x, y)),
            tf.data.Dataset.from_tensor_slices((x[:64], y[:64])))
'''


def _train(model_dir, backup_dir) -> list[str]:
    """recipes/train.py on the hook's NaN labels (run from the hook's folder)."""
    return [str(RECIPES / "train.py"), "--model=regression", "--dataset=nan_data:data",
            "--num_examples=256", "--global_batch_size=32", "--epochs=2", "--seed=0",
            "--verbose=0", f"--model_dir={model_dir}", f"--backup_dir={backup_dir}",
            "--backup_every_steps=4"]


@pytest.mark.slow
def test_nan_labels_end_the_recipe_in_one_line_with_exit_65_and_nothing_published(tmp_path):
    (tmp_path / "nan_data.py").write_text(_HOOK)
    ran = tmp_path / "shadow-ran"
    (tmp_path / "configparser.py").write_text(f"open({str(ran)!r}, 'w').close()\n")
    model_dir, backup_dir = tmp_path / "run", tmp_path / "backup"
    result = run_python_warm([*_train(model_dir, backup_dir), "--distribution=one_device"],
                             cwd=tmp_path)
    assert result.returncode == 65, result.stderr[-3000:]
    # tfmulti's and the recipe's own lines (TensorFlow's native start-up logs aside).
    errors = [line for line in result.stderr.splitlines()
              if line.startswith(("tfmulti: error:", "train.py: error:"))]
    assert len(errors) == 1 and errors[0].startswith(
        "tfmulti: error: the training loss is nan at epoch 1, global step"), result.stderr
    assert "Traceback" not in result.stderr
    assert {"model.keras", "metrics.json"}.isdisjoint(os.listdir(model_dir))
    assert not ran.exists()  # the hook's `import configparser` got the standard library's


@pytest.mark.cluster
def test_every_worker_of_a_cluster_stops_at_the_same_step(tmp_path, monkeypatch):
    """MultiWorkerMirroredStrategy: the logged loss is all-reduced, so both workers
    stop after the same call (none waits on a collective), each with the one line,
    and the cluster ends with exit code 65."""
    (tmp_path / "nan_data.py").write_text(_HOOK)
    model_dir, backup_dir = tmp_path / "run", tmp_path / "backup"
    code, output = cluster_python_warm([*_train(model_dir, backup_dir),
                                        "--distribution=multi_worker"],
                                       cwd=tmp_path)  # the workers start in the hook's folder
    assert code == 65, output[-4000:]
    lines = [line for line in output.splitlines() if "tfmulti: error: the training loss" in line]
    assert len(lines) == 2 and len({line.split("error:", 1)[1] for line in lines}) == 1, output
    assert "Traceback" not in output
    assert {"model.keras", "metrics.json"}.isdisjoint(os.listdir(model_dir))
