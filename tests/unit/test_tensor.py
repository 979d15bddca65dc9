"""Tensor-parallel layers (tfmulti.parallel.tensor_layers): forward, gradients and
Adam steps equal to the unsplit layers; variables, optimizer slots and ops
on their devices; initialization, serialization and errors."""

from __future__ import annotations

import collections

import keras
import numpy as np
import pytest
import tensorflow as tf

from tfmulti.models import optimizers
from tfmulti.utils.sizes import variables_bytes
from tfmulti.parallel import ColumnParallelDense, ParallelMultiHeadAttention, RowParallelDense
from tfmulti.parallel.tensor_layers import run_on_device

LENGTH, CONTEXT, DIM, BATCH = 6, 5, 8, 4
# Adam's epsilon: the key projection's bias has a zero gradient up to
# rounding (softmax ignores a shift shared by all keys), and Adam with
# Keras' 1e-7 divides that rounding noise by itself; a larger epsilon keeps
# the comparison about the split, not about noise.
ADAM = dict(learning_rate=1e-2, epsilon=1e-4)
MATMULS = ("MatMul", "BatchMatMulV2", "Einsum")


def _devices(T, first=0):
    return [f"CPU:{first + i}" for i in range(T)]


def _inputs():
    return {"x": keras.Input((LENGTH, DIM), name="x"),
            "context": keras.Input((CONTEXT, DIM), name="context"),
            "mask": keras.Input((LENGTH, CONTEXT), dtype="bool", name="mask")}


# Each case: the unsplit layers, how to split them (once they are built) and
# how the model uses them.
def _column():
    dense = keras.layers.Dense(12, activation="gelu", name="up")
    return [dense], lambda d: [ColumnParallelDense.from_layer(dense, d, gather_output=True)], \
        lambda i, layers: layers[0](i["x"])


def _row():
    dense = keras.layers.Dense(DIM, name="down")
    return [dense], lambda d: [RowParallelDense.from_layer(dense, d, input_is_parallel=False)], \
        lambda i, layers: layers[0](i["x"])


def _mlp():
    up, down = keras.layers.Dense(16, activation="relu"), keras.layers.Dense(DIM)
    # A residual around the pair, as in a transformer block.
    return [up, down], lambda d: [ColumnParallelDense.from_layer(up, d),
                                  RowParallelDense.from_layer(down, d)], \
        lambda i, layers: i["x"] + layers[1](layers[0](i["x"]))


def _causal_attention():
    mha = keras.layers.MultiHeadAttention(4, 3, name="attention")
    return [mha], lambda d: [ParallelMultiHeadAttention.from_layer(mha, d)], \
        lambda i, layers: layers[0](i["x"], i["x"], use_causal_mask=True)


def _cross_attention():
    # Query and value differ, an explicit mask, a value_dim and an output size.
    mha = keras.layers.MultiHeadAttention(4, 3, value_dim=5, output_shape=7)
    return [mha], lambda d: [ParallelMultiHeadAttention.from_layer(mha, d)], \
        lambda i, layers: layers[0](i["x"], i["context"], attention_mask=i["mask"])


CASES = {"column": _column, "row": _row, "mlp": _mlp, "causal_attention": _causal_attention,
         "cross_attention": _cross_attention}


def _user_loss(y_true, y_pred):
    """A loss tfmulti does not know: Huber-like on a scaled error."""
    error = tf.abs(y_true - y_pred) * 2.0
    return tf.reduce_mean(tf.where(error < 1.0, 0.5 * error ** 2, error - 0.5))


def _pair(case, T, devices=None):
    keras.utils.set_random_seed(0)
    inputs = _inputs()
    plain, make_split, forward = CASES[case]()
    reference = keras.Model(inputs, forward(inputs, plain))
    split = make_split(devices or _devices(T))
    parallel = keras.Model(inputs, forward(inputs, split))
    for model in (reference, parallel):
        model.compile(optimizer=keras.optimizers.Adam(**ADAM), loss=_user_loss)
        optimizers.build_on_variable_devices(model.optimizer, model.trainable_variables)
    return reference, parallel, plain, split


