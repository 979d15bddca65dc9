"""Training-memory estimate per device, before anything is placed.

Like Accelerate's `estimate-memory`, but it knows where things live: data
parallelism copies the whole model to every device and splits the batch;
a pipeline cuts the layers into stages (with `plan_partition`) and splits the
batch into micro-batches. The model is built on the host without a strategy
and counted from its shapes, so no virtual devices are needed.

Counted per device, in bytes:
    * parameters: every variable, float32 (Keras 3 keeps variables float32
      under mixed precision, so there is no separate master copy);
    * gradients: one float32 tensor per trainable variable;
    * optimizer_slots: adam keeps 2 float32 slots per trainable weight, sgd none;
    * activations: the sum of the layer output sizes for the examples whose
      activations a device holds at once, in the compute dtype: its
      per-replica batch under data parallelism; in a pipeline, the M
      micro-batches of its replica's batch, since GPipe (what `PipelineModel`
      runs) keeps every micro-batch's activations until the backward pass
      starts. The input batch itself and framework workspace are not counted.

Example:
    >>> from tfmulti import memory
    >>> estimate = memory.estimate_memory("mlp", strategy="mirrored", num_devices=4,
    ...                                   global_batch_size=256)
    >>> len(estimate["devices"]), estimate["devices"][0]["activation_batch"]
    (4, 64)
"""

from __future__ import annotations

import math

STRATEGIES = ("one_device", "mirrored", "pipeline", "hybrid")
DTYPE_BYTES = {"float32": 4, "bfloat16": 2, "float16": 2}
OPTIMIZER_SLOTS = {"adam": 2, "sgd": 0}
VARIABLE_BYTES = 4  # float32 variables, also under mixed precision
COLUMNS = ("parameters", "gradients", "optimizer_slots", "activations", "total")
# The pipeline settings each strategy uses, and their defaults.
PIPELINE_SETTINGS = {"pipeline": ("num_stages", "num_microbatches"),
                     "hybrid": ("num_stages", "num_microbatches", "num_replicas")}
PIPELINE_DEFAULTS = {"num_stages": 2, "num_microbatches": 4, "num_replicas": 2}


def _check(strategy, num_devices, num_stages, num_microbatches, num_replicas,
           global_batch_size, optimizer, dtype) -> tuple[int, int, int]:
    """Validates the arguments; returns (replicas, stages, examples per device step)."""
    if strategy not in STRATEGIES:
        raise ValueError(f"unknown strategy {strategy!r}; valid: {list(STRATEGIES)}.")
    if optimizer not in OPTIMIZER_SLOTS:
        raise ValueError(
            f"`optimizer` must be one of {list(OPTIMIZER_SLOTS)}, got {optimizer!r}.")
    if dtype not in DTYPE_BYTES:
        raise ValueError(f"`dtype` must be one of {list(DTYPE_BYTES)}, got {dtype!r}.")
    for name, value in (("global_batch_size", global_batch_size), ("num_stages", num_stages),
                        ("num_microbatches", num_microbatches),
                        ("num_replicas", num_replicas)):
        if not isinstance(value, int) or value < 1:
            raise ValueError(f"`{name}` must be a positive integer, got {value!r}.")
    if num_devices is not None and (not isinstance(num_devices, int) or num_devices < 1):
        raise ValueError(f"`num_devices` must be a positive integer, got {num_devices!r}.")
    if strategy in ("one_device", "mirrored"):
        devices = num_devices or 1
        if strategy == "one_device" and devices != 1:
            raise ValueError(f"strategy 'one_device' uses 1 device, got num_devices="
                             f"{devices}; use --strategy=mirrored for {devices} devices.")
        if global_batch_size % devices:
            raise ValueError(
                f"`global_batch_size` ({global_batch_size}) must be divisible by the number "
                f"of replicas ({devices}); use a multiple of {devices}.")
        return devices, 1, global_batch_size // devices
    replicas = num_replicas if strategy == "hybrid" else 1
    if num_devices is not None and num_devices != replicas * num_stages:
        raise ValueError(
            f"strategy {strategy!r} uses {replicas} replica(s) x {num_stages} stages = "
            f"{replicas * num_stages} devices, got num_devices={num_devices}; leave it unset "
            f"or set it to {replicas * num_stages}.")
    split = replicas * num_microbatches
    if global_batch_size % split:
        raise ValueError(
            f"`global_batch_size` ({global_batch_size}) must split into {replicas} "
            f"replica(s) x {num_microbatches} micro-batches; use a multiple of {split}.")
    return replicas, num_stages, global_batch_size // split


def output_elements(layers, input_shape: tuple) -> list[int]:
    """Per-example element count of each layer's output, in stack order."""
    shape, counts = (None, *input_shape), []
    for layer in layers:
        shape = layer.compute_output_shape(shape)
        counts.append(math.prod(int(d) for d in shape[1:]))
    return counts


def _row(layers, out_elements: list[int], batch: int, slots: int, dtype_bytes: int,
         **where) -> dict:
    params = sum(int(layer.count_params()) for layer in layers)
    trainable = sum(math.prod(v.shape) for layer in layers for v in layer.trainable_weights)
    row = {
        **where,
        "parameters": params * VARIABLE_BYTES,
        "gradients": trainable * VARIABLE_BYTES,
        "optimizer_slots": slots * trainable * VARIABLE_BYTES,
        "activations": sum(out_elements) * batch * dtype_bytes,
        "activation_batch": batch,
    }
    row["total"] = sum(row[k] for k in COLUMNS[:-1])
    return row


