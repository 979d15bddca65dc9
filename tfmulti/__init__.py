"""tfmulti: multi-device and multi-machine training for TensorFlow + Keras 3.

The package in layers; each imports only from the layers below it (a test
enforces this, see `setup.cfg`, `[importlinter]`):

    application   cli, training, backup, export (SavedModel), bench (the benchmark suites)
    tools         insight: timing, diagnose, environment, memory (estimate)
    assembly      runs: a config's strategy, inputs and compiled model
    model parallel  parallel: pipeline, partitioner, schedules
    core          models, data, strategy, footprint (the memory model), loops
                  (custom training loops), optimizers, workarounds (upstream
                  bug fixes), devices, transformer (the byte-level language
                  model)
    cluster       cluster: TF_CONFIG, launcher, supervisor, notebook launcher
                  (no TensorFlow)
    configuration config, config_flags, _checks, _tables (no TensorFlow)

The names most users need are re-exported here and load lazily, so `import
tfmulti` (and the `tfmulti` command) stays fast until TensorFlow is needed:

    import tfmulti
    tfmulti.configure_virtual_devices(4)
    strategy = tfmulti.get_strategy("mirrored")
    train = tfmulti.data.distribute(tfmulti.data.load("synthetic"), strategy, 256)
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING

__version__ = "0.2.0"

# Public submodules, reachable as attributes (`tfmulti.data.load(...)`).
_SUBMODULES = ("backup", "bench", "cluster", "config", "data", "devices", "export", "footprint",
               "insight", "loops", "models", "optimizers", "parallel", "runs", "strategy",
               "training", "transformer", "workarounds")
# Public names re-exported here: name -> module.
_NAMES = {
    "configure_virtual_devices": "tfmulti.devices",
    "get_strategy": "tfmulti.strategy",
    "TrainConfig": "tfmulti.config",
    "train": "tfmulti.training",
    "build_run": "tfmulti.runs",
    "build_model": "tfmulti.models",
    "compile_model": "tfmulti.models",
    "distribute": "tfmulti.data",
    "load": "tfmulti.data",
    "PipelineModel": "tfmulti.parallel.pipeline",
    "launch": "tfmulti.cluster.launcher",
    "notebook_launcher": "tfmulti.cluster.notebook_launcher",
    "diagnose": "tfmulti.insight.diagnose",
    "estimate_memory": "tfmulti.insight.memory",
}
__all__ = sorted([*_SUBMODULES, *_NAMES, "__version__"])

if TYPE_CHECKING:  # what IDEs and type checkers see; at run time they load on first use
    from tfmulti import (backup, bench, cluster, config, data, devices, export, footprint,
                         insight, loops, models, optimizers, parallel, runs, strategy, training,
                         transformer,
                         workarounds)
    from tfmulti.cluster.launcher import launch
    from tfmulti.cluster.notebook_launcher import notebook_launcher
    from tfmulti.config import TrainConfig
    from tfmulti.data import distribute, load
    from tfmulti.devices import configure_virtual_devices
    from tfmulti.insight.diagnose import diagnose
    from tfmulti.insight.memory import estimate_memory
    from tfmulti.models import build_model, compile_model
    from tfmulti.parallel.pipeline import PipelineModel
    from tfmulti.runs import build_run
    from tfmulti.strategy import get_strategy
    from tfmulti.training import train


def __getattr__(name: str):
    if name in _SUBMODULES:
        return importlib.import_module(f"tfmulti.{name}")
    if name in _NAMES:
        return getattr(importlib.import_module(_NAMES[name]), name)
    raise AttributeError(f"module 'tfmulti' has no attribute {name!r}")


def __dir__():
    return __all__
