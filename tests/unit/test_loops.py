"""Tests of tfmulti.training.loops: the custom-loop step trains a user's model exactly
as `fit` does (one device, 4 replicas, 2 workers), with gradient accumulation
equal to the big batch, and resumes mid-epoch from a backup to the weights of
an uninterrupted run.

The model, data and runs are tests/workers/accumulate.py's (functional, dict
inputs, a residual, an L2 penalty, the user's own loss, Keras' Adam); the
reference is plain Keras `fit` on one device at the same global batch.
"""

from __future__ import annotations

import keras
import numpy as np
import pytest
import tensorflow as tf

from tests.workers import accumulate
from tfmulti.training import backup
from tfmulti.training import loops


@pytest.mark.parametrize("replicas, accumulate_steps", [(4, 1), (2, accumulate.ACCUMULATE)])
def test_loop_equals_fit(replicas, accumulate_steps, big_batch):
    # 2 steps per call; with accumulation, 4 micro-batches of 4 rows per replica.
    got = accumulate.loop(accumulate.strategy_of(replicas), accumulate_steps, 2)
    assert got["rows"] == 32 // replicas // accumulate_steps  # the probe's last batch
    assert got["iterations"] == accumulate.STEPS
    accumulate.assert_same_training(got, big_batch)
    # Each call's loss is the mean of its 2 steps' global losses: the mean
    # over each epoch's 2 calls is fit's epoch loss.
    losses = got["losses"].reshape(accumulate.EPOCHS, -1).mean(axis=1)
    np.testing.assert_allclose(losses, big_batch["loss"], atol=1e-6)


def test_loop_keeps_the_loss_scaling(big_batch):
    # A LossScaleOptimizer (mixed float16) in the loop: loss scaled by 2**15,
    # the summed gradients unscaled once per update, so the plain update.
    strategy = tf.distribute.OneDeviceStrategy("CPU:0")
    with strategy.scope():
        optimizer = keras.optimizers.LossScaleOptimizer(keras.optimizers.Adam(0.01))
    got = accumulate.loop(strategy, accumulate.ACCUMULATE, optimizer=optimizer)
    assert float(optimizer.dynamic_scale.numpy()) == 2.0 ** 15
    accumulate.assert_same_training(got, big_batch)


@pytest.mark.slow  # seconds of training: the full suite's, not the fast tier's
def test_loop_resumes_mid_epoch(tmp_path, big_batch):
    # Trained to step 6 of 8 (the middle of epoch 2), saving every 2 steps;
    # a fresh model, optimizer and step resume at 6 and end where an
    # uninterrupted run does.
    strategy = accumulate.strategy_of(2)

    def backup_for(model, optimizer):
        model.compile(optimizer=optimizer)  # Backup saves model.optimizer's variables
        return backup.Backup(str(tmp_path), model)

    first = accumulate.loop(strategy, 2, 2, steps=6, backup_for=backup_for)
    assert first["resumed_step"] == 0 and first["iterations"] == 6
    assert sorted(int(p.rsplit("-", 1)[1]) for p in backup.checkpoints(str(tmp_path))) == [4, 6]
    resumed = accumulate.loop(strategy, 2, 2, backup_for=backup_for)
    assert resumed["resumed_step"] == 6
    assert resumed["iterations"] == accumulate.STEPS  # the restored count went on
    assert len(resumed["losses"]) == 1  # one call of 2 steps: 6 -> 8
    accumulate.assert_same_training(resumed, big_batch)


@pytest.fixture
def one_device():
    strategy = tf.distribute.OneDeviceStrategy("CPU:0")
    with strategy.scope():
        model = accumulate.build()
        optimizer = keras.optimizers.SGD(0.1)
    return strategy, model, optimizer


@pytest.mark.parametrize("arguments, message", [
    ({"global_batch_size": 0}, r"`global_batch_size` must be an integer >= 1, got 0"),
    ({"steps_per_execution": 2.0}, r"`steps_per_execution` must be an integer >= 1, got 2\.0"),
    ({"accumulate_steps": 3}, r"`global_batch_size` \(32\) must be divisible by the 1 "
                              r"replica x accumulate_steps \(3\); use a multiple of 3"),
])
def test_step_refuses_bad_counts(one_device, arguments, message):
    strategy, model, optimizer = one_device
    with pytest.raises(ValueError, match=message):
        loops.TrainStep(model, accumulate.log_cosh, optimizer, strategy,
                        **{"global_batch_size": 32, **arguments})


def test_step_refuses_what_is_not_under_the_strategy(one_device):
    strategy, model, optimizer = one_device
    mirrored = accumulate.strategy_of(2)
    with pytest.raises(ValueError, match="model 'user_model' was not built under this strategy"):
        loops.TrainStep(model, accumulate.log_cosh, optimizer, mirrored, global_batch_size=32)
    with mirrored.scope():
        model = accumulate.build()
    with pytest.raises(ValueError, match="optimizer was not created under this strategy"):
        loops.TrainStep(model, accumulate.log_cosh, optimizer, mirrored, global_batch_size=32)
    unbuilt = keras.Sequential([keras.layers.Dense(2)])
    with pytest.raises(ValueError, match="has no variables yet; build it first"):
        loops.TrainStep(unbuilt, accumulate.log_cosh, optimizer, strategy, global_batch_size=32)


def test_step_refuses_a_loss_over_the_whole_batch(one_device):
    strategy, model, optimizer = one_device
    step = loops.TrainStep(model, keras.losses.MeanSquaredError(), optimizer, strategy,
                           global_batch_size=32)  # reduction: the batch mean
    iterator = iter(step.distribute(accumulate.examples().batch(32)))
    with pytest.raises(ValueError, match="must return one loss per example"):
        step(iterator)


def test_step_stops_where_the_data_ends(one_device):
    strategy, model, optimizer = one_device
    step = loops.TrainStep(model, accumulate.log_cosh, optimizer, strategy,
                           global_batch_size=32, steps_per_execution=3)
    iterator = iter(step.distribute(accumulate.examples().batch(32)))  # 4 batches
    step(iterator)
    step(iterator)  # the 4th batch only
    assert int(optimizer.iterations) == 4
    with pytest.raises(StopIteration):
        step(iterator)


def test_run_refuses_a_backup_past_the_end(tmp_path, one_device):
    class At:
        step = 9

    class Ahead:
        def resume_point(self):
            return At()

    strategy, model, optimizer = one_device
    step = loops.TrainStep(model, accumulate.log_cosh, optimizer, strategy, global_batch_size=32)
    with pytest.raises(ValueError, match=r"backup is at step 9, past `steps` \(8\)"):
        loops.run(step, lambda s: accumulate.examples().batch(32), steps=8, backup=Ahead())
