"""Training-memory estimate per device, before anything is placed.

Like Accelerate's `estimate-memory`, but it knows where things live: data
parallelism copies the whole model to every device and splits the batch; a
pipeline cuts the layers into stages (with `plan_partition`) and splits each
replica's batch into micro-batches. The model is built on the host without a
strategy and counted from its shapes by the memory model that a placed
pipeline is counted by too (`tfmulti.memory.footprint.pipeline_footprint`),
so no virtual devices are needed. The model is cut into its chain of blocks
once (`tfmulti.parallel.chain.chain_of`), and that chain is what the
partitioner cuts into stages; a tensor-parallel stage is shared out over its
devices by `tfmulti.memory.shares`.

Example:
    >>> from tfmulti.memory import estimate as memory
    >>> estimate = memory.estimate_memory("mlp", distribution="mirrored", num_devices=4,
    ...                                   global_batch_size=256)
    >>> len(estimate["devices"]), estimate["devices"][0]["activation_batch"]
    (4, 64)
"""

from __future__ import annotations

import inspect
import math

import keras

from tfmulti.utils import checks
from tfmulti.utils import human
from tfmulti.memory import footprint
from tfmulti.config import user_functions as hooks
from tfmulti.data import checks as data_checks
from tfmulti.models import builders as models
from tfmulti.models import own_fit
from tfmulti.models import transformer
from tfmulti.data.from_config import features_spec, load_data
from tfmulti.models.from_config import build_model_for
from tfmulti.config.train_config import MODEL_PARALLEL, TRANSFORMER, TrainConfig, is_hook
from tfmulti.memory.arguments import DISTRIBUTIONS, check_estimate_arguments, config_arguments
from tfmulti.parallel import placement
from tfmulti.parallel import chain as blocks
from tfmulti.parallel import zero
from tfmulti.parallel.partition import plan_partition
from tfmulti.parallel.pipeline import check_remat
from tfmulti.memory.shares import device_shares
from tfmulti.utils.sizes import dtype_bytes, variables_bytes

__all__ = ["DISTRIBUTIONS", "check_config", "check_fits", "estimate_for_config", "estimate_memory",
           "format_memory_estimate"]

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
    tensor_parallel: int | None = None,
    seq_len: int | None = None,
    d_model: int | None = None,
    num_heads: int | None = None,
    num_layers: int | None = None,
    task: str = "auto",
    zero_stage: int = 0,
    shard_embeddings: bool = False,
) -> dict:
    """Estimates the training memory of each device.

    Args:
        model (str | Callable): a built-in model name ("mlp", "cnn", "regression"), with its
            default input shape (or `dataset`'s), "transformer"
            (`tfmulti.models.transformer`, of the sizes below), or your own model
            function (a callable or "package.module:function", as for
            training).
        dataset (str | Callable | None): the data whose shapes the model takes (a dataset name or
            your dataset function, as for training); needed for your own
            model unless its function takes no `input_shape`.
        distribution: "one_device" (the default), "mirrored", "pipeline" or "hybrid"
            (a built-in model's or your own model's chain of blocks cut into
            stages as `PipelineModel` cuts it, each counted as
            `tfmulti.memory.footprint.pipeline_footprint` counts a placed
            stage).
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
        tensor_parallel: T devices per stage (pipeline and hybrid, model
            "transformer" only; default 1): attention, MLP and output head
            split over them (`tfmulti.parallel.tensor_split.split_transformer`),
            R x S x T devices in all.
        seq_len: the transformer's sequence length (model "transformer"
            only, as the three below; default `TrainConfig`'s, as theirs).
        d_model: the transformer's width.
        num_heads: the transformer's attention heads.
        num_layers: the transformer's blocks.
        task: "auto", "classification" or "regression", as for training (your
            own model's function is offered `num_classes` for classification).
        zero_stage: 0 (the default), or 1, 2 or 3 under "mirrored": the
            optimizer's slots sharded over the replicas as a run shards them
            (`tfmulti.parallel.zero`: each device holds ceil(size / N)
            elements of every variable's slots). Stage 2 holds what stage 1
            does: the gradients it shards are the reduced ones, one bucket at
            a time; each replica's own gradients are whole, as Keras computes
            them before any update. Stage 3 also holds its shard of each
            parameter and of the parameter's gradient (the gradient of the
            gather); the step gathers each layer's parameters whole at its
            call, and again for its backward (a Functional or Sequential
            model; another model gathers all of its parameters when called
            and holds them until their gradients): not counted here.
        shard_embeddings: under "mirrored", each embedding table split by
            rows over the N replicas as a run splits it (every
            `keras.layers.Embedding` with Keras' own call, not quantized,
            without LoRA, trainable, of N rows or more): each device holds
            ceil(rows / N) rows of the table, of its gradient and of its
            optimizer slots; the other variables as `zero_stage` says.

    Returns:
        A dict with the arguments, "sharded_tables" (with shard_embeddings:
        each sharded table's "name", "rows", "width" and "rows_per_device")
        and "devices": one row per device with
        "device", "replica", "stage", "shard" (its place among a stage's T
        devices) and the bytes of `tfmulti.memory.footprint.stack_footprint`. A
        tensor-parallel device holds its share of the split weights (and of
        their gradients and slots), its share of the split layers' outputs
        (a slice, or a whole partial sum) and a copy of the input of each
        layer whose shards all take it; the stage's first device also holds
        the whole layers and the sums.

    Raises:
        ValueError: an unknown model, distribution, optimizer, precision or
            partition method, a batch that does not split over replicas (and
            micro-batches), a device count that does not fit the distribution,
            a pipeline setting for a distribution that does not use it, or
            remat with layers it cannot recompute (dropout above 0), or
            transformer sizes that T does not split evenly.
    """
    return _estimate(dict(
        model=model, dataset=dataset, distribution=distribution, num_devices=num_devices,
        num_stages=num_stages, num_microbatches=num_microbatches, num_replicas=num_replicas,
        remat=remat, global_batch_size=global_batch_size, optimizer=optimizer,
        mixed_precision=mixed_precision, partition=partition, dropout=dropout,
        tensor_parallel=tensor_parallel, seq_len=seq_len, d_model=d_model,
        num_heads=num_heads, num_layers=num_layers, task=task, zero_stage=zero_stage,
        shard_embeddings=shard_embeddings))


