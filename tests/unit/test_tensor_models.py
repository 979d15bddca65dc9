"""A user's built model split over T devices (tfmulti.parallel.split_layers):
the keras-io text transformer as published (`tests/corpus/text_transformer.py`,
its own `TransformerBlock` holding the attention and the MLP) gives the same
forward, gradients and Adam steps as the unsplit model, holds each weight
once, and trains without Keras' "Gradients do not exist"; layers at any
depth; refusals in one line; the one-stage pipeline of the recipe."""

from __future__ import annotations

import warnings

import keras
import numpy as np
import pytest
import tensorflow as tf

from tests.corpus import text_transformer
from tfmulti.config.train_config import TrainConfig
from tfmulti.models import optimizers
from tfmulti.parallel import (ColumnParallelDense, ParallelMultiHeadAttention, PipelineModel,
                              RowParallelDense, join_layers, split_layers)
from tfmulti.parallel.tensor_layers import TensorParallelLayer
from tfmulti.parallel.tensor_models import split_for_pipeline

DEVICES = ["CPU:0", "CPU:1"]
# Adam's epsilon: as in test_tensor.py, the key projection's bias has a zero
# gradient up to rounding, which Keras' 1e-7 would divide by itself.
ADAM = dict(learning_rate=1e-2, epsilon=1e-4)


def _quiet(line):
    pass


def _transformer():
    """The published model twice with the same weights: (plain, to be split)."""
    keras.utils.set_random_seed(0)
    plain = text_transformer.build((text_transformer.MAXLEN,))
    source = text_transformer.build((text_transformer.MAXLEN,))
    source.set_weights(plain.get_weights())
    return plain, source


def _batch(seed, n=8):
    (x, y), _ = text_transformer.data(seed)
    return x[:n], y[:n]


def _in_unsplit_order(model) -> list:
    """The model's trainable weights as the unsplit model orders them, each
    split layer joined again (`to_layer`)."""
    embedding, block = model.layers[1], model.layers[2]
    parts = [embedding, block.att, *block.ffn.layers, block.layernorm1, block.layernorm2,
             *model.layers[5::2]]
    return [w for layer in parts for w in (
        layer.to_layer().get_weights() if isinstance(layer, TensorParallelLayer)
        else [v.numpy() for v in layer.trainable_weights])]


def _loss_and_gradients(model, x, y):
    with tf.GradientTape() as tape:
        loss = tf.reduce_mean(keras.losses.sparse_categorical_crossentropy(
            y, model(x, training=False)))
    return loss, tape.gradient(loss, model.trainable_variables)


def _gradients_in_unsplit_order(model, grads) -> list:
    saved = [v.numpy() for v in model.trainable_variables]
    for variable, grad in zip(model.trainable_variables, grads):
        variable.assign(grad)
    joined = _in_unsplit_order(model)
    for variable, value in zip(model.trainable_variables, saved):
        variable.assign(value)
    return joined


def _close(a_list, b_list):
    assert len(a_list) == len(b_list)
    for a, b in zip(a_list, b_list):
        np.testing.assert_allclose(a, b, atol=1e-5)


