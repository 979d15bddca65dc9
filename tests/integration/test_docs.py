"""The docs are tested: README.md, BENCHMARKS.md and every page of the site (docs/**/*.md).

The tests that start processes or clusters; the in-process ones, and the
conventions, are in tests/unit/test_docs.py."""

from __future__ import annotations


import pytest

from tests._util import run_python_warm
from tests.unit.test_docs import Block, PYTHON_BLOCKS

CLUSTER_HINTS = ("notebook_launcher", "tfmulti.launch(", "cluster.launch(")
(RAY_EXAMPLE,) = [b for b in PYTHON_BLOCKS
                  if b.path.name == "ray.md" and "from tfmulti.ray import train" in b.code]
"""docs/how-to/ray.md's example, run as written by tests/integration/test_ray.py with
a worker killed mid-run (one local Ray for both checks), so not here."""


def _python_param(block: Block):
    cluster = any(hint in block.code for hint in CLUSTER_HINTS)
    return pytest.param(block, id=block.id,
                        marks=[pytest.mark.cluster if cluster else pytest.mark.slow,
                               pytest.mark.timeout(900)])


@pytest.mark.parametrize("block", [_python_param(b) for b in PYTHON_BLOCKS
                                   if b is not RAY_EXAMPLE])
def test_python_block_runs(fashion_mnist_data_dir, block, tmp_path):
    # TMPDIR: the folders a block makes with `tempfile.mkdtemp()` go with the test's.
    result = run_python_warm(["-c", block.code], timeout=600,
                             env={"TFDS_DATA_DIR": fashion_mnist_data_dir,
                                  "TMPDIR": str(tmp_path)})
    assert result.returncode == 0, f"{block.id}\n{result.stdout[-2000:]}\n{result.stderr[-3000:]}"
    if "4 x 64" in block.code:  # the README's data-parallel example prints its split
        assert "4 x 64" in result.stdout and "'accuracy'" in result.stdout, result.stdout