def _estimate(arguments: dict, data_config: TrainConfig | None = None) -> dict:
    """`estimate_memory(**arguments)`; your own model's data read as
    `data_config` says (its data_dir, download, seed...), when given."""
    arguments = {**{name: p.default for name, p in
                    inspect.signature(estimate_memory).parameters.items()}, **arguments}
    layout = check_estimate_arguments(**arguments)
    model, dataset, distribution, global_batch_size, optimizer, mixed_precision, partition, \
        dropout = (arguments[k] for k in ("model", "dataset", "distribution",
                                          "global_batch_size", "optimizer", "mixed_precision",
                                          "partition", "dropout"))
    settings, replicas, stages, micro = (layout.settings, layout.replicas, layout.stages,
                                         layout.micro_batch)
    pipelined = distribution in MODEL_PARALLEL
    slots = footprint.OPTIMIZER_SLOTS.get(optimizer)
    if slots is None:
        raise ValueError(f"estimate-memory counts the slots of {sorted(footprint.OPTIMIZER_SLOTS)}"
                         f", not {optimizer!r}; estimate with the closest one.")
    if callable(model) or is_hook(model) or dataset is not None:
        # From Python, `optimizer` is the caller's; from a configuration, None
        # there (not given) takes the optimizer the model function compiles with.
        data = (data_config or TrainConfig(optimizer=optimizer)).replace(
            model=model, dataset="synthetic" if dataset is None else dataset, dropout=dropout,
            task=arguments["task"])
        return _estimate_any_model(
            data, dataset is not None, distribution=distribution, layout=layout, slots=slots,
            global_batch_size=global_batch_size, optimizer=optimizer,
            mixed_precision=mixed_precision, partition=partition,
            zero_stage=arguments["zero_stage"], shard_embeddings=arguments["shard_embeddings"])
    summary = {
        "model": model, "distribution": distribution, "num_replicas": replicas,
        "num_stages": stages, "tensor_parallel": layout.tensor_parallel,
        "num_microbatches": settings["num_microbatches"] if pipelined else 1,
        "remat": settings["remat"] if pipelined else False,
        "global_batch_size": global_batch_size, "optimizer": optimizer,
        "mixed_precision": mixed_precision, **layout.sizes,
        "zero_stage": arguments["zero_stage"], "shard_embeddings": arguments["shard_embeddings"],
    }
    if model == TRANSFORMER:
        rows = _transformer_rows(layout, summary, slots, partition, dropout)
        return {**summary, "num_devices": len(rows), "devices": rows}
    input_shape = models.INPUT_SHAPES[model]
    # Built under the run's policy, so each layer computes (and is counted) in
    # its own dtype: the logits stay float32 under mixed precision.
    with models.mixed_precision_policy(_CPU_POLICY.get(mixed_precision, mixed_precision)):
        built = models.build_model(model, input_shape=input_shape, dropout=dropout)
    layers = list(built.layers)
    if pipelined and settings["remat"]:
        check_remat(layers)
    rows = []
    if not pipelined:
        for r in range(replicas):
            rows.append({"device": r, "replica": r, "stage": 0, "shard": 0,
                         **footprint.stack_footprint(layers, input_shape, micro_batch=micro,
                                                     optimizer_slots=slots)})
        _shard_state(summary, rows, built, slots)
    else:
        plan = plan_partition(blocks.chain_of(layers, input_shape=input_shape), stages,
                              method=partition)
        for r in range(replicas):
            shape, received = input_shape, None
            for s, cut in enumerate(plan.slices):
                rows.append({"device": r * stages + s, "replica": r, "stage": s, "shard": 0,
                             **footprint.stack_footprint(
                                 layers[cut], shape, micro_batch=micro,
                                 num_microbatches=settings["num_microbatches"],
                                 optimizer_slots=slots, receives_input=s > 0,
                                 input_dtype=received,
                                 remat=settings["remat"] and s < stages - 1)})
                for layer in layers[cut]:
                    shape = tuple(layer.compute_output_shape((None, *shape))[1:])
                received = layers[cut][-1].compute_dtype
    return {**summary, "num_devices": len(rows), "devices": rows}


