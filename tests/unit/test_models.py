"""Model builders, the compile helper, the mixed-precision policy, and
data-parallel equivalence."""

from __future__ import annotations

import numpy as np
import pytest
import tensorflow as tf

import keras

import tfmulti
from tfmulti import data
from tfmulti.models import builders as models
from tfmulti.runtime import strategy as strategy_lib

STEPS = 6
GLOBAL_BATCH = 32


def _train_steps(strategy, init_weights, learning_rate=0.02):
    """SGD for STEPS steps; returns (per-step losses, final weights)."""
    model = models.build_model("mlp", strategy=strategy, dropout=0.0, seed=0)
    model.set_weights(init_weights)
    models.compile_model(model, task="classification", strategy=strategy, optimizer="sgd",
                         learning_rate=learning_rate)
    train = data.load("synthetic", "train", num_examples=GLOBAL_BATCH * STEPS)
    dist = data.distribute(train, strategy, GLOBAL_BATCH, seed=3)
    # One step per "epoch": History then holds every step's loss.
    history = model.fit(dist.dataset, steps_per_epoch=1, epochs=STEPS, verbose=0, shuffle=False)
    return np.array(history.history["loss"]), model.get_weights()


@pytest.fixture(scope="module")
def one_device_reference():
    """(initial weights, per-step losses, final weights) of the one-device run,
    trained once for both replica counts."""
    init = models.build_model("mlp", dropout=0.0, seed=0).get_weights()
    one = strategy_lib.get_strategy("one_device", devices=["CPU:0"])
    return (init, *_train_steps(one, init))


@pytest.mark.parametrize("num_replicas", [2, 4])
def test_mirrored_matches_one_device(num_replicas, one_device_reference):
    init, losses_one, weights_one = one_device_reference
    mirrored = strategy_lib.get_strategy(
        "mirrored", devices=[f"CPU:{i}" for i in range(num_replicas)])
    assert mirrored.num_replicas_in_sync == num_replicas
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
    models.compile_model(model, task="classification", learning_rate=0.1, lr_scaling="linear",
                         global_batch_size=1024, warmup_epochs=2, steps_per_epoch=5)
    assert isinstance(model.optimizer.learning_rate, tf.Variable) or model.optimizer._learning_rate
    assert model.optimizer._learning_rate.get_config() == {
        "initial": 0.1, "target": 0.4, "warmup_steps": 10}


@pytest.mark.parametrize("scaling,batch,target", [("none", 256, 0.1), ("linear", 64, 0.025)])
def test_warmup_ramps_up_where_scaling_does_not_raise_the_rate(scaling, batch, target):
    # Without a higher scaled rate to ramp to, warmup starts near 0 (target /
    # warmup steps) instead of being a no-op or running backwards.
    model = models.build_model("mlp")
    models.compile_model(model, task="classification", learning_rate=0.1, lr_scaling=scaling,
                         global_batch_size=batch, warmup_epochs=2, steps_per_epoch=5)
    schedule = model.optimizer._learning_rate
    values = [float(schedule(s)) for s in (0, 5, 10, 50)]
    assert values == pytest.approx([target / 10, target * 0.55, target, target])


@pytest.mark.parametrize("kwargs,match", [
    ({"optimizer": "rmsprops"}, r"`optimizer` must be one of \['adam', 'adamw', 'sgd'"),
    ({"optimizer": 3}, r"`optimizer` must be a Keras optimizer name or a "
                       r"keras.optimizers.Optimizer, got int"),
    ({"optimizer": keras.optimizers.SGD(0.1), "learning_rate": 0.5},
     r"`learning_rate` \(0.5\) applies to an optimizer given by name; set the rate on your SGD"),
    ({"optimizer": keras.optimizers.SGD(keras.optimizers.schedules.ExponentialDecay(
        0.1, 10, 0.9)), "lr_scaling": "linear", "global_batch_size": 512},
     r"need a constant learning rate, but your SGD has a schedule"),
    ({"loss": "huberr"}, r"`loss` 'huberr' is not a Keras loss name"),
    ({"metrics": ["acuracy"]}, r"`metrics` lists 'acuracy', which is not a Keras metric name"),
    ({"metrics": "accuracy"}, r"`metrics` must be a list, got the string 'accuracy'"),
    ({"learning_rate": 0.0}, r"`learning_rate` must be a finite number > 0, got 0.0"),
    ({"learning_rate": float("nan")}, r"`learning_rate` must be a finite number > 0, got nan"),
    ({"learning_rate": float("inf")}, r"`learning_rate` must be a finite number > 0, got inf"),
    ({"lr_scaling": "cubic", "global_batch_size": 256}, r"`lr_scaling` must be one of"),
    ({"lr_scaling": "linear"}, r"needs `global_batch_size`"),
    ({"warmup_epochs": 1}, r"needs `steps_per_epoch`"),
    ({"warmup_epochs": -1}, r"`warmup_epochs` must be a finite number >= 0"),
    ({"task": "ranking"}, r"`task` must be one of \['classification', 'regression'\], got "
                          r"'ranking'"),
    ({"task": "mlp"}, r"`task` must be one of"),  # a model name is not a task
])
def test_compile_errors(kwargs, match):
    with pytest.raises(ValueError, match=match):
        models.compile_model(models.build_model("mlp"), **{"task": "classification", **kwargs})


