"""A URL path refused by the recipe as a user runs it: exit 2, one line, before
TensorFlow starts (a `tensorflow` that fails on import stands in for it),
nothing written (no `./gs:` folder). The rules themselves are in
tests/unit/test_remote_paths.py."""

from __future__ import annotations

import os

import pytest

from tests._util import RECIPES, run_python

_NO_TENSORFLOW = "raise ImportError('tensorflow imported before the flags were checked')\n"


@pytest.mark.slow
@pytest.mark.parametrize("flag", ["--model_dir=gs://bucket/run", "--backup_dir=s3://bucket/b",
                                  "--data_dir=gs://tfds-data/datasets"])
def test_train_recipe_refuses_a_url_before_tensorflow(flag, tmp_path):
    fake = tmp_path / "fake"
    (fake / "tensorflow").mkdir(parents=True)
    (fake / "tensorflow" / "__init__.py").write_text(_NO_TENSORFLOW)
    work = tmp_path / "work"
    work.mkdir()
    result = run_python([str(RECIPES / "train.py"), "--dataset=synthetic", flag], timeout=120,
                        cwd=work, env={"PYTHONPATH": os.pathsep.join(
                            [str(fake), os.environ.get("PYTHONPATH", "")])})
    name, _, value = flag[2:].partition("=")
    assert result.returncode == 2, result.stderr[-2000:]
    assert result.stderr.splitlines() == [
        line for line in result.stderr.splitlines() if line.startswith("train.py: error: ")]
    assert len(result.stderr.splitlines()) == 1, result.stderr
    assert result.stderr.startswith(f"train.py: error: --{name} {value!r} is a URL"), \
        result.stderr
    assert "POSIX path" in result.stderr and result.stdout == ""
    assert os.listdir(work) == []
