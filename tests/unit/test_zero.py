"""Tests for tfmulti.parallel.zero: the optimizer's state sharded over the
replicas (ZeRO stages 1 and 2, and the parameters too at stage 3) trains to
the weights of the whole state (stage 0), and each replica's device really
holds 1/N of it.

Keras' own `fit` under `MirroredStrategy` over the 4 test devices, a model
whose variables do not split evenly in 4 (7 x 13, 13, 13 x 3, 3): the last
shards are padded. The tests that train are marked slow (the fast tier's
budget)."""

from __future__ import annotations

import math
import os
import re

import keras
import numpy as np
import pytest
import tensorflow as tf

import tfmulti
from tfmulti.parallel import zero
from tfmulti.runtime.strategy import get_strategy

DEVICES = ("CPU:0", "CPU:1", "CPU:2", "CPU:3")
EXACT = 1e-5
"""float32, the same seed: stage K's weights within this of stage 0's."""


def _data():
    rng = np.random.default_rng(0)
    return rng.normal(size=(256, 7)).astype("float32"), rng.integers(0, 3, 256)


def _train(stage: int, optimizer: dict):
    """A small classifier trained 2 epochs by `fit` on the 4 devices, its
    optimizer (a Keras config) sharded at `stage`: (model, optimizer)."""
    strategy = get_strategy("mirrored", devices=DEVICES)
    keras.utils.set_random_seed(1)
    with strategy.scope():
        model = keras.Sequential([keras.Input((7,)), keras.layers.Dense(13, activation="relu"),
                                  keras.layers.Dense(3)])
        opt = keras.optimizers.deserialize(optimizer)
        model.compile(opt, loss=keras.losses.SparseCategoricalCrossentropy(from_logits=True))
    assert zero.shard_optimizer(opt, model.trainable_variables, strategy, stage,
                                model=model) is opt
    x, y = _data()
    model.fit(x, y, batch_size=32, epochs=2, shuffle=False, verbose=0)
    return model, opt


def _assert_same_weights(got, want):
    for a, b in zip(got.get_weights(), want.get_weights(), strict=True):
        np.testing.assert_allclose(a, b, rtol=0, atol=EXACT)


@pytest.fixture(scope="module")
def adam_runs():
    """Adam at stages 0 to 3, and at stage 2 a bucket per variable (the
    step's reduce, update, gather and assign bucket after bucket, each waiting
    for the previous one's assignments: "2-per-variable")."""
    adam = {"class_name": "Adam", "config": {"learning_rate": 0.01}}
    runs = {stage: _train(stage, adam) for stage in (0, 1, 2, 3)}
    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(zero, "BUCKET_BYTES", 4)  # under any variable's bytes
        runs["2-per-variable"] = _train(2, adam)
    return runs


def test_buckets_group_consecutive_sizes_up_to_the_cap():
    assert zero.buckets([10, 30, 5, 100, 1], 40) == [[0, 1], [2], [3], [4]]
    assert zero.buckets([1, 1, 1], 40) == [[0, 1, 2]]
    assert zero.buckets([], 40) == []


@pytest.mark.slow
@pytest.mark.parametrize("stage", [1, 2, "2-per-variable", 3])
def test_a_stage_trains_to_the_weights_of_the_whole_state(stage, adam_runs):
    model, optimizer = adam_runs[stage]
    _assert_same_weights(model, adam_runs[0][0])
    assert int(optimizer.iterations.numpy()) == 2 * 256 // 32
    assert zero.sharding_of(optimizer).stage == int(str(stage)[0])
    assert zero.sharding_of(adam_runs[0][1]) is None


@pytest.mark.slow
def test_the_slots_kept_whole_for_saving_are_the_gathered_ones_then_removed(adam_runs):
    """`keep_whole` writes every slot whole to files that `each_whole_slot`
    reads back one at a time (the process never holds them all); a process
    that does not save keeps nothing; `drop_whole` removes the files."""
    sharding = zero.sharding_of(adam_runs[1][1])
    gathered = sharding.whole_slots()
    assert [g.shape for g in gathered] == [tuple(sharding.variables[i].shape)
                                           for _, i, _ in sharding.slots]
    sharding.keep_whole(keep=False)
    assert sharding._kept is None
    sharding.keep_whole(keep=True)
    paths = sharding._kept[1]
    assert len(paths) == len(gathered) and all(os.path.exists(p) for p in paths)
    for kept, live in zip(sharding.each_whole_slot(), gathered, strict=True):
        np.testing.assert_array_equal(kept, live)
    sharding.drop_whole()
    assert not os.path.exists(os.path.dirname(paths[0])) and sharding._kept is None


