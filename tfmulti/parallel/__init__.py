"""Model parallelism by manual device placement, a module per job:

    pipeline       the GPipe pipeline (and the data x pipeline hybrid)
    layouts        the transformer over R x S x T devices
    tensor_layers  the tensor-parallel layers (Megatron-LM) and their base
    tensor_split   a transformer split over T devices, and joined again
    tensor_models  any user's built model split over T devices, and joined again
    placement      variables made on their stage's device, a stage's shards placed
    chain          the chain of blocks a model is cut into
    partition      the stage partitioner and the one stage-count check
    schedule       the schedule tables (GPipe, 1F1B), their bubble and memory
    zero           data parallelism with the optimizer state sharded (ZeRO 1-2)

The bytes each device needs are counted above this layer, by
`tfmulti.memory`. `PipelineModel`, the tensor-parallel layers, `split_layers`,
`join_layers`, `build_parallel_transformer`, `plan_partition` and
`shard_optimizer` are the names
re-exported here, lazily (they import TensorFlow); the schedule tables are
`tfmulti.parallel.schedule`'s (pure Python, as is
`tfmulti.parallel.partition`'s numeric core).
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING

_LAZY = {
    "PipelineModel": "tfmulti.parallel.pipeline",
    "build_parallel_transformer": "tfmulti.parallel.layouts",
    "ColumnParallelDense": "tfmulti.parallel.tensor_layers",
    "RowParallelDense": "tfmulti.parallel.tensor_layers",
    "ParallelMultiHeadAttention": "tfmulti.parallel.tensor_layers",
    "plan_partition": "tfmulti.parallel.partition",
    "join_layers": "tfmulti.parallel.tensor_models",
    "split_layers": "tfmulti.parallel.tensor_models",
    "shard_optimizer": "tfmulti.parallel.zero",
}
__all__ = sorted(_LAZY)

if TYPE_CHECKING:
    from tfmulti.parallel.layouts import build_parallel_transformer
    from tfmulti.parallel.partition import plan_partition
    from tfmulti.parallel.pipeline import PipelineModel
    from tfmulti.parallel.tensor_layers import (ColumnParallelDense, ParallelMultiHeadAttention,
                                                RowParallelDense)
    from tfmulti.parallel.tensor_models import join_layers, split_layers
    from tfmulti.parallel.zero import shard_optimizer


def __getattr__(name: str):
    if name in _LAZY:
        return getattr(importlib.import_module(_LAZY[name]), name)
    raise AttributeError(f"module 'tfmulti.parallel' has no attribute {name!r}")


def __dir__():
    return __all__
