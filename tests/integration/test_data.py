"""Tests for tfmulti.data: batch arithmetic, exactly-once distribution over the
4 virtual CPUs of conftest.py, offline dataset sources and synthetic data.

Nothing here downloads: `download=True` is never passed.
"""

from __future__ import annotations


import pytest

from tfmulti import data


@pytest.mark.slow
def test_workers_preparing_fashion_mnist_at_once_take_turns(tmp_path, fake_idx):
    """Two processes preparing the same data dir at once (a cluster's workers on
    first use) both succeed: a lock serializes them, the second finds it prepared."""
    import subprocess
    import sys

    src, _ = fake_idx
    code = ("import sys; from tfmulti.data import catalog; "
            "catalog.prepare_fashion_mnist(sys.argv[1], sys.argv[2]); print('ok')")
    procs = [subprocess.Popen([sys.executable, "-c", code, str(tmp_path / "tfds"), str(src)],
                              stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
             for _ in range(2)]
    try:
        results = [p.communicate(timeout=240) for p in procs]
    finally:
        for p in procs:
            p.kill()
    assert [p.returncode for p in procs] == [0, 0], [err[-2000:] for _, err in results]
    assert len(list(data.load("fashion_mnist", "train", data_dir=str(tmp_path / "tfds")))) == 12
