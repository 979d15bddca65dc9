"""The byte-level transformer (tfmulti.models.transformer) and its tensor-parallel
form (tfmulti.parallel.tensor_split.split_transformer): shapes and sizes, causal
and padding masks, sampling, and the split form equal to the plain one
(forward, gradients, 3 Adam steps within 1e-5) with its weights, slots and
ops on their devices."""

from __future__ import annotations

import json

import pytest

from tests._util import WORKERS, run_python_warm
from tests._util import assert_layout_equals_the_plain_model


@pytest.mark.slow
def test_two_replicas_of_two_stages_of_two_devices_equal_the_plain_model():
    result = run_python_warm([str(WORKERS / "layouts.py"), "2", "2", "2"], timeout=900)
    assert result.returncode == 0, result.stderr[-3000:]
    assert_layout_equals_the_plain_model(json.loads(result.stdout.strip().splitlines()[-1]), 8)
