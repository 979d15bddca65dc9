"""The arguments of a memory estimate, checked without TensorFlow.

`tfmulti estimate-memory` checks its flags here before TensorFlow starts;
`tfmulti.memory.estimate.estimate_memory` checks the same arguments here.
"""

from __future__ import annotations

import dataclasses

from tfmulti.utils import checks
from tfmulti.utils import human
from tfmulti.config.train_config import (BUILTIN_MODELS, MIXED_PRECISION, MODEL_PARALLEL,
                                         MODEL_TASKS, OPTIMIZERS, TASKS, TRANSFORMER,
                                         ZERO_STAGES, TrainConfig, check_transformer_sizes,
                                         is_hook)

__all__ = ["DISTRIBUTIONS", "MODELS", "Layout", "check_estimate_arguments", "config_arguments"]

DISTRIBUTIONS = ("one_device", "mirrored", "pipeline", "hybrid")
MODELS = tuple(dict.fromkeys((*MODEL_TASKS, TRANSFORMER)))
"""The models an estimate counts: the built-in ones (`tfmulti.models.builders`) and
the language model of `tfmulti.models.transformer`."""
# The pipeline settings each distribution uses, and their defaults.
_PIPELINE_SETTINGS = {"pipeline": ("num_stages", "num_microbatches", "remat", "tensor_parallel"),
                      "hybrid": ("num_stages", "num_microbatches", "num_replicas", "remat",
                                 "tensor_parallel")}
_PIPELINE_DEFAULTS = {"num_stages": 2, "num_microbatches": 4, "num_replicas": 2, "remat": False,
                      "tensor_parallel": 1}
# The transformer's sizes (model "transformer" only), defaulting to TrainConfig's.
_SIZES = ("seq_len", "d_model", "num_heads", "num_layers")


def _layout(distribution, num_devices, num_stages, num_microbatches, num_replicas,
            global_batch_size, tensor_parallel=1) -> tuple[int, int, int]:
    """(replicas, stages, examples per micro-batch) of a valid layout."""
    checks.positive_int("num_devices", num_devices, none_ok=True)
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
    used = replicas * num_stages * tensor_parallel
    if num_devices is not None and num_devices != used:
        shards = f" x {tensor_parallel} tensor-parallel" if tensor_parallel > 1 else ""
        raise ValueError(
            f"distribution {distribution!r} uses {human.count(replicas, 'replica')} x {num_stages} "
            f"stages{shards} = {used} devices, got `num_devices` ({num_devices}); leave it "
            f"unset or set num_devices={used}.")
    split = replicas * num_microbatches
    if global_batch_size % split:
        raise ValueError(
            f"`global_batch_size` ({global_batch_size}) must split into "
            f"{human.count(replicas, 'replica')} x {num_microbatches} micro-batches; use a "
            f"multiple of {split}.")
    return replicas, num_stages, global_batch_size // split


@dataclasses.dataclass(frozen=True)
class Layout:
    """A checked estimate's devices: the pipeline settings that apply (with
    their defaults), replicas, stages per replica, examples per micro-batch,
    the devices per stage (tensor parallelism) and the transformer's sizes
    (empty for other models)."""

    settings: dict
    replicas: int
    stages: int
    micro_batch: int
    tensor_parallel: int = 1
    sizes: dict = dataclasses.field(default_factory=dict)


