"""Model parallelism: manual placement, pipeline, partitioner, hybrid.

`PipelineModel` loads lazily (it imports TensorFlow); the schedule helpers and
`tfmulti.parallel.partition` are pure Python.
"""

from __future__ import annotations

import importlib

_LAZY = {
    "PipelineModel": "tfmulti.parallel.pipeline",
    "format_memory": "tfmulti.parallel.pipeline",
    "plan_partition": "tfmulti.parallel.partition",
    "gpipe": "tfmulti.parallel.schedule",
    "one_f_one_b": "tfmulti.parallel.schedule",
    "bubble_fraction": "tfmulti.parallel.schedule",
    "measured_bubble": "tfmulti.parallel.schedule",
    "max_in_flight": "tfmulti.parallel.schedule",
}
__all__ = list(_LAZY)


def __getattr__(name: str):
    if name in _LAZY:
        return getattr(importlib.import_module(_LAZY[name]), name)
    raise AttributeError(f"module 'tfmulti.parallel' has no attribute {name!r}")
