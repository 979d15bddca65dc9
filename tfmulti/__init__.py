"""tfmulti: multi-device and multi-machine training for TensorFlow + Keras 3.

The public names are the ones below (`dir(tfmulti)`); they load lazily, so
`import tfmulti` (and the `tfmulti` command) stays fast until TensorFlow is
needed:

    import tfmulti
    tfmulti.configure_virtual_devices(4)
    strategy = tfmulti.get_strategy("mirrored")
    train = tfmulti.data.distribute(tfmulti.data.load("synthetic"), strategy, 256)

The package's folders are its layers, top to bottom; each imports only from
the layers below it (the import contract in `setup.cfg`, `[importlinter]`,
is the one description; `tests/integration/test_layers.py` holds the code to it):

    cli | ray  the `tfmulti` command | training on Ray (`tfmulti[ray]`)
    insight    diagnose, environment, timing
    training   a run assembled from a TrainConfig, train, loops, backup, export
    memory     the memory model and the estimate per device
    parallel   pipeline, tensor parallelism, the chain of blocks, the partitioner
    models | data   builders, transformer, optimizers, accumulation | datasets, streaming
    runtime    devices, strategies, roles, the upstream Keras fixes
    cluster    TF_CONFIG, the launcher and its supervisor (no TensorFlow)
    config     TrainConfig, its flags, the user's functions (no TensorFlow)
    utils      checks, tables, atomic files, failpoints (no TensorFlow)
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING

__version__ = "0.3.0"

# Importing tfmulti changes nothing in the process: no hook, no filter, Keras as it
# ships. The processes tfmulti owns (the `tfmulti` command, the recipes, the notebook
# launcher's workers) defer Keras' plotting, notebook and pandas imports themselves
# (tfmulti/utils/deferred_imports.py); the Keras fixes apply when a strategy is asked for.

# Public names: name -> the module that defines it.
_NAMES = {
    "TrainConfig": "tfmulti.config.train_config",
    "train": "tfmulti.training.train",
    "configure_virtual_devices": "tfmulti.runtime.devices",
    "get_strategy": "tfmulti.runtime.strategy",
    "apply_keras_fixes": "tfmulti.runtime.keras_fixes",
    "build_model": "tfmulti.models.builders",
    "compile_model": "tfmulti.models.builders",
    "PipelineModel": "tfmulti.parallel.pipeline",
    "estimate_memory": "tfmulti.memory.estimate",
    "diagnose": "tfmulti.insight.diagnose",
    "launch": "tfmulti.cluster.launcher",
    "notebook_launcher": "tfmulti.cluster.notebook_launcher",
}
# Public modules: name -> module (`tfmulti.data.load(...)`, `tfmulti.backup.fit(...)`).
_MODULES = {
    "data": "tfmulti.data",
    "parallel": "tfmulti.parallel",
    "backup": "tfmulti.training.backup",
    "loops": "tfmulti.training.loops",
}
# The layers' packages: importable, not part of the public surface.
_PACKAGES = ("cli", "cluster", "config", "insight", "memory", "models", "runtime", "training",
             "utils")
__all__ = sorted([*_NAMES, *_MODULES])

if TYPE_CHECKING:  # what IDEs and type checkers see; at run time they load on first use
    from tfmulti import data, parallel
    from tfmulti.cluster.launcher import launch
    from tfmulti.cluster.notebook_launcher import notebook_launcher
    from tfmulti.config.train_config import TrainConfig
    from tfmulti.insight.diagnose import diagnose
    from tfmulti.memory.estimate import estimate_memory
    from tfmulti.models.builders import build_model, compile_model
    from tfmulti.parallel.pipeline import PipelineModel
    from tfmulti.runtime.devices import configure_virtual_devices
    from tfmulti.runtime.keras_fixes import apply_keras_fixes
    from tfmulti.runtime.strategy import get_strategy
    from tfmulti.training import backup, loops
    from tfmulti.training.train import train


def __getattr__(name: str):
    if name in _NAMES:
        return getattr(importlib.import_module(_NAMES[name]), name)
    if name in _MODULES:
        return importlib.import_module(_MODULES[name])
    if name in _PACKAGES:
        return importlib.import_module(f"tfmulti.{name}")
    raise AttributeError(f"module 'tfmulti' has no attribute {name!r}")


def __dir__():
    return [*__all__, "__version__"]
