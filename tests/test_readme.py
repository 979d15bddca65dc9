"""Every Python example in the README runs as written."""

from __future__ import annotations

import re

import pytest

from tests._util import REPO, run_python

BLOCKS = re.findall(r"```python\n(.*?)```", (REPO / "README.md").read_text(), flags=re.S)


def test_readme_has_python_examples():
    assert len(BLOCKS) >= 3


@pytest.mark.parametrize("index", range(len(BLOCKS)))
def test_readme_python_example_runs(fashion_mnist_data_dir, index):
    result = run_python(["-c", BLOCKS[index]], timeout=300,
                        env={"TFDS_DATA_DIR": fashion_mnist_data_dir})
    assert result.returncode == 0, result.stderr[-3000:]
    if "4 x 64" in BLOCKS[index]:  # the data-parallel example prints its split
        assert "4 x 64" in result.stdout and "'accuracy'" in result.stdout