@pytest.mark.slow
@pytest.mark.parametrize("stage", [1, 2, 3])
def test_each_device_holds_one_nth_of_the_slots(stage, adam_runs):
    """Read from the variables: each device holds its shard of every
    parameter (ceil(size / 4) elements) in Adam's two moments, and
    its copy's step count and learning rate; replicated (stage 0), each device
    holds both moments of every parameter."""
    model, optimizer = adam_runs[stage]
    chunks = sum(math.ceil(math.prod(v.shape) / len(DEVICES)) for v in model.trainable_variables)
    held = zero.sharding_of(optimizer).bytes_by_device()
    assert sorted(held) == sorted(tf.DeviceSpec.from_string(
        f"/job:localhost/replica:0/task:0/device:{d}").to_string() for d in DEVICES)
    assert set(held.values()) == {2 * 4 * chunks + 8 + 4}  # 2 moments, int64 + float32
    whole, per_device = adam_runs[0][1], {}
    for variable in whole.variables:
        for component in getattr(variable.value, "values", (variable.value,)):
            per_device[component.device] = per_device.get(component.device, 0) + (
                math.prod(component.shape) * component.dtype.size)
    parameters = sum(math.prod(v.shape) for v in model.trainable_variables)
    assert len(per_device) == len(DEVICES)
    assert set(per_device.values()) == {2 * 4 * parameters + 8 + 4}
    assert 2 * 4 * chunks < 2 * 4 * parameters / len(DEVICES) + 2 * 4 * len(model.weights)


@pytest.mark.slow
def test_the_estimate_counts_the_slots_each_device_holds(adam_runs):
    """`tfmulti estimate-memory --zero_stage=1` counts what the run's devices
    hold: each device's slots, read from the variables, are the estimate's
    plus the copy's step count and learning rate (int64 and float32)."""
    from tfmulti.memory import estimate as memory

    def build():
        return keras.Sequential([keras.Input((7,)), keras.layers.Dense(13, activation="relu"),
                                 keras.layers.Dense(3)])

    estimate = memory.estimate_memory(build, distribution="mirrored", num_devices=4,
                                      zero_stage=1, global_batch_size=32)
    held = zero.sharding_of(adam_runs[1][1]).bytes_by_device()
    assert [row["optimizer_slots"] + 8 + 4 for row in estimate["devices"]] == list(held.values())


@pytest.mark.slow
@pytest.mark.parametrize("optimizer", [
    {"class_name": "AdamW", "config": {"learning_rate": 0.01, "weight_decay": 0.1}},
    {"class_name": "SGD", "config": {"learning_rate": 0.05, "momentum": 0.9, "nesterov": True}},
    {"class_name": "RMSprop", "config": {"learning_rate": 0.01, "momentum": 0.5}},
    {"class_name": "Lion", "config": {"learning_rate": 0.001}},
    {"class_name": "Adagrad", "config": {"learning_rate": 0.1}},
    {"class_name": "Adam", "config": {"learning_rate": 0.01, "clipnorm": 0.1, "use_ema": True}},
], ids=lambda o: o["class_name"] + ("+clip+ema" if "clipnorm" in o["config"] else ""))
def test_any_keras_optimizer_shards_exactly(optimizer):
    """A rule per element updates a shard as it updates those elements of the
    whole; weight decay, clipping by the norm and the moving average act on
    the whole variables, where Keras puts them."""
    whole = _train(0, optimizer)[0]
    _assert_same_weights(_train(2, optimizer)[0], whole)


@pytest.mark.slow
def test_stage_3_holds_one_nth_of_the_parameters_and_reads_them_whole(adam_runs):
    """Each device holds its shard of every parameter (ceil(size / 4)
    elements, read from the variables), where stage 0 holds them whole on each;
    outside the step the parameters read whole (`get_weights`), an assignment
    of a whole value gives each replica its shard, and the model saves as an
    ordinary one; at the end of a run they are made whole again."""
    model, optimizer = adam_runs[3]
    sharding = zero.sharding_of(optimizer)
    chunks = sum(math.ceil(math.prod(v.shape) / len(DEVICES)) for v in model.trainable_variables)
    parameters = sum(math.prod(v.shape) for v in model.trainable_variables)
    assert set(sharding.parameter_bytes_by_device().values()) == {4 * chunks}
    assert set(zero.sharding_of(adam_runs[2][1]).parameter_bytes_by_device().values()) == {
        4 * parameters}
    assert all(isinstance(v, zero.ShardedParameter) for v in model.trainable_variables)
    weights = model.get_weights()
    assert [w.shape for w in weights] == [tuple(v.shape) for v in model.weights]
    kernel = model.trainable_variables[0]
    doubled = 2 * np.asarray(kernel)
    kernel.assign(doubled)
    np.testing.assert_array_equal(np.asarray(kernel), doubled)
    kernel.assign(weights[0])
    sharding.unshard_parameters()
    assert not any(isinstance(v, zero.ShardedParameter) for v in model.trainable_variables)
    for a, b in zip(model.get_weights(), weights, strict=True):
        np.testing.assert_array_equal(a, b)
    assert set(sharding.parameter_bytes_by_device().values()) == {4 * parameters}


