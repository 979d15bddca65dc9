"""The byte-level transformer (tfmulti.models.transformer) and its tensor-parallel
form (tfmulti.parallel.tensor_split.split_transformer): shapes and sizes, causal
and padding masks, sampling, and the split form equal to the plain one
(forward, gradients, 3 Adam steps within 1e-5) with its weights, slots and
ops on their devices."""

from __future__ import annotations

import collections

import keras
import numpy as np
import pytest
import tensorflow as tf

from tests.workers import layouts
from tfmulti.models import optimizers
from tfmulti.models import transformer
from tfmulti.parallel.tensor_split import split_transformer, unsplit_transformer
from tests._util import assert_layout_equals_the_plain_model

SIZES = dict(seq_len=8, d_model=16, num_heads=4, num_layers=2, mlp_ratio=2)
BATCH = 4
ADAM = dict(learning_rate=1e-2, epsilon=1e-4)  # see tests/unit/test_tensor.py: the key bias


def _loss():
    return keras.losses.SparseCategoricalCrossentropy(from_logits=True)


def _tokens(seed=0, n=BATCH):
    rng = np.random.default_rng(seed)
    text = rng.integers(0, 256, (n, SIZES["seq_len"] + 1)).astype("int32")
    return text[:, :-1], text[:, 1:]


def _compiled(model):
    model.compile(optimizer=keras.optimizers.Adam(**ADAM), loss=_loss())
    optimizers.build_on_variable_devices(model.optimizer, model.trainable_variables)
    return model


def _unsplit_weights(model):
    """A model's weights in the plain transformer's layout and order."""
    return unsplit_transformer(model).get_weights()


def test_shapes_sizes_and_the_parameter_count():
    model = transformer.build_transformer(**SIZES, seed=0)
    tokens, _ = _tokens()
    assert model(tokens).shape == (BATCH, 8, 256)
    assert model.output.dtype == "float32"
    sizes = transformer.transformer_sizes(model)
    assert sizes == {"vocab_size": 256, "seq_len": 8, "d_model": 16, "num_heads": 4,
                     "num_layers": 2, "mlp_ratio": 2, "padding_mask": False}
    assert transformer.count_parameters(model) == model.count_params()
    names = transformer.layers_by_name(model)
    assert {transformer.role_of(n) for n in names} == set(transformer.ROLES)
    # The same seed, the same weights.
    again = transformer.build_transformer(**SIZES, seed=0)
    for a, b in zip(model.get_weights(), again.get_weights()):
        np.testing.assert_array_equal(a, b)


def test_a_position_sees_no_later_byte_and_no_padding():
    model = transformer.build_transformer(**SIZES, padding_mask=True, seed=1)
    tokens, _ = _tokens()
    mask = np.ones_like(tokens, dtype=bool)
    base = model({"tokens": tokens, "padding_mask": mask}).numpy()
    changed = tokens.copy()
    changed[:, 5:] = (changed[:, 5:] + 7) % 256  # later bytes differ
    later = model({"tokens": changed, "padding_mask": mask}).numpy()
    np.testing.assert_allclose(later[:, :5], base[:, :5], atol=1e-5)
    assert not np.allclose(later[:, 5:], base[:, 5:], atol=1e-3)
    # A padded (masked) key changes nothing for the positions after it.
    padded = tokens.copy()
    padded[:, 2] = 0
    mask2 = mask.copy()
    mask2[:, 2] = False
    out1 = model({"tokens": padded, "padding_mask": mask2}).numpy()
    padded[:, 2] = 99
    out2 = model({"tokens": padded, "padding_mask": mask2}).numpy()
    np.testing.assert_allclose(out1[:, 3:], out2[:, 3:], atol=1e-5)


def test_sample_writes_bytes_and_is_greedy_at_temperature_zero():
    model = transformer.build_transformer(**SIZES, seed=2)
    written = transformer.sample(model, b"The quick brown fox", 5, temperature=0)
    assert isinstance(written, bytes) and len(written) == 5
    window = np.frombuffer(b"The quick brown fox"[-8:], dtype=np.uint8).astype("int32")
    first = int(np.argmax(model(window[None])[0, -1]))
    assert written[0] == first
    assert transformer.sample(model, b"ab", 6, seed=3) == transformer.sample(model, b"ab", 6,
                                                                            seed=3)
    with pytest.raises(ValueError, match="`prompt` is empty"):
        transformer.sample(model, b"", 3)