def test_compile_needs_a_task_or_a_loss():
    model = models.build_model("mlp")
    with pytest.raises(ValueError, match=r"pass `task` \('classification' or 'regression'\) for "
                                         r"tfmulti's default loss and metrics, or your own "
                                         r"`loss`"):
        models.compile_model(model)
    assert not model.compiled
    models.compile_model(model, loss="mse")
    assert model.compiled and model.loss == "mse"


def test_a_model_with_its_own_train_step_compiles_without_a_loss():
    # keras-io's VAE: `vae.compile(optimizer=...)`, its train_step computes
    # the loss; tfmulti compiles it the same way, and it trains.
    import numpy as np

    class Own(keras.Model):
        def __init__(self):
            super().__init__()
            self.dense = keras.layers.Dense(1)

        def call(self, x):
            return self.dense(x)

        def train_step(self, data):
            with tf.GradientTape() as tape:
                loss = keras.ops.mean(keras.ops.square(self(data) - 1.0))
            grads = tape.gradient(loss, self.trainable_weights)
            self.optimizer.apply_gradients(zip(grads, self.trainable_weights))
            return {"own_loss": loss}

    model = Own()
    models.compile_model(model, optimizer="sgd", learning_rate=0.1)
    assert model.compiled and model.loss is None
    x = np.ones((8, 2), "float32")
    history = model.fit(x, batch_size=4, epochs=3, verbose=0)
    assert history.history["own_loss"][-1] < history.history["own_loss"][0]


def _own_functional():
    from tests import own_model

    return own_model.build(dict(pixels=(16,), extra=(4,)))


def test_the_users_optimizer_loss_and_metrics_pass_through():
    """Keras objects and names are kept as given; tfmulti only scales the rate."""
    from tests import own_model

    strategy = tfmulti.get_strategy("mirrored", devices=["CPU:0", "CPU:1"])
    with strategy.scope():
        model = _own_functional()
        xent = keras.metrics.SparseCategoricalCrossentropy(from_logits=True, name="xent")
    optimizer = keras.optimizers.RMSprop(0.01, rho=0.8)  # made outside the scope
    models.compile_model(model, strategy=strategy, optimizer=optimizer,
                         loss=own_model.smooth_loss, metrics=["accuracy", xent],
                         lr_scaling="linear", global_batch_size=512, base_batch_size=256)
    opt = model.optimizer
    assert isinstance(opt, keras.optimizers.RMSprop) and opt.rho == 0.8
    assert opt._distribution_strategy is strategy  # re-made under the model's strategy
    assert float(keras.ops.convert_to_numpy(opt.learning_rate)) == pytest.approx(0.02)
    assert model.loss is own_model.smooth_loss
    x, y = own_model.arrays(64)
    logs = model.fit(x, y, batch_size=32, epochs=1, verbose=0).history
    assert set(logs) == {"loss", "accuracy", "xent"}


@pytest.mark.parametrize("name", ["sgd", "rmsprop", "adamw", "nadam", "lion", "adagrad"])
def test_any_keras_optimizer_by_name_with_warmup(name):
    model = models.build_model("mlp")
    models.compile_model(model, task="classification", optimizer=name, learning_rate=0.01,
                         warmup_epochs=1, steps_per_epoch=10)
    assert type(model.optimizer).__name__.lower() == name
    schedule = model.optimizer._learning_rate
    assert isinstance(schedule, models.WarmupSchedule) and schedule.target == 0.01