def check_estimate_arguments(model="mlp", *, dataset=None, distribution: str = "one_device",
                             num_devices: int | None = None, num_stages: int | None = None,
                             num_microbatches: int | None = None,
                             num_replicas: int | None = None, remat: bool | None = None,
                             global_batch_size: int = 256, optimizer: str = "adam",
                             mixed_precision: str = "none", partition: str = "params",
                             dropout: float = 0.2, tensor_parallel: int | None = None,
                             seq_len: int | None = None, d_model: int | None = None,
                             num_heads: int | None = None,
                             num_layers: int | None = None, task: str = "auto",
                             zero_stage: int = 0, shard_embeddings: bool = False) -> Layout:
    """Checks `estimate_memory`'s arguments (same names and defaults; see
    there) and returns the layout.

    Raises:
        ValueError: naming the argument, the value and what is accepted.
    """
    own_model = callable(model) or is_hook(model)
    if not own_model:
        checks.one_of("model", model, MODELS,
                       hint="or your own model as package.module:function")
    checks.one_of("distribution", distribution, DISTRIBUTIONS)
    checks.one_of("task", task, ("auto", *TASKS))
    if not own_model and task not in ("auto", BUILTIN_MODELS[model]):
        raise ValueError(f"`task` {task!r} does not fit `model` {model!r}, which does "
                         f"{BUILTIN_MODELS[model]}; leave task='auto'.")
    checks.one_of("optimizer", optimizer, OPTIMIZERS)
    checks.one_of("zero_stage", zero_stage, ZERO_STAGES)
    if zero_stage and distribution != "mirrored":
        raise ValueError(f"`zero_stage` ({zero_stage}) shards the optimizer's slots over "
                         f"data-parallel replicas: distribution 'mirrored' (the devices of all "
                         f"workers), got {distribution!r}; leave zero_stage=0.")
    if shard_embeddings and distribution != "mirrored":
        raise ValueError(f"`shard_embeddings` splits the tables' rows over data-parallel "
                         f"replicas: distribution 'mirrored' (the devices of all workers), got "
                         f"{distribution!r}; leave shard_embeddings off.")
    checks.one_of("mixed_precision", mixed_precision, MIXED_PRECISION)
    checks.positive_int("global_batch_size", global_batch_size)
    checks.finite_number("dropout", dropout, minimum=0)
    given = {"num_stages": num_stages, "num_microbatches": num_microbatches,
             "num_replicas": num_replicas, "remat": remat, "tensor_parallel": tensor_parallel}
    for name, value in given.items():
        if value is not None and name not in _PIPELINE_SETTINGS.get(distribution, ()):
            fix = ("distribution='hybrid'" if name == "num_replicas"
                   else "distribution='pipeline' or 'hybrid'")
            raise ValueError(f"`{name}` ({value}) does not apply to distribution "
                             f"{distribution!r}; leave it unset or use {fix}.")
    settings = {name: _PIPELINE_DEFAULTS[name] if value is None else value
                for name, value in given.items()}
    for name in ("num_stages", "num_microbatches", "num_replicas", "tensor_parallel"):
        checks.positive_int(name, settings[name])
    T = settings["tensor_parallel"]
    if T > 1 and own_model:
        raise ValueError(f"a memory estimate splits model {TRANSFORMER!r} over "
                         f"`tensor_parallel` ({T}) devices, not your own model; estimate it "
                         "with tensor_parallel=1 (each stage on one device), or read the table "
                         "its training run prints.")
    if T > 1 and model != TRANSFORMER:
        raise ValueError(f"`tensor_parallel` ({T}) splits model {TRANSFORMER!r}, got model "
                         f"{model!r}; set model={TRANSFORMER!r} or tensor_parallel=1.")
    sizes = dict(zip(_SIZES, (seq_len, d_model, num_heads, num_layers)))
    if model == TRANSFORMER:
        defaults = TrainConfig()
        sizes = {k: getattr(defaults, k) if v is None else v for k, v in sizes.items()}
        check_transformer_sizes(**sizes, tensor_parallel=T)
    else:
        for name, value in sizes.items():
            if value is not None:
                raise ValueError(f"`{name}` ({value}) sizes model {TRANSFORMER!r}, got model "
                                 f"{model!r}; leave it unset or set model={TRANSFORMER!r}.")
        sizes = {}
    replicas, stages, micro = _layout(distribution, num_devices, settings["num_stages"],
                                      settings["num_microbatches"], settings["num_replicas"],
                                      global_batch_size, T)
    if distribution in MODEL_PARALLEL:
        checks.one_of("partition", partition, ("params", "flops"))
    return Layout(settings, replicas, stages, micro, T, sizes)