def test_bad_sizes_name_the_value_and_the_fix():
    with pytest.raises(ValueError, match=r"`num_heads` \(3\) must divide `d_model` \(16\); use "
                                         r"e.g. num_heads=2"):
        transformer.build_transformer(d_model=16, num_heads=3)
    with pytest.raises(ValueError, match=r"`dropout` must be in \[0, 1\), got 1.0"):
        transformer.build_transformer(dropout=1.0)
    with pytest.raises(ValueError, match="`num_layers` must be a positive integer, got 0"):
        transformer.build_transformer(num_layers=0)
    with pytest.raises(ValueError, match=r"`layers` lacks \['lm_head'\]"):
        layers = transformer.layers_by_name(transformer.build_transformer(**SIZES))
        del layers["lm_head"]
        transformer.assemble(layers, seq_len=8)
    with pytest.raises(ValueError, match="is not a transformer from"):
        split_transformer(keras.Sequential([keras.Input((3,)), keras.layers.Dense(2)]),
                          ["CPU:0", "CPU:1"])
    with pytest.raises(ValueError, match=r"`num_heads` \(4\) must be divisible by the number of "
                                         r"devices \(3\)"):
        split_transformer(transformer.build_transformer(**SIZES), ["CPU:0", "CPU:1", "CPU:2"])


@pytest.mark.slow  # trains for seconds: not in make test-fast
def test_tensor_parallel_form_equals_the_plain_one_for_three_adam_steps():
    plain = transformer.build_transformer(**SIZES, seed=0)
    split = split_transformer(plain, ["CPU:0", "CPU:1"])
    tokens, targets = _tokens()
    np.testing.assert_allclose(split(tokens), plain(tokens), atol=1e-5)
    # Gradients, in the plain layout (the split ones joined as the weights are).
    grads = []
    for model in (plain, split):
        with tf.GradientTape() as tape:
            loss = _loss()(targets, model(tokens, training=True))
        grads.append(tape.gradient(loss, model.trainable_variables))
    saved = [v.numpy() for v in split.trainable_variables]
    for variable, grad in zip(split.trainable_variables, grads[1]):
        variable.assign(tf.convert_to_tensor(grad))
    joined = _unsplit_weights(split)
    assert len(joined) == len(grads[0])
    for a, b in zip(joined, grads[0]):
        np.testing.assert_allclose(a, tf.convert_to_tensor(b), atol=1e-5)
    for variable, value in zip(split.trainable_variables, saved):
        variable.assign(value)
    _compiled(plain), _compiled(split)
    for step in range(3):
        x, y = _tokens(seed=step + 1)
        np.testing.assert_allclose(split.train_on_batch(x, y), plain.train_on_batch(x, y),
                                   atol=1e-5)
    for a, b in zip(_unsplit_weights(split), plain.get_weights()):
        np.testing.assert_allclose(a, b, atol=1e-5)


def test_tensor_parallel_form_places_weights_slots_and_matmuls_per_device():
    devices = ["CPU:2", "CPU:3"]
    split = _compiled(split_transformer(transformer.build_transformer(**SIZES, seed=0), devices))
    by_device = collections.Counter()
    for v in split.weights:
        by_device[v.value.device[-5:]] += int(np.prod(v.shape))
    for slot in split.optimizer.variables:
        if len(slot.shape):
            (owner,) = [v for v in split.trainable_variables
                        if slot.path.endswith("/" + v.path.replace("/", "_") + "_momentum")
                        or slot.path.endswith("/" + v.path.replace("/", "_") + "_velocity")]
            assert slot.value.device == owner.value.device, slot.path
    # Each device holds half of the split weights; CPU:2 (the home) also
    # the embeddings, LayerNorms and unsplit biases.
    d, n, r, v = 16, 2, 2, 256
    split_per_device = n * (4 * d * d + 3 * d + 2 * r * d * d + r * d) // 2 + (d * v + v) // 2
    whole = v * d + 8 * d + n * (2 * 2 * d + d + d) + 2 * d
    assert by_device == {"CPU:2": split_per_device + whole, "CPU:3": split_per_device}
    tokens, targets = _tokens()

    @tf.function
    def step():
        with tf.GradientTape() as tape:
            loss = _loss()(targets, split(tokens, training=True))
        return tape.gradient(loss, split.trainable_variables)

    graph = step.get_concrete_function().graph
    matmuls = collections.Counter(op.device[-5:] for op in graph.get_operations()
                                  if op.type in ("MatMul", "BatchMatMulV2", "Einsum"))
    assert set(matmuls) == {"CPU:2", "CPU:3"} and matmuls["CPU:2"] == matmuls["CPU:3"], matmuls


@pytest.mark.slow  # trains for seconds: not in make test-fast
def test_two_pipeline_stages_equal_the_plain_model():
    # Stages of tensor-parallel devices: 2 x 2 x 2 below, in a process of 8
    # devices; their placement (and a 1 x 2 x 2 forward): tests/unit/test_layouts.py.
    assert_layout_equals_the_plain_model(layouts.compare(1, 2, 1), 2)
