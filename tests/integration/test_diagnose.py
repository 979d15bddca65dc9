"""`tfmulti diagnose` (tfmulti.insight.diagnose and the CLI) that train for long or
start the CLI: the seeds' overhead-bound configuration, a slow input, the JSON.

The tests that start processes or clusters; the in-process ones, and the
conventions, are in tests/unit/test_diagnose.py."""

from __future__ import annotations

import json
import threading
import time

import pytest
import tensorflow as tf

from tests._util import run_python_warm
from tfmulti.config.train_config import TrainConfig, resolve_steps_per_execution
from tfmulti.insight import diagnose, timing

SEED_000 = dict(distribution="mirrored", devices=("CPU:0", "CPU:1"), dataset="synthetic",
                num_examples=4096, global_batch_size=32, steps_per_execution=1)
SEED_000_STEPS = 4096 // 32  # steps per epoch


@pytest.mark.slow  # trains for seconds
def test_seed_000_configuration_is_overhead_bound_and_advice_helps():
    """Seed 000's shape (2 replicas of 16 examples, one step per call): most of
    each step is fixed cost, and fewer/larger steps are the advice."""
    d = diagnose.diagnose(TrainConfig(**SEED_000), seconds=0.3)
    assert d.bottleneck == "overhead", d.format()
    assert d.num_replicas == 2 and d.per_replica_batch_size == 16
    assert d.advice, d.format()
    best = d.advice[0]
    assert best.measured and best.expected_gain >= diagnose.MIN_GAIN
    assert "--global_batch_size" in best.flags or "--steps_per_execution" in best.flags
    assert set(best.settings) & {"global_batch_size", "steps_per_execution"}, best
    text = d.format()
    assert "BOTTLENECK: per-step overhead" in text and "1. " in text
    assert best.arguments in text and best.flags in d.format(flags=True)
    # More steps per call: the one policy's number (advised, or tried without gain).
    k = resolve_steps_per_execution("auto", SEED_000_STEPS)
    spe = [a for a in d.advice if a.change == "more steps per tf.function call"]
    assert ([a.settings for a in spe] == [{"steps_per_execution": k}]
            or any(f"tried steps_per_execution={k}:" in n for n in d.notes)), d.format()


_ONE_AT_A_TIME = threading.Lock()


def _slow_batches(x, y):
    """50 ms of waiting per batch, one batch at a time (tf.data's parallel map
    would overlap the waits): an input pipeline far slower than the step."""
    def wait(t):
        with _ONE_AT_A_TIME:
            time.sleep(0.05)
        return t

    out = tf.py_function(wait, [x], x.dtype)
    out.set_shape(x.shape)
    return out, y


@pytest.mark.slow  # trains for seconds
def test_slow_input_is_input_bound():
    d = diagnose.diagnose(
        TrainConfig(distribution="one_device", dataset="synthetic", num_examples=2048,
                    global_batch_size=64, steps_per_execution=8),
        batch_map_fn=_slow_batches, seconds=0.3, measure_advice=False)
    assert d.bottleneck == "input", d.format()
    parallelism = [a for a in d.advice if a.change == "more input parallelism"]
    assert parallelism, d.format()
    # Outside the configuration: no settings, the advice says how.
    assert parallelism[0].settings == {} and parallelism[0].flags == parallelism[0].how
    assert "BOTTLENECK: the input pipeline" in d.format()


@pytest.mark.slow
def test_cli_diagnose_json(tmp_path):
    plot, trace = tmp_path / "split.png", tmp_path / "trace"
    result = run_python_warm([
        "-m", "tfmulti.cli", "diagnose", "--distribution=mirrored", "--num_virtual_devices=2",
        "--dataset=synthetic", "--num_examples=4096", "--global_batch_size=32",
        "--steps_per_execution=1", "--seconds=0.2", "--no_measure", "--json",
        f"--plot={plot}", f"--profile_dir={trace}"], timeout=240)
    assert result.returncode == 0, result.stderr[-3000:]
    report = json.loads(result.stdout)
    for key in ("bottleneck", "utilization", "examples_per_second", "advice", "notes",
                "num_replicas", "global_batch_size", "steps_per_execution", "config"):
        assert key in report, key
    for key in ("input_s", "compute_s", "compute_fixed_s", "fit_s", "overhead_s", "split"):
        assert key in report["times"], key
    # The verdict on the timings, and the raw figures of each round behind it.
    assert report["consistent"] is (not report["problems"])
    assert 1 <= len(report["rounds"]) <= 1 + timing.EXTRA_ROUNDS
    for key in ("fit_s", "compute_s", "scaled_s", "input_s"):
        assert report["rounds"][-1][key] and min(report["rounds"][-1][key]) > 0, key
    assert report["rounds"][-1]["batch_scale"] == 4
    assert report["bottleneck"] in ("input", "compute", "overhead")
    assert report["num_replicas"] == 2
    assert report["config"]["distribution"] == "mirrored"
    assert report["advice"] and all(a["flags"] and a["arguments"] and a["measured"] is False
                                    for a in report["advice"])  # --no_measure
    for a in report["advice"]:
        if a["settings"]:  # the flags and arguments spell the settings
            assert all(f"{k}=" in a["arguments"] for k in a["settings"]), a
            assert a["flags"].startswith("--") or a["flags"].startswith("drop --"), a
    # The steps-per-execution advice is the one policy's number.
    k = resolve_steps_per_execution("auto", SEED_000_STEPS)
    spe = [a for a in report["advice"] if a["change"] == "more steps per tf.function call"]
    if spe:
        assert spe[0]["settings"] == {"steps_per_execution": k}
        assert spe[0]["flags"] == f"--steps_per_execution={k}"
    # oneDNN advice exactly where TensorFlow runs without it on x86 (the
    # child inherits this process's environment and CPU).
    assert (any("oneDNN" in a["change"] for a in report["advice"])
            == diagnose.onednn_would_help())
    assert "diagnose [1/4]" in result.stderr  # progress goes to stderr
    assert plot.stat().st_size > 0
    assert list(trace.rglob("*.xplane.pb"))


@pytest.mark.slow  # trains for seconds
def test_diagnose_measures_lazy_updates_for_a_model_of_large_tables(monkeypatch):
    """The two-tower model of the embeddings benchmark with Adam: diagnose names
    its tables (of 50,000 rows here: the threshold lowered to keep the test
    short) and measures sparse_updates='lazy' against the dense update."""
    monkeypatch.setenv("TFMULTI_BENCH_EMBEDDING_ROWS", "50000")
    monkeypatch.setattr(diagnose, "LARGE_TABLE_ROWS", 50_000)
    d = diagnose.diagnose(
        TrainConfig(model="benchmarks.embeddings:two_tower_model",
                    dataset="benchmarks.embeddings:two_tower_data", num_examples=2048,
                    optimizer="adam", global_batch_size=256, steps_per_execution=8),
        seconds=0.2)
    lazy = [a for a in d.advice if a.settings == {"sparse_updates": "lazy"}]
    assert lazy, d.format()
    assert lazy[0].measured and lazy[0].expected_gain >= diagnose.MIN_GAIN, d.format()
    assert "user_table (50,000 x 32), item_table (50,000 x 32)" in lazy[0].detail
    assert lazy[0].flags == "--sparse_updates=lazy"