@pytest.mark.slow
@pytest.mark.parametrize("optimizer", [
    {"class_name": "AdamW", "config": {"learning_rate": 0.01, "weight_decay": 0.1}},
    {"class_name": "SGD", "config": {"learning_rate": 0.05, "momentum": 0.9}},
], ids=lambda o: o["class_name"])
def test_stage_3_with_weight_decay_and_momentum_trains_exactly(optimizer):
    """At stage 3 the decay is the shards' own (Keras decays the whole
    variables before the rule): the same weights as stage 0."""
    _assert_same_weights(_train(3, optimizer)[0], _train(0, optimizer)[0])


@pytest.mark.slow
def test_stage_3_gathers_outside_the_loops_and_conditions_of_layers():
    """An RNN reads its kernel inside a loop, and a convolution (with the fix for an
    empty batch) inside a condition, where the replicas cannot exchange the shards:
    the model gathers them when it is called, and stage 3 trains as stage 0."""
    def train(stage):
        strategy = get_strategy("mirrored", devices=DEVICES[:2])
        keras.utils.set_random_seed(1)
        with strategy.scope():
            model = keras.Sequential([keras.Input((12, 3)), keras.layers.Conv1D(4, 3),
                                      keras.layers.LSTM(5), keras.layers.Dropout(0.2),
                                      keras.layers.Dense(3)])
            model.compile(keras.optimizers.Adam(0.01),
                          keras.losses.SparseCategoricalCrossentropy(from_logits=True),
                          steps_per_execution=3)
        zero.shard_optimizer(model.optimizer, model.trainable_variables, strategy, stage,
                             model=model)
        rng = np.random.default_rng(2)
        x, y = rng.normal(size=(96, 12, 3)).astype("float32"), rng.integers(0, 3, 96)
        model.fit(x, y, batch_size=16, epochs=2, shuffle=False, verbose=0)
        return model

    _assert_same_weights(train(3), train(0))


@pytest.mark.parametrize("option", ["clipnorm", "global_clipnorm", "use_ema"])
def test_stage_3_refuses_what_reads_a_parameter_or_gradient_whole(option):
    strategy = get_strategy("mirrored", devices=DEVICES)
    optimizer = keras.optimizers.Adam(**{option: True if option == "use_ema" else 1.0})
    with pytest.raises(ValueError, match=rf"^zero_stage=3 cannot shard Adam with {option}="):
        zero.shard_optimizer(optimizer, [], strategy, 3)
    with pytest.raises(ValueError, match=r"^zero_stage=3 gathers the parameters where the "
                                         r"model is called: pass the model"):
        zero.shard_optimizer(keras.optimizers.Adam(), [], strategy, 3)
    # (float16's loss scaling trains: test_stage_3_with_loss_scaling_skips_what_overflows...)
    tfmulti.TrainConfig(distribution="mirrored", zero_stage=3, mixed_precision="float16").validate()
    # (accumulate_steps > 1 trains at stage 3: test_stage_3_accumulates_micro_batches_exactly)
    tfmulti.TrainConfig(distribution="mirrored", zero_stage=3, accumulate_steps=2).validate()


def test_a_model_without_variables_yet_is_refused():
    """A subclassed model makes its variables at its first call (`build(shape)`
    makes none without a build method): sharding nothing would fail at the
    first step with Keras' "Unknown variable"; it is refused, saying what to do."""
    strategy = get_strategy("mirrored", devices=DEVICES)
    with pytest.raises(ValueError, match=r"^shard_optimizer got no variables to shard: .*call "
                                         r"the model on a batch first"):
        zero.shard_optimizer(keras.optimizers.Adam(), [], strategy, 2)


