"""A decoder-only byte-level language model (GPT-2's layout, pre-LayerNorm).

Bytes in, next-byte logits out: a token embedding (256 byte values, so no
tokenizer to download) and a learned position embedding, N blocks of causal
self-attention and an MLP, each behind a LayerNorm and inside a residual,
then a final LayerNorm and the output head. The model is a functional Keras
model whose blocks meet at single tensors (the residual stream), so a
pipeline can cut it between blocks (`tfmulti.parallel.PipelineModel`).

The layers are named by their role (`ROLES`), which is how the
tensor-parallel form finds them: `tfmulti.parallel.tensor_split.split_transformer`
builds the same graph (`assemble`) from the same weights, with the attention
heads, the MLP and the output head split over T devices (Megatron-LM's
layout, `TENSOR_PARALLEL`).

Example:
    >>> import numpy as np
    >>> from tfmulti.models import transformer
    >>> model = transformer.build_transformer(seq_len=16, d_model=32, num_heads=4,
    ...                                       num_layers=2, seed=0)
    >>> model(np.zeros((3, 16), dtype="int32")).shape
    TensorShape([3, 16, 256])
    >>> transformer.count_parameters(model) == model.count_params()
    True
"""

from __future__ import annotations

import re
from collections.abc import Mapping

import keras
import numpy as np

from tfmulti.utils import checks
from tfmulti.config.train_config import TRANSFORMER, check_transformer_sizes

__all__ = ["PositionEmbedding", "ROLES", "TENSOR_PARALLEL", "assemble", "build_transformer",
           "count_parameters", "layers_by_name", "role_of", "sample", "transformer_sizes"]

ROLES = ("token_embedding", "position_embedding", "embedding_dropout", "ln1", "attention",
         "attention_dropout", "attention_residual", "ln2", "mlp_up", "mlp_down",
         "mlp_dropout", "mlp_residual", "final_ln", "lm_head")
"""The roles of the layers, named `<role>` (outside the blocks) or
`block<i>_<role>`."""
TENSOR_PARALLEL = {"attention": "heads", "mlp_up": "column", "mlp_down": "row",
                   "lm_head": "column_gathered"}
"""How the tensor-parallel form splits each role (Megatron-LM): attention by
heads, the MLP's first Dense by columns and its second by rows (one sum per
MLP), the output head by vocabulary columns, gathered into whole logits; the
embeddings and LayerNorms stay whole, on the first device."""
_BLOCK = re.compile(r"block(\d+)_(\w+)$")


class PositionEmbedding(keras.layers.Layer):
    """Adds a learned embedding of each position (0, 1, ...) to its input.

    Args:
        max_length: the longest sequence (the embedding's rows).
        initializer: of the embedding; default normal with stddev 0.02.
        **kwargs: `keras.layers.Layer` arguments.
    """

    def __init__(self, max_length: int, initializer="random_normal", **kwargs):
        super().__init__(**kwargs)
        self.max_length = checks.positive_int("max_length", max_length)
        self.initializer = keras.initializers.get(
            keras.initializers.RandomNormal(stddev=0.02) if initializer == "random_normal"
            else initializer)

    def build(self, input_shape):
        self.embeddings = self.add_weight(name="embeddings",
                                          shape=(self.max_length, int(input_shape[-1])),
                                          initializer=self.initializer)

    def call(self, inputs):
        length = keras.ops.shape(inputs)[-2]
        return inputs + keras.ops.cast(self.embeddings[:length], inputs.dtype)

    def compute_output_shape(self, input_shape):
        return input_shape

    def get_config(self):
        return {**super().get_config(), "max_length": self.max_length,
                "initializer": keras.initializers.serialize(self.initializer)}


keras.saving.register_keras_serializable(package="tfmulti")(PositionEmbedding)


def role_of(name: str) -> str | None:
    """A transformer layer's role from its name ("block3_mlp_up" -> "mlp_up"),
    or None for a name that is not one of `ROLES`."""
    match = _BLOCK.match(name)
    role = match.group(2) if match else name
    return role if role in ROLES else None


