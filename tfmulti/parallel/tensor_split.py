"""A `tfmulti.models.transformer` language model split over T devices, and
joined again: `split_transformer` replaces each layer that
`tfmulti.models.transformer.TENSOR_PARALLEL` names by its tensor-parallel
form (`tfmulti.parallel.tensor_layers`), with its weights;
`unsplit_transformer` goes back; `tensor_parallel_degree` tells the T of a
model's layers.

Example:
    >>> import numpy as np, tfmulti
    >>> from tfmulti.parallel.tensor_split import split_transformer, tensor_parallel_degree
    >>> plain = tfmulti.models.transformer.build_transformer(seq_len=8, d_model=16, num_heads=2,
    ...                                                      num_layers=1, seed=0)
    >>> split = split_transformer(plain, ["CPU:0", "CPU:1"])
    >>> tensor_parallel_degree(plain.layers), tensor_parallel_degree(split.layers)
    (1, 2)
"""

from __future__ import annotations

import keras
import tensorflow as tf

from tfmulti.models import transformer
from tfmulti.parallel.tensor_layers import (ColumnParallelDense, ParallelMultiHeadAttention,
                                            RowParallelDense, TensorParallelLayer,
                                            shard_devices)

__all__ = ["split_transformer", "tensor_parallel_degree", "unsplit_transformer"]

# How each `transformer.TENSOR_PARALLEL` kind splits a built layer.
_SPLITS = {
    "heads": ParallelMultiHeadAttention.from_layer,
    "column": ColumnParallelDense.from_layer,
    "row": RowParallelDense.from_layer,
    "column_gathered": lambda layer, devices: ColumnParallelDense.from_layer(
        layer, devices, gather_output=True),
}


def split_transformer(model: keras.Model, devices, *, name: str | None = None) -> keras.Model:
    """The tensor-parallel form of a `tfmulti.models.transformer` language model,
    with its weights.

    The same graph (`tfmulti.models.transformer.assemble`) with every block's
    attention split by heads and its MLP by columns then rows, and the
    output head by vocabulary columns (`tfmulti.models.transformer.TENSOR_PARALLEL`):
    device i of T holds 1/T of those weights. The embeddings and LayerNorms
    are copied whole onto devices[0], which also runs the residual stream.
    The given model is left as it is.

    Args:
        model: a model built by `tfmulti.models.transformer.build_transformer`.
        devices: T device names; T must divide the heads, the MLP width and
            the vocabulary.
        name: the new model's name; default: the model's, + "_tp<T>".

    Returns:
        A functional `keras.Model` with the same inputs and outputs.

    Raises:
        ValueError: not a transformer from `build_transformer`, unknown or
            repeated devices, or sizes that T does not divide.

    Example:
        >>> import numpy as np, tfmulti
        >>> from tfmulti.parallel.tensor_split import split_transformer
        >>> plain = tfmulti.models.transformer.build_transformer(seq_len=8, d_model=16, num_heads=2,
        ...                                               num_layers=1, seed=0)
        >>> split = split_transformer(plain, ["CPU:0", "CPU:1"])
        >>> tokens = np.arange(16, dtype="int32").reshape(2, 8)
        >>> bool(np.allclose(split(tokens), plain(tokens), atol=1e-5))
        True
    """
    layers = transformer.layers_by_name(model)
    if "block0_attention" not in layers or "lm_head" not in layers:
        raise ValueError(f"model {model.name!r} is not a transformer from "
                         "tfmulti.models.transformer.build_transformer; split its layers with "
                         "ColumnParallelDense/RowParallelDense/ParallelMultiHeadAttention."
                         "from_layer instead.")
    devices = shard_devices(devices)
    sizes = transformer.transformer_sizes(model)
    kinds = {n: transformer.TENSOR_PARALLEL.get(transformer.role_of(n)) for n in layers}
    split = {n: _SPLITS[kind](layers[n], devices) if kind else
             layers[n].__class__.from_config(layers[n].get_config())
             for n, kind in kinds.items()}
    with tf.device(devices[0]):  # the whole layers are built here, on their first call
        result = transformer.assemble(split, seq_len=sizes["seq_len"],
                                      padding_mask=sizes["padding_mask"],
                                      name=name or f"{model.name}_tp{len(devices)}")
    for n, kind in kinds.items():
        if not kind:
            split[n].set_weights(layers[n].get_weights())
    return result


def unsplit_transformer(model: keras.Model, *, name: str | None = None) -> keras.Model:
    """The plain form of a tensor-parallel transformer (`split_transformer`),
    with its current weights, built on the current device: for saving,
    serving, or comparing with the plain model.

    Args:
        model: a transformer from `split_transformer` (a plain one is copied).
        name: the new model's name; default: the model's, + "_unsplit".

    Returns:
        A functional `keras.Model` of plain Keras layers.

    Example:
        >>> import numpy as np, tfmulti
        >>> from tfmulti.parallel.tensor_split import split_transformer, unsplit_transformer
        >>> plain = tfmulti.models.transformer.build_transformer(seq_len=8, d_model=16, num_heads=2,
        ...                                               num_layers=1, seed=0)
        >>> again = unsplit_transformer(split_transformer(plain, ["CPU:0", "CPU:1"]))
        >>> all(np.array_equal(a, b) for a, b in zip(again.get_weights(), plain.get_weights()))
        True
    """
    layers = transformer.layers_by_name(model)
    sizes = transformer.transformer_sizes(model)
    plain = {n: layer.to_layer() if isinstance(layer, TensorParallelLayer) else
             layer.__class__.from_config(layer.get_config()) for n, layer in layers.items()}
    result = transformer.assemble(plain, seq_len=sizes["seq_len"],
                                  padding_mask=sizes["padding_mask"],
                                  name=name or f"{model.name}_unsplit")
    for n, layer in layers.items():
        if not isinstance(layer, TensorParallelLayer):
            plain[n].set_weights(layer.get_weights())
    return result


def tensor_parallel_degree(layers) -> int:
    """T, the number of devices the tensor-parallel layers among `layers`
    are split over; 1 when there are none.

    Raises:
        ValueError: layers split over different numbers of devices.
    """
    degrees = {layer.name: layer.tensor_parallel for layer in layers
               if isinstance(layer, TensorParallelLayer)}
    if len(set(degrees.values())) > 1:
        raise ValueError(f"the tensor-parallel layers are split over different numbers of "
                         f"devices ({degrees}); split every layer over T devices.")
    return next(iter(degrees.values()), 1)