def test_softmax_outputs_get_a_loss_on_probabilities():
    logits = models.build_model("mlp")
    probabilities = keras.Sequential([keras.Input((4,)), keras.layers.Dense(3, "softmax")])
    for model, from_logits in ((logits, True), (probabilities, False)):
        models.compile_model(model, task="classification")
        assert model.loss.get_config()["from_logits"] is from_logits


@pytest.mark.parametrize("name, task", [("mlp", "classification"), ("mlp", "regression"),
                                        ("regression", "regression"),
                                        ("regression", "classification")])
def test_the_loss_follows_the_task_not_the_model_name(name, task):
    loss, metric = {"classification": (keras.losses.SparseCategoricalCrossentropy, "accuracy"),
                    "regression": (keras.losses.MeanSquaredError, "mae")}[task]
    model = models.build_model(name)
    assert model.name == name
    models.compile_model(model, task=task)
    assert isinstance(model.loss, loss)
    x = np.zeros((4, *models.INPUT_SHAPES[name]), "float32")
    y = np.zeros((4,) if task == "classification" else (4, *model.output_shape[1:]), "float32")
    assert set(model.evaluate(x, y, verbose=0, return_dict=True)) == {"loss", metric}


def test_build_errors():
    with pytest.raises(ValueError, match=r"`model` must be one of \['mlp', 'regression', "
                                         r"'cnn'\], got 'resnet'"):
        models.build_model("resnet")
    with pytest.raises(ValueError, match=r"`dropout` must be in \[0, 1\)"):
        models.build_model("mlp", dropout=1.5)


def test_model_task_and_input_shapes():
    assert {n: models.model_task(n) for n in models.INPUT_SHAPES} == {
        "mlp": "classification", "regression": "regression", "cnn": "classification"}
    assert models.INPUT_SHAPES == {"mlp": (28, 28, 1), "regression": (1024,),
                                   "cnn": (28, 28, 1)}


def test_compile_refuses_steps_per_execution_that_do_not_tile_the_epoch():
    # (The policy itself: tests/unit/test_config.py.)
    with pytest.raises(ValueError, match=r"`steps_per_execution` \(4\) must divide"):
        models.compile_model(models.build_model("mlp"), task="classification",
                             steps_per_execution=4, steps_per_epoch=10)
    model = models.compile_model(models.build_model("mlp"), task="classification",
                                 steps_per_epoch=10)
    assert model.steps_per_execution == 10  # "auto"


@pytest.mark.parametrize("name, policy", [("none", "float32"), ("bfloat16", "mixed_bfloat16")])
def test_mixed_precision_policy_sets_and_restores(name, policy):
    before = keras.mixed_precision.global_policy().name
    with models.mixed_precision_policy(name):
        assert keras.mixed_precision.global_policy().name == policy
        model = models.build_model("mlp")
    assert keras.mixed_precision.global_policy().name == before
    assert model.layers[1].dtype_policy.name == policy  # fc1
    assert model.layers[-1].dtype_policy.name == "float32"  # logits stay float32
    assert all(v.dtype == "float32" for v in model.trainable_variables)
    with pytest.raises(RuntimeError, match="inside"):
        with models.mixed_precision_policy(name):
            raise RuntimeError("inside")
    assert keras.mixed_precision.global_policy().name == before  # restored on errors too


def test_mixed_precision_policy_errors():
    before = keras.mixed_precision.global_policy().name
    with pytest.raises(ValueError, match=r"`mixed_precision` must be one of \['none', "
                                         r"'bfloat16', 'float16'\], got 'int8'"):
        with models.mixed_precision_policy("int8"):
            pass
    if not tf.config.list_physical_devices("GPU"):
        with pytest.raises(ValueError, match=r"`mixed_precision` 'float16' needs a GPU and none "
                                             r"was found; use mixed_precision='bfloat16'"):
            with models.mixed_precision_policy("float16"):
                pass
    assert keras.mixed_precision.global_policy().name == before


def test_model_saves_and_loads_with_warmup(tmp_path):
    model = models.build_model("mlp")
    models.compile_model(model, task="classification", warmup_epochs=1, steps_per_epoch=3)
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
        models.compile_model(models.build_model("mlp", strategy=mirrored), task="classification",
                             strategy=mirrored, jit_compile=True)
    one = strategy_lib.get_strategy("one_device")
    model = models.compile_model(models.build_model("mlp", strategy=one), task="classification",
                                 strategy=one, jit_compile=True)
    assert model.jit_compile is True