def _make_layers(vocab_size, seq_len, d_model, num_heads, num_layers, mlp_ratio,
                 dropout) -> dict:
    normal = keras.initializers.RandomNormal(stddev=0.02)
    layers = {
        "token_embedding": keras.layers.Embedding(vocab_size, d_model,
                                                  embeddings_initializer=normal,
                                                  name="token_embedding"),
        "position_embedding": PositionEmbedding(seq_len, name="position_embedding"),
        "embedding_dropout": keras.layers.Dropout(dropout, name="embedding_dropout"),
    }
    for i in range(num_layers):
        p = f"block{i}_"
        layers.update({
            p + "ln1": keras.layers.LayerNormalization(epsilon=1e-5, name=p + "ln1"),
            p + "attention": keras.layers.MultiHeadAttention(
                num_heads, d_model // num_heads, dropout=dropout, name=p + "attention"),
            p + "attention_dropout": keras.layers.Dropout(dropout, name=p + "attention_dropout"),
            p + "attention_residual": keras.layers.Add(name=p + "attention_residual"),
            p + "ln2": keras.layers.LayerNormalization(epsilon=1e-5, name=p + "ln2"),
            p + "mlp_up": keras.layers.Dense(mlp_ratio * d_model, activation="gelu",
                                             name=p + "mlp_up"),
            p + "mlp_down": keras.layers.Dense(d_model, name=p + "mlp_down"),
            p + "mlp_dropout": keras.layers.Dropout(dropout, name=p + "mlp_dropout"),
            p + "mlp_residual": keras.layers.Add(name=p + "mlp_residual"),
        })
    layers["final_ln"] = keras.layers.LayerNormalization(epsilon=1e-5, name="final_ln")
    # float32 logits under any mixed-precision policy, for the loss.
    layers["lm_head"] = keras.layers.Dense(vocab_size, name="lm_head", dtype="float32")
    return layers


def assemble(layers: Mapping[str, keras.layers.Layer], *, seq_len: int,
             padding_mask: bool = False, name: str = "transformer") -> keras.Model:
    """The transformer's graph over the given layer objects.

    One definition of the wiring for the plain and the tensor-parallel form:
    any layer may be replaced by one with the same call (an attention layer
    with Keras' signature; an MLP pair whose first layer's output, one tensor
    or a split list, the second takes).

    Args:
        layers: role name -> layer, every role of `ROLES` for blocks
            0..N-1 (as `layers_by_name` returns them).
        seq_len: the input length.
        padding_mask: take a dict {"tokens", "padding_mask"}: the mask (True
            for real bytes) keeps attention off padding, on top of the causal
            mask; else one tensor of byte ids.
        name: the model's name.

    Returns:
        The functional model: (batch, seq_len) int32 byte ids (or the dict)
        -> (batch, seq_len, vocab) float32 logits.

    Raises:
        ValueError: a role missing from `layers`.
    """
    num_layers = len({m.group(1) for m in map(_BLOCK.match, layers) if m})
    needed = [r for r in ROLES if not r.startswith(("ln", "attention", "mlp"))] + [
        f"block{i}_{r}" for i in range(num_layers) for r in ROLES
        if r.startswith(("ln", "attention", "mlp"))]
    missing = [r for r in needed if r not in layers]
    if missing:
        raise ValueError(f"`layers` lacks {missing}; pass every layer of the transformer "
                         "(see tfmulti.models.transformer.layers_by_name).")
    tokens = keras.Input((seq_len,), dtype="int32", name="tokens")
    inputs = tokens
    attention_mask = None
    if padding_mask:
        mask = keras.Input((seq_len,), dtype="bool", name="padding_mask")
        inputs = {"tokens": tokens, "padding_mask": mask}
        # (batch, 1, keys): every query position ignores padded keys.
        attention_mask = keras.layers.Reshape((1, seq_len), name="key_mask")(mask)
    x = layers["token_embedding"](tokens)
    x = layers["position_embedding"](x)
    x = layers["embedding_dropout"](x)
    for i in range(num_layers):
        def layer(role, i=i):
            return layers[f"block{i}_{role}"]
        h = layer("ln1")(x)
        h = layer("attention")(h, h, attention_mask=attention_mask, use_causal_mask=True)
        x = layer("attention_residual")([x, layer("attention_dropout")(h)])
        h = layer("mlp_down")(layer("mlp_up")(layer("ln2")(x)))
        x = layer("mlp_residual")([x, layer("mlp_dropout")(h)])
    logits = layers["lm_head"](layers["final_ln"](x))
    return keras.Model(inputs, logits, name=name)


def build_transformer(*, vocab_size: int = 256, seq_len: int = 128, d_model: int = 128,
                      num_heads: int = 4, num_layers: int = 2, mlp_ratio: int = 4,
                      dropout: float = 0.0, padding_mask: bool = False, seed: int | None = None,
                      name: str = TRANSFORMER) -> keras.Model:
    """A decoder-only transformer language model (see the module docstring).

    Args:
        vocab_size: token values; 256 (bytes) by default.
        seq_len: the input length (and the position embedding's rows).
        d_model: the width of the residual stream.
        num_heads: attention heads; must divide `d_model` (head size
            d_model / num_heads).
        num_layers: transformer blocks.
        mlp_ratio: the MLP's hidden width as a multiple of `d_model`.
        dropout: after the embeddings, on the attention weights and on each
            block's two outputs; 0 (default) disables it.
        padding_mask: also take a padding mask (see `assemble`).
        seed: seeds the initializers (same seed, same weights) through
            `keras.utils.set_random_seed`.
        name: the model's name.

    Returns:
        A functional `keras.Model`, built: (batch, seq_len) int32 byte ids ->
        (batch, seq_len, vocab_size) float32 logits.

    Raises:
        ValueError: a size that is not a positive integer, `num_heads` not
            dividing `d_model`, or a dropout rate outside [0, 1).
    """
    check_transformer_sizes(seq_len=seq_len, d_model=d_model, num_heads=num_heads,
                            num_layers=num_layers, mlp_ratio=mlp_ratio, vocab_size=vocab_size)
    checks.finite_number("dropout", dropout, minimum=0)
    if not dropout < 1:
        raise ValueError(f"`dropout` must be in [0, 1), got {dropout!r}.")
    if seed is not None:
        keras.utils.set_random_seed(seed)
    layers = _make_layers(vocab_size, seq_len, d_model, num_heads, num_layers, mlp_ratio,
                          dropout)
    return assemble(layers, seq_len=seq_len, padding_mask=padding_mask, name=name)


def layers_by_name(model: keras.Model) -> dict:
    """A transformer's layers by name (what `assemble` takes), inputs and
    helper layers (the padding mask's reshape) left out."""
    return {layer.name: layer for layer in model.layers if role_of(layer.name)}


def transformer_sizes(model: keras.Model) -> dict:
    """The sizes of a model built by `build_transformer` (or its
    tensor-parallel form): vocab_size, seq_len, d_model, num_heads,
    num_layers, mlp_ratio, padding_mask."""
    layers = layers_by_name(model)
    embedding = layers["token_embedding"]
    attention = layers["block0_attention"]
    d_model = int(embedding.output_dim)
    return {"vocab_size": int(embedding.input_dim), "d_model": d_model,
            "seq_len": int(layers["position_embedding"].max_length),
            "num_heads": int(attention.num_heads),
            "num_layers": sum(1 for n in layers if n.endswith("_ln1")),
            "mlp_ratio": int(layers["block0_mlp_up"].units) // d_model,
            "padding_mask": isinstance(model.input, dict)}


def count_parameters(model: keras.Model) -> int:
    """The transformer's parameters from its sizes (embeddings, per block
    4 d^2 + 2 r d^2 weights with their biases and 2 LayerNorms, final
    LayerNorm, head), a check on the built model."""
    s = transformer_sizes(model)
    d, v, n, r = s["d_model"], s["vocab_size"], s["num_layers"], s["mlp_ratio"]
    block = (4 * d * d + 4 * d) + (2 * r * d * d + r * d + d) + 2 * 2 * d
    return v * d + s["seq_len"] * d + n * block + 2 * d + (d * v + v)


def sample(model: keras.Model, prompt: bytes, num_bytes: int, *, temperature: float = 1.0,
           seed: int = 0) -> bytes:
    """Bytes the language model writes after `prompt`, one at a time.

    The model sees the last seq_len bytes (the prompt padded after its end
    when shorter: the causal mask keeps the padding out of the positions
    read) and the next byte is drawn from its softmax at `temperature` (0:
    the most likely byte).

    Args:
        model: a model from `build_transformer` (plain or tensor-parallel)
            or any model of the same inputs and outputs.
        prompt: at least one byte.
        num_bytes: how many bytes to write.
        temperature: > 0 scales the logits; 0 picks the most likely byte.
        seed: for the draws.

    Returns:
        The `num_bytes` bytes written (not the prompt).

    Raises:
        ValueError: an empty prompt, a negative `num_bytes` or temperature.
    """
    if not prompt:
        raise ValueError("`prompt` is empty; pass at least one byte, e.g. b'The '.")
    checks.non_negative_int("num_bytes", num_bytes)
    checks.finite_number("temperature", temperature, minimum=0)
    inputs = model.input
    seq_len = int((inputs["tokens"] if isinstance(inputs, dict) else inputs).shape[1])
    rng = np.random.default_rng(seed)
    text = list(prompt)
    for _ in range(num_bytes):
        window = text[-seq_len:]
        tokens = np.zeros((1, seq_len), dtype="int32")
        tokens[0, :len(window)] = window
        x = tokens
        if isinstance(inputs, dict):
            x = {"tokens": tokens, "padding_mask": np.arange(seq_len)[None] < len(window)}
        logits = np.asarray(model(x, training=False))[0, len(window) - 1].astype("float64")
        if temperature == 0:
            text.append(int(np.argmax(logits)))
            continue
        p = np.exp((logits - logits.max()) / temperature)
        text.append(int(rng.choice(len(p), p=p / p.sum())))
    return bytes(text[len(prompt):])