def _shard_state(summary: dict, rows: list[dict], model, slots: int) -> None:
    """Data parallelism over 2 or more replicas: each row's parameters,
    gradients and slots as `summary`'s zero_stage and shard_embeddings hold
    them (a table sharded by rows: ceil(rows / N) rows of each on every
    device; the other trainable variables ceil(size / N) elements of their
    slots from stage 1, of themselves and their gradients at stage 3), in
    `summary` the tables sharded ("sharded_tables") and what each device's
    slots would be at stage 1 ("optimizer_slots_sharded", for `check_fits`
    to name the stage that fits)."""
    N, stage = len(rows), summary["zero_stage"]
    tables = zero.table_layers(model, N) if summary["shard_embeddings"] and N > 1 else []
    if summary["shard_embeddings"]:
        summary["sharded_tables"] = [
            {"name": layer.name, "rows": layer.input_dim, "width": layer.output_dim,
             "rows_per_device": math.ceil(layer.input_dim / N)} for layer in tables]
    if N < 2:
        return
    trainable = model.trainable_variables
    table_ids = {id(layer.embeddings) for layer in tables}
    others = [v for v in trainable if id(v) not in table_ids]
    # One copy of each device's rows of the tables, and of its shards of the others.
    rows_held = sum(math.ceil(layer.input_dim / N) * layer.output_dim
                    * dtype_bytes(layer.embeddings.dtype) for layer in tables)
    other_shards = footprint.sharded_slot_bytes(others, 1, N)
    if slots:
        summary["optimizer_slots_sharded"] = slots * (rows_held + other_shards)
    if not tables and not stage:
        return
    whole = variables_bytes(trainable)
    other_whole = whole - variables_bytes(layer.embeddings for layer in tables)
    held = rows_held + (other_shards if stage == 3 else other_whole)
    slot_bytes = slots * (rows_held + (other_shards if stage else other_whole))
    for row in rows:
        row["parameters"] += held - whole  # (the weights that do not train: whole)
        row["gradients"] = held
        row["optimizer_slots"] = slot_bytes
        row["total"] = sum(row[k] for k in footprint.COLUMNS[:-1])


class _DeviceWeights:
    """A device's `WeightShare`s, counted by `footprint.stage_footprint` as
    a layer's weights are."""

    def __init__(self, shares):
        self.weights = list(shares)
        self.trainable_weights = [w for w in shares if w.trainable]


