"""Model builders, the compile helper, and data-parallel equivalence."""

from __future__ import annotations

import numpy as np
import pytest
import tensorflow as tf

from tfmulti import data, models, strategy as strategy_lib

STEPS = 6
GLOBAL_BATCH = 32


def _train_steps(strategy, init_weights, learning_rate=0.02):
    """SGD for STEPS steps; returns (per-step losses, final weights)."""
    model = models.build_model("mlp", strategy=strategy, dropout=0.0, seed=0)
    model.set_weights(init_weights)
    models.compile_model(model, strategy=strategy, optimizer="sgd", learning_rate=learning_rate)
    train = data.load("synthetic", "train", num_examples=GLOBAL_BATCH * STEPS)
    dist = data.distribute(train, strategy, GLOBAL_BATCH, seed=3)
    # One step per "epoch": History then holds every step's loss.
    history = model.fit(dist.dataset, steps_per_epoch=1, epochs=STEPS, verbose=0, shuffle=False)
    return np.array(history.history["loss"]), model.get_weights()


@pytest.mark.parametrize("num_replicas", [2, 4])
def test_mirrored_matches_one_device(num_replicas):
    reference = models.build_model("mlp", dropout=0.0, seed=0)
    init = reference.get_weights()
    one = strategy_lib.get_strategy("one_device", devices=["CPU:0"])
    mirrored = strategy_lib.get_strategy(
        "mirrored", devices=[f"CPU:{i}" for i in range(num_replicas)])
    assert mirrored.num_replicas_in_sync == num_replicas
    losses_one, weights_one = _train_steps(one, init)
    losses_mirrored, weights_mirrored = _train_steps(mirrored, init)
    # Training really moved the weights (so equality below is not vacuous).
    assert max(np.abs(w - w0).max() for w, w0 in zip(weights_one, init)) > 1e-3
    assert np.ptp(losses_one) > 1e-3  # distinct batches and weights at each step
    np.testing.assert_allclose(losses_mirrored, losses_one, atol=1e-5, rtol=0)
    for w_m, w_o in zip(weights_mirrored, weights_one):
        np.testing.assert_allclose(w_m, w_o, atol=1e-5, rtol=0)


def test_builders_shapes_and_variables_under_strategy():
    strategy = strategy_lib.get_strategy("mirrored")
    for name, (input_shape, out) in {
        "mlp": ((28, 28, 1), 10), "cnn": ((28, 28, 1), 10), "regression": ((1024,), 1),
    }.items():
        model = models.build_model(name, strategy=strategy)
        assert model.output_shape == (None, out)
        assert model.input_shape == (None, *input_shape)
        # Variables created under the scope are mirrored over all 4 replicas.
        var = model.trainable_variables[0]
        assert len(strategy.experimental_local_results(var.value)) == 4
    assert models.build_model("mlp").count_params() == 784 * 512 + 512 + 512 * 10 + 10


def test_mlp_takes_images_not_flat_vectors():
    # Seed 000 fed 28x28x1 images to Dense(input_shape=(784,)); ours flattens.
    model = models.build_model("mlp")
    assert model(tf.zeros((2, 28, 28, 1))).shape == (2, 10)


def test_same_seed_same_weights():
    a = models.build_model("mlp", seed=7).get_weights()
    b = models.build_model("mlp", seed=7).get_weights()
    c = models.build_model("mlp", seed=8).get_weights()
    for x, y in zip(a, b):
        np.testing.assert_array_equal(x, y)
    assert not np.array_equal(a[0], c[0])


@pytest.mark.parametrize("scaling,expected", [("none", 0.1), ("linear", 0.4), ("sqrt", 0.2)])
def test_learning_rate_scaling(scaling, expected):
    assert models.scaled_learning_rate(0.1, 1024, 256, scaling) == pytest.approx(expected)


def test_warmup_schedule_ramps_then_holds():
    schedule = models.WarmupSchedule(0.1, 0.4, warmup_steps=10)
    values = [float(schedule(s)) for s in (0, 5, 10, 50)]
    assert values == pytest.approx([0.1, 0.25, 0.4, 0.4])
    model = models.build_model("mlp")
    models.compile_model(model, learning_rate=0.1, lr_scaling="linear", global_batch_size=1024,
                         warmup_epochs=2, steps_per_epoch=5)
    assert isinstance(model.optimizer.learning_rate, tf.Variable) or model.optimizer._learning_rate
    assert model.optimizer._learning_rate.get_config() == {
        "initial": 0.1, "target": 0.4, "warmup_steps": 10}


@pytest.mark.parametrize("scaling,batch,target", [("none", 256, 0.1), ("linear", 64, 0.025)])
def test_warmup_ramps_up_where_scaling_does_not_raise_the_rate(scaling, batch, target):
    # Without a higher scaled rate to ramp to, warmup starts near 0 (target /
    # warmup steps) instead of being a no-op or running backwards.
    model = models.build_model("mlp")
    models.compile_model(model, learning_rate=0.1, lr_scaling=scaling, global_batch_size=batch,
                         warmup_epochs=2, steps_per_epoch=5)
    schedule = model.optimizer._learning_rate
    values = [float(schedule(s)) for s in (0, 5, 10, 50)]
    assert values == pytest.approx([target / 10, target * 0.55, target, target])


@pytest.mark.parametrize("kwargs,match", [
    ({"optimizer": "rmsprop"}, r"`optimizer` must be one of \['adam', 'sgd'\]"),
    ({"learning_rate": 0.0}, r"`learning_rate` must be positive"),
    ({"lr_scaling": "cubic", "global_batch_size": 256}, r"`lr_scaling` must be one of"),
    ({"lr_scaling": "linear"}, r"needs `global_batch_size`"),
    ({"warmup_epochs": 1}, r"needs `steps_per_epoch`"),
    ({"task": "ranking"}, r"`task` must be"),
])
def test_compile_errors(kwargs, match):
    with pytest.raises(ValueError, match=match):
        models.compile_model(models.build_model("mlp"), **kwargs)


def test_build_errors():
    with pytest.raises(ValueError, match=r"unknown model 'resnet'; valid models: \['cnn', 'mlp', 'regression'\]"):
        models.build_model("resnet")
    with pytest.raises(ValueError, match=r"`dropout` must be in \[0, 1\)"):
        models.build_model("mlp", dropout=1.5)


def test_model_saves_and_loads_with_warmup(tmp_path):
    import keras

    model = models.build_model("mlp")
    models.compile_model(model, warmup_epochs=1, steps_per_epoch=3)
    model.fit(np.zeros((4, 28, 28, 1), "float32"), np.zeros((4,), "int64"), verbose=0)
    path = tmp_path / "m.keras"
    model.save(path)
    loaded = keras.models.load_model(path)
    np.testing.assert_allclose(loaded.predict(np.ones((2, 28, 28, 1)), verbose=0),
                               model.predict(np.ones((2, 28, 28, 1)), verbose=0), atol=1e-6)


def test_xla_refused_with_two_replicas():
    """Keras 3 compiles the step around strategy.run; XLA then fails on the
    other replica's variables (keras-team/keras#17187). One replica is fine."""
    mirrored = strategy_lib.get_strategy("mirrored", devices=["CPU:0", "CPU:1"])
    with pytest.raises(ValueError, match=r"`jit_compile=True` does not work with 2 replicas"):
        models.compile_model(models.build_model("mlp", strategy=mirrored), strategy=mirrored,
                             jit_compile=True)
    one = strategy_lib.get_strategy("one_device")
    models.compile_model(models.build_model("mlp", strategy=one), strategy=one, jit_compile=True)