def test_the_keras_io_transformer_split_trains_as_the_unsplit_model():
    plain, source = _transformer()
    split = split_layers(source, DEVICES, print_fn=_quiet)
    block = split.layers[2]
    assert isinstance(block, text_transformer.TransformerBlock)
    assert isinstance(block.att, ParallelMultiHeadAttention)
    assert [type(l) for l in block.ffn.layers] == [ColumnParallelDense, RowParallelDense]
    # Each weight once: the same parameters, the old attention and MLP gone.
    count = lambda model: sum(int(np.prod(w.shape)) for w in model.trainable_weights)
    assert count(split) == count(plain)
    assert len(split.trainable_weights) == 22 - 12 + 15 + 7  # 8 + 4 replaced by their shards
    old = {id(w) for layer in (source.layers[2].att, source.layers[2].ffn)
           for w in layer.weights}
    assert not old & {id(w) for w in split.weights}
    # Forward and gradients.
    x, y = _batch(0)
    np.testing.assert_allclose(split(x, training=False), plain(x, training=False), atol=1e-5)
    loss_p, grads_p = _loss_and_gradients(plain, x, y)
    loss_s, grads_s = _loss_and_gradients(split, x, y)
    assert not [v.path for v, g in zip(split.trainable_variables, grads_s) if g is None]
    np.testing.assert_allclose(loss_s, loss_p, atol=1e-5)
    _close(_gradients_in_unsplit_order(split, grads_s),
           _gradients_in_unsplit_order(plain, grads_p))
    # Three Adam steps.
    adam_p, adam_s = keras.optimizers.Adam(**ADAM), keras.optimizers.Adam(**ADAM)
    optimizers.build_on_variable_devices(adam_s, split.trainable_variables)
    for step in range(3):
        x, y = _batch(step + 1)
        loss_p, grads_p = _loss_and_gradients(plain, x, y)
        loss_s, grads_s = _loss_and_gradients(split, x, y)
        np.testing.assert_allclose(loss_s, loss_p, atol=1e-5)
        adam_p.apply(grads_p, plain.trainable_variables)
        adam_s.apply(grads_s, split.trainable_variables)
    _close(_in_unsplit_order(split), _in_unsplit_order(plain))


@pytest.mark.slow  # trains for seconds: not in make test-fast
def test_the_split_model_fits_without_missing_gradients_and_holds_shards_on_their_devices():
    _, source = _transformer()
    split = split_layers(source, DEVICES, print_fn=_quiet)
    block = split.layers[2]
    shards = {layer.shard_of(w): w.value.device[-5:] for layer in (block.att, *block.ffn.layers)
              for w in layer.weights if layer.shard_of(w) is not None}
    assert shards == {0: "CPU:0", 1: "CPU:1"}
    split.compile(optimizer=keras.optimizers.Adam(**ADAM),
                  loss="sparse_categorical_crossentropy")
    x, y = _batch(0, n=32)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        history = split.fit(x, y, batch_size=16, epochs=1, verbose=0)
    assert not [str(w.message) for w in caught if "Gradients do not exist" in str(w.message)]
    assert np.isfinite(history.history["loss"][-1])


def test_split_layers_says_what_it_split_and_leaves_the_given_model_working():
    plain, source = _transformer()
    lines = []
    split_layers(source, DEVICES, print_fn=lines.append)
    block = source.layers[2]
    up, down = (layer.name for layer in block.ffn.layers)
    assert lines == [f"tfmulti: split over 2 devices: {block.name}.att (MultiHeadAttention, "
                     f"2 heads), {block.name}.ffn.{up}+{down} (Dense 32->32 + Dense 32->32)"]
    x, _ = _batch(0)
    np.testing.assert_allclose(source(x, training=False), plain(x, training=False), atol=1e-6)


class Scaled(keras.layers.Layer):
    """A user's layer with a weight of its own, blocks in a list and a dict,
    and a Sequential MLP (an MLP block inside, then a classifier head that
    is not one)."""

    def __init__(self, dim, heads, depth=2, **kwargs):
        super().__init__(**kwargs)
        self.blocks = [keras.layers.MultiHeadAttention(heads, 4) for _ in range(depth)]
        self.named = {"mlp": keras.Sequential([keras.layers.Dense(4 * dim, activation="gelu"),
                                               keras.layers.Dense(dim)])}
        self.head = keras.Sequential([keras.layers.Dense(dim, activation="softmax"),
                                      keras.layers.Dense(dim), keras.layers.Dense(3)])

    def build(self, input_shape):
        self.scale = self.add_weight(shape=(input_shape[-1],), initializer="random_normal")

    def call(self, x):
        for block in self.blocks:
            x = x + block(x, x)
        return self.head(self.named["mlp"](x * self.scale))