def _transformer_rows(layout, summary: dict, slots: int, partition: str,
                      dropout: float) -> list[dict]:
    """The rows of a transformer over R x S x T devices: the model built
    without values (its shapes only), cut into stages as `PipelineModel`
    cuts it, each stage's layers shared out over its T devices as
    `tfmulti.parallel.tensor_split.split_transformer` splits them."""
    T = layout.tensor_parallel
    policy = _CPU_POLICY.get(summary["mixed_precision"], summary["mixed_precision"])
    with models.mixed_precision_policy(policy), placement.deferred_variables():
        model = transformer.build_transformer(**layout.sizes, dropout=dropout)
    if summary["remat"]:
        check_remat(model.layers)
    rows = _chain_rows(
        blocks.chain_of(model), layout, summary, slots, partition,
        kind_of=lambda op: (transformer.TENSOR_PARALLEL.get(transformer.role_of(op.name))
                            if T > 1 else None))
    if summary["distribution"] not in MODEL_PARALLEL:
        _shard_state(summary, rows, model, slots)
    return rows


def _chain_rows(chain, layout, summary: dict, slots: int, partition: str,
                kind_of=lambda op: None) -> list[dict]:
    """The rows of a model's chain of blocks over R x S x T devices: cut into
    stages as `PipelineModel` cuts it (`plan_partition`), each stage counted
    as `footprint.pipeline_footprint` counts a placed one, its layers shared
    out over its T devices by `kind_of(layer)` (None: whole, on the first)."""
    R, S, T = layout.replicas, layout.stages, layout.tensor_parallel
    stage_rows = []
    for s, cut in enumerate(plan_partition(chain, S, method=partition).slices):
        weights = [[] for _ in range(T)]
        kept = [0.0] * T  # bytes per example each device keeps for the backward pass
        seen = set()
        for node in chain.stage_nodes(cut.start, cut.stop):
            op = node.operation
            outputs = footprint.output_bytes(node)
            for t, share in enumerate(device_shares(op, kind_of(op), T)):
                if id(op) not in seen and isinstance(op, keras.layers.Layer):
                    weights[t].extend(share.weights)
                kept[t] += share.output * outputs
                if share.input:  # a copy of the layer's inputs (counted only where kept)
                    kept[t] += share.input * sum({id(x): footprint.tensor_bytes(x)
                                                  for x in node.input_tensors}.values())
            seen.add(id(op))
        entry = chain.blocks[cut.start].entry
        stage_rows.append([footprint.stage_footprint(
            [_DeviceWeights(weights[t])], output_bytes=round(kept[t]),
            received_bytes=footprint.tensor_bytes(entry) if entry is not None and t == 0 else 0,
            micro_batch=layout.micro_batch, num_microbatches=summary["num_microbatches"],
            optimizer_slots=slots, remat=summary["remat"] and s < S - 1) for t in range(T)])
    return [{"device": (r * S + s) * T + t, "replica": r, "stage": s, "shard": t,
             **stage_rows[s][t]} for r in range(R) for s in range(S) for t in range(T)]


def check_fits(estimate: dict, device_memory_mb: float) -> None:
    """Refuses a layout that some device cannot hold.

    Args:
        estimate: an `estimate_memory` result.
        device_memory_mb: what one device can give to training, in MiB (a
            GPU's memory, less the framework's workspace; on CPUs a stated
            budget).

    Raises:
        ValueError: naming the fullest device, its bytes, the budget and
            what would lower it.

    Example:
        >>> from tfmulti.memory import estimate as memory
        >>> estimate = memory.estimate_memory("mlp", global_batch_size=256)
        >>> memory.check_fits(estimate, device_memory_mb=64)
        >>> memory.check_fits(estimate, device_memory_mb=4)
        Traceback (most recent call last):
            ...
        ValueError: device 0 (replica 0, stage 0, shard 0) needs 7.99 MiB to train mlp ...
    """
    budget = checks.positive_number("device_memory_mb", device_memory_mb)
    row = max(estimate["devices"], key=lambda r: r["total"])
    if row["total"] <= budget * 2**20:
        return
    parts = ", ".join(f"{k.replace('_', ' ')} {human.size(row[k])}"
                      for k in footprint.COLUMNS[:-1])
    sharded = estimate.get("optimizer_slots_sharded")
    if sharded is not None and not estimate.get("zero_stage"):
        # The same devices with the optimizer's slots sharded over the replicas.
        total = row["total"] - row["optimizer_slots"] + sharded
        verdict = "which fits" if total <= budget * 2**20 else "still over it"
        shard = (f"shard the optimizer's slots over the {estimate['num_replicas']} replicas "
                 f"(zero_stage=1: {human.size(total)} per device, {verdict}), ")
    else:
        shard = ""
    raise ValueError(
        f"device {row['device']} (replica {row['replica']}, stage {row['stage']}, shard "
        f"{row['shard']}) needs {human.size(row['total'])} to train {estimate['model']} under "
        f"{estimate['distribution']} ({parts}), over the budget of {budget:g} MiB per device; "
        f"{shard}split the model over more devices (`num_stages`, `tensor_parallel`), hold "
        f"fewer examples at once (a smaller `global_batch_size`, more `num_microbatches`, "
        f"`remat`) or use sgd (no optimizer slots).")


