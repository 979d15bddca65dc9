"""The per-device memory estimate (`tfmulti.memory`, `tfmulti estimate-memory`)."""

from __future__ import annotations

import json

import pytest

from tests._util import run_python
from tfmulti import memory, models


def _one(**kwargs) -> dict:
    return memory.estimate_memory("mlp", global_batch_size=256, **kwargs)


def test_one_device_adam_counts():
    estimate = _one(strategy="one_device", optimizer="adam")
    (row,) = estimate["devices"]
    params = models.build_model("mlp").count_params()
    assert row["parameters"] == 4 * params
    assert row["gradients"] == row["parameters"]
    assert row["optimizer_slots"] == 2 * row["parameters"]
    # flatten 784 + fc1 512 + dropout 512 + logits 10, float32, batch 256
    assert row["activations"] == (784 + 512 + 512 + 10) * 256 * 4
    assert row["total"] == sum(row[k] for k in ("parameters", "gradients", "optimizer_slots",
                                                "activations"))


def test_sgd_has_no_slots():
    (row,) = _one(optimizer="sgd")["devices"]
    assert row["optimizer_slots"] == 0


def test_mirrored_copies_params_and_splits_activations():
    (single,) = _one()["devices"]
    rows = _one(strategy="mirrored", num_devices=4)["devices"]
    assert len(rows) == 4
    for row in rows:
        assert row["parameters"] == single["parameters"]
        assert row["optimizer_slots"] == single["optimizer_slots"]
        assert row["activations"] * 4 == single["activations"]


@pytest.mark.parametrize("model", ["mlp", "cnn"])
def test_pipeline_stages_split_the_parameters(model):
    (single,) = memory.estimate_memory(model)["devices"]
    estimate = memory.estimate_memory(model, strategy="pipeline", num_stages=2,
                                      num_microbatches=4)
    rows = estimate["devices"]
    assert [r["stage"] for r in rows] == [0, 1] and estimate["num_devices"] == 2
    assert sum(r["parameters"] for r in rows) == single["parameters"]
    # GPipe keeps all 4 micro-batches' activations until the backward pass:
    # the stages' activations add up to the whole batch's.
    assert all(r["activation_batch"] == 256 for r in rows)
    assert sum(r["activations"] for r in rows) == single["activations"]


def test_hybrid_repeats_the_stages_per_replica():
    rows = _one(strategy="hybrid", num_replicas=2, num_stages=2)["devices"]
    assert [(r["replica"], r["stage"]) for r in rows] == [(0, 0), (0, 1), (1, 0), (1, 1)]
    assert rows[0]["parameters"] == rows[2]["parameters"]
    assert rows[0]["activation_batch"] == 256 // 2  # a replica's 4 micro-batches


@pytest.mark.parametrize("dtype", ["bfloat16", "float16"])
def test_half_precision_halves_activations_not_parameters(dtype):
    (full,) = _one()["devices"]
    (half,) = _one(dtype=dtype)["devices"]
    assert half["activations"] * 2 == full["activations"]
    assert half["parameters"] == full["parameters"]


@pytest.mark.parametrize("kwargs,message", [
    (dict(strategy="bogus"), "unknown strategy 'bogus'; valid:"),
    (dict(strategy="mirrored", num_devices=3), r"`global_batch_size` \(256\) must be divisible"),
    (dict(strategy="pipeline", num_microbatches=3), r"must split into 1 replica\(s\) x 3"),
    (dict(strategy="one_device", num_devices=2), "strategy 'one_device' uses 1 device"),
    (dict(strategy="pipeline", num_devices=4), "uses 1 replica"),
    (dict(dtype="int8"), "`dtype` must be one of"),
    (dict(strategy="pipeline", num_replicas=4),
     r"`num_replicas` \(4\) does not apply to strategy 'pipeline'; leave it unset or use "
     r"strategy='hybrid'"),
    (dict(strategy="mirrored", num_devices=2, num_stages=2),
     r"`num_stages` \(2\) does not apply to strategy 'mirrored'"),
    (dict(optimizer="rmsprop"), "`optimizer` must be one of"),
])
def test_bad_arguments(kwargs, message):
    with pytest.raises(ValueError, match=message):
        _one(**kwargs)


def test_table_is_aligned():
    text = memory.format_memory_estimate(_one(strategy="mirrored", num_devices=2))
    table = text.splitlines()[1:4]
    assert table[0].split()[:4] == ["device", "replica", "stage", "parameters"]
    assert len({len(line) for line in table}) == 1
    assert "MiB" in table[1]


def test_cli_json():
    result = run_python(["-m", "tfmulti.cli", "estimate-memory", "--model", "mlp",
                         "--strategy", "mirrored", "--num_devices", "2", "--json"], timeout=120)
    assert result.returncode == 0, result.stderr[-2000:]
    estimate = json.loads(result.stdout)
    assert len(estimate["devices"]) == 2
    for row in estimate["devices"]:
        for key in ("device", "parameters", "gradients", "optimizer_slots", "activations",
                    "total"):
            assert key in row, key
    assert estimate["devices"][0]["activation_batch"] == 128


@pytest.mark.parametrize("args,message", [
    (["--strategy", "bogus"], "unknown strategy 'bogus'"),
    (["--strategy", "mirrored", "--num_devices", "3"], "must be divisible by the number of"),
])
def test_cli_bad_input(args, message):
    result = run_python(["-m", "tfmulti.cli", "estimate-memory", *args], timeout=120)
    assert result.returncode == 2
    errors = [l for l in result.stderr.splitlines() if l.startswith("tfmulti estimate-memory:")]
    assert len(errors) == 1 and message in errors[0], result.stderr[-2000:]
    assert "Traceback" not in result.stderr and not result.stdout
