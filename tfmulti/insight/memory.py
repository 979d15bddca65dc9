"""Training-memory estimate per device, before anything is placed.

Like Accelerate's `estimate-memory`, but it knows where things live: data
parallelism copies the whole model to every device and splits the batch; a
pipeline cuts the layers into stages (with `plan_partition`) and splits each
replica's batch into micro-batches. The model is built on the host without a
strategy and counted from its shapes by the memory model that
`PipelineModel.memory_report` uses too (`tfmulti.footprint`), so no virtual
devices are needed.

Example:
    >>> from tfmulti.insight import memory
    >>> estimate = memory.estimate_memory("mlp", distribution="mirrored", num_devices=4,
    ...                                   global_batch_size=256)
    >>> len(estimate["devices"]), estimate["devices"][0]["activation_batch"]
    (4, 64)
"""

from __future__ import annotations

from tfmulti import footprint, hooks, models, runs
from tfmulti.config import MODEL_PARALLEL, TrainConfig, is_hook
from tfmulti.insight.estimate_args import DISTRIBUTIONS, check_estimate_arguments
from tfmulti.parallel.partition import plan_partition
from tfmulti.parallel.pipeline import check_remat

__all__ = ["DISTRIBUTIONS", "estimate_memory", "format_memory_estimate"]

_COMPUTE_DTYPES = {"none": "float32", "bfloat16": "bfloat16", "float16": "float16"}
_CPU_POLICY = {"float16": "bfloat16"}  # same widths; float16 layers need a GPU to be built


def estimate_memory(
    model="mlp",
    *,
    dataset=None,
    distribution: str = "one_device",
    num_devices: int | None = None,
    num_stages: int | None = None,
    num_microbatches: int | None = None,
    num_replicas: int | None = None,
    remat: bool | None = None,
    global_batch_size: int = 256,
    optimizer: str = "adam",
    mixed_precision: str = "none",
    partition: str = "params",
    dropout: float = 0.2,
) -> dict:
    """Estimates the training memory of each device.

    Args:
        model: a built-in model name ("mlp", "cnn", "regression"), with its
            default input shape (or `dataset`'s), or your own model function
            (a callable or "package.module:function", as for training).
        dataset: the data whose shapes the model takes (a dataset name or
            your dataset function, as for training); needed for your own
            model unless its function takes no `input_shape`.
        distribution: "one_device" (the default), "mirrored", "pipeline" or "hybrid".
        num_devices: data-parallel devices (default 1); for pipeline/hybrid it
            defaults to, and must equal, replicas x stages.
        num_stages: pipeline stages (pipeline and hybrid only; default 2).
        num_microbatches: micro-batches per replica batch (pipeline and hybrid
            only; default 4).
        num_replicas: data-parallel pipelines (hybrid only; default 2).
        remat: recompute stage activations in the backward pass (pipeline and
            hybrid only; default False).
        global_batch_size: examples per step over all replicas; default 256.
        optimizer: "adam" (2 slots per weight, the default) or "sgd" (none).
        mixed_precision: "none" (float32 activations, the default),
            "bfloat16" or "float16"; variables stay float32, the logits float32.
        partition: how pipeline stages are balanced, as in `plan_partition`
            ("params", the default, or "flops").
        dropout: the model's dropout rate (remat needs 0).

    Returns:
        A dict with the arguments and "devices": one row per device with
        "device", "replica", "stage" and the bytes of
        `tfmulti.footprint.stack_footprint`.

    Raises:
        ValueError: an unknown model, distribution, optimizer, precision or
            partition method, a batch that does not split over replicas (and
            micro-batches), a device count that does not fit the distribution,
            a pipeline setting for a distribution that does not use it, or
            remat with layers it cannot recompute (dropout above 0).
    """
    layout = check_estimate_arguments(
        model, dataset=dataset, distribution=distribution, num_devices=num_devices,
        num_stages=num_stages,
        num_microbatches=num_microbatches, num_replicas=num_replicas, remat=remat,
        global_batch_size=global_batch_size, optimizer=optimizer,
        mixed_precision=mixed_precision, partition=partition, dropout=dropout)
    settings, replicas, stages, micro = (layout.settings, layout.replicas, layout.stages,
                                         layout.micro_batch)
    pipelined = distribution in MODEL_PARALLEL
    slots = footprint.OPTIMIZER_SLOTS.get(optimizer)
    if slots is None:
        raise ValueError(f"estimate-memory counts the slots of {sorted(footprint.OPTIMIZER_SLOTS)}"
                         f", not {optimizer!r}; estimate with the closest one.")
    if callable(model) or is_hook(model) or dataset is not None:
        return _estimate_any_model(
            model, dataset, distribution=distribution, replicas=layout.replicas,
            micro=layout.micro_batch, slots=slots, global_batch_size=global_batch_size,
            optimizer=optimizer, mixed_precision=mixed_precision, dropout=dropout)
    input_shape = models.INPUT_SHAPES[model]
    # Built under the run's policy, so each layer computes (and is counted) in
    # its own dtype: the logits stay float32 under mixed precision.
    with models.mixed_precision_policy(_CPU_POLICY.get(mixed_precision, mixed_precision)):
        layers = list(models.build_model(model, input_shape=input_shape,
                                         dropout=dropout).layers)
    if pipelined and settings["remat"]:
        check_remat(layers)
    rows = []
    if not pipelined:
        for r in range(replicas):
            rows.append({"device": r, "replica": r, "stage": 0, **footprint.stack_footprint(
                layers, input_shape, micro_batch=micro, optimizer_slots=slots)})
    else:
        plan = plan_partition(layers, stages, method=partition, input_shape=input_shape)
        for r in range(replicas):
            shape, received = input_shape, None
            for s, cut in enumerate(plan.slices):
                rows.append({"device": r * stages + s, "replica": r, "stage": s,
                             **footprint.stack_footprint(
                                 layers[cut], shape, micro_batch=micro,
                                 num_microbatches=settings["num_microbatches"],
                                 optimizer_slots=slots, receives_input=s > 0,
                                 input_dtype=received,
                                 remat=settings["remat"] and s < stages - 1)})
                for layer in layers[cut]:
                    shape = tuple(layer.compute_output_shape((None, *shape))[1:])
                received = layers[cut][-1].compute_dtype
    return {
        "model": model, "distribution": distribution, "num_devices": len(rows),
        "num_replicas": replicas, "num_stages": stages,
        "num_microbatches": settings["num_microbatches"] if pipelined else 1,
        "remat": settings["remat"] if pipelined else False,
        "global_batch_size": global_batch_size, "optimizer": optimizer,
        "mixed_precision": mixed_precision, "devices": rows,
    }