def estimate_for_config(config: TrainConfig, *, num_devices: int | None = None,
                        given: tuple | set | None = None) -> dict:
    """`estimate_memory` for a training configuration's model and layout, read
    as the run reads them (`tfmulti.memory.arguments.config_arguments`, which
    says how): `tfmulti estimate-memory` takes the training flags.

    Args:
        config: the training configuration.
        num_devices: `--num_devices`, the command line's old name for the
            data-parallel devices.
        given: the fields the command line set (None: a whole configuration).

    Raises:
        ValueError: a distribution whose devices the configuration does not
            name (auto without devices, multi_worker, mirrored without
            `devices` or `num_virtual_devices`), or partition "time" (measured
            when the run starts).
    """
    return _estimate(config_arguments(config, num_devices=num_devices, given=given), config)


def check_config(config: TrainConfig) -> None:
    """Refuses a training configuration some device of its layout cannot
    hold, by `config.device_memory_mb` (nothing to check without it); for a
    recipe, before anything is built.

    Raises:
        ValueError: the layout does not fit (see `check_fits`), or its
            devices are not known before the run (see `estimate_for_config`).

    Example:
        >>> from tfmulti.config.train_config import TrainConfig
        >>> from tfmulti.memory import estimate as memory
        >>> memory.check_config(TrainConfig(distribution="pipeline", device_memory_mb=2.5))
        Traceback (most recent call last):
            ...
        ValueError: device 0 (replica 0, stage 0, shard 0) needs 7.40 MiB to train mlp ...
    """
    if config.device_memory_mb is not None:
        check_fits(estimate_for_config(config), config.device_memory_mb)


def _user_model(config: TrainConfig, data_given: bool):
    """(the built model, its input shape, its input dtype, a function giving
    the model's inputs for the first training examples (None without data))
    for any model and data (`config`'s; without `data_given`, the model
    function must take no `input_shape`). A model that prepares its own input
    (`tfmulti.models.own_fit`: keras-hub's tasks) takes the shapes and dtypes
    of what it makes of the first examples."""
    model, dropout = config.model, config.dropout
    if not data_given and not config.builtin_model:
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
        return built, shapes[0] if len(shapes) == 1 else shapes, None, None
    run_data = load_data(config)
    built = build_model_for(config, run_data)
    preprocess = own_fit.preprocessing(built)

    def inputs():
        return data_checks.first_inputs(run_data.train, preprocess)

    if preprocess is not None:
        prepared = inputs()
        return (built, keras.tree.map_structure(lambda t: tuple(t.shape[1:]), prepared),
                keras.tree.map_structure(lambda t: t.dtype, prepared), lambda: prepared)
    spec = features_spec(run_data.train)
    dtype = ({k: v.dtype for k, v in spec.items()} if isinstance(spec, dict)
             else spec.dtype)
    return built, run_data.input_shape, dtype, inputs


def _compiled_optimizer(model) -> str | None:
    """The name of the optimizer `model` was compiled with, where its slots
    are counted (`footprint.OPTIMIZER_SLOTS`); None otherwise."""
    optimizer = getattr(model, "optimizer", None) if getattr(model, "compiled", False) else None
    inner = getattr(optimizer, "inner_optimizer", optimizer)  # a LossScaleOptimizer's
    name = type(inner).__name__.lower() if inner is not None else None
    return name if name in footprint.OPTIMIZER_SLOTS else None


