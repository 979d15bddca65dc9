"""Tests of tfmulti.models.accumulation: gradient accumulation through `fit`
equals training on the big batch (one device, 2 and 4 replicas, 2 workers,
several steps per call, a LossScaleOptimizer), and refuses what it cannot
do with a message.

Keras' own accumulation fails with 2+ replicas (keras-team/keras#20582; the
`test_upstream_bug_*` test): when that test starts failing after a Keras
upgrade, upstream has fixed it. The user's model (functional, dict inputs, a
residual, an L2 penalty, its own loss, Keras' Adam) and the runs come from
tests/workers/accumulate.py, which the 2-worker test runs too.
"""

from __future__ import annotations

import pytest

from tests.workers import accumulate


def test_upstream_bug_keras_gradient_accumulation_with_replicas():
    # keras-team/keras#20582: Keras' own accumulation applies inside an
    # ops.cond in the replica function, and the apply is a merge_call.
    import keras
    import numpy as np

    from tfmulti.runtime import keras_fixes

    strategy = keras_fixes.mirrored_strategy(["CPU:0", "CPU:1"])
    with strategy.scope():
        model = keras.Sequential([keras.Input((4,)), keras.layers.Dense(3)])
        model.compile(keras.optimizers.SGD(0.1, gradient_accumulation_steps=2), "mse")
    with pytest.raises(RuntimeError, match="merge_call` called while defining a new graph"):
        model.fit(np.ones((16, 4), "float32"), np.ones((16, 3), "float32"), batch_size=8,
                  verbose=0)


@pytest.mark.parametrize("replicas, steps_per_execution", [(1, 2), (2, 2), (4, 1)])
def test_fix_accumulation_equals_the_big_batch(replicas, steps_per_execution, big_batch):
    # 4 micro-batches per update at global batch 32: 8 rows per micro-step
    # (over the replicas), the same weights and losses as 32-row steps; 2
    # replicas x 2 steps per call run inside the multi-step fix's loop
    # (tfmulti.runtime.keras_fixes).
    import numpy as np

    got = accumulate.fit(accumulate.strategy_of(replicas), accumulate.ACCUMULATE,
                         steps_per_execution)
    assert big_batch["rows"] == 32
    assert got["rows"] == 32 // replicas // accumulate.ACCUMULATE  # the probe's micro-batch
    accumulate.assert_same_training(got, big_batch)
    np.testing.assert_allclose(got["loss"], big_batch["loss"], atol=1e-6)  # every micro-batch


def test_fix_accumulation_keeps_the_loss_scaling(big_batch):
    # A LossScaleOptimizer (Keras' mixed float16) scales the loss by 2**15:
    # the summed gradients are unscaled once, so the update is the plain one.
    import keras

    strategy = accumulate.strategy_of(2)
    with strategy.scope():  # its variables on the strategy
        optimizer = keras.optimizers.LossScaleOptimizer(keras.optimizers.Adam(0.01))
    got = accumulate.fit(strategy, accumulate.ACCUMULATE, optimizer=optimizer)
    assert got["rows"] == 4  # micro-batches of 4 rows per replica
    assert float(optimizer.dynamic_scale.numpy()) == 2.0 ** 15  # scaled, never overflowed
    accumulate.assert_same_training(got, big_batch)


class _Subclassed:
    """A subclassed Keras model (its own `call`, Keras' `train_step`)."""

    def __new__(cls):
        import keras

        class Subclassed(keras.Model):
            def __init__(self):
                super().__init__()
                self.probe = accumulate.RowProbe(name="probe")
                self.hidden = keras.layers.Dense(4, activation="tanh")
                self.out = keras.layers.Dense(2)

            def call(self, x):
                return self.out(self.hidden(self.probe(x, training=True)))

        return Subclassed()


@pytest.mark.parametrize("kind", ["sequential", "subclassed"])
def test_fix_accumulation_equals_keras_own_on_one_device(kind):
    # Where Keras' own accumulation works (one device), tfmulti's gives the
    # same weights: 4 Keras steps of 8 rows = one tfmulti step of 32.
    import keras
    import numpy as np

    from tfmulti.models import accumulation

    rng = np.random.default_rng(0)
    x, y = rng.normal(size=(64, 5)).astype("float32"), rng.normal(size=(64, 2)).astype("float32")

    def trained(optimizer, batch_size, accumulate_steps):
        keras.utils.set_random_seed(0)
        model = _Subclassed() if kind == "subclassed" else keras.Sequential(
            [keras.Input((5,)), accumulate.RowProbe(name="probe"),
             keras.layers.Dense(4, activation="tanh"), keras.layers.Dense(2)])
        model.compile(optimizer, "mse")
        if accumulate_steps:
            accumulation.accumulate_gradients(model, accumulate_steps)
        model.fit(x, y, batch_size=batch_size, shuffle=False, verbose=0)  # 2 updates
        probe = model.probe if kind == "subclassed" else model.get_layer("probe")
        assert int(probe.rows.numpy()) == 8  # both: 8-row micro-steps
        return model.trainable_weights

    keras_own = trained(keras.optimizers.Adam(0.01, gradient_accumulation_steps=4), 8, None)
    ours = trained(keras.optimizers.Adam(0.01), 32, 4)
    for a, b in zip(ours, keras_own):
        np.testing.assert_allclose(a, b, atol=1e-6)


