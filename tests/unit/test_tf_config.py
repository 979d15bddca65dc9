"""Tests of tfmulti.cluster.tf_config: building TF_CONFIG, and the malformed
TF_CONFIGs it refuses (through `parse_tf_config` and `get_strategy`) before
TensorFlow would hang on them. No processes."""

from __future__ import annotations

import time

import pytest

from tfmulti.cluster import tf_config


def test_tf_config_lists_all_workers_and_marks_the_task():
    assert tf_config.build_tf_config(["localhost:2000", "localhost:2001"], 1) == {
        "cluster": {"worker": ["localhost:2000", "localhost:2001"]},
        "task": {"type": "worker", "index": 1},
    }
    with pytest.raises(ValueError, match=r"task.index 2 is out of range for 'worker', which "
                                         r"has 2 tasks; use 0..1"):
        tf_config.build_tf_config(["localhost:2000", "localhost:2001"], 2)


@pytest.mark.parametrize("text,match", [
    ("{not json", r"TF_CONFIG: not valid JSON"),
    ('{"clusters": {"worker": ["a:1"]}, "task": {"type": "worker", "index": 0}}',
     r"unknown key 'clusters' \(did you mean 'cluster'\?\)"),
    ('{"task": {"type": "worker", "index": 0}}', r"missing 'cluster'"),
    ('{"cluster": {"worker": ["a:1"]}}', r"missing 'task'"),
    ('{"cluster": {"worker": ["a:1"]}, "task": {"type": "wroker", "index": 0}}',
     r"unknown task type 'wroker' \(did you mean 'worker'\?\)"),
    ('{"cluster": {"worker": ["a:1", "b:1"]}, "task": {"type": "worker", "index": 2}}',
     r"task.index 2 is out of range for 'worker', which has 2 tasks; use 0..1"),
    ('{"cluster": {"worker": ["a:1", "a:1"]}, "task": {"type": "worker", "index": 0}}',
     r"address 'a:1' appears twice"),
    ('{"cluster": {"chief": ["a:1", "b:1"]}, "task": {"type": "chief", "index": 0}}',
     r"cluster.chief lists 2 tasks; there can be one chief"),
    ('{"cluster": {"wrkr": ["a:1"]}, "task": {"type": "worker", "index": 0}}',
     r"unknown job 'wrkr'"),
    ('{"cluster": {"worker": ["a"]}, "task": {"type": "worker", "index": 0}}',
     r"use 'host:port'"),
    ('{"cluster": {"worker": ["a:1"]}, "task": {"type": "chief", "index": 0}}',
     r"'cluster' has no 'chief' job"),
    # Digits that str.isdigit() and int() accept, but no port: full-width, Arabic-Indic.
    ('{"cluster": {"worker": ["localhost:\uff12\uff12\uff12\uff12"]}, '
     '"task": {"type": "worker", "index": 0}}',
     r"cluster.worker\[0\] is 'localhost:２２２２'; the port must be a number in "
     r"1..65535 \(ASCII digits\)"),
    ('{"cluster": {"worker": ["localhost:\u0662\u0662\u0662\u0662"]}, '
     '"task": {"type": "worker", "index": 0}}',
     r"the port must be a number in 1..65535 \(ASCII digits\)"),
])
def test_malformed_tf_config_is_refused_fast(monkeypatch, text, match):
    import tfmulti

    with pytest.raises(ValueError, match=match):
        tf_config.parse_tf_config(text)
    monkeypatch.setenv("TF_CONFIG", text)
    start = time.monotonic()
    with pytest.raises(ValueError, match=match):
        tfmulti.get_strategy("multi_worker")
    with pytest.raises(ValueError, match=match):
        tfmulti.get_strategy("auto")
    assert time.monotonic() - start < 1.0