class Penalized(keras.Model):
    """A subclassed model with Dropout, and optionally losses its layers add
    (`penalties`: its call's `add_loss`, an activity regularizer) and
    BatchNormalization (`norm`)."""

    def __init__(self, penalties: bool, norm: bool):
        super().__init__()
        self.penalties = penalties
        self.hidden = keras.layers.Dense(
            8, activation="relu",
            activity_regularizer=keras.regularizers.L2(0.05) if penalties else None)
        self.norm = keras.layers.BatchNormalization() if norm else None
        self.drop = keras.layers.Dropout(0.2)
        self.out = keras.layers.Dense(3)

    def call(self, x, training=False):
        h = self.hidden(x)
        if self.penalties:
            self.add_loss(0.01 * tf.reduce_sum(tf.square(h)))
        if self.norm is not None:
            h = self.norm(h, training=training)
        return self.out(self.drop(h, training=training))


def _fit_on_2_devices(build, stage: int, accumulate_steps: int, data=None):
    """The model `build()` makes under the strategy of 2 devices, trained 2 epochs by
    `fit` at `stage`, its gradients accumulated over `accumulate_steps`
    micro-batches, on `data` ((x, y); None: `_data()`): (model, losses)."""
    from tfmulti.models import accumulation

    strategy = get_strategy("mirrored", devices=DEVICES[:2])
    keras.utils.set_random_seed(1)
    with strategy.scope():
        model = build()
        model.compile(keras.optimizers.Adam(0.01),
                      keras.losses.SparseCategoricalCrossentropy(from_logits=True))
    accumulation.accumulate_gradients(model, accumulate_steps)
    zero.shard_optimizer(model.optimizer, model.trainable_variables, strategy, stage,
                         model=model)
    x, y = _data() if data is None else data
    history = model.fit(x, y, batch_size=32, epochs=2, shuffle=False, verbose=0)
    return model, history.history["loss"]


def _train_penalized(stage: int, penalties: bool, norm: bool, accumulate_steps: int = 1):
    """`Penalized` trained by `_fit_on_2_devices`: (model, losses)."""
    def build():
        model = Penalized(penalties, norm)
        model(np.zeros((1, 7), "float32"))
        return model

    return _fit_on_2_devices(build, stage, accumulate_steps)


@pytest.mark.slow
@pytest.mark.parametrize("penalties,norm", [(True, False), (False, True)],
                         ids=["added-losses", "batch-norm"])
def test_stage_3_keeps_what_layers_add_and_assign_in_the_call(penalties, norm):
    """The parameters are read from a scope while the model is called: the
    losses its layers add there (`add_loss`, an activity regularizer) count, each
    replica's own (the replicas' calls interleave at the gathers), and its
    BatchNormalization statistics and its dropout's seed are assigned as
    without sharding: the same losses and weights as stage 0."""
    sharded, sharded_losses = _train_penalized(3, penalties, norm)
    whole, whole_losses = _train_penalized(0, penalties, norm)
    np.testing.assert_allclose(sharded_losses, whole_losses, rtol=1e-5)
    _assert_same_weights(sharded, whole)


class Block(keras.layers.Layer):
    """A layer holding layers: a Dense, then Dropout (Keras' seeded draws), called
    without `training` (they take it from Keras' context of the call, as keras-io's
    text transformer's block calls its dropouts)."""

    def __init__(self):
        super().__init__()
        self.dense = keras.layers.Dense(8, activation="relu")
        self.drop = keras.layers.Dropout(0.3)

    def call(self, x):
        return self.drop(self.dense(x))


class Noisy(keras.layers.Dense):
    """A Dense whose call drops with TensorFlow's own dropout (a stateful draw)."""

    def call(self, x, training=False):
        x = super().call(x)
        return tf.nn.dropout(x, 0.3, seed=5) if training else x


class Jittered(keras.layers.Dense):
    """A Dense whose call scales its output by draws of a `tf.random.Generator`
    (a state of its own, which each draw advances), in a `tf.function` of its own
    (the draws in a function the call's operations call, not among them)."""

    def build(self, shape):
        super().build(shape)
        self.generator = tf.random.Generator.from_seed(11)

    def call(self, x, training=False):
        x = super().call(x)
        return self._jitter(x) if training else x

    @tf.function
    def _jitter(self, x):
        return x * self.generator.uniform(tf.shape(x), 0.5, 1.5)


class KernelPenalty(keras.layers.Layer):
    """A layer whose call adds a loss of its own kernel."""

    def build(self, shape):
        self.kernel = self.add_weight((shape[-1], 8), initializer="glorot_uniform")

    def call(self, x):
        self.add_loss(0.01 * tf.reduce_sum(tf.square(self.kernel)))
        return tf.nn.relu(x @ self.kernel)


