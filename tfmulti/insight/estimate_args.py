"""The arguments of a memory estimate, checked without TensorFlow.

`tfmulti estimate-memory` checks its flags here before TensorFlow starts;
`tfmulti.insight.memory.estimate_memory` checks the same arguments here.
"""

from __future__ import annotations

import dataclasses

from tfmulti import _checks
from tfmulti.config import MIXED_PRECISION, MODEL_PARALLEL, MODEL_TASKS, OPTIMIZERS, is_hook

__all__ = ["DISTRIBUTIONS", "Layout", "check_estimate_arguments"]

DISTRIBUTIONS = ("one_device", "mirrored", "pipeline", "hybrid")
_COMPUTE_DTYPES = {"none": "float32", "bfloat16": "bfloat16", "float16": "float16"}
_CPU_POLICY = {"float16": "bfloat16"}  # same widths; float16 layers need a GPU to be built
# The pipeline settings each distribution uses, and their defaults.
_PIPELINE_SETTINGS = {"pipeline": ("num_stages", "num_microbatches", "remat"),
                      "hybrid": ("num_stages", "num_microbatches", "num_replicas", "remat")}
_PIPELINE_DEFAULTS = {"num_stages": 2, "num_microbatches": 4, "num_replicas": 2, "remat": False}


def _layout(distribution, num_devices, num_stages, num_microbatches, num_replicas,
            global_batch_size) -> tuple[int, int, int]:
    """(replicas, stages, examples per micro-batch) of a valid layout."""
    _checks.positive_int("num_devices", num_devices, none_ok=True)
    if distribution not in MODEL_PARALLEL:
        devices = num_devices or 1
        if distribution == "one_device" and devices != 1:
            raise ValueError(f"distribution 'one_device' uses 1 device, got `num_devices` "
                             f"({devices}); use distribution='mirrored' for {devices} devices.")
        if global_batch_size % devices:
            raise ValueError(
                f"`global_batch_size` ({global_batch_size}) must be divisible by the number "
                f"of replicas ({devices}); use a multiple of {devices}.")
        return devices, 1, global_batch_size // devices
    replicas = num_replicas if distribution == "hybrid" else 1
    if num_devices is not None and num_devices != replicas * num_stages:
        raise ValueError(
            f"distribution {distribution!r} uses {replicas} replica(s) x {num_stages} stages "
            f"= {replicas * num_stages} devices, got `num_devices` ({num_devices}); leave it "
            f"unset or set num_devices={replicas * num_stages}.")
    split = replicas * num_microbatches
    if global_batch_size % split:
        raise ValueError(
            f"`global_batch_size` ({global_batch_size}) must split into {replicas} "
            f"replica(s) x {num_microbatches} micro-batches; use a multiple of {split}.")
    return replicas, num_stages, global_batch_size // split


@dataclasses.dataclass(frozen=True)
class Layout:
    """A checked estimate's devices: the pipeline settings that apply (with
    their defaults), replicas, stages per replica and examples per micro-batch."""

    settings: dict
    replicas: int
    stages: int
    micro_batch: int


def check_estimate_arguments(model="mlp", *, dataset=None, distribution: str = "one_device",
                             num_devices: int | None = None, num_stages: int | None = None,
                             num_microbatches: int | None = None,
                             num_replicas: int | None = None, remat: bool | None = None,
                             global_batch_size: int = 256, optimizer: str = "adam",
                             mixed_precision: str = "none", partition: str = "params",
                             dropout: float = 0.2) -> Layout:
    """Checks `estimate_memory`'s arguments (same names and defaults; see
    there) and returns the layout.

    Raises:
        ValueError: naming the argument, the value and what is accepted.
    """
    own_model = callable(model) or is_hook(model)
    if not own_model:
        _checks.one_of("model", model, MODEL_TASKS,
                       hint="or your own model as package.module:function")
    _checks.one_of("distribution", distribution, DISTRIBUTIONS)
    if own_model and distribution in MODEL_PARALLEL:
        raise ValueError(f"estimating distribution {distribution!r} splits a built-in model "
                         "into stages; for your own model, build it as a PipelineModel and "
                         "read model.memory_report(batch_size), or estimate 'one_device' / "
                         "'mirrored'.")
    _checks.one_of("optimizer", optimizer, OPTIMIZERS)
    _checks.one_of("mixed_precision", mixed_precision, MIXED_PRECISION)
    _checks.positive_int("global_batch_size", global_batch_size)
    _checks.finite_number("dropout", dropout, minimum=0)
    given = {"num_stages": num_stages, "num_microbatches": num_microbatches,
             "num_replicas": num_replicas, "remat": remat}
    for name, value in given.items():
        if value is not None and name not in _PIPELINE_SETTINGS.get(distribution, ()):
            fix = ("distribution='hybrid'" if name == "num_replicas"
                   else "distribution='pipeline' or 'hybrid'")
            raise ValueError(f"`{name}` ({value}) does not apply to distribution "
                             f"{distribution!r}; leave it unset or use {fix}.")
    settings = {name: _PIPELINE_DEFAULTS[name] if value is None else value
                for name, value in given.items()}
    for name in ("num_stages", "num_microbatches", "num_replicas"):
        _checks.positive_int(name, settings[name])
    replicas, stages, micro = _layout(distribution, num_devices, settings["num_stages"],
                                      settings["num_microbatches"], settings["num_replicas"],
                                      global_batch_size)
    if distribution in MODEL_PARALLEL:
        _checks.one_of("partition", partition, ("params", "flops"))
    return Layout(settings, replicas, stages, micro)
