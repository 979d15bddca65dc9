"""Gradient accumulation under MultiWorkerMirroredStrategy, on a 2-worker
cluster: through `fit` (tfmulti.models.accumulation) and through the custom
loop (tfmulti.training.loops); each equals the one-device big-batch training.

The in-process tests are in tests/unit/test_accumulation.py and
tests/unit/test_loops.py."""

from __future__ import annotations

import pytest

from tests.workers import accumulate

HOWS = ["fit", "loop"]


@pytest.fixture(scope="module")
def two_workers(tmp_path_factory):
    """One 2-worker cluster training both ways: {how: the chief's arrays}."""
    return accumulate.on_two_workers(tmp_path_factory.mktemp("accumulate"), HOWS)


@pytest.mark.cluster
@pytest.mark.parametrize("how", HOWS)
def test_accumulation_under_multi_worker(two_workers, big_batch, how):
    # 2 workers x 1 replica, 4 micro-batches of 4 rows each per update, 2
    # steps per call: the one-device big-batch training.
    got = two_workers[how]
    assert got["rows"] == 4
    if how == "loop":
        assert got["iterations"] == accumulate.STEPS
    accumulate.assert_same_training(got, big_batch)