def _train_functional(stage: int, accumulate_steps: int = 1):
    """A Functional model (a nested one in it, layers that add losses, BatchNormalization,
    Keras' and TensorFlow's dropout, a generator's draws in a function) trained by `_fit_on_2_devices`: (model, losses)."""
    def build():
        inner_inputs = keras.Input((8,))
        inner = keras.Model(inner_inputs, keras.layers.Dense(
            8, activation="relu", activity_regularizer=keras.regularizers.L2(0.05))(inner_inputs))
        inputs = keras.Input((7,))
        h = keras.layers.BatchNormalization()(inner(KernelPenalty()(inputs)))
        h = Jittered(8)(Noisy(8)(Block()(h)))
        return keras.Model(inputs, keras.layers.Dense(3)(keras.layers.Dropout(0.2)(h)))

    return _fit_on_2_devices(build, stage, accumulate_steps)


@pytest.mark.slow
def test_stage_3_gathers_a_functional_models_parameters_layer_by_layer(monkeypatch):
    """In a Functional model each layer gathers its own parameters at its call, and
    one that can run twice gathers them again in the backward pass and runs again
    there (nothing gathered kept between the two), the rest keep theirs (their
    statistics must not move twice): the same losses (those the layers add
    included) and weights as stage 0."""
    recomputed = []
    recompute = zero._recomputed

    def spy(layer, *args):
        recomputed.append(type(layer).__name__)
        return recompute(layer, *args)

    monkeypatch.setattr(zero, "_recomputed", spy)
    sharded, sharded_losses = _train_functional(3)
    assert {"KernelPenalty", "Dense", "BatchNormalization", "Block", "Noisy",
            "Jittered"} == set(recomputed)
    whole, whole_losses = _train_functional(0)
    np.testing.assert_allclose(sharded_losses, whole_losses, rtol=1e-5)
    _assert_same_weights(sharded, whole)


class Branching(keras.Model):
    """A subclassed model: blocks in a Python loop, a layer in each branch of a
    `tf.cond`, one in a `tf.while_loop`'s body, and its embedding read again
    outside the embedding's call (the output tied to it)."""

    def __init__(self):
        super().__init__()
        self.embed = keras.layers.Embedding(20, 8)
        self.blocks = [keras.layers.Dense(8, activation="relu") for _ in range(2)]
        self.norm = keras.layers.BatchNormalization()
        self.gate = keras.layers.Dense(8)
        self.shared = keras.layers.Dense(8, activation="tanh")

    def call(self, ids, training=False):
        x = tf.reduce_mean(self.embed(ids), axis=1)
        for block in self.blocks:
            x = block(x)
        x = self.norm(x, training=training)
        x = tf.cond(tf.reduce_sum(x) > 0.0, lambda: self.gate(x), lambda: -self.gate(x))
        _, x = tf.while_loop(lambda i, x: i < 2, lambda i, x: (i + 1, self.shared(x)),
                             (tf.constant(0), x))
        return tf.matmul(x, self.embed.embeddings, transpose_b=True)


@pytest.mark.slow
def test_stage_3_gathers_a_subclassed_models_layers_in_and_out_of_control_flow(monkeypatch):
    """A subclassed model's layers gather their own parameters at their call too:
    those called in the model's own flow gather again in their backward and run
    again there; those called in a condition or a loop gather before it (each
    replica runs the exchange once) and keep their wholes; a parameter read
    outside its layer's call gathers where it is read: stage 0's weights."""
    recomputed = []
    recompute = zero._recomputed

    def spy(layer, *args):
        recomputed.append(layer)
        return recompute(layer, *args)

    monkeypatch.setattr(zero, "_recomputed", spy)

    def build():
        model = Branching()
        model(np.zeros((1, 5), "int32"))
        return model

    rng = np.random.default_rng(0)
    data = rng.integers(0, 20, (256, 5)), rng.integers(0, 20, 256)
    sharded, sharded_losses = _fit_on_2_devices(build, 3, accumulate_steps=1, data=data)
    in_flow = [sharded.embed, *sharded.blocks, sharded.norm]
    assert {id(layer) for layer in recomputed} == {id(layer) for layer in in_flow}
    whole, whole_losses = _fit_on_2_devices(build, 0, accumulate_steps=1, data=data)
    np.testing.assert_allclose(sharded_losses, whole_losses, rtol=1e-5)
    _assert_same_weights(sharded, whole)


