"""`recipes/train.py --validation_split`: a bad value, or one the data cannot
honour, is one line and exit 2, with nothing written (the in-process tests of
validation are in tests/unit/test_validation.py; 2 workers validating, in
tests/integration/test_launcher.py)."""

from __future__ import annotations

import pytest

from tests import own_model
from tests._util import run_recipe

pytestmark = pytest.mark.slow


def test_a_validation_split_outside_0_1_is_one_line_before_tensorflow(tmp_path):
    model_dir = tmp_path / "run"
    result = run_recipe("train", "--validation_split=1.5", f"--model_dir={model_dir}",
                        timeout=60)
    assert result.returncode == 2
    assert result.stderr.splitlines() == [
        "train.py: error: --validation_split must be in (0, 1), the fraction of the training "
        "examples held out (0: none), got 1.5; e.g. 0.2 holds out the last 20%."]
    assert result.stdout == "" and not model_dir.exists()


def test_a_validation_split_of_files_is_one_line_saying_why(tmp_path):
    own_model.write_tfrecords(tmp_path, num_files=2, per_file=8)
    model_dir = tmp_path / "run"
    result = run_recipe("train", "--dataset=tests.own_model:file_data",
                        "--model=tests.own_model:build", "--validation_split=0.2",
                        f"--model_dir={model_dir}", timeout=120,
                        env={"OWN_MODEL_FILES": str(tmp_path / "part-*.tfrecord")})
    assert result.returncode == 2, result.stderr[-2000:]
    errors = [line for line in result.stderr.splitlines() if line.startswith("train.py: error:")]
    assert len(errors) == 1, result.stderr[-2000:]
    assert errors[0].startswith("train.py: error: --validation_split (0.2) holds out the last "
                                "examples of the training data, but the training data are files")
    assert "return a 'validation' split from the dataset function instead" in errors[0]
    assert "Traceback" not in result.stderr and not model_dir.exists()
