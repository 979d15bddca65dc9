"""Where a pipeline can cut a model (tfmulti.parallel.chain): blocks at
single-tensor cuts, side inputs and side computations, shared layers, the
stage sub-models, and the models that cannot be cut."""

from __future__ import annotations

import keras
import numpy as np
import pytest

from tfmulti.memory import footprint, shares
from tfmulti.parallel import chain as blocks
from tfmulti.parallel import partition


def _side_input_model():
    """Dict inputs; a stateless computation on a side input (a mask-like
    0/1 gate) used by every residual block."""
    features = keras.Input((6,), name="features")
    gate = keras.Input((1,), dtype="int32", name="gate")
    gate_float = keras.ops.cast(gate, "float32")  # a side computation
    x = keras.layers.Dense(8, name="embed")(features)
    for i in range(2):
        h = keras.layers.Dense(8, activation="tanh", name=f"inner{i}")(x)
        x = keras.layers.Add(name=f"residual{i}")([x, keras.layers.Multiply(name=f"gated{i}")(
            [h, gate_float])])
    out = keras.layers.Dense(3, name="head")(x)
    return keras.Model({"gate": gate, "features": features}, out, name="gated")


def test_blocks_of_a_residual_model_with_a_side_input():
    model = _side_input_model()
    chain = blocks.chain_of(model)
    assert [b.name for b in chain.blocks] == ["embed", "inner0..residual0", "inner1..residual1",
                                              "head"]
    features, gate = [t.name for t in chain.inputs].index("features"), [
        t.name for t in chain.inputs].index("gate")
    assert [b.side_keys for b in chain.blocks] == [(features,), (gate,), (gate,), ()]
    # The cast is recomputed by each block that uses the gate, not cut at.
    assert [[type(n.operation).__name__ for n in b.free_nodes] for b in chain.blocks] == [
        [], ["Cast"], ["Cast"], []]
    assert chain.blocks[0].entry is None and chain.blocks[-1].exit is model.outputs[0]
    assert chain.blocks[1].entry is chain.blocks[0].exit
    assert chain.stage_side_keys(1, 4) == (gate,)
    assert [layer.name for layer in chain.layers] == [
        "embed", "inner0", "gated0", "residual0", "inner1", "gated1", "residual1", "head"]


def test_stage_models_chained_give_the_model_output():
    model = _side_input_model()
    chain = blocks.chain_of(model)
    rng = np.random.default_rng(0)
    x = {"features": rng.random((5, 6), dtype=np.float32),
         "gate": rng.integers(0, 2, (5, 1)).astype("int32")}
    flat = [keras.ops.convert_to_tensor(t) for t in keras.tree.flatten(x)]
    first = chain.stage_model(0, 2, name="s0")
    second = chain.stage_model(2, 4, name="s1")
    assert [l.name for l in second.layers if not isinstance(l, keras.layers.InputLayer)] == [
        "inner1", "gated1", "residual1", "head"]
    carry = first([flat[k] for k in chain.stage_side_keys(0, 2)])
    out = second([carry, *[flat[k] for k in chain.stage_side_keys(2, 4)]])
    np.testing.assert_allclose(out, model(x), atol=1e-6)
    assert first.layers[-1] is model.get_layer("residual0")  # the same layer objects


def test_a_model_called_inside_the_model_is_cut_through_its_layers():
    """A backbone model inside a task model (keras-hub's shape), taking a dict
    and giving a dict: its layers are blocks of the task's chain, the same
    objects, and the stages chained give the task's output."""
    tokens = keras.Input((None,), dtype="int32", name="tokens")
    mask = keras.Input((None,), dtype="bool", name="mask")
    h = keras.layers.Embedding(20, 8, name="embed")(tokens)
    for i in range(2):
        h = keras.layers.Add(name=f"residual{i}")([h, keras.layers.Dense(8, name=f"inner{i}")(h)])
    pooled = keras.layers.Dense(8, name="pool")(h[:, 0])
    backbone = keras.Model({"tokens": tokens, "mask": mask}, {"sequence": h, "pooled": pooled},
                           name="backbone")
    inputs = {"tokens": keras.Input((None,), dtype="int32", name="tokens"),
              "mask": keras.Input((None,), dtype="bool", name="mask")}
    task = keras.Model(inputs, keras.layers.Dense(2, name="logits")(backbone(inputs)["pooled"]))
    chain = blocks.chain_of(task)
    names = [block.name for block in chain.blocks]
    # `h[:, 0]` is named by Keras' global counter: get_item, get_item_25, ...
    assert names[3].startswith("get_item") and names[:3] + names[4:] == [
        "embed", "inner0..residual0", "inner1..residual1", "pool", "logits"]
    assert chain.layers[0] is backbone.get_layer("embed")  # the same layer objects
    x = {"tokens": np.arange(10).reshape(2, 5).astype("int32"), "mask": np.ones((2, 5), bool)}
    flat = [keras.ops.convert_to_tensor(t) for t in keras.tree.flatten(x)]
    first = chain.stage_model(0, 2, name="s0")
    second = chain.stage_model(2, 6, name="s1")
    carry = first([flat[k] for k in chain.stage_side_keys(0, 2)])
    out = second([carry, *[flat[k] for k in chain.stage_side_keys(2, 6)]])
    np.testing.assert_allclose(out, task(x), atol=1e-6)
    assert blocks.inlined(backbone) is backbone  # nothing nested: the model itself
    # `h[:, 0]`, an operation without weights, is counted as a stage's (the estimate's shares).
    (get_item,) = [node.operation for node in chain.stage_nodes(0, 6)
                   if not isinstance(node.operation, keras.layers.Layer)]
    assert shares.device_shares(get_item, None, 2)[0].weights == ()


