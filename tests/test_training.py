"""TrainConfig validation (no TensorFlow runtime needed)."""

from __future__ import annotations

import re

import pytest

from tfmulti.training import (AUTO_STEPS_PER_EXECUTION, TrainConfig,
                              resolve_steps_per_execution)


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


@pytest.mark.parametrize("value, steps_per_epoch, expected", [
    ("auto", 234, 26),      # Fashion-MNIST at batch 256: largest divisor of 234 up to 32
    ("auto", 1875, 25),     # ... at batch 32
    ("auto", 24, 24),       # a short epoch: one call
    ("auto", 31 * 37, 31),  # a prime factor under the cap
    ("auto", 37, 1),        # a prime epoch length over the cap: one step per call
    ("auto", None, 1),      # unknown epoch length
    ("AUTO", 8, 8),
    (4, 8, 4),
    ("4", 8, 4),            # as given by a flag
])
def test_resolve_steps_per_execution(value, steps_per_epoch, expected):
    assert resolve_steps_per_execution(value, steps_per_epoch) == expected


@pytest.mark.parametrize("steps_per_epoch, backup_every_steps, expected", [
    (64, 4, 4),     # a backup every 4 steps: calls of 4
    (64, 100, 4),   # gcd(64, 100) = 4
    (64, 96, 32),
    (64, None, 32),
])
def test_auto_steps_per_execution_keeps_the_backup_cadence(steps_per_epoch, backup_every_steps,
                                                           expected):
    assert resolve_steps_per_execution("auto", steps_per_epoch, backup_every_steps) == expected
    assert resolve_steps_per_execution(8, steps_per_epoch, backup_every_steps) == 8


def test_steps_per_execution_must_tile_the_epoch():
    # Keras would run whole blocks: 10 steps per epoch in calls of 4 train 12.
    with pytest.raises(ValueError, match=r"`steps_per_execution` \(4\) must divide the steps "
                                         r"per epoch \(10\): .* would train 12 steps"):
        resolve_steps_per_execution(4, 10)
    from tfmulti import models

    with pytest.raises(ValueError, match=r"`steps_per_execution` \(4\) must divide"):
        models.compile_model(models.build_model("mlp"), steps_per_execution=4,
                             steps_per_epoch=10)


def test_steps_per_execution_defaults_to_auto():
    assert TrainConfig().steps_per_execution == "auto"
    assert AUTO_STEPS_PER_EXECUTION == 32


@pytest.mark.parametrize("value", [0, -3, "0", "many", 2.5, True, None])
def test_steps_per_execution_refused(value):
    with pytest.raises(ValueError, match=r"`steps_per_execution` must be 'auto' or a positive "
                                         rf"integer, got {re.escape(repr(value))}"):
        TrainConfig(steps_per_execution=value).validate()


@pytest.mark.parametrize("value", [0, -1])
def test_num_examples_refused(value):
    # 0 used to mean "the default" (60,000 synthetic examples) silently.
    with pytest.raises(ValueError, match=rf"`num_examples` must be a positive integer \(or "
                                         rf"unset\), got {value}"):
        TrainConfig(dataset="synthetic", num_examples=value).validate()
