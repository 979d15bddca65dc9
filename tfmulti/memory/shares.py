"""What each of T devices holds of a layer once it is split for tensor
parallelism, worked out from the unsplit layer: the memory estimate
(`tfmulti.memory.estimate`) counts a tensor-parallel stage before anything
is split or placed. `device_shares` gives a `DeviceShare` per device (its
`WeightShare`s of the variables, and the fractions of the layer's output and
input it keeps for the backward pass), the way
`tfmulti.parallel.tensor_split.split_transformer` splits each kind of layer
(`tfmulti.models.transformer.TENSOR_PARALLEL`).

Example:
    >>> import keras
    >>> from tfmulti.memory.shares import device_shares
    >>> dense = keras.layers.Dense(8)
    >>> dense.build((None, 4))
    >>> [len(d.weights) for d in device_shares(dense, "column", 2)]
    [2, 2]
"""

from __future__ import annotations

import dataclasses
import math

__all__ = ["DeviceShare", "WeightShare", "device_shares"]


@dataclasses.dataclass(frozen=True)
class WeightShare:
    """A device's part of one unsplit variable: what `tfmulti.memory.footprint`
    counts (a shape and a dtype), and whether it trains."""

    shape: tuple
    dtype: str
    trainable: bool


@dataclasses.dataclass(frozen=True)
class DeviceShare:
    """What one device holds of a split layer: its parts of the variables,
    and the fractions of the unsplit layer's output and input it keeps for
    the backward pass."""

    weights: tuple
    output: float
    input: float


def _unsplit_variables(layer, kind: str) -> list:
    """The variables of an unsplit layer that its split form keeps whole, on
    the home device: a row-parallel Dense's bias, attention's output bias."""
    if kind == "row":
        return [layer.bias] if layer.use_bias else []
    if kind == "heads":
        return [layer.output_dense.bias] if layer.use_bias else []
    return []


# What each device keeps of a split layer's output for the backward pass,
# as (fraction on every device, fraction on the home device in addition):
# column shards their slice (the next layer's input); a gathered, row or
# attention output is kept whole on the home, where it is joined (the
# slices and partial sums it is made of are not needed again).
_OUTPUT_SHARES = {"column": lambda T: (1 / T, 0.0), "column_gathered": lambda T: (0.0, 1.0),
                  "row": lambda T: (0.0, 1.0), "heads": lambda T: (0.0, 1.0)}
# The kinds whose shards each take a copy of the whole input (kept by every
# device other than the home, which holds the original, for the weight
# gradient); a row-parallel layer's input is already split.
_REPLICATED_INPUT = ("column", "column_gathered", "heads")


def _weight_share(v, size=None) -> WeightShare:
    return WeightShare(tuple(v.shape) if size is None else (size,), str(v.dtype), v.trainable)


def device_shares(layer, kind: str | None, T: int) -> list[DeviceShare]:
    """What each of T devices holds of an unsplit, built layer once it is
    split as `kind` (see `tfmulti.models.transformer.TENSOR_PARALLEL`), for a
    memory estimate made before anything is split or placed.

    Args:
        layer: the unsplit layer.
        kind: "column", "column_gathered", "row", "heads"; None: the layer
            stays whole, on device 0 (the home).
        T: the number of devices.

    Returns:
        A `DeviceShare` per device.

    Example:
        >>> import keras
        >>> from tfmulti.memory.shares import device_shares
        >>> dense = keras.layers.Dense(8)
        >>> dense.build((None, 4))
        >>> [([w.shape for w in d.weights], d.output) for d in device_shares(dense, "row", 2)]
        [([(16,), (8,)], 1.0), ([(16,)], 0.0)]
    """
    if kind is None:  # (an operation of the graph, `x[:, 0]`, has no weights)
        whole = DeviceShare(tuple(_weight_share(v) for v in getattr(layer, "weights", ())),
                            1.0, 0.0)
        return [whole] + [DeviceShare((), 0.0, 0.0)] * (T - 1)
    unsplit = {id(v) for v in _unsplit_variables(layer, kind)}
    each, home = _OUTPUT_SHARES[kind](T)
    shares = []
    for t in range(T):
        weights = tuple(_weight_share(v) if id(v) in unsplit else
                        _weight_share(v, math.prod(int(d) for d in v.shape) // T)
                        for v in layer.weights if t == 0 or id(v) not in unsplit)
        copied = 1.0 if t > 0 and kind in _REPLICATED_INPUT else 0.0
        shares.append(DeviceShare(weights, each + (home if t == 0 else 0.0), copied))
    return shares
