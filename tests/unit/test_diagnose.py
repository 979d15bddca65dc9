"""Tests for `tfmulti diagnose` (tfmulti.insight.diagnose and the CLI) on virtual
CPUs: the classification of clearly overhead-bound and clearly input-bound
configurations, the advice as settings / arguments / flags, the oneDNN advice
and the JSON report; the timings that check themselves (fabricated figures fed to
the checks and to `diagnose`: a part larger than the whole, a consistent set, a
set made consistent by measuring again). Timings are never asserted, only which
part dominates when one part dominates by far. The CLI's bad input is checked in-process in
tests/unit/test_cli.py; the steps-per-execution policy's arithmetic in
tests/unit/test_config.py."""

from __future__ import annotations

import dataclasses
import json

import pytest

from tfmulti.config.train_config import TrainConfig
from tfmulti.insight import diagnose, timing

MS = 1e-3
# The impossible figures of issue 28 (a loaded machine): the step alone 56.00 ms,
# 4.82 ms of it fixed, through fit 30.69 ms ("per-example arithmetic takes 51.18 of
# 30.69 ms"); the step on 4 times the batch 4.82 + 4 x 51.18 ms.
NOISY = dict(fit_s=(30.69 * MS,), compute_s=(56.0 * MS, 55.0 * MS, 57.0 * MS),
             scaled_s=((4.82 + 4 * 51.18) * MS,) * 3, input_s=(0.5 * MS,) * 3)
# Seed 000's figures in docs/how-to/diagnose.md (a quiet run): they add up.
QUIET = dict(fit_s=(5.72 * MS,), compute_s=(3.6 * MS, 3.67 * MS, 3.7 * MS),
             scaled_s=((3.23 + 4 * 0.44) * MS,) * 3, input_s=(0.47 * MS,) * 3)


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
    assert "one tf.function call per step)" in text  # not "per 1 step(s)"
    assert text.splitlines()[-1] == "diagnosed in 1.00 s"
    d.elapsed_s = 66.4  # durations as people read them
    assert d.format().splitlines()[-1] == "diagnosed in 1 min 06 s"
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


def test_a_part_larger_than_the_whole_does_not_add_up():
    m = timing.Measurements(**NOISY)
    t = m.step_times()
    assert t.work_s == pytest.approx(51.18 * MS) and t.fit_s == pytest.approx(30.69 * MS)
    assert m.problems() == ["the train step alone (56.00 ms) takes longer than the whole "
                            "step through fit (30.69 ms)"]
    # The input alone slower than the whole step; a larger batch faster than the batch.
    slow_input = timing.Measurements(**{**QUIET, "input_s": (9.0 * MS,)})
    assert slow_input.problems() == ["the input alone (9.00 ms) takes longer than the whole "
                                     "step through fit (5.72 ms)"]
    faster = timing.Measurements(**{**QUIET, "scaled_s": (2.0 * MS,)})
    assert faster.problems() == ["the train step on 4 times the batch takes 2.00 ms, the step "
                                 "on the batch 3.67 ms: the larger batch is faster"]
    quarter = timing.Measurements(**{**QUIET, "scaled_s": (4.5 * MS,), "batch_scale": 0.25})
    assert "the larger batch is faster" in quarter.problems()[0]
    # Repeats that spread too wide to tell the parts apart: between the quartiles
    # of the step alone (4 and 8 ms of a 10 ms step), compute or overhead.
    spread = timing.Measurements(fit_s=(10 * MS,), compute_s=(2 * MS, 4 * MS, 6 * MS, 8 * MS,
                                                             10 * MS), input_s=(1 * MS,))
    assert spread.step_times().compute_s <= spread.step_times().fit_s  # the medians add up
    assert spread.problems() == ["the middle half of the repeats of the train step alone from "
                                 "4.00 ms to 8.00 ms spreads too wide to tell the parts apart "
                                 "(the bottleneck could be compute or overhead)"]
    # One call far off (its batches prefetched, or a pause) is no spread.
    outliers = (0.3 * MS,) + (0.47 * MS,) * 6 + (9.0 * MS,)
    assert timing.Measurements(**{**QUIET, "input_s": outliers}).problems() == []
    with pytest.raises(ValueError, match="`fit_s` is empty"):
        timing.Measurements(**{**QUIET, "fit_s": ()})


