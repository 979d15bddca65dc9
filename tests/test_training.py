"""TrainConfig validation (no TensorFlow runtime needed)."""

from __future__ import annotations

import pytest

from tfmulti.training import TrainConfig


def test_mixed_precision_unknown_policy():
    with pytest.raises(ValueError, match=r"`mixed_precision` must be one of \['none', "
                                         r"'bfloat16', 'float16'\], got 'int8'"):
        TrainConfig(mixed_precision="int8").validate()


@pytest.mark.parametrize("strategy", ["pipeline", "hybrid"])
def test_jit_compile_refused_with_placed_pipelines(strategy):
    with pytest.raises(ValueError, match="`jit_compile` cannot be used with strategy"):
        TrainConfig(strategy=strategy, jit_compile=True).validate()


@pytest.mark.parametrize("mixed_precision", ["none", "bfloat16", "float16"])
def test_valid_precision_and_xla_pass(mixed_precision):
    TrainConfig(strategy="mirrored", mixed_precision=mixed_precision,
                jit_compile=True).validate()
