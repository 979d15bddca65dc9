"""Tests of tfmulti.cluster.watchdog: a worker whose peers never join is stopped
after the startup timeout, with a message naming the peer it waited for."""

from __future__ import annotations

import json
import time

import pytest

from tests._util import run_python_warm


@pytest.mark.slow
def test_startup_timeout_names_missing_peer():
    # One task of a 2-task cluster whose peer never starts.
    tf_config = {"cluster": {"worker": ["localhost:1", "localhost:2"]},
                 "task": {"type": "worker", "index": 1}}
    code = ("import tfmulti, sys\n"
            "tfmulti.get_strategy('multi_worker', startup_timeout=3)\n"
            "print('formed')\n")
    start = time.monotonic()
    result = run_python_warm(["-c", code], timeout=90, env={"TF_CONFIG": json.dumps(tf_config)})
    assert time.monotonic() - start < 60
    assert result.returncode != 0, result.stderr[-2000:]
    assert "did not form within 3 s" in result.stderr
    assert "localhost:1" in result.stderr and "formed" not in result.stdout