def test_consistent_timings_have_no_problems():
    m = timing.Measurements(**QUIET)
    assert m.problems() == []
    # A loaded machine's figures (the slow-input test's, recorded on 2 busy cores):
    # the step alone spreads from 2.66 to 16.02 ms, but within that spread the
    # 52 ms input stays the bottleneck, so the parts are told apart.
    busy = timing.Measurements(
        fit_s=(50.86 * MS,), compute_s=tuple(v * MS for v in (2.85, 6.29, 2.66, 4.0, 16.02)),
        scaled_s=tuple(v * MS for v in (9.61, 4.76, 5.27, 7.99, 8.87)),
        input_s=(52.74 * MS, 58.2 * MS, 51.25 * MS))
    assert busy.problems() == [] and busy.step_times().bottleneck == "input"
    t = m.step_times()
    assert t.compute_fixed_s == pytest.approx(3.23 * MS) and t.bottleneck == "overhead"
    # Within the tolerance a part may time a little longer than the whole (noise).
    close = timing.Measurements(**{**QUIET, "compute_s": (6.0 * MS,), "scaled_s": ()})
    assert close.problems() == [] and close.step_times().compute_fixed_s == 0.0


def _rounds(*figures):
    """A `measure` that returns the given rounds' figures in turn, and its calls."""
    made = []

    def measure():
        made.append(timing.Measurements(**figures[len(made)]))
        return made[-1]

    return measure, made


def test_measuring_again_until_the_timings_add_up():
    lines = []
    measure, made = _rounds(NOISY, QUIET, NOISY)
    rounds = timing.measure_until_consistent(measure, say=lines.append)
    assert rounds == made and len(rounds) == 2 and rounds[-1].problems() == []
    assert lines == ["  the timings do not add up: the train step alone (56.00 ms) takes "
                     "longer than the whole step through fit (30.69 ms); measuring again "
                     "(round 2 of 3)"]
    # Consistent at once: one round, nothing said.
    measure, made = _rounds(QUIET)
    assert timing.measure_until_consistent(measure, say=lines.append) == made
    assert len(made) == 1 and len(lines) == 1
    # Never consistent: a fixed number of rounds, then the last one.
    measure, made = _rounds(*[NOISY] * 9)
    rounds = timing.measure_until_consistent(measure, extra_rounds=2)
    assert len(rounds) == len(made) == 3 and rounds[-1].problems()


def _diagnosis(figures, problems_after_rounds=1) -> diagnose.Diagnosis:
    rounds = [timing.Measurements(**figures)] * problems_after_rounds
    return diagnose.Diagnosis(
        config={}, strategy="MirroredStrategy", devices=["CPU:0", "CPU:1"],
        global_batch_size=32, per_replica_batch_size=16, steps_per_execution=1,
        times=rounds[-1].step_times(), per_call_overhead_s=None, advice=[], notes=[],
        elapsed_s=1.0, problems=rounds[-1].problems(), rounds=rounds, seconds=1.0)


def _no_impossible_figures(text: str) -> None:
    assert "time split" not in text and "BOTTLENECK" not in text, text
    assert "51.18 of 30.69" not in text and "utilization" not in text, text


def test_a_noisy_report_says_so_instead_of_impossible_shares():
    d = _diagnosis(NOISY, 3)
    assert not d.consistent
    text = d.format(flags=True)
    _no_impossible_figures(text)
    noise = [line for line in text.splitlines() if line.startswith("NOT CONSISTENT")]
    assert noise == [d.noise_line(flags=True)]
    assert noise[0].startswith("NOT CONSISTENT after 3 rounds of timings: the train step "
                               "alone (56.00 ms) takes longer than the whole step through fit")
    assert "too noisy to tell" in noise[0] and "quiet machine" in noise[0]
    assert "--seconds=5" in noise[0] and "seconds=5" in d.format()
    report = json.loads(json.dumps(d.to_dict()))
    assert report["consistent"] is False and report["problems"] == d.problems
    assert len(report["rounds"]) == 3
    assert report["rounds"][0]["compute_s"] == pytest.approx([0.056, 0.055, 0.057])
    assert report["rounds"][0]["fit_s"] == pytest.approx([0.03069])
    # A consistent one keeps its split and bottleneck.
    quiet = _diagnosis(QUIET)
    assert quiet.consistent and quiet.to_dict()["consistent"] is True
    assert "BOTTLENECK: per-step overhead" in quiet.format()
    assert "NOT CONSISTENT" not in quiet.format()


def test_the_verdict_shows_no_share_over_the_whole():
    """Within the tolerance the step alone may time a little over the whole:
    the verdict's figures are the split's, which add up to the step."""
    times = timing.StepTimes(input_s=0.5 * MS, compute_s=10.8 * MS, fit_s=10.0 * MS,
                             compute_fixed_s=0.2 * MS)
    d = diagnose.Diagnosis(
        config={}, strategy="OneDeviceStrategy", devices=["CPU:0"], global_batch_size=32,
        per_replica_batch_size=32, steps_per_execution=1, times=times,
        per_call_overhead_s=None, advice=[], notes=[], elapsed_s=1.0)
    text = d.format()
    assert "per-example arithmetic takes 10.00 of 10.00 ms" in text, text
    assert "10.60 of" not in text
    assert d.consistent and d.bottleneck == "compute"


