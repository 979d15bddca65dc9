"""Tests for `tfmulti diagnose` (tfmulti.diagnose.diagnose and the CLI) on virtual
CPUs: the classification of clearly overhead-bound and clearly input-bound
configurations, the JSON report, and bad input. Timings are never asserted,
only which part dominates when one part dominates by far."""

from __future__ import annotations

import json
import time

import pytest
import tensorflow as tf

from tests._util import run_python
from tfmulti import diagnose
from tfmulti.training import TrainConfig

SEED_000 = dict(strategy="mirrored", devices=("CPU:0", "CPU:1"), dataset="synthetic",
                num_examples=4096, global_batch_size=32, steps_per_execution=1)


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
    text = d.format()
    assert "BOTTLENECK: per-step overhead" in text and "1. " in text


def _slow_batches(x, y):
    """50 ms of waiting per batch: an input pipeline far slower than the step."""
    def wait(t):
        time.sleep(0.05)
        return t

    out = tf.py_function(wait, [x], x.dtype)
    out.set_shape(x.shape)
    return out, y


def test_slow_input_is_input_bound():
    d = diagnose.diagnose(
        TrainConfig(strategy="one_device", dataset="synthetic", num_examples=2048,
                    global_batch_size=64, steps_per_execution=8),
        batch_map_fn=_slow_batches, seconds=0.3, measure_advice=False)
    assert d.bottleneck == "input", d.format()
    assert any(a.change == "more input parallelism" for a in d.advice)
    assert "BOTTLENECK: the input pipeline" in d.format()


def test_suggest_steps_per_execution_divides_the_epoch():
    assert diagnose.suggest_steps_per_execution(1875) == 125  # Fashion-MNIST at batch 32
    assert diagnose.suggest_steps_per_execution(234) == 117  # ... at batch 256
    assert diagnose.suggest_steps_per_execution(7) == 7
    assert diagnose.suggest_steps_per_execution(None) == diagnose.MAX_STEPS_PER_EXECUTION


def test_cli_diagnose_json(tmp_path):
    plot, trace = tmp_path / "split.png", tmp_path / "trace"
    result = run_python([
        "-m", "tfmulti.cli", "diagnose", "--strategy=mirrored", "--num_virtual_devices=2",
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
    assert report["bottleneck"] in ("input", "compute", "overhead")
    assert report["num_replicas"] == 2
    assert report["advice"] and all(a["flags"] and a["measured"] is False
                                    for a in report["advice"])  # --no_measure
    # oneDNN advice exactly where TensorFlow runs without it on x86 (the
    # child inherits this process's environment and CPU).
    assert (any("oneDNN" in a["change"] for a in report["advice"])
            == diagnose.onednn_would_help())
    assert "diagnose [1/4]" in result.stderr  # progress goes to stderr
    assert plot.stat().st_size > 0
    assert list(trace.rglob("*.xplane.pb"))


def test_onednn_advice_only_where_it_is_off_and_not_refused(monkeypatch):
    import platform

    from tfmulti import environment

    monkeypatch.setattr(platform, "machine", lambda: "x86_64")
    monkeypatch.delenv("TF_ENABLE_ONEDNN_OPTS", raising=False)
    monkeypatch.setattr(environment, "onednn_enabled", lambda: False)
    assert diagnose.onednn_would_help()
    for refused in ("0", "false", "False"):  # turned off on purpose
        monkeypatch.setenv("TF_ENABLE_ONEDNN_OPTS", refused)
        assert not diagnose.onednn_would_help(), refused
    monkeypatch.delenv("TF_ENABLE_ONEDNN_OPTS")
    monkeypatch.setattr(environment, "onednn_enabled", lambda: None)  # TensorFlow won't say
    assert not diagnose.onednn_would_help()
    monkeypatch.setattr(environment, "onednn_enabled", lambda: True)  # already on
    assert not diagnose.onednn_would_help()
    monkeypatch.setattr(environment, "onednn_enabled", lambda: False)
    monkeypatch.setattr(platform, "machine", lambda: "aarch64")  # measured on x86 only
    assert not diagnose.onednn_would_help()


@pytest.mark.parametrize("flags,message", [
    (["--global_batch_size=0"], "`global_batch_size` must be a positive integer, got 0"),
    (["--strategy=pipeline"], "strategy 'pipeline' is not supported, use one of"),
    (["--plot=split.jpg"], "`--plot` takes a .png file name"),
])
def test_cli_diagnose_bad_input(flags, message):
    result = run_python(["-m", "tfmulti.cli", "diagnose", *flags], timeout=60)
    assert result.returncode == 2
    errors = [line for line in result.stderr.splitlines()
              if line.startswith("tfmulti diagnose: error:")]
    assert len(errors) == 1 and message in errors[0], result.stderr[-2000:]
    assert "Traceback" not in result.stderr