def _user_model(model, dataset, dropout):
    """(the built model, its input shape, its input dtype) for any model and data."""
    config = TrainConfig(model=model, dataset=dataset or "synthetic", dropout=dropout)
    if dataset is None and not config.builtin_model:
        fn = hooks.resolve(model, "model")
        wanted = hooks.parameters(fn)
        if wanted is None or "input_shape" in wanted:
            raise ValueError(f"your model function {config.model_name} takes `input_shape`; "
                             "pass `dataset` (its data) so that estimate-memory knows the "
                             "shapes.")
        built = hooks.call(fn, {"dropout": dropout}, "model")
        if not getattr(built, "inputs", None):
            raise ValueError(f"the model function {config.model_name} returned a model without "
                             "inputs (not built); pass `dataset` so that it can be built.")
        shapes = [tuple(t.shape[1:]) for t in built.inputs]
        return built, shapes[0] if len(shapes) == 1 else shapes, None
    run_data = runs.load_data(config)
    spec = runs.features_spec(run_data.train)
    dtype = ({k: v.dtype for k, v in spec.items()} if isinstance(spec, dict)
             else spec.dtype)
    return runs.build_model_for(config, run_data), run_data.input_shape, dtype


def _estimate_any_model(model, dataset, *, distribution, replicas, micro, slots,
                        global_batch_size, optimizer, mixed_precision, dropout) -> dict:
    with models.mixed_precision_policy(_CPU_POLICY.get(mixed_precision, mixed_precision)):
        built, input_shape, input_dtype = _user_model(model, dataset, dropout)
        row = footprint.model_footprint(built, input_shape, micro_batch=micro,
                                        optimizer_slots=slots, input_dtype=input_dtype)
    name = model if isinstance(model, str) else TrainConfig(model=model).model_name
    return {
        "model": name, "distribution": distribution, "num_devices": replicas,
        "num_replicas": replicas, "num_stages": 1, "num_microbatches": 1, "remat": False,
        "global_batch_size": global_batch_size, "optimizer": optimizer,
        "mixed_precision": mixed_precision,
        "devices": [{"device": r, "replica": r, "stage": 0, **row} for r in range(replicas)],
    }


def format_memory_estimate(estimate: dict) -> str:
    """An `estimate_memory` result as an aligned table in MiB, one row per device."""
    pipelined = estimate["distribution"] in MODEL_PARALLEL
    what = (f"micro-batch of {estimate['devices'][0]['activation_batch']} examples x "
            f"{estimate['num_microbatches']} (GPipe holds them all until the backward pass"
            + ("; remat keeps stage inputs only" if estimate["remat"] else "") + ")"
            if pipelined else
            f"per-replica batch of {estimate['devices'][0]['activation_batch']} examples")
    title = (f"{estimate['model']} under {estimate['distribution']}: "
             f"{estimate['num_devices']} device(s), global batch "
             f"{estimate['global_batch_size']}, {estimate['optimizer']}, activations in "
             f"{_COMPUTE_DTYPES[estimate['mixed_precision']]} (variables float32)")
    return (footprint.format_footprint(estimate["devices"], title=title)
            + f"\nactivations: a {what} per device.")