def _nested_model():
    keras.utils.set_random_seed(1)
    inputs = keras.Input((5, 8))
    return keras.Model(inputs, Scaled(8, 4, name="scaled")(inputs))


def test_layers_at_any_depth_with_the_users_own_weights():
    plain = _nested_model()
    lines = []
    split = split_layers(plain, [f"CPU:{i}" for i in range(4)], print_fn=lines.append)
    layer = split.layers[1]
    assert [type(b) for b in layer.blocks] == [ParallelMultiHeadAttention] * 2
    assert [type(l) for l in layer.named["mlp"].layers] == [ColumnParallelDense,
                                                             RowParallelDense]
    assert layer.head is plain.layers[1].head  # softmax, then 8 -> 3: not MLP blocks
    np.testing.assert_array_equal(layer.scale.numpy(), plain.layers[1].scale.numpy())
    assert "scaled.blocks[0] (MultiHeadAttention, 4 heads)" in lines[0]
    up, down = (layer.name for layer in plain.layers[1].named["mlp"].layers)
    assert f"scaled.named['mlp'].{up}+{down} (Dense 8->32 + Dense 32->8)" in lines[0]
    x = np.random.default_rng(0).normal(size=(2, 5, 8)).astype("float32")
    np.testing.assert_allclose(split(x), plain(x), atol=1e-5)


def test_an_mlp_block_of_a_sequential_model():
    keras.utils.set_random_seed(2)
    plain = keras.Sequential([keras.Input((6,)), keras.layers.Dense(12, activation="relu"),
                              keras.layers.Dense(6), keras.layers.Dense(2)])
    split = split_layers(plain, DEVICES, print_fn=_quiet)
    assert [type(l) for l in split.layers] == [ColumnParallelDense, RowParallelDense,
                                               keras.layers.Dense]
    x = np.ones((3, 6), "float32")
    np.testing.assert_allclose(split(x), plain(x), atol=1e-5)


def test_join_layers_gives_back_the_plain_model_with_the_trained_weights():
    plain, source = _transformer()
    split = split_layers(source, DEVICES, print_fn=_quiet)
    x, y = _batch(0)
    joined = join_layers(split, print_fn=_quiet)
    assert not [l for l in joined.layers[2].ffn.layers if isinstance(l, TensorParallelLayer)]
    assert type(joined.layers[2].att) is keras.layers.MultiHeadAttention
    _close([w.numpy() for w in joined.trainable_weights],
           [w.numpy() for w in plain.trainable_weights])
    _, grads = _loss_and_gradients(split, x, y)
    keras.optimizers.Adam(**ADAM).apply(grads, split.trainable_variables)
    joined = join_layers(split, print_fn=_quiet)
    np.testing.assert_allclose(joined(x, training=False), split(x, training=False), atol=1e-5)
    with pytest.raises(ValueError, match="holds no tensor-parallel layer to join"):
        join_layers(joined, print_fn=_quiet)
    nested = _nested_model()
    again = join_layers(split_layers(nested, DEVICES, print_fn=_quiet), print_fn=_quiet)
    _close(again.get_weights(), nested.get_weights())


class NoConfig(keras.layers.Layer):
    """Takes an object its config cannot give back."""

    def __init__(self, attention):
        super().__init__()
        self.att = attention

    def call(self, x):
        return self.att(x, x)


def _refusal(model, devices=DEVICES) -> str:
    with pytest.raises(ValueError) as error:
        split_layers(model, devices, print_fn=_quiet)
    message = str(error.value)
    assert "\n" not in message
    return message