def estimate_memory(
    model: str = "mlp",
    *,
    strategy: str = "one_device",
    num_devices: int | None = None,
    num_stages: int | None = None,
    num_microbatches: int | None = None,
    num_replicas: int | None = None,
    global_batch_size: int = 256,
    optimizer: str = "adam",
    dtype: str = "float32",
    partition: str = "params",
) -> dict:
    """Estimates the training memory of each device.

    Args:
        model: a `tfmulti.models` builder name ("mlp", "cnn", "regression"),
            with its default input shape.
        strategy: "one_device" (the default), "mirrored", "pipeline" or "hybrid".
        num_devices: data-parallel devices (default 1); for pipeline/hybrid it
            defaults to, and must equal, replicas x stages.
        num_stages: pipeline stages (pipeline and hybrid only; default 2).
        num_microbatches: micro-batches per replica batch (pipeline and hybrid
            only; default 4).
        num_replicas: data-parallel pipelines (hybrid only; default 2).
        global_batch_size: examples per step over all replicas; default 256.
        optimizer: "adam" (2 slots per weight, the default) or "sgd" (none).
        dtype: compute dtype of the activations: "float32" (default),
            "bfloat16" or "float16" (mixed precision; variables stay float32).
        partition: how pipeline stages are balanced, as in `plan_partition`
            ("params", the default, or "flops").

    Returns:
        A dict with the arguments and "devices": one row per device with
        "device", "replica", "stage", "parameters", "gradients",
        "optimizer_slots", "activations", "activation_batch" (the examples the
        activations are for) and "total", sizes in bytes.

    Raises:
        ValueError: an unknown model, strategy, optimizer, dtype or partition
            method, a batch that does not split over replicas (and
            micro-batches), a device count that does not fit the strategy, or
            a pipeline setting for a strategy that does not use it.
    """
    from tfmulti import models

    models.model_task(model)
    given = {"num_stages": num_stages, "num_microbatches": num_microbatches,
             "num_replicas": num_replicas}
    for name, value in given.items():
        if value is not None and strategy in STRATEGIES \
                and name not in PIPELINE_SETTINGS.get(strategy, ()):
            fix = ("strategy='hybrid'" if name == "num_replicas"
                   else "strategy='pipeline' or 'hybrid'")
            raise ValueError(f"`{name}` ({value}) does not apply to strategy {strategy!r}; "
                             f"leave it unset or use {fix}.")
    num_stages, num_microbatches, num_replicas = (
        PIPELINE_DEFAULTS[name] if value is None else value for name, value in given.items())
    replicas, stages, batch = _check(strategy, num_devices, num_stages, num_microbatches,
                                     num_replicas, global_batch_size, optimizer, dtype)
    if strategy in ("pipeline", "hybrid") and partition not in ("params", "flops"):
        raise ValueError(f"`partition` must be 'params' or 'flops', got {partition!r}.")
    input_shape = models.MODELS[model][2]
    built = models.build_model(model, input_shape=input_shape)
    layers = list(built.layers)
    out_elements = output_elements(layers, input_shape)
    slots, dtype_bytes = OPTIMIZER_SLOTS[optimizer], DTYPE_BYTES[dtype]
    rows = []
    if strategy in ("one_device", "mirrored"):
        for r in range(replicas):
            rows.append(_row(layers, out_elements, batch, slots, dtype_bytes,
                             device=r, replica=r, stage=0))
    else:
        from tfmulti.parallel.partition import plan_partition

        plan = plan_partition(layers, stages, method=partition, input_shape=input_shape)
        held = batch * num_microbatches  # GPipe: all M micro-batches until the backward
        for r in range(replicas):
            for s, cut in enumerate(plan.slices):
                rows.append(_row(layers[cut], out_elements[cut], held, slots, dtype_bytes,
                                 device=r * stages + s, replica=r, stage=s))
    return {
        "model": model, "strategy": strategy, "num_devices": len(rows),
        "num_replicas": replicas, "num_stages": stages,
        "num_microbatches": num_microbatches if strategy in ("pipeline", "hybrid") else 1,
        "global_batch_size": global_batch_size, "optimizer": optimizer, "dtype": dtype,
        "devices": rows,
    }


def format_memory_estimate(estimate: dict) -> str:
    """An `estimate_memory` result as an aligned table in MiB, one row per device."""
    what = (f"replica batch ({estimate['num_microbatches']} micro-batches, all held until "
            f"the backward pass under GPipe)"
            if estimate["strategy"] in ("pipeline", "hybrid") else "per-replica batch")
    lines = [f"{estimate['model']} under {estimate['strategy']}: {estimate['num_devices']} "
             f"device(s), global batch {estimate['global_batch_size']}, "
             f"{estimate['optimizer']}, activations in {estimate['dtype']} "
             f"(variables float32)"]
    header = ("device", "replica", "stage", *COLUMNS)
    cells = [header] + [
        (str(row["device"]), str(row["replica"]), str(row["stage"]),
         *(f"{row[k] / 2**20:.2f} MiB" for k in COLUMNS))
        for row in estimate["devices"]]
    widths = [max(len(row[k]) for row in cells) for k in range(len(header))]
    lines += ["  ".join(c.rjust(w) for c, w in zip(row, widths)) for row in cells]
    lines.append(f"activations: one {what} of {estimate['devices'][0]['activation_batch']} "
                 f"examples per device.")
    return "\n".join(lines)