def _tiny_model(optimizer="sgd", model_class=None, strategy=None):
    import contextlib

    import keras

    with strategy.scope() if strategy else contextlib.nullcontext():
        inputs = keras.Input((3,))
        model = (model_class or keras.Model)(inputs, keras.layers.Dense(2)(inputs))
        model.compile(optimizer, "mse")
    return model


@pytest.mark.parametrize("steps", [0, -1, 1.5, True, "2", None])
def test_accumulation_refuses_a_bad_count(steps):
    from tfmulti.models import accumulation

    with pytest.raises(ValueError, match=r"`accumulate_steps` must be an integer >= 1, got"):
        accumulation.accumulate_gradients(_tiny_model(), steps)


def test_accumulation_refuses_a_batch_it_cannot_split():
    import numpy as np
    import tensorflow as tf

    from tfmulti.models import accumulation

    model = accumulation.accumulate_gradients(_tiny_model(), 3)
    x, y = np.ones((16, 3), "float32"), np.ones((16, 2), "float32")
    static = tf.data.Dataset.from_tensor_slices((x, y)).batch(8, drop_remainder=True)
    with pytest.raises(ValueError, match=r"batch \(8 rows\) must be divisible by "
                                         r"accumulate_steps \(3\)"):
        model.fit(static, shuffle=False, verbose=0)
    model = accumulation.accumulate_gradients(_tiny_model(), 4)
    dynamic = tf.data.Dataset.from_tensor_slices((x[:10], y[:10])).batch(8)  # 8, then 2 rows
    with pytest.raises(tf.errors.InvalidArgumentError, match="divisible by accumulate_steps"):
        model.fit(dynamic, shuffle=False, verbose=0)


def _counted(aggregation: str):
    """A Keras Sequential on 2 replicas, accumulating 2 micro-batches, whose
    layer adds 1 to a variable of `aggregation` in each training call."""
    import keras

    from tfmulti.models import accumulation

    class Counter(keras.layers.Layer):
        def build(self, input_shape):
            self.calls = self.add_weight(shape=(), initializer="zeros", trainable=False,
                                         aggregation=aggregation)

        def call(self, x, training=False):
            if training:
                self.calls.assign_add(1.0)
            return x

    strategy = accumulate.strategy_of(2)
    with strategy.scope():
        model = keras.Sequential([keras.Input((3,)), Counter(), keras.layers.Dense(2)])
        model.compile("sgd", "mse")
    return accumulation.accumulate_gradients(model, 2), strategy


def _ones(rows: int = 8):
    import numpy as np
    import tensorflow as tf

    return tf.data.Dataset.from_tensor_slices((np.ones((rows, 3), "float32"),
                                               np.ones((rows, 2), "float32"))).batch(rows)


def test_accumulation_assigns_a_mean_synchronized_variable_per_replica_then_their_mean():
    # A variable synchronized by its mean (BatchNormalization's statistics, with the
    # fix for tensorflow#46488) is assigned through a merge_call, which the
    # micro-batch loop cannot hold: each replica assigns its copy in the loop, and
    # the copies are made their mean after it. 2 steps of 2 micro-batches: each
    # replica counted 4 calls, the mean 4.
    model, strategy = _counted("mean")
    model.fit(_ones().repeat(2), shuffle=False, verbose=0)
    counts = strategy.experimental_local_results(model.layers[0].calls.value)
    assert [float(c) for c in counts] == [4.0, 4.0]


def test_accumulation_refuses_a_summed_update_in_the_forward_pass():
    # A variable summed across replicas cannot be assigned per replica and summed
    # after the loop: refused, naming it.
    model, _ = _counted("sum")
    with pytest.raises(ValueError, match=r"the forward pass runs in a loop, and it assigns "
                                         r"\S*counter\S*, summed across replicas"):
        model.fit(_ones(), shuffle=False, verbose=0)