def _data(seed=0, n=BATCH, width=DIM):
    rng = np.random.default_rng(seed)
    x = {"x": rng.normal(size=(n, LENGTH, DIM)).astype("float32"),
         "context": rng.normal(size=(n, CONTEXT, DIM)).astype("float32"),
         "mask": rng.random((n, LENGTH, CONTEXT)) > 0.3}
    return x, rng.normal(size=(n, LENGTH, width)).astype("float32")


def _unsplit(split_layers):
    return [w for layer in split_layers for w in layer.to_layer().get_weights()]


def _gradients(model, x, y):
    x = {k: tf.constant(v) for k, v in x.items()}
    with tf.GradientTape() as tape:
        tape.watch(x["x"])
        loss = _user_loss(y, model(x, training=True))
    return tape.gradient(loss, [x["x"], *model.trainable_variables])


_REFERENCE_RUNS = {}
"""The unsplit layers' results, by case: the same seeded layers and data
whatever T, computed once per process and compared with each split."""


def _reference_run(case, reference, plain, width):
    """The unsplit model's forward pass and eager gradients on _data(), then
    its three Adam steps' losses and the unsplit layers' weights after them."""
    if case not in _REFERENCE_RUNS:
        x, y = _data(width=width)
        forward = np.asarray(reference(x))
        grads = [np.asarray(g) for g in _gradients(reference, x, y)]
        losses = []
        for step in range(3):
            xs, ys = _data(seed=step + 1, width=width)
            losses.append(reference.train_on_batch(xs, ys))
        _REFERENCE_RUNS[case] = forward, grads, losses, [w for l in plain for w in l.get_weights()]
    return _REFERENCE_RUNS[case]


@pytest.mark.parametrize("T", [2, 4])
@pytest.mark.parametrize("case", list(CASES))
def test_forward_gradients_and_three_adam_steps_equal_the_unsplit_layer(case, T):
    reference, parallel, plain, split = _pair(case, T)
    width = parallel.output.shape[-1]
    x, y = _data(width=width)
    forward_r, grads_r, losses_r, trained_r = _reference_run(case, reference, plain, width)
    np.testing.assert_allclose(parallel(x), forward_r, atol=1e-5)
    # Gradients (eager): of the input, and of every weight in the unsplit
    # layout (the split gradients joined as the weights are, by to_layer).
    grads_p = _gradients(parallel, x, y)
    np.testing.assert_allclose(grads_p[0], grads_r[0], atol=1e-5)
    saved = [v.numpy() for v in parallel.trainable_variables]
    for variable, grad in zip(parallel.trainable_variables, grads_p[1:]):
        variable.assign(grad)
    joined = _unsplit(split)
    assert len(joined) == len(grads_r) - 1
    for a, b in zip(joined, grads_r[1:]):
        np.testing.assert_allclose(a, b, atol=1e-5)
    for variable, value in zip(parallel.trainable_variables, saved):
        variable.assign(value)
    # Three Adam steps through Keras' compiled train step (graph mode).
    for step in range(3):
        xs, ys = _data(seed=step + 1, width=width)
        np.testing.assert_allclose(parallel.train_on_batch(xs, ys), losses_r[step], atol=1e-5)
    for a, b in zip(_unsplit(split), trained_r):
        np.testing.assert_allclose(a, b, atol=1e-5)


def _by_device(variables):
    out = collections.defaultdict(list)
    for v in variables:
        out[v.value.device.split("device:")[-1]].append(v)
    return out