@pytest.mark.slow
def test_stage_3_reads_a_regularized_parameter_whole_for_its_penalty():
    """A kernel regularizer's penalty (Keras adds it to the loss in the step,
    outside the layer's call) reads the parameter gathered whole there, and its
    gradient is reduce-scattered with the rest: stage 0's losses and weights."""
    def build():
        inputs = keras.Input((7,))
        hidden = keras.layers.Dense(13, activation="relu",
                                    kernel_regularizer=keras.regularizers.L2(0.1))(inputs)
        return keras.Model(inputs, keras.layers.Embedding(
            13, 3, embeddings_regularizer=keras.regularizers.L1(0.01))(
                keras.ops.argmax(hidden, axis=-1)) + keras.layers.Dense(3)(hidden))

    sharded, sharded_losses = _fit_on_2_devices(build, 3, accumulate_steps=1)
    whole, whole_losses = _fit_on_2_devices(build, 0, accumulate_steps=1)
    np.testing.assert_allclose(sharded_losses, whole_losses, rtol=1e-5)
    _assert_same_weights(sharded, whole)


@pytest.mark.slow
def test_stage_3_accumulates_micro_batches_exactly():
    """accumulate_steps=2 runs the micro-batches in a loop, where the replicas
    cannot exchange shards: stage 3 gathers the parameters once before it (a
    Functional model's too, not layer by layer) and reduce-scatters the summed
    gradient after it, and trains as stage 0 does with the same accumulation."""
    for train in (_train_penalized, _train_functional):
        arguments = (True, False) if train is _train_penalized else ()
        sharded, sharded_losses = train(3, *arguments, accumulate_steps=2)
        whole, whole_losses = train(0, *arguments, accumulate_steps=2)
        np.testing.assert_allclose(sharded_losses, whole_losses, rtol=1e-5)
        _assert_same_weights(sharded, whole)


def _train_mixed_float16(stage: int):
    """A Functional classifier in mixed_float16 trained by `_fit_on_2_devices`, one
    feature of the last row of the first batch an outlier: the scaled gradient
    overflows float16 in the second replica's share of that batch, and in the
    kernel's second shard only. (model, losses)."""
    def build():
        previous = keras.mixed_precision.global_policy()
        keras.mixed_precision.set_global_policy("mixed_float16")
        try:
            inputs = keras.Input((7,))
            hidden = keras.layers.Dense(13, activation="relu")(inputs)
            return keras.Model(inputs, keras.layers.Dense(3, dtype="float32")(hidden))
        finally:
            keras.mixed_precision.set_global_policy(previous)

    x, y = _data()
    x[31, 6] = 1000.0
    return _fit_on_2_devices(build, stage, accumulate_steps=1, data=(x, y))


@pytest.mark.slow
def test_stage_3_with_loss_scaling_skips_what_overflows_in_any_shard():
    """mixed_precision=float16 at stage 3: Keras' loss-scale optimizer checks the
    gradients it is given, here each replica's shard; the answers agree over the
    replicas (tfmulti's fix of Keras' check), so the step whose shard overflows on
    one replica is skipped by both, as at stage 0: the same scale, losses and
    weights (one replica's check alone applies it: NaN)."""
    sharded, sharded_losses = _train_mixed_float16(3)
    whole, whole_losses = _train_mixed_float16(0)
    scale = float(sharded.optimizer.dynamic_scale.numpy())
    assert scale == float(whole.optimizer.dynamic_scale.numpy()) == 2.0 ** 15 / 4
    assert np.isfinite(sharded_losses).all()
    np.testing.assert_allclose(sharded_losses, whole_losses, rtol=1e-5)
    _assert_same_weights(sharded, whole)


def test_a_stage_it_does_not_know_is_refused():
    strategy = get_strategy("mirrored", devices=DEVICES)
    with pytest.raises(ValueError, match=r"^zero_stage=4 is not a sharding stage; use one of "
                                         r"0, 1, 2, 3\.$"):
        zero.shard_optimizer(keras.optimizers.Adam(), [], strategy, 4)
    optimizer = keras.optimizers.Adam()
    optimizer.build([keras.Variable(np.zeros(3, "float32"))])
    with pytest.raises(ValueError, match="already built"):
        zero.shard_optimizer(optimizer, [], strategy, 1)


@pytest.mark.parametrize("distribution", ["one_device", "pipeline", "hybrid"])
def test_the_configuration_refuses_a_stage_without_data_parallel_replicas(distribution):
    config = tfmulti.TrainConfig(distribution=distribution, zero_stage=1)
    with pytest.raises(ValueError, match=rf"^`zero_stage` \(1\) shards the training state over "
                                         rf"data-parallel replicas: distribution 'mirrored' or "
                                         rf"'multi_worker', got '{distribution}'"):
        config.validate()
    with pytest.raises(ValueError, match="zero_stage"):
        tfmulti.TrainConfig(zero_stage=4).validate()


