"""The docs are tested: README.md, BENCHMARKS.md and every page of the site (docs/**/*.md).

The tests that start processes or clusters; the in-process ones, and the
conventions, are in tests/unit/test_docs.py."""

from __future__ import annotations

import gzip

import pytest

from tests._util import run_python_warm
from tests.unit.test_docs import Block, PYTHON_BLOCKS

CLUSTER_HINTS = ("notebook_launcher", "tfmulti.launch(", "cluster.launch(")
(RAY_EXAMPLE,) = [b for b in PYTHON_BLOCKS
                  if b.path.name == "ray.md" and "from tfmulti.ray import train" in b.code]
"""docs/how-to/ray.md's example, run as written by tests/integration/test_ray.py with
a worker killed mid-run (one local Ray for both checks), so not here."""


DOCS_FASHION_MNIST = {"train": 26 * 256 + 96, "test": 1000}
"""How many of each split's first images the blocks get (`docs_fashion_mnist_data_dir`):
the README's example then trains an epoch of 26 steps of 256 in one call (the 26
steps per call its comment gives), dropping the last 96 images as on the full set,
and evaluates 4 batches, the last one partial (as the full set's 40th)."""


@pytest.fixture(scope="module")
def docs_fashion_mnist_data_dir(tmp_path_factory) -> str:
    """The TFDS data dir the blocks read: real Fashion-MNIST, the first
    `DOCS_FASHION_MNIST` images and labels of each split, cut from the Debian
    package's IDX files (same format, gzipped) and prepared by
    `prepare_fashion_mnist` as a user's IDX files are.

    The blocks are checked to run as written and to print what they say (the
    README's "4 x 64" and its 'accuracy'); the data set's size is not what they
    show. On all 60,000 training images (234 steps in 9 calls) and 10,000 test
    images, the README's example alone took 56 s of a `make test` (17-19 CPU-s
    alone, 8-9 on these); the whole data set's preparation and contents are
    checked by tests/unit/test_data.py (`fashion_mnist_data_dir`)."""
    from tfmulti import data
    from tfmulti.data import catalog

    folder, tried = data.find_fashion_mnist_idx()
    if folder is None:
        raise data.DataNotFoundError(f"Fashion-MNIST IDX files not found in {tried}; "
                                     "`make data` installs them.")
    source = tmp_path_factory.mktemp("fashion_mnist_idx")
    for split, files in catalog.FASHION_MNIST_FILES.items():
        for name in files:
            first = data.read_idx(folder / name)[:DOCS_FASHION_MNIST[split]]
            header = bytes([0, 0, 0x08, first.ndim]) + b"".join(
                int(d).to_bytes(4, "big") for d in first.shape)
            # Level 1: these images took 1.6 CPU-s at level 9 (tests._util.write_idx), 0.1 at 1.
            with gzip.open(source / name, "wb", compresslevel=1) as f:
                f.write(header + first.tobytes())
    return data.prepare_fashion_mnist(str(tmp_path_factory.mktemp("tfds")), str(source))


def _python_param(block: Block):
    cluster = any(hint in block.code for hint in CLUSTER_HINTS)
    return pytest.param(block, id=block.id,
                        marks=[pytest.mark.cluster if cluster else pytest.mark.slow,
                               pytest.mark.timeout(900)])


@pytest.mark.parametrize("block", [_python_param(b) for b in PYTHON_BLOCKS
                                   if b is not RAY_EXAMPLE])
def test_python_block_runs(docs_fashion_mnist_data_dir, block, tmp_path):
    # TMPDIR: the folders a block makes with `tempfile.mkdtemp()` go with the test's.
    result = run_python_warm(["-c", block.code], timeout=600,
                             env={"TFDS_DATA_DIR": docs_fashion_mnist_data_dir,
                                  "TMPDIR": str(tmp_path)})
    assert result.returncode == 0, f"{block.id}\n{result.stdout[-2000:]}\n{result.stderr[-3000:]}"
    if "4 x 64" in block.code:  # the README's data-parallel example prints its split
        assert "4 x 64" in result.stdout and "'accuracy'" in result.stdout, result.stdout
