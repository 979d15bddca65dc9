"""Tests for tfmulti.data: batch arithmetic, exactly-once distribution over the
4 virtual CPUs of conftest.py, offline dataset sources and synthetic data.

Nothing here downloads: `download=True` is never passed.
"""

from __future__ import annotations


import pytest

from tests._util import popen_python_warm
from tfmulti import data


@pytest.mark.slow
def test_workers_preparing_fashion_mnist_at_once_take_turns(tmp_path, fake_idx):
    """Two processes preparing the same data dir at once (a cluster's workers on
    first use) both succeed: a lock serializes them, the second finds it prepared."""
    src, _ = fake_idx
    code = ("import sys; from tfmulti.data import catalog; "
            "catalog.prepare_fashion_mnist(sys.argv[1], sys.argv[2]); print('ok')")
    procs = [popen_python_warm(["-c", code, str(tmp_path / "tfds"), str(src)])
             for _ in range(2)]
    try:
        outputs = [p.communicate(timeout=240)[0] for p in procs]
    finally:
        for p in procs:
            p.kill()
            p.wait(timeout=30)
    assert [p.returncode for p in procs] == [0, 0], [out[-2000:] for out in outputs]
    assert all("ok" in out.splitlines() for out in outputs), outputs
    assert len(list(data.load("fashion_mnist", "train", data_dir=str(tmp_path / "tfds")))) == 12