@pytest.mark.parametrize("case", ["mlp", "causal_attention"])
def test_each_device_holds_its_share_of_weights_and_adam_slots(case):
    devices = ["CPU:1", "CPU:2", "CPU:3"][:2]  # not the default device CPU:0
    _, parallel, _, split = _pair(case, 2, devices)
    x, y = _data()
    parallel.fit(x, y, epochs=1, verbose=0)
    for layer in split:
        weights = _by_device(layer.weights)
        assert sorted(weights) == devices
        # The split weights: named *_<shard>, on their shard's device, the
        # same bytes on every device; the home device adds the unsplit bias.
        for i, device in enumerate(devices):
            shards = [v for v in weights[device] if v.name.endswith(f"_{i}")]
            assert shards and len(shards) == len([v for v in layer.weights
                                                  if v.name.endswith("_0")])
        split_bytes = [variables_bytes(v for v in weights[d] if v.name[-2] == "_")
                       for d in devices]
        assert len(set(split_bytes)) == 1, split_bytes
    # Adam's two slots per weight live with it.
    slots = [s for s in parallel.optimizer.variables if len(s.shape)]
    assert len(slots) == 2 * len(parallel.trainable_variables)
    for v in parallel.trainable_variables:
        key = v.path.replace("/", "_")
        for kind in ("momentum", "velocity"):
            (slot,) = [s for s in slots if s.path.endswith(f"/{key}_{kind}")]
            assert slot.value.device == v.value.device, (v.path, kind)


def test_without_the_eager_build_keras_puts_the_slots_on_the_default_device():
    # Why build_on_variable_devices exists: Keras builds the optimizer inside
    # the traced step, where the shards' placement is lost.
    keras.utils.set_random_seed(0)
    inputs = keras.Input((DIM,))
    model = keras.Model(inputs, ColumnParallelDense(8, ["CPU:1", "CPU:2"], gather_output=True)(
        inputs))
    model.compile(optimizer="adam", loss="mse")
    model.train_on_batch(np.ones((2, DIM)), np.ones((2, 8)))
    slots = {s.value.device[-5:] for s in model.optimizer.variables if len(s.shape)}
    assert slots == {"CPU:0"}


def _placed_matmuls(model, x, y):
    x = {k: tf.constant(v) for k, v in x.items()}

    @tf.function
    def step():
        with tf.GradientTape() as tape:
            loss = _user_loss(y, model(x, training=True))
        return tape.gradient(loss, model.trainable_variables)

    graph = step.get_concrete_function().graph
    return collections.Counter(op.device.split("device:")[-1] for op in graph.get_operations()
                               if op.type in MATMULS)


@pytest.mark.parametrize("case,per_device", [("mlp", 6), ("causal_attention", 18)])
def test_every_device_runs_its_share_of_the_forward_and_backward_matmuls(case, per_device):
    # MLP: per device, 2 forward matmuls and 4 backward (kernel and input
    # gradients). Attention: 3 projections + 2 attention products + the
    # output projection forward, twice as many backward.
    devices = ["CPU:1", "CPU:3"]
    _, parallel, _, _ = _pair(case, 2, devices)
    x, y = _data()
    counts = _placed_matmuls(parallel, x, y)
    assert counts == {"CPU:1": per_device, "CPU:3": per_device}, counts


def test_run_on_device_places_the_backward_and_leaves_masks_alone():
    w = tf.Variable(tf.ones((3, 2)))
    mask = tf.constant([[1.0, 0.0]])

    @tf.function
    def step(x):
        with tf.GradientTape() as tape:
            tape.watch(x)
            y = run_on_device("CPU:2", lambda t: tf.matmul(t, w) * mask, x)
            loss = tf.reduce_sum(y)
        return tape.gradient(loss, [x, w])

    x = tf.ones((1, 3))
    dx, dw = step(x)
    np.testing.assert_allclose(dw.numpy(), [[1, 0]] * 3)
    np.testing.assert_allclose(dx.numpy(), [[1, 1, 1]])
    graph = step.get_concrete_function(x).graph
    assert {op.device for op in graph.get_operations() if op.type == "MatMul"} == {
        "/device:CPU:2"}


