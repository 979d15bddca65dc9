"""Gradient accumulation through `fit` (tfmulti.models.accumulation) under
MultiWorkerMirroredStrategy: a 2-worker cluster.

The tests that start processes or clusters; the in-process ones, and the
conventions, are in tests/unit/test_accumulation.py."""

from __future__ import annotations

import pytest

from tests.workers import accumulate


@pytest.mark.cluster
def test_fix_accumulation_under_multi_worker(tmp_path, big_batch):
    # 2 workers x 1 replica, 4 micro-batches of 4 rows each per update, 2
    # steps per call: the one-device big-batch training.
    got = accumulate.on_two_workers(tmp_path, "fit")
    assert got["rows"] == 4
    accumulate.assert_same_training(got, big_batch)
