"""Tests for tfmulti.models.optimizers: Keras' Adam with the fused kernel, same results.

Compared on linear problems: through a ReLU, a rounding-level difference can
flip a unit that sits at 0 and the two trajectories part (as they do when
only the order of a sum changes), which says nothing about the update."""

from __future__ import annotations

import keras
import numpy as np
import pytest
import tensorflow as tf

from tfmulti.models import builders as models
from tfmulti.models import optimizers
from tfmulti.runtime.strategy import get_strategy


def numpy_adam(w, grads, lr, beta_1=0.9, beta_2=0.999, epsilon=1e-7):
    """Kingma and Ba's Adam in float64, Keras' epsilon placement."""
    w, m, v = w.astype(np.float64), np.zeros_like(w, np.float64), np.zeros_like(w, np.float64)
    for t, g in enumerate(grads, 1):
        g = g.astype(np.float64)
        m = beta_1 * m + (1 - beta_1) * g
        v = beta_2 * v + (1 - beta_2) * g * g
        w = w - lr * np.sqrt(1 - beta_2 ** t) / (1 - beta_1 ** t) * m / (np.sqrt(v) + epsilon)
    return w, m, v


@pytest.mark.parametrize("amsgrad", [False, True])
def test_fused_adam_follows_the_reference_formula(amsgrad, monkeypatch):
    """Six steps on gradients spanning nine orders of magnitude (and exact
    zeros): the weights and both slots match float64 Adam (amsgrad=True takes
    Keras' own path and must match it exactly)."""
    kernel, calls = tf.raw_ops.ResourceApplyAdam, []
    monkeypatch.setattr(tf.raw_ops, "ResourceApplyAdam",
                        lambda **kw: calls.append(1) or kernel(**kw))
    rng = np.random.default_rng(0)
    w0 = rng.standard_normal(4096).astype(np.float32)
    grads = [(rng.standard_normal(4096) * 10.0 ** rng.uniform(-9, 1, 4096)).astype(np.float32)
             for _ in range(6)]
    grads[0][:512] = 0.0
    results = {}
    for fused in (False, True):
        var = keras.Variable(w0)
        opt = keras.optimizers.Adam(learning_rate=3e-3, amsgrad=amsgrad)
        if fused:
            assert optimizers.fuse(opt) is opt and optimizers.is_fused(opt)
        for g in grads:
            opt.apply_gradients([(tf.convert_to_tensor(g), var)])
        assert int(opt.iterations.numpy()) == len(grads)
        results[fused] = (var.numpy(), opt._momentums[0].numpy(), opt._velocities[0].numpy())
    keras_result, fused = results[False], results[True]
    assert len(calls) == (0 if amsgrad else len(grads))
    if amsgrad:
        for a, b in zip(keras_result, fused):
            np.testing.assert_array_equal(a, b)
        return
    w, m, v = numpy_adam(w0, grads, 3e-3)
    np.testing.assert_allclose(fused[0], w, rtol=0, atol=2e-6)
    # The slots to float32 rounding of the gradients they average (a moving
    # average of opposite-signed gradients cancels: no relative bound).
    scale = np.abs(np.stack(grads)).max(axis=0)
    assert (np.abs(fused[1] - m) <= 1e-6 * scale).all()
    assert (np.abs(fused[2] - v) <= 1e-6 * scale ** 2).all()
    # And no further from the reference than Keras' own update is.
    assert np.abs(fused[0] - w).max() <= 4 * np.abs(keras_result[0] - w).max() + 1e-7


def _linear_fit(strategy, fused, x, y, steps_per_execution):
    with strategy.scope():
        model = keras.Sequential([keras.Input((16,)), keras.layers.Dense(8), keras.layers.Dense(1)])
        model.set_weights([np.full(w.shape, 0.1 * (i + 1), np.float32)
                           for i, w in enumerate(model.get_weights())])
        optimizer = keras.optimizers.Adam(learning_rate=1e-2)
        model.compile(optimizer=optimizers.fuse(optimizer) if fused else optimizer, loss="mse",
                      steps_per_execution=steps_per_execution)
    model.fit(x, y, batch_size=32, epochs=2, shuffle=False, verbose=0)
    return model


