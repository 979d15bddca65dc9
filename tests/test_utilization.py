"""Tests for tfmulti.utilization on the virtual CPUs of conftest.py: the custom
loop does fit's work, the costly map, the step-time split. No timing is
asserted (timings go in recipes/benchmark.py)."""

from __future__ import annotations

import keras
import numpy as np
import pytest
import tensorflow as tf

from tfmulti import data, models, utilization
from tfmulti.strategy import get_strategy
from tfmulti.utilization import StepTimes


def test_custom_loop_and_fit_reach_the_same_weights():
    """The overhead benchmark's reference loop does exactly fit's work: same
    data order, loss scaling and all-reduce give the same SGD weights."""
    strategy = get_strategy("mirrored", devices=["CPU:0", "CPU:1"])
    batch, k, calls = 64, 4, 3
    dist = data.distribute(data.load("synthetic", num_examples=1024), strategy, batch, seed=0)
    fitted = models.build_model("mlp", strategy=strategy, dropout=0.0, seed=0)
    looped = models.build_model("mlp", strategy=strategy, dropout=0.0, seed=0)
    looped.set_weights(fitted.get_weights())
    models.compile_model(fitted, strategy=strategy, optimizer="sgd", learning_rate=0.1,
                         steps_per_execution=k)
    fitted.fit(dist.dataset, steps_per_epoch=k * calls, epochs=1, verbose=0, shuffle=False)
    with strategy.scope():
        optimizer = keras.optimizers.SGD(0.1)
    loop = utilization.CustomLoop(looped, strategy, optimizer, batch, k)
    assert "steps_per_call=4" in repr(loop)
    loss = loop.train(iter(dist.dataset), calls)
    assert np.isfinite(loss)
    initial = models.build_model("mlp", dropout=0.0, seed=0).get_weights()
    for a, b, w0 in zip(fitted.get_weights(), looped.get_weights(), initial):
        assert np.abs(a - w0).max() > 1e-4  # both trained
        np.testing.assert_allclose(a, b, atol=1e-5, rtol=0)


def test_costly_batch_map_keeps_shape_dtype_and_is_deterministic():
    x = tf.random.stateless_uniform((8, 28, 28, 1), seed=(1, 2))
    y = tf.range(8)
    fn = utilization.costly_batch_map(3)
    out, labels = fn(x, y)
    assert out.shape == x.shape and out.dtype == x.dtype
    assert labels is y
    np.testing.assert_array_equal(out.numpy(), fn(x, y)[0].numpy())
    assert not np.allclose(out.numpy(), x.numpy())
    identity, _ = utilization.costly_batch_map(0)(x, y)
    assert identity is x
    with pytest.raises(ValueError, match=r"`rounds` must be a non-negative integer, got -1"):
        utilization.costly_batch_map(-1)


def test_batch_map_runs_after_the_cache_every_epoch():
    calls = []

    def count(x, y):
        return tf.py_function(lambda t: calls.append(1) or t, [x], x.dtype), y

    strategy = get_strategy("one_device")
    dist = data.distribute(data.load("synthetic", num_examples=64), strategy, 16, seed=0,
                           batch_map_fn=count)
    iterator = iter(dist.dataset)
    for _ in range(2 * dist.steps_per_epoch):  # two epochs
        next(iterator)
    assert len(calls) >= 2 * dist.steps_per_epoch


@pytest.mark.parametrize("kwargs,message", [
    ({"input_threads": 0}, r"`input_threads` must be a positive integer or None, got 0"),
])
def test_distribute_refuses_bad_input_threads(kwargs, message):
    strategy = get_strategy("one_device")
    with pytest.raises(ValueError, match=message):
        data.distribute(data.load("synthetic", num_examples=64), strategy, 16, **kwargs)


def test_time_compute_needs_a_trained_model():
    strategy = get_strategy("one_device")
    dist = data.distribute(data.load("synthetic", num_examples=64), strategy, 16)
    model = models.build_model("mlp", strategy=strategy)
    models.compile_model(model, strategy=strategy)
    with pytest.raises(RuntimeError, match="time_compute needs a model that has trained"):
        utilization.time_compute(model, strategy, dist)


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
