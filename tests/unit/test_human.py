"""tfmulti.utils.human: numbers as people read them, and the results line a run prints
(its scores stay `key=value` for the scripts that read them). The other surfaces are tested
with their modules: `tfmulti env` (test_environment.py), estimate-memory (test_memory.py,
test_footprint.py), diagnose (test_diagnose.py), the launcher's restarts
(test_rendezvous.py), the strategy's and the run's lines (test_strategy.py, test_runs.py)."""

from __future__ import annotations

import json

import numpy as np
import pytest

from tfmulti.training import outputs
from tfmulti.utils import human


@pytest.mark.parametrize("value, text", [
    (0, "0"), (7, "7"), (1000, "1,000"), (-1234567, "-1,234,567"), (np.int64(25656), "25,656"),
    (25655.8623, "25,656"), (100.0, "100"), (99.96, "100"), (99.94, "99.9"), (42.345, "42.3"),
    (3.14159, "3.14"), (0.5, "0.500"), (0.0123456, "0.0123"), (0.0, "0"),
    (np.float32(1.5), "1.50"), (float("nan"), "nan"), (float("inf"), "inf"), (True, "True"),
    ("x", "x"),
])
def test_number(value, text):
    assert human.number(value) == text


@pytest.mark.parametrize("n, noun, text", [
    (1, "replica", "1 replica"), (2, "replica", "2 replicas"), (0, "device", "0 devices"),
    (4096, "worker", "4,096 workers"), (2, "batch", "2 batches"), (1, "batch", "1 batch"),
    (3, "process", "3 processes"), (2, "axis", "2 axes"),
])
def test_count(n, noun, text):
    plural = "axes" if noun == "axis" else None
    assert human.count(n, noun, plural) == text


@pytest.mark.parametrize("num_bytes, text", [
    (0, "0 B"), (1, "1 B"), (1023, "1,023 B"), (1024, "1.00 KiB"), (1536, "1.50 KiB"),
    (512 * 1024, "512 KiB"), (20992, "20.5 KiB"), (2**20 - 1, "1.00 MiB"),
    (1632000, "1.56 MiB"), (23.5 * 2**30, "23.5 GiB"), (140 * 2**30, "140 GiB"),
    (2**40, "1.00 TiB"), (2**60, "1,024 PiB"), (-(2**21), "-2.00 MiB"),
])
def test_size(num_bytes, text):
    assert human.size(num_bytes) == text


@pytest.mark.parametrize("seconds, text", [
    (0.000412, "0.412 ms"), (0.01234, "12.3 ms"), (0.35, "350 ms"), (0.9996, "1.00 s"),
    (1, "1.00 s"), (4.2, "4.20 s"), (42.34, "42.3 s"), (59.96, "1 min 00 s"),
    (66.4, "1 min 06 s"), (3599.4, "59 min 59 s"), (3600, "1 h 00 min"),
    (7500, "2 h 05 min"), (100000, "27 h 47 min"), (float("inf"), "inf s"),
])
def test_duration(seconds, text):
    assert human.duration(seconds) == text


def test_rate():
    assert human.rate(25655.8623, "examples/s") == "25,656 examples/s"
    assert human.rate(12.345, "steps/s") == "12.3 steps/s"


# ------------------------------------------------------------------- the results line

RUN = {"distribution": "MirroredStrategy", "num_replicas": 4, "test_accuracy": 0.81234,
       "test_loss": 0.50119, "examples_per_second": 25655.8623, "epochs_completed": 5,
       "train_seconds": 12.3456789, "epoch_seconds": [3.1, 2.9]}


def test_the_results_line_reads_as_words_and_keeps_its_scores():
    assert outputs.summary_line(RUN) == (
        "tfmulti: test_accuracy=0.8123, test_loss=0.5012, 25,656 examples/s, 4 replicas, "
        "MirroredStrategy, 5 epochs")
    one = {**RUN, "num_replicas": 1, "epochs_completed": 1, "examples_per_second": None,
           "val_loss": 0.25, "test_accuracy": None}
    assert outputs.summary_line(one) == (
        "tfmulti: test_accuracy=None, test_loss=0.5012, val_loss=0.2500, 1 replica, "
        "MirroredStrategy, 1 epoch")
    # What reads the line: the scores as key=value (tests, benchmarks/bad_inputs.py).
    scores = dict(part.split("=") for part in outputs.summary_line(RUN)[9:].split(", ")
                  if "=" in part)
    assert scores == {"test_accuracy": "0.8123", "test_loss": "0.5012"}
    assert json.loads(json.dumps(RUN))["examples_per_second"] == 25655.8623  # JSON: whole
