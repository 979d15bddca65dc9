"""Custom loops (tfmulti.training.loops) under
MultiWorkerMirroredStrategy: a 2-worker cluster.

The tests that start processes or clusters; the in-process ones, and the
conventions, are in tests/unit/test_loops.py."""

from __future__ import annotations

import pytest

from tests.workers import accumulate


@pytest.mark.cluster
def test_loop_under_multi_worker(tmp_path, big_batch):
    # 2 workers x 1 replica, 4 micro-batches per update, 2 steps per call.
    got = accumulate.on_two_workers(tmp_path, "loop")
    assert got["rows"] == 4 and got["iterations"] == accumulate.STEPS
    accumulate.assert_same_training(got, big_batch)