@pytest.mark.slow
def test_the_saved_model_is_an_ordinary_one_with_the_whole_optimizer_state(adam_runs, tmp_path):
    """`model.keras` of a sharded run loads into plain Keras with its
    optimizer's state whole: each slot the unsharded run's."""
    import warnings

    saved = {}
    for stage in (0, 1):
        model, _ = adam_runs[stage]
        model.save(tmp_path / f"stage{stage}.keras")
        with warnings.catch_warnings():
            warnings.simplefilter("error")  # "Skipping variable loading for optimizer ..."
            saved[stage] = keras.models.load_model(tmp_path / f"stage{stage}.keras")
    whole, sharded = (saved[stage].optimizer.variables for stage in (0, 1))
    # The same variables in the same order (the layers' names differ: two models here).
    assert [(v.name.rsplit("_", 1)[-1], v.shape) for v in sharded] == [
        (v.name.rsplit("_", 1)[-1], v.shape) for v in whole]
    for a, b in zip(sharded, whole, strict=True):
        np.testing.assert_allclose(np.asarray(a), np.asarray(b), rtol=0, atol=EXACT)


@pytest.mark.slow
def test_a_sharded_backup_resumes_resharded_as_the_unsharded_one(tmp_path):
    """A backup holds each slot whole (the keys of the unsharded optimizer's):
    a stage-1 run's backup on 4 replicas, resumed at stage 2 on 2 replicas (and
    a stage-3 one resumed at stage 3: its slots keyed by the parameters themselves),
    trains to what the same backup of a stage-0 run resumed at stage 0 on 2
    does (the replica count changes the result a little, the stage does not),
    the optimizer's state included."""
    def train(name, stage, devices, epochs, backup):
        tfmulti.train(tfmulti.TrainConfig(
            distribution="mirrored", devices=devices, dataset="synthetic", num_examples=128,
            global_batch_size=32, model="mlp", epochs=epochs, zero_stage=stage, verbose=0,
            backup_dir=str(tmp_path / backup), keep_backup=epochs == 1,
            model_dir=str(tmp_path / name)))
        return keras.models.load_model(tmp_path / name / "model.keras")

    resumed = {}
    for first, then in ((0, 0), (1, 2), (3, 3)):
        train(f"{first}-first", first, DEVICES, 1, f"backup{first}")
        resumed[first] = train(f"{first}-then", then, DEVICES[:2], 2, f"backup{first}")
    for sharded in (1, 3):
        _assert_same_weights(resumed[sharded], resumed[0])
        for a, b in zip(resumed[sharded].optimizer.variables, resumed[0].optimizer.variables,
                        strict=True):
            np.testing.assert_allclose(np.asarray(a), np.asarray(b), rtol=0, atol=EXACT)


@pytest.mark.parametrize("optimizer", [keras.optimizers.Lamb(), keras.optimizers.Nadam()],
                         ids=lambda o: type(o).__name__)
def test_an_optimizer_whose_rule_is_not_per_element_is_refused(optimizer):
    strategy = get_strategy("mirrored", devices=DEVICES)
    with pytest.raises(ValueError, match=rf"^{type(optimizer).__name__} cannot be sharded "
                                         r"\(zero_stage\): its update .*; use an optimizer whose "
                                         r"rule is per element"):
        zero.shard_optimizer(optimizer, [], strategy, 1)


@pytest.mark.slow
def test_an_embeddings_gradient_given_as_rows_shards_exactly():
    """An `Embedding`'s gradient comes as rows (`tf.IndexedSlices`): sharded,
    it is made dense, which is what stage 0 makes of it with the fix for rows
    repeated in a sparse gradient (`get_strategy` installs it): the tokens
    repeat within each batch and across the replicas here."""
    def train(stage):
        strategy = get_strategy("mirrored", devices=DEVICES)
        keras.utils.set_random_seed(1)
        with strategy.scope():
            model = keras.Sequential([keras.Input((4,), dtype="int32"),
                                      keras.layers.Embedding(256, 8), keras.layers.Flatten(),
                                      keras.layers.Dense(3)])
            model.compile(keras.optimizers.Adam(0.01),
                          keras.losses.SparseCategoricalCrossentropy(from_logits=True))
        zero.shard_optimizer(model.optimizer, model.trainable_variables, strategy, stage,
                             model=model)
        x = np.random.default_rng(1).integers(0, 16, (64, 4)).astype("int32")  # repeated
        y = np.random.default_rng(0).integers(0, 3, 64)
        model.fit(x, y, batch_size=8, epochs=2, shuffle=False, verbose=0)
        return model

    whole = train(0)
    for stage in (1, 2):
        _assert_same_weights(train(stage), whole)


