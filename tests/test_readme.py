"""The README's Python example runs as written."""

from __future__ import annotations

import re

from tests._util import REPO, run_python


def test_readme_python_example_runs(fashion_mnist_data_dir):
    text = (REPO / "README.md").read_text()
    blocks = re.findall(r"```python\n(.*?)```", text, flags=re.S)
    assert blocks, "README has no python example"
    result = run_python(["-c", blocks[0]], timeout=300,
                        env={"TFDS_DATA_DIR": fashion_mnist_data_dir})
    assert result.returncode == 0, result.stderr[-3000:]
    assert "4 x 64" in result.stdout
    assert "'accuracy'" in result.stdout
