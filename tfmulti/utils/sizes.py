"""Byte counts of dtypes and variables, without TensorFlow.

The primitives the memory model (`tfmulti.memory.footprint`) and the stage
partitioner (`tfmulti.parallel.partition`) both count bytes with: anything
with a `name` or a string names a dtype, anything with a `shape` and a
`dtype` is a variable (a Keras or TensorFlow variable, a NumPy array).

Example:
    >>> import numpy as np
    >>> from tfmulti.utils import sizes
    >>> sizes.dtype_bytes("float32"), sizes.dtype_bytes("bfloat16"), sizes.dtype_bytes("bool")
    (4, 2, 1)
    >>> kernel = np.zeros((8, 3), "float32")
    >>> sizes.variables_bytes([kernel, kernel])  # counted once
    96
"""

from __future__ import annotations

import math
import re

__all__ = ["dtype_bytes", "variables_bytes"]


def dtype_bytes(dtype) -> int:
    """Bytes per element of a dtype (a name, a NumPy, TensorFlow or Keras dtype).

    Raises:
        ValueError: a dtype whose name does not tell its size ("resource").
    """
    import numpy as np

    name = getattr(dtype, "name", None) or str(dtype)
    try:
        return np.dtype(name).itemsize
    except TypeError:
        if name == "bool":
            return 1
        match = re.search(r"(\d+)", name)  # bfloat16, float8_e4m3fn, ...
        if not match:
            raise ValueError(f"cannot tell the size of dtype {name!r}.") from None
        return max(1, int(match.group(1)) // 8)


def variables_bytes(variables) -> int:
    """Bytes of `variables`, each counted once (shared weights appear once)."""
    seen, total = set(), 0
    for variable in variables:
        if id(variable) in seen:
            continue
        seen.add(id(variable))
        total += math.prod(variable.shape) * dtype_bytes(variable.dtype)
    return total