class _FakeClock:
    """Fabricated timings for `diagnose` in place of the real clock: the warm-up
    and each round's `time_fit` move to the next round's figures."""

    def __init__(self, monkeypatch, *figures):
        self.figures, self.fits = figures, 0
        for name in ("time_fit", "compute_call", "call_times_interleaved",
                     "time_input_repeats", "time_compute", "time_input"):
            monkeypatch.setattr(timing, name, getattr(self, name), raising=False)

    @property
    def now(self) -> dict:
        return self.figures[max(0, min(self.fits - 2, len(self.figures) - 1))]

    def time_fit(self, model, dist, steps, epochs=2, clock=None):
        self.fits += 1
        return list(self.now["fit_s"])

    @staticmethod
    def compute_call(model, strategy, dist, steps_per_execution=20, batch_scale=1.0):
        return steps_per_execution, batch_scale

    def call_times_interleaved(self, calls, min_seconds=0.5, min_calls=3, warmup_calls=1):
        return [[s * steps for s in self.now["compute_s" if scale == 1 else "scaled_s"]]
                for steps, scale in calls]

    def time_input_repeats(self, dist, steps_per_execution=20, min_seconds=0.5):
        return list(self.now["input_s"])

    # What diagnose used before it checked its timings, to show its report then.
    def time_compute(self, model, strategy, dist, steps_per_execution=20, min_seconds=0.5,
                     batch_scales=(1,)):
        return [self.now["compute_s"][0], self.now["scaled_s"][0]]

    def time_input(self, dist, steps_per_execution=20, min_seconds=0.5):
        return self.now["input_s"][0]


_TINY = TrainConfig(distribution="one_device", dataset="synthetic", num_examples=512,
                    global_batch_size=32, steps_per_execution=1)


def test_diagnose_measures_again_and_says_when_the_machine_is_too_noisy(monkeypatch):
    """`diagnose` itself with the clock of a loaded machine: every round gives
    issue 28's figures, so it measures again twice, then says so."""
    _FakeClock(monkeypatch, NOISY)
    lines = []
    d = diagnose.diagnose(_TINY, measure_advice=False, progress=lines.append)
    text = d.format(flags=True)
    _no_impossible_figures(text)
    assert "NOT CONSISTENT after 3 rounds" in text and "too noisy to tell" in text
    assert not d.consistent and len(d.rounds) == 3
    assert d.to_dict()["consistent"] is False
    again = [line for line in lines if "measuring again" in line]
    assert [line[-len("(round 2 of 3)"):] for line in again] == ["(round 2 of 3)",
                                                                 "(round 3 of 3)"]
    assert any("still do not add up after 3 rounds" in line for line in lines)


def test_diagnose_reports_the_round_that_adds_up(monkeypatch):
    _FakeClock(monkeypatch, NOISY, QUIET)
    lines = []
    d = diagnose.diagnose(_TINY, measure_advice=False, progress=lines.append)
    assert d.consistent and len(d.rounds) == 2, d.format()
    assert (dataclasses.astuple(d.times)
            == pytest.approx(dataclasses.astuple(timing.Measurements(**QUIET).step_times())))
    assert d.bottleneck == "overhead" and "BOTTLENECK: per-step overhead" in d.format()
    assert sum("measuring again (round 2 of 3)" in line for line in lines) == 1


def test_compute_alone_compiles_the_step_as_fit_does(monkeypatch):
    """With `jit_compile` on, `fit` runs the step under XLA: the step alone must
    too, or it times another program than the whole it is a part of."""
    import tensorflow as tf

    from tfmulti import data
    from tfmulti.models import builders as models
    from tfmulti.runtime.strategy import get_strategy

    strategy = get_strategy("one_device")
    dist = data.distribute(data.load("synthetic", num_examples=64), strategy, 16)
    model = models.build_model("mlp", strategy=strategy)
    models.compile_model(model, task="classification", strategy=strategy, jit_compile=True)
    with strategy.scope():  # what the first step of fit builds, without training
        model.build((None,) + tuple(dist.dataset.element_spec[0].shape[1:]))
        model.optimizer.build(model.trainable_variables)
    compiled, function = [], tf.function

    def spy(*args, **kwargs):
        compiled.append(kwargs.get("jit_compile"))
        return function(*args, **kwargs)

    monkeypatch.setattr(tf, "function", spy)
    timing.compute_call(model, strategy, dist, steps_per_execution=2)()
    assert True in compiled, compiled