def config_arguments(config: TrainConfig, *, num_devices: int | None = None,
                     given: tuple | set | None = None) -> dict:
    """`estimate_memory`'s arguments for a training configuration, its layout
    read as the run reads it, checked (`check_estimate_arguments`) without
    TensorFlow: `tfmulti estimate-memory`'s flags are the training flags.

    A mirrored run's devices are `devices`, else `num_virtual_devices` (or
    `num_devices`, their old name on the command line); "auto" is mirrored
    over the devices named, one_device on one. A pipeline or hybrid uses
    its `num_stages`, `num_microbatches`, `num_replicas`, `remat`,
    `tensor_parallel` and `partition`. The model's shapes come from
    `dataset` where `given` names it (a whole configuration: for your own
    model; a built-in model has its own).

    Args:
        config: the training configuration.
        num_devices: the data-parallel devices by their old name (the command
            line's `--num_devices`).
        given: the fields set on the command line (None: a whole training
            configuration): a pipeline setting given for a distribution that
            does not use it is refused, as by `check_estimate_arguments`.

    Raises:
        ValueError: a distribution whose devices the configuration does not
            name (auto without devices, multi_worker, mirrored without
            `devices` or `num_virtual_devices`), partition "time" (measured
            when the run starts), or what `check_estimate_arguments` refuses.
    """
    given = set(given) if given is not None else None
    distribution = config.distribution
    named = len(config.devices) if config.devices else config.num_virtual_devices or None
    if num_devices is not None and named is not None and num_devices != named:
        raise ValueError(f"`num_devices` ({num_devices}) and `num_virtual_devices` ({named}) "
                         "disagree; pass `num_virtual_devices` alone (`num_devices` is its "
                         "old name).")
    count = named or num_devices
    if distribution == "auto":
        if count is None:
            raise ValueError("distribution 'auto' decides the devices when it runs; name them "
                             "(`num_virtual_devices` or `devices`) or pick "
                             "distribution='one_device', 'mirrored', 'pipeline' or 'hybrid'.")
        distribution = "mirrored" if count > 1 else "one_device"
    own = not (isinstance(config.model, str) and config.model in BUILTIN_MODELS)
    arguments = dict(model=config.model, distribution=distribution,
                     global_batch_size=config.global_batch_size,
                     optimizer=config.optimizer if config.optimizer is not None else "adam",
                     mixed_precision=config.mixed_precision, dropout=config.dropout,
                     task=config.task)
    if config.zero_stage:
        arguments["zero_stage"] = config.zero_stage
    if config.shard_embeddings:
        # Its distribution is the estimate's to refuse (check_estimate_arguments).
        config.check_shard_embeddings_settings()
        arguments["shard_embeddings"] = True
    if (own and given is None) or (given is not None and "dataset" in given):
        arguments["dataset"] = config.dataset
    pipeline = ("num_stages", "num_microbatches", "num_replicas", "remat", "tensor_parallel")
    if distribution == "mirrored":
        if not count:
            raise ValueError("a memory estimate of distribution 'mirrored' needs its devices: "
                             "set `devices` or `num_virtual_devices`.")
        arguments["num_devices"] = count
    elif distribution == "one_device":
        if num_devices is not None:
            arguments["num_devices"] = num_devices
    elif distribution in MODEL_PARALLEL:
        if config.partition == "time":
            raise ValueError("a memory estimate cannot cut stages by measured time "
                             "(partition 'time'); use partition 'params' or 'flops'.")
        used = _PIPELINE_SETTINGS[distribution]
        arguments.update({name: getattr(config, name) for name in used},
                         partition=config.partition)
        if num_devices is not None:
            arguments["num_devices"] = num_devices
        pipeline = tuple(name for name in pipeline if name not in used)
    else:
        raise ValueError(f"a memory estimate of distribution {distribution!r} needs its devices "
                         "per worker: estimate one worker with distribution='mirrored' and its "
                         "`num_virtual_devices` (or `devices`).")
    # A pipeline setting given for a distribution that does not use it is refused.
    arguments.update({name: getattr(config, name) for name in pipeline
                      if given is not None and name in given
                      and not (name == "remat" and config.remat is False)})
    if config.model == TRANSFORMER:
        arguments.update({k: getattr(config, k) for k in _SIZES})
    else:  # sizes given for another model are refused
        arguments.update({k: getattr(config, k) for k in _SIZES
                          if given is not None and k in given})
    check_estimate_arguments(**arguments)
    return arguments