def _estimate_any_model(config: TrainConfig, data_given: bool, *, distribution, layout, slots,
                        global_batch_size, optimizer, mixed_precision, partition,
                        zero_stage, shard_embeddings) -> dict:
    pipelined = distribution in MODEL_PARALLEL
    summary = {
        "model": config.model_name, "distribution": distribution,
        "num_devices": layout.replicas * layout.stages, "num_replicas": layout.replicas,
        "num_stages": layout.stages, "tensor_parallel": 1,
        "num_microbatches": layout.settings["num_microbatches"] if pipelined else 1,
        "remat": layout.settings["remat"] if pipelined else False,
        "global_batch_size": global_batch_size, "optimizer": optimizer,
        "mixed_precision": mixed_precision, "zero_stage": zero_stage,
        "shard_embeddings": shard_embeddings,
    }
    with models.mixed_precision_policy(_CPU_POLICY.get(mixed_precision, mixed_precision)):
        built, input_shape, input_dtype, inputs = _user_model(config, data_given)
        compiled = _compiled_optimizer(built) if config.optimizer is None else None
        if compiled is not None:  # the optimizer the model function compiled it with
            summary["optimizer"], slots = compiled, footprint.OPTIMIZER_SLOTS[compiled]
        if not pipelined:
            row = footprint.model_footprint(built, input_shape, micro_batch=layout.micro_batch,
                                            optimizer_slots=slots, input_dtype=input_dtype)
            rows = [{"device": r, "replica": r, "stage": 0, "shard": 0, **row}
                    for r in range(layout.replicas)]
            _shard_state(summary, rows, built, slots)
            return {**summary, "devices": rows}
        # Cut as the run's PipelineModel cuts it: a functional model's graph,
        # a stack's layers on its input shape.
        chain = blocks.chain_of(built, input_shape=None if isinstance(input_shape, dict)
                                else input_shape)
        if summary["remat"]:
            check_remat(chain.layers)
        open_inputs = any(None in t.shape[1:] for t in getattr(built, "inputs", None) or [])
        if not open_inputs or inputs is None:
            rows = _chain_rows(chain, layout, summary, slots, partition)
        else:  # a sequence length the model leaves open: the data's
            example = inputs()
            with footprint.measured_on(chain.graph, example):
                rows = _chain_rows(chain, layout, summary, slots, partition)
            summary["input_shapes_from_data"] = keras.tree.map_structure(
                lambda t: list(t.shape[1:]), example)
    return {**summary, "devices": rows}


def format_memory_estimate(estimate: dict) -> str:
    """An `estimate_memory` result as an aligned table, one row per device, each size in
    the unit that reads best (`--json` keeps the bytes)."""
    pipelined = estimate["distribution"] in MODEL_PARALLEL
    what = (f"micro-batch of {estimate['devices'][0]['activation_batch']} examples x "
            f"{estimate['num_microbatches']} (GPipe holds them all until the backward pass"
            + ("; remat keeps stage inputs only" if estimate["remat"] else "") + ")"
            if pipelined else
            f"per-replica batch of {estimate['devices'][0]['activation_batch']} examples")
    shards = (f" x {estimate['tensor_parallel']} tensor-parallel"
              if estimate["tensor_parallel"] > 1 else "")
    title = (f"{estimate['model']} under {estimate['distribution']}{shards}: "
             f"{human.count(estimate['num_devices'], 'device')}, global batch "
             f"{estimate['global_batch_size']}, {estimate['optimizer']}, activations in "
             f"{_COMPUTE_DTYPES[estimate['mixed_precision']]} (variables float32)")
    shapes = estimate.get("input_shapes_from_data")
    if shapes is not None:  # open dimensions of the model, sized by the data
        what += (", at the training data's input shapes ("
                 + (", ".join(f"{k} {tuple(v)}" for k, v in sorted(shapes.items()))
                    if isinstance(shapes, dict) else str(shapes)) + ")")
    text = (footprint.format_footprint(estimate["devices"], title=title)
            + f"\nactivations: a {what} per device.")
    if estimate.get("zero_stage"):
        text += (f"\noptimizer_slots: zero_stage={estimate['zero_stage']}, each device's "
                 f"shard (1/{estimate['num_replicas']}) of every weight's slots.")
        if estimate["zero_stage"] == 3:
            text += ("\nparameters, gradients: zero_stage=3, each device's shard of them too "
                     "(the step gathers them whole when the model is called, until their "
                     "gradients are computed).")
    tables = estimate.get("sharded_tables")
    if tables:
        held = ", ".join(f"{t['name']} {t['rows_per_device']:,} of {t['rows']:,} rows "
                         f"(x {t['width']:,})" for t in tables)
        text += (f"\ntables: shard_embeddings, by rows over {estimate['num_replicas']} "
                 f"replicas: {held} on each device, with their gradients and optimizer slots.")
    elif tables is not None:
        text += ("\ntables: shard_embeddings, none sharded: " + (
            "one replica holds them whole." if estimate["num_replicas"] < 2 else
            f"no trainable keras.layers.Embedding of {estimate['num_replicas']} rows or more."))
    return text