def test_what_cannot_be_split_is_refused_in_one_line_naming_the_layer():
    _, source = _transformer()
    message = _refusal(source, [f"CPU:{i}" for i in range(4)])  # 2 heads over 4 devices
    assert f"layer {source.layers[2].name}.att: `num_heads` (2)" in message
    inputs = keras.Input((4,))
    dense = keras.Model(inputs, keras.layers.Dense(2)(inputs), name="plain_dense")
    assert "'plain_dense' has no layer split_layers can split" in _refusal(dense)
    inputs = keras.Input((3, 4))
    held = NoConfig(keras.layers.MultiHeadAttention(2, 2))
    message = _refusal(keras.Model(inputs, held(inputs)))
    assert f"layer {held.name} (NoConfig)" in message and "**kwargs" in message

    class Subclassed(keras.Model):
        def call(self, x):
            return x

    assert "Functional or Sequential" in _refusal(Subclassed())


def test_the_recipe_pipeline_keeps_the_shards_where_they_were_split():
    plain, source = _transformer()
    split, devices = split_for_pipeline(source, 2, ["CPU:2", "CPU:3"])
    assert devices == ["/device:CPU:2"]
    pipeline = PipelineModel(split, devices=devices, num_stages=1, num_microbatches=2)
    block = split.layers[2]
    assert {w.value.device[-5:] for w in block.att.weights} == {"CPU:2", "CPU:3"}
    assert block.layernorm1.gamma.value.device[-5:] == "CPU:2"
    x, _ = _batch(0)
    np.testing.assert_allclose(pipeline(x), plain(x, training=False), atol=1e-5)
    inputs = keras.Input((3, 4))
    on_top = keras.Model(inputs, keras.layers.MultiHeadAttention(2, 2, name="att")(inputs, inputs))
    with pytest.raises(ValueError, match=r"\['att'\] at the top of model"):
        split_for_pipeline(on_top, 2)


def test_tensor_parallel_takes_the_users_model_on_one_pipeline_stage():
    own = dict(model="tests.corpus.text_transformer:build", tensor_parallel=2,
               distribution="pipeline")
    TrainConfig(**own, num_stages=1).validate()
    with pytest.raises(ValueError, match="set distribution='pipeline' and num_stages=1"):
        TrainConfig(**own, num_stages=2).validate()
    with pytest.raises(ValueError, match="also splits your own model"):
        TrainConfig(model="cnn", tensor_parallel=2, distribution="pipeline").validate()


class Aliased(keras.layers.Layer):
    """Holds one attention under two names."""

    def __init__(self, heads):
        super().__init__()
        self.att = keras.layers.MultiHeadAttention(heads, 4)
        self.same = self.att

    def call(self, x):
        return self.same(self.att(x, x), x)


def test_a_layer_held_twice_is_split_once():
    inputs = keras.Input((3, 8))
    model = keras.Model(inputs, Aliased(2)(inputs))
    split = split_layers(model, DEVICES, print_fn=_quiet)
    layer = split.layers[1]
    assert layer.att is layer.same and isinstance(layer.att, ParallelMultiHeadAttention)
    x = np.ones((2, 3, 8), "float32")
    np.testing.assert_allclose(split(x), model(x), atol=1e-5)


def test_an_mlp_block_of_a_functional_graph():
    keras.utils.set_random_seed(3)
    inputs = keras.Input((5, 8))
    hidden = keras.layers.Dense(16, activation="gelu", name="up")(inputs)
    x = inputs + keras.layers.Dense(8, name="down")(hidden)
    outputs = keras.layers.Dense(8, name="head")(keras.layers.Dense(16, name="wide")(x) * 2.0)
    plain = keras.Model(inputs, outputs)
    lines = []
    split = split_layers(plain, DEVICES, print_fn=lines.append)
    assert lines == ["tfmulti: split over 2 devices: up+down (Dense 8->16 + Dense 16->8)"]
    kinds = {layer.name: type(layer) for layer in split.layers}
    assert kinds["up"] is ColumnParallelDense and kinds["down"] is RowParallelDense
    assert kinds["wide"] is keras.layers.Dense  # read by a multiplication, not a Dense
    x = np.random.default_rng(0).normal(size=(2, 5, 8)).astype("float32")
    np.testing.assert_allclose(split(x), plain(x), atol=1e-5)
    _close(join_layers(split, print_fn=_quiet).get_weights(), plain.get_weights())
