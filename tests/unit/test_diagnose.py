"""Tests for `tfmulti diagnose` (tfmulti.insight.diagnose and the CLI) on virtual
CPUs: the classification of clearly overhead-bound and clearly input-bound
configurations, the advice as settings / arguments / flags, the oneDNN advice
and the JSON report. Timings are never asserted, only which part dominates
when one part dominates by far. The CLI's bad input is checked in-process in
tests/unit/test_cli.py; the steps-per-execution policy's arithmetic in
tests/unit/test_config.py."""

from __future__ import annotations

import json


from tfmulti.insight import diagnose, timing


def test_advice_as_arguments_and_flags():
    both = diagnose.Advice("both", {"global_batch_size": 256, "steps_per_execution": 26},
                           2.0, True, "detail")
    assert both.arguments == "global_batch_size=256, steps_per_execution=26"
    assert both.flags == "--global_batch_size=256 --steps_per_execution=26"
    xla = diagnose.Advice("xla", {"jit_compile": True}, None, False, "detail")
    assert (xla.arguments, xla.flags) == ("jit_compile=True", "--jit_compile")
    # diagnose's own pipeline switches are flags of their own.
    prefetch = diagnose.Advice("prefetch", {"prefetch": True}, None, False, "detail")
    assert (prefetch.arguments, prefetch.flags) == ("prefetch=True", "drop --no_prefetch")
    assert diagnose.Advice("c", {"cache": False}, None, False, "d").flags == "--no_cache"
    # A change outside the configuration: `how` says it, in both forms.
    outside = diagnose.Advice("env", {}, None, False, "detail", how="TF_ENABLE_ONEDNN_OPTS=1")
    assert outside.arguments == outside.flags == "TF_ENABLE_ONEDNN_OPTS=1"


def test_format_shows_arguments_or_flags():
    """A hand-made overhead-bound diagnosis: no training needed to render it."""
    advice = diagnose.Advice("more steps per tf.function call", {"steps_per_execution": 32},
                             1.5, True, "the detail")
    d = diagnose.Diagnosis(
        config={}, strategy="mirrored", devices=["/job:localhost/replica:0/task:0/device:CPU:0",
                                                 "/job:localhost/replica:0/task:0/device:CPU:1"],
        global_batch_size=32, per_replica_batch_size=16, steps_per_execution=1,
        times=timing.StepTimes(input_s=0.001, compute_s=0.008, fit_s=0.010,
                               compute_fixed_s=0.006),
        per_call_overhead_s=None, advice=[advice], notes=["a note"], elapsed_s=1.0)
    assert d.bottleneck == "overhead" and d.num_replicas == 2
    text = d.format()
    assert "configuration    mirrored on CPU:0, CPU:1" in text
    assert "BOTTLENECK: per-step overhead" in text
    assert "1. more steps per tf.function call: steps_per_execution=32  [1.50x measured]" in text
    assert "--steps_per_execution" not in text
    assert ("1. more steps per tf.function call: --steps_per_execution=32  [1.50x measured]"
            in d.format(flags=True))
    assert "note: a note" in text
    report = d.to_dict()
    assert report["advice"][0]["settings"] == {"steps_per_execution": 32}
    assert report["advice"][0]["arguments"] == "steps_per_execution=32"
    assert report["advice"][0]["flags"] == "--steps_per_execution=32"
    assert report["bottleneck"] == "overhead" and report["num_replicas"] == 2
    json.dumps(report)  # JSON-ready


def test_onednn_advice_only_where_it_is_off_and_not_refused(monkeypatch):
    import platform

    from tfmulti.insight import environment

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