def test_accumulation_with_batch_normalization_on_replicas_equals_one_device():
    # Both replicas see the same half of every batch: 2 replicas accumulating 2
    # micro-batches train BatchNormalization (its statistics mean-synchronized
    # across replicas by the fix) as one device accumulating the same micro-batches:
    # the same weights and moving statistics.
    import keras
    import numpy as np

    from tfmulti.models import accumulation

    rng = np.random.default_rng(0)
    x = rng.normal(size=(64, 5)).astype("float32")
    y = rng.normal(size=(64, 1)).astype("float32")

    def train(strategy, batch, features, labels):
        keras.utils.set_random_seed(0)
        with strategy.scope():
            model = keras.Sequential([keras.Input((5,)), keras.layers.Dense(8),
                                      keras.layers.BatchNormalization(), keras.layers.Dense(1)])
            model.compile(keras.optimizers.SGD(0.1), "mse")
        accumulation.accumulate_gradients(model, 2)
        model.fit(features, labels, batch_size=batch, epochs=2, shuffle=False, verbose=0)
        return model

    one = train(accumulate.strategy_of(1), 16, x, y)
    halves = lambda a: np.concatenate([np.concatenate([b, b]) for b in np.split(a, 4)])  # noqa: E731
    two = train(accumulate.strategy_of(2), 32, halves(x), halves(y))
    for a, b in zip(two.get_weights(), one.get_weights(), strict=True):
        np.testing.assert_allclose(a, b, rtol=0, atol=1e-5)


def test_accumulation_refuses_a_step_of_its_own():
    import keras

    from tfmulti.models import accumulation

    class OwnStep(keras.Model):
        def train_step(self, data):
            return super().train_step(data)

    with pytest.raises(ValueError, match="OwnStep overrides `train_step`"):
        accumulation.accumulate_gradients(_tiny_model(model_class=OwnStep), 2)
    model = _tiny_model(model_class=OwnStep)
    assert accumulation.accumulate_gradients(model, 1) is model  # nothing to split


def test_accumulation_of_a_pipeline_model():
    # A model class that accumulates by itself (a method
    # `accumulate_gradients(steps)`, as PipelineModel, which runs `steps`
    # rounds of its own schedule) is handed the count.
    import keras

    from tfmulti.models import accumulation
    from tfmulti.parallel import PipelineModel

    model = PipelineModel([keras.layers.Dense(4), keras.layers.Dense(2)], input_shape=(3,),
                          devices=["CPU:0", "CPU:1"], num_microbatches=2)
    model.compile("sgd", "mse")
    assert accumulation.accumulate_gradients(model, 2) is model
    assert model.accumulate_steps == 2

    calls = []

    class Accumulating(keras.Model):
        def accumulate_gradients(self, steps):
            calls.append(steps)

    model = _tiny_model(model_class=Accumulating)
    assert accumulation.accumulate_gradients(model, 3) is model and calls == [3]


def test_accumulation_refuses_keras_own_accumulation():
    import keras
    import numpy as np

    from tfmulti.models import accumulation

    def keras_accumulating():
        return keras.optimizers.SGD(gradient_accumulation_steps=2)

    # Under 2 replicas Keras' own fails: pointed to tfmulti's, even with
    # accumulate_steps=1 (the default compile_model passes).
    strategy = accumulate.strategy_of(2)
    with strategy.scope():
        optimizer = keras_accumulating()
    with pytest.raises(ValueError, match=r"gradient_accumulation_steps \(2\) fails with 2 "
                                         r"replicas .* use tfmulti's accumulate_steps=2"):
        accumulation.accumulate_gradients(_tiny_model(optimizer, strategy=strategy), 1)
    # Both at once (one device): refused when the step is traced, for a model
    # made to accumulate before it was compiled.
    model = _tiny_model()
    accumulation.accumulate_gradients(model, 2)
    model.compile(keras_accumulating(), "mse")
    with pytest.raises(ValueError, match="use accumulate_steps alone"):
        model.fit(np.ones((8, 3), "float32"), np.ones((8, 2), "float32"), verbose=0)


# The guard: the micro-batch step copies Keras' train step.


def test_recorded_keras_train_step_is_the_installed_one():
    # Fails after a Keras upgrade that changed the train step the micro-batch
    # step copies: check the copy against the new code, then record the new digest.
    from tfmulti.models import accumulation
    from tfmulti.runtime import keras_fixes

    assert keras_fixes.changed_keras_functions(accumulation.KERAS_COPIED) == []


def test_guard_refuses_accumulation_where_keras_changed_its_step(monkeypatch):
    from keras.src.backend.tensorflow.trainer import TensorFlowTrainer

    from tfmulti.models import accumulation

    def train_step(self, data):  # a Keras release changed the step the micro-batch step copies
        raise NotImplementedError

    monkeypatch.setattr(TensorFlowTrainer, "train_step", train_step)
    with pytest.raises(RuntimeError, match=r"gradient accumulation was written for Keras 3\.15, .*"
                                           r"TensorFlowTrainer\.train_step: .* install keras"):
        accumulation.accumulate_gradients(_tiny_model(), 2)
    model = _tiny_model()
    assert accumulation.accumulate_gradients(model, 1) is model  # Keras' own step: nothing copied