def test_fresh_shards_are_drawn_like_slices_of_one_kernel():
    layer = ColumnParallelDense(64, _devices(4),
                                kernel_initializer=keras.initializers.GlorotUniform(seed=3))
    layer.build((None, 32))
    kernels = [k.numpy() for k in layer.kernels]
    # Glorot's limit for the whole (32, 64) kernel, not for a (32, 16) shard.
    limit = np.sqrt(6 / (32 + 64))
    whole = np.concatenate(kernels, axis=1)
    assert np.abs(whole).max() <= limit
    assert np.abs(whole).max() > 0.9 * limit
    assert not np.allclose(kernels[0], kernels[1])  # each shard its own draw
    mha = ParallelMultiHeadAttention(4, 8, _devices(2))
    mha.build((None, LENGTH, DIM), (None, LENGTH, DIM))
    assert not np.allclose(mha.shards[0]["query"].numpy(), mha.shards[1]["query"].numpy())


def test_saved_and_loaded_like_any_keras_model(tmp_path):
    reference, parallel, _, _ = _pair("mlp", 2)
    path = str(tmp_path / "split.keras")
    parallel.save(path)
    loaded = keras.models.load_model(path, custom_objects={"_user_loss": _user_loss})
    x, _ = _data()
    np.testing.assert_allclose(loaded.predict(x, verbose=0), parallel.predict(x, verbose=0),
                               atol=1e-6)
    (row,) = [l for l in loaded.layers if isinstance(l, RowParallelDense)]
    assert [v.value.device[-5:] for v in row.kernels] == ["CPU:0", "CPU:1"]


def test_attention_dropout_trains_and_returns_scores():
    layer = ParallelMultiHeadAttention(4, 3, _devices(2), dropout=0.5, seed=1)
    x = tf.random.normal((2, LENGTH, DIM))
    with tf.GradientTape() as tape:
        out, scores = layer(x, x, return_attention_scores=True, training=True,
                            use_causal_mask=True)
        loss = tf.reduce_sum(out)
    grads = tape.gradient(loss, layer.trainable_variables)
    assert all(g is not None for g in grads)
    assert scores.shape == (2, 4, LENGTH, LENGTH)
    # Causal: no weight on later positions.
    assert float(tf.reduce_max(tf.linalg.band_part(scores, 0, -1)
                               - tf.linalg.band_part(scores, 0, 0))) == 0.0


def test_bad_arguments_name_the_value_and_the_fix():
    with pytest.raises(ValueError, match=r"`units` \(10\) must be divisible by the number of "
                                         r"devices \(4\)"):
        ColumnParallelDense(10, _devices(4))
    with pytest.raises(ValueError, match=r"`num_heads` \(3\) must be divisible"):
        ParallelMultiHeadAttention(3, 4, _devices(2))
    with pytest.raises(ValueError, match=r"device\(s\) \['/device:CPU:9'\] do not exist"):
        RowParallelDense(4, ["CPU:0", "CPU:9"])
    with pytest.raises(ValueError, match="`devices` must be a list of device names"):
        RowParallelDense(4, "CPU:0")
    with pytest.raises(ValueError, match="from_layer takes a built keras.layers.Dense"):
        ColumnParallelDense.from_layer(keras.layers.Dense(4), _devices(2))
    with pytest.raises(ValueError, match="does not split {'use_gate': True}"):
        ParallelMultiHeadAttention(2, 4, _devices(2), use_gate=True)
    with pytest.raises(ValueError, match="initializer Orthogonal depends on the whole kernel"):
        ColumnParallelDense(4, _devices(2), kernel_initializer="orthogonal").build((None, 3))
    with pytest.raises(ValueError, match=r"takes a list of 2 tensors"):
        RowParallelDense(4, _devices(2))(keras.Input((6,)))