class _Wrapper(keras.Model):
    """keras-io's VAE's shape: a subclassed model never called itself, holding
    models built from `keras.Input` (so its variables exist), trained by a
    `train_step` of its own; `own_optimizers`: the GAN's shape, whose
    train_step applies optimizers of its own."""

    def __init__(self, own_optimizers: bool):
        super().__init__()
        self.inner = keras.Sequential([keras.Input((7,)), keras.layers.Dense(3)])
        if own_optimizers:
            self.d_optimizer = keras.optimizers.Adam()


@pytest.mark.parametrize("own_optimizers", [False, True])
def test_tfmulti_shards_a_model_of_built_models_and_refuses_optimizers_of_its_own(
        own_optimizers, capsys):
    from tfmulti.training import run

    strategy = get_strategy("mirrored", devices=DEVICES[:2])
    with strategy.scope():
        model = _Wrapper(own_optimizers)
        model.compile(keras.optimizers.Adam())
    assert not model.built and model.trainable_variables
    if own_optimizers:
        with pytest.raises(ValueError, match=r"^zero_stage=1 shards the model's optimizer "
                                             r"\(model.optimizer\), and your model _Wrapper "
                                             r"trains with optimizers of its own in its "
                                             r"train_step \(d_optimizer\)"):
            run._shard(model, strategy, 1, None)
        return
    run._shard(model, strategy, 3, None)
    assert zero.sharding_of(model.optimizer).stage == 3
    assert "zero_stage=3: Adam's state sharded over 2 replicas" in capsys.readouterr().out


class Unbuilt(keras.Model):
    """A subclassed model whose layers are made in `__init__`, no `keras.Input`:
    Keras makes its variables at its first call (keras-io's recommenders' habit)."""

    def __init__(self, num_classes):
        super().__init__()
        self.flatten = keras.layers.Flatten()
        self.hidden = keras.layers.Dense(16, activation="relu")
        self.out = keras.layers.Dense(num_classes)

    def call(self, x):
        return self.out(self.hidden(self.flatten(x)))


def unbuilt_model(input_shape, num_classes):
    return Unbuilt(num_classes)


@pytest.mark.slow
def test_tfmulti_builds_a_model_that_makes_its_variables_at_its_first_call(tmp_path, capsys):
    """`tfmulti.train` builds such a model from the shapes of a training batch
    before sharding its optimizer (there were no variables to shard, and the
    run was refused), and it trains to stage 0's weights."""
    def train(stage):
        tfmulti.train(tfmulti.TrainConfig(
            distribution="mirrored", devices=DEVICES[:2], dataset="synthetic", num_examples=128,
            global_batch_size=32, model="tests.unit.test_zero:unbuilt_model", epochs=1,
            zero_stage=stage, verbose=0, model_dir=str(tmp_path / str(stage))))
        model = Unbuilt(10)  # (not serializable: its weights are saved)
        model(np.zeros((1, 28, 28, 1), "float32"))
        model.load_weights(tmp_path / str(stage) / "model.weights.h5")
        return model

    sharded = train(3)
    out = capsys.readouterr().out
    assert "tfmulti: built Unbuilt from the shapes of a training batch" in out, out
    assert "zero_stage=3: Adam's state sharded over 2 replicas" in out, out
    _assert_same_weights(sharded, train(0))


class NeedsValues(keras.Model):
    """A subclassed model whose call reads its input's values (no symbolic call
    can build it)."""

    def __init__(self):
        super().__init__()
        self.dense = keras.layers.Dense(2)

    def call(self, x):
        sign = float(np.asarray(x).sum() > 0)
        return self.dense(x) * sign


def test_a_model_that_cannot_be_built_from_the_batches_shapes_is_refused_saying_why():
    import types

    from tfmulti.training import run

    strategy = get_strategy("mirrored", devices=DEVICES[:2])
    with strategy.scope():
        model = NeedsValues()
        model.compile(keras.optimizers.Adam())
    batches = types.SimpleNamespace(
        dataset=tf.data.Dataset.from_tensor_slices(np.zeros((4, 3), "float32")).batch(2))
    with pytest.raises(ValueError, match=r"^zero_stage=1 shards the optimizer over the model's "
                                         r"variables, and your model NeedsValues has none yet, "
                                         r"and calling it on inputs of the training batches' "
                                         r"shapes made none \(its call failed: \w+Error: .+\): "
                                         r"build it in your model function"):
        run._shard(model, strategy, 1, batches)
