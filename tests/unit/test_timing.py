"""Tests for tfmulti.insight.timing on the virtual CPUs of conftest.py: the
step-time split, the timing functions' contracts (trained model, whole calls,
the epoch clock). No timing is asserted (timings go in the benchmarks).

The last section holds a test of tfmulti.data (the per-batch map), to move to
tests/unit/test_data.py. The benchmark fixtures (CustomLoop, costly_batch_map) are
tested in benchmarks/tests/test_bench.py."""

from __future__ import annotations

import pytest

from tfmulti import data
from tfmulti.models import builders as models
from tfmulti.insight import timing
from tfmulti.insight.timing import StepTimes
from tfmulti.runtime.strategy import get_strategy


@pytest.mark.parametrize("times,bottleneck", [
    (StepTimes(input_s=1.0, compute_s=8.0, fit_s=10.0, compute_fixed_s=6.0), "overhead"),
    (StepTimes(input_s=9.0, compute_s=2.0, fit_s=9.5, compute_fixed_s=0.5), "input"),
    (StepTimes(input_s=1.0, compute_s=9.0, fit_s=9.2, compute_fixed_s=1.0), "compute"),
])
def test_step_times_split_adds_up(times, bottleneck):
    assert times.bottleneck == bottleneck
    split = times.split()
    assert sum(split.values()) == pytest.approx(times.fit_s)
    assert all(v >= 0 for v in split.values())
    assert 0.0 <= times.utilization <= 1.0


def test_fixed_step_cost_and_steps_for():
    # time = fixed + batch x per-example: 2 ms fixed, 1 ms per batch -> x4: 6 ms.
    assert timing.fixed_step_cost(0.003, 0.006, 4) == pytest.approx(0.002)
    assert timing.fixed_step_cost(0.003, 0.0015, 0.25) == pytest.approx(0.001)
    assert timing.fixed_step_cost(0.003, 0.020, 4) == 0.0  # never negative
    assert timing.fixed_step_cost(0.003, 0.003, 4) == pytest.approx(0.003)  # at most the step
    assert timing.steps_for(1.0, 0.01, 8) == 104  # 100 steps, rounded up to whole calls
    assert timing.steps_for(1.0, 10.0, 1) == 4  # at least `lo`
    assert timing.steps_for(1.0, 1e-9, 1) == 2000  # at most `hi`
    assert timing.steps_for(0.0, 1.0, 32) == 32  # at least one call


def test_time_compute_needs_a_trained_model_and_time_fit_whole_calls():
    """One tiny model: refused before training, timed with an epoch clock
    subclass, then every timing works."""
    strategy = get_strategy("one_device")
    dist = data.distribute(data.load("synthetic", num_examples=64), strategy, 16)
    model = models.build_model("mlp", strategy=strategy)
    models.compile_model(model, task="classification", strategy=strategy, steps_per_execution=2)
    with pytest.raises(RuntimeError, match="time_compute needs a model that has trained"):
        timing.time_compute(model, strategy, dist)
    with pytest.raises(ValueError, match=r"`steps` \(3\) must be a multiple of the model's "
                                         r"steps_per_execution \(2\)"):
        timing.time_fit(model, dist, 3)
    with pytest.raises(ValueError, match=r"`epochs` must be at least 2"):
        timing.time_fit(model, dist, 4, epochs=1)

    class Between(timing.EpochClock):
        calls = 0

        def between_epochs(self):
            Between.calls += 1

    clock = Between()
    per_step = timing.time_fit(model, dist, 4, epochs=3, clock=clock)
    assert len(per_step) == 2 and all(s > 0 for s in per_step)  # the first epoch warms up
    assert len(clock.seconds) == 3 and Between.calls == 3
    compute = timing.time_compute(model, strategy, dist, steps_per_execution=2,
                                  min_seconds=0.01, batch_scales=(1, 2))
    assert len(compute) == 2 and all(s > 0 for s in compute)
    assert timing.time_input(dist, steps_per_execution=2, min_seconds=0.01) > 0
