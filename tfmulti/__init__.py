"""tfmulti: multi-device and multi-machine training for TensorFlow + Keras 3.

Submodules and functions load lazily, so `import tfmulti` (and the `tfmulti`
command) stays fast until TensorFlow is really needed.
"""

from __future__ import annotations

import importlib

__version__ = "0.1.0"

_SUBMODULES = ("backup", "cluster", "data", "devices", "diagnose", "environment", "keras_fixes",
               "launch", "memory", "models", "notebook", "optimizers", "parallel", "strategy",
               "training", "utilization")
_FUNCTIONS = {
    "configure_virtual_devices": "tfmulti.devices",
    "get_strategy": "tfmulti.strategy",
}
__all__ = [*_SUBMODULES, *_FUNCTIONS, "__version__"]


def __getattr__(name: str):
    if name in _SUBMODULES:
        return importlib.import_module(f"tfmulti.{name}")
    if name in _FUNCTIONS:
        return getattr(importlib.import_module(_FUNCTIONS[name]), name)
    raise AttributeError(f"module 'tfmulti' has no attribute {name!r}")


def __dir__():
    return sorted(__all__)