def test_a_stack_is_a_chain_of_its_layers():
    layers = [keras.layers.Flatten(), keras.layers.Dense(4), keras.layers.Dense(2)]
    shapeless = blocks.chain_of(layers)
    assert shapeless.inputs is None and [b.layers for b in shapeless.blocks] == [
        (layer,) for layer in layers]
    chain = blocks.chain_of(layers, input_shape=(2, 3))
    # A stateless first layer is a block too (a functional model would treat it
    # as a side computation).
    assert [b.layers for b in chain.blocks] == [(layer,) for layer in layers]
    assert chain.stack == tuple(layers) and all(layer.built for layer in layers)
    assert [footprint.output_bytes(b.nodes[0]) for b in chain.blocks] == [6 * 4, 4 * 4, 2 * 4]
    with pytest.raises(ValueError, match=r"^model 'stack' cannot be cut into 4 stages: it has 3 "
                                         r"layers; use at most 3 stages\.$"):
        partition.check_stage_count(4, chain=chain)


def test_a_shared_layer_keeps_its_uses_in_one_block():
    x = keras.Input((4,))
    shared = keras.layers.Dense(4, name="shared")
    h = shared(keras.layers.Dense(4, name="middle")(shared(x)))
    model = keras.Model(x, keras.layers.Dense(2, name="head")(h), name="tied")
    chain = blocks.chain_of(model)
    assert [b.name for b in chain.blocks] == ["shared..middle", "head"]
    with pytest.raises(ValueError, match=r"cannot be cut into 3 stages.*Layer 'shared' is used at "
                                         r"two places"):
        partition.check_stage_count(3, chain=chain)


def test_models_that_cannot_be_chained():
    x = keras.Input((4,))
    h = keras.layers.Dense(4)(x)
    two_outputs = keras.Model(x, [h, keras.layers.Dense(2)(h)], name="two")
    # Several outputs are taken where they all leave the last stage; this one's first
    # output is an input of the second, so no cut can leave both on the last stage.
    with pytest.raises(ValueError, match=r"model 'two' cannot be cut into 2 stages: it has 1 "
                                         r"block .*Output 'dense(_\d+)?' is computed before"):
        partition.check_stage_count(2, chain=blocks.chain_of(two_outputs))
    stateless = keras.Model(x, keras.layers.ReLU()(x), name="relu_only")
    with pytest.raises(ValueError, match=r"'relu_only': its output is computed from its inputs "
                                         r"by stateless operations only"):
        blocks.chain_of(stateless)

    class Subclassed(keras.Model):
        def call(self, inputs):
            return inputs

    with pytest.raises(ValueError, match=r"is a subclassed model"):
        blocks.chain_of(Subclassed())
    with pytest.raises(ValueError, match=r"got a single layer 'single'"):
        blocks.chain_of(keras.layers.Dense(2, name="single"))
    with pytest.raises(ValueError, match=r"the layer stack is empty"):
        blocks.chain_of([])
    with pytest.raises(ValueError, match=r"layers\[1\] is a str, not a keras layer"):
        blocks.chain_of([keras.layers.Dense(2), "dense"])
    with pytest.raises(ValueError, match=r"layer 'split' has several outputs"):
        blocks.chain_of([keras.layers.Lambda(lambda t: [t, t], name="split")], input_shape=(2,))
    with pytest.raises(ValueError, match=r"has shape \(None, None, 4\); this needs fully known"):
        blocks.per_example_elements(keras.Input((None, 4)))