@pytest.mark.slow  # trains for seconds: not in make test-fast
@pytest.mark.parametrize("strategy_kind", ["one_device", "mirrored"])
def test_fused_adam_trains_like_keras_adam_under_a_strategy(strategy_kind, monkeypatch):
    """fit on a linear model, 2 epochs of 8 steps, 4 steps per call: the fused
    kernel runs once per variable and replica in the traced step, the weights
    are Keras Adam's, and under MirroredStrategy every replica holds the same
    weights and slots (each updated its own copies)."""
    strategy = get_strategy(strategy_kind, devices=["CPU:0", "CPU:1"]
                            if strategy_kind == "mirrored" else None)
    rng = np.random.default_rng(1)
    x = rng.standard_normal((256, 16)).astype(np.float32)
    y = (x @ rng.standard_normal((16, 1))).astype(np.float32)
    reference = _linear_fit(strategy, False, x, y, 4)
    kernel, traced = tf.raw_ops.ResourceApplyAdam, []
    monkeypatch.setattr(tf.raw_ops, "ResourceApplyAdam",
                        lambda **kw: traced.append(kw["var"].device) or kernel(**kw))
    fused = _linear_fit(strategy, True, x, y, 4)
    per_trace = 4 * strategy.num_replicas_in_sync  # 2 kernels, 2 biases
    assert traced and len(traced) % per_trace == 0
    assert len(set(traced)) == strategy.num_replicas_in_sync
    assert int(fused.optimizer.iterations.numpy()) == 16
    for a, b in zip(reference.get_weights(), fused.get_weights()):
        np.testing.assert_allclose(b, a, rtol=1e-5, atol=1e-6)
    moved = [np.abs(w - 0.1 * (i + 1)).max() for i, w in enumerate(fused.get_weights())]
    assert min(moved) > 1e-3  # it trained
    if strategy_kind == "mirrored":
        slots = [*fused.optimizer._momentums, *fused.optimizer._velocities]
        for variable in [*fused.trainable_variables, *slots]:
            first, second = (c.numpy() for c in variable.value.values)
            np.testing.assert_array_equal(first, second)


def test_compile_model_fuses_adam_and_saves_plain_keras(tmp_path):
    """compile_model's "adam" is a fused keras.optimizers.Adam; a checkpoint of
    an unfused Adam restores into it; the saved model names Keras' Adam (it
    loads without tfmulti) and loads with the same optimizer state."""
    model = models.build_model("mlp", seed=0)
    models.compile_model(model, task="classification", learning_rate=2e-3)
    assert type(model.optimizer) is keras.optimizers.Adam
    assert optimizers.is_fused(model.optimizer)
    x = np.random.default_rng(0).random((64, 28, 28), dtype=np.float32)
    y = np.arange(64) % 10
    model.fit(x, y, batch_size=32, epochs=1, verbose=0)

    plain = keras.optimizers.Adam(2e-3)
    plain.build(model.trainable_variables)
    for i, variable in enumerate(plain.variables):
        variable.assign(np.full(variable.shape, i + 1, variable.dtype))
    saved = tf.train.Checkpoint(optimizer=plain).save(str(tmp_path / "adam"))
    fused = optimizers.fused_adam(2e-3)
    fused.build(model.trainable_variables)
    tf.train.Checkpoint(optimizer=fused).restore(saved).assert_consumed()
    for a, b in zip(plain.variables, fused.variables):
        np.testing.assert_array_equal(a.numpy(), b.numpy())

    config = keras.saving.serialize_keras_object(model.optimizer)
    assert (config["module"], config["class_name"], config["registered_name"]) == \
        ("keras.optimizers", "Adam", None)
    path = str(tmp_path / "model.keras")
    model.save(path)
    loaded = keras.saving.load_model(path)
    assert type(loaded.optimizer) is keras.optimizers.Adam
    assert not optimizers.is_fused(loaded.optimizer)
    for a, b in zip(model.optimizer.variables, loaded.optimizer.variables):
        np.testing.assert_array_equal(a.numpy(), b.numpy())
    np.testing.assert_allclose(loaded.predict(x, verbose=0), model.predict(x, verbose=0),
                               rtol=1e-6)


def test_fuse_refuses_other_optimizers():
    with pytest.raises(TypeError, match="fuse\\(\\) takes a keras.optimizers.Adam.*got SGD"):
        optimizers.fuse(keras.optimizers.SGD(0.1))

    class MyAdam(keras.optimizers.Adam):
        def update_step(self, gradient, variable, learning_rate):
            pass

    with pytest.raises(TypeError, match="got MyAdam"):
        optimizers.fuse(MyAdam())
    adamw = optimizers.fuse(keras.optimizers.AdamW(1e-3))  # Adam's update, decay apart
    assert optimizers.is_fused(adamw) and optimizers.fuse(adamw) is adamw
