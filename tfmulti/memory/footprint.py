"""The memory model: the bytes a stack of layers needs on a device to train.

One model serves `tfmulti estimate-memory` (before anything is placed) and
`pipeline_footprint` (a placed `PipelineModel`), so the two always agree.
This module holds the per-device rows (`stack_footprint`, `stage_footprint`,
`model_footprint`, `pipeline_footprint`), the bytes per example of a graph's
tensors (`tensor_bytes`, `output_bytes`) and the table of rows
(`format_footprint`); the byte counts of dtypes and variables are
`tfmulti.utils.sizes`'.
Counted for one device that holds a contiguous run of layers (all of a
model under data parallelism, one stage of a pipeline):

* parameters: every variable of the layers, at its dtype's size (Keras 3
  keeps variables float32 under mixed precision: no separate master copy);
* gradients: one tensor per trainable variable, at the variable's size;
* optimizer_slots: the optimizer's per-weight state (Adam: 2 tensors per
  trainable variable, SGD: none, SGD with momentum: 1); sharded over N
  data-parallel replicas (`zero_stage` 1 or 2, `sharded_slot_bytes`), each
  replica's shard of every variable, ceil(size / N) elements;
* activations: what the device keeps for the backward pass, in the compute
  dtype: the outputs of its layers for every example it holds at once, plus
  the stage's input where that came from another device (a pipeline stage
  after the first). Under GPipe a stage keeps all M micro-batches until the
  backward pass starts; with rematerialization it keeps only its input and
  recomputes one micro-batch's outputs at a time (the last stage never
  recomputes). The model's own input batch and framework workspace are not
  counted.

Keras, TensorFlow and the pipeline are imported by the functions that look
at layers, so the module itself loads without them.

Example:
    >>> import keras
    >>> from tfmulti.memory import footprint
    >>> model = keras.Sequential([keras.Input((8,)), keras.layers.Dense(4), keras.layers.Dense(2)])
    >>> row = footprint.stack_footprint(model.layers, (8,), micro_batch=16, optimizer_slots=2)
    >>> row["parameters"], row["optimizer_slots"], row["activations"]
    (184, 368, 384)
"""

from __future__ import annotations

import contextlib
import contextvars
import math

from tfmulti.utils.sizes import dtype_bytes, variables_bytes

__all__ = ["COLUMNS", "OPTIMIZER_SLOTS", "format_footprint", "layer_outputs", "measured_on",
           "model_footprint", "output_bytes", "output_elements", "pipeline_footprint",
           "sharded_slot_bytes", "slot_bytes_by_device", "stack_footprint", "stage_footprint",
           "tensor_bytes"]

OPTIMIZER_SLOTS = {"adam": 2, "adamw": 2, "nadam": 2, "adamax": 2, "lion": 1, "rmsprop": 1,
                   "adagrad": 1, "adadelta": 2, "ftrl": 2, "sgd": 0}
"""Per-weight state tensors of the Keras optimizers by name, at their defaults
(`momentum`/`centered` add one; adafactor factors its state, muon and
schedulefreeadamw are not listed: measure those)."""
COLUMNS = ("parameters", "gradients", "optimizer_slots", "activations", "total")
"""The byte counts of a row; `activations` is the peak, `total` their sum."""


def output_elements(layers, input_shape: tuple) -> list[int]:
    """Per-example element count of each layer's output, in stack order."""
    shape, counts = (None, *input_shape), []
    for layer in layers:
        shape = layer.compute_output_shape(shape)
        counts.append(math.prod(int(d) for d in shape[1:]))
    return counts


def _stack_output_bytes(layers, input_shape: tuple, override: str | None) -> list[int]:
    """Per-example bytes of each layer's output, in the layer's compute dtype
    (its mixed-precision policy) or in `override`."""
    return [n * dtype_bytes(override or getattr(layer, "compute_dtype", None) or "float32")
            for n, layer in zip(output_elements(layers, input_shape), layers)]


def tensor_bytes(tensor) -> int:
    """Bytes of one example of a symbolic tensor: floating outputs of a
    layer in its floating compute dtype (its mixed-precision policy), others in
    their own dtype; text (string) tensors, the raw features a lookup layer
    takes, 0 (their size is the data's, as the model's input batch is not
    counted).

    Raises:
        ValueError: a dimension other than the batch is unknown.
    """
    from tfmulti.parallel.chain import node_of, per_example_elements

    dtype = getattr(tensor.dtype, "name", None) or str(tensor.dtype)
    if dtype == "string":
        return 0
    measured = _MEASURED.get()
    if measured is not None and id(tensor) in measured and None in tuple(tensor.shape[1:]):
        return measured[id(tensor)]
    node = node_of(tensor)
    compute = getattr(node.operation, "compute_dtype", None) if node is not None else None
    if "float" in dtype and "float" in str(compute):  # not a lookup's: a string "compute" dtype
        dtype = compute
    return per_example_elements(tensor) * dtype_bytes(dtype)


_MEASURED: contextvars.ContextVar[dict | None] = contextvars.ContextVar("measured", default=None)
"""Bytes per example of the tensors of a graph whose shapes are open (`measured_on`)."""


@contextlib.contextmanager
def measured_on(model, inputs):
    """Within: `tensor_bytes` of a tensor of `model`'s graph that has a
    dimension the model leaves open (a sequence length, an image size) is
    that tensor's bytes per example in one pass of `inputs` (a batch of the
    model's inputs from the data: `tfmulti.data.checks.first_inputs`) through
    the graph's layers; every other tensor is counted from its shape as
    before.

    Example:
        >>> import keras, numpy as np
        >>> tokens = keras.Input((None,), dtype="int32")
        >>> model = keras.Model(tokens, keras.layers.Embedding(10, 4)(tokens))
        >>> with measured_on(model, np.zeros((2, 16), "int32")):
        ...     tensor_bytes(model.outputs[0])
        256
    """
    token = _MEASURED.set(_graph_bytes(model, inputs))
    try:
        yield
    finally:
        _MEASURED.reset(token)


def _graph_bytes(model, inputs) -> dict[int, int]:
    """id of each tensor of the functional `model`'s graph -> its bytes per
    example when `inputs` run through it (`tfmulti.parallel.chain.run_graph`),
    eagerly, in inference mode."""
    import tensorflow as tf
    from keras import tree

    from tfmulti.parallel.chain import run_graph

    graph_inputs = tree.flatten(model._inputs_struct)  # pylint: disable=protected-access
    if isinstance(inputs, dict) and not isinstance(model._inputs_struct, dict):  # pylint: disable=protected-access
        missing = sorted({x.name for x in graph_inputs} - set(inputs))
        if missing:
            raise ValueError(f"the data has no input named {', '.join(missing)} (it has "
                             f"{', '.join(sorted(inputs))})")
        given = [inputs[x.name] for x in graph_inputs]  # by name, as Keras feeds a dict
    else:
        given = tree.flatten(inputs)
    values = run_graph(model, [tf.convert_to_tensor(y) for y in given],
                       lambda node, args, kwargs: tree.flatten(node.operation(*args, **kwargs)))
    return {key: math.prod(int(d) for d in value.shape[1:]) * dtype_bytes(value.dtype)
            for key, value in values.items() if hasattr(value, "shape") and value.shape}


def output_bytes(node) -> int:
    """Bytes per example of a graph node's outputs (see `tensor_bytes`)."""
    return sum(tensor_bytes(t) for t in node.outputs)


def stack_footprint(layers, input_shape: tuple, *, micro_batch: int, num_microbatches: int = 1,
                    optimizer_slots: int | None = None, slot_bytes: int | None = None,
                    compute_dtype: str | None = None, receives_input: bool = False,
                    input_dtype: str | None = None, remat: bool = False) -> dict:
    """The training memory of one device holding the built `layers`.

    Args:
        layers: a contiguous run of built Keras layers (one feeds the next).
        input_shape: the per-example shape of their input.
        micro_batch: examples per forward pass (the per-replica batch, or a
            pipeline's micro-batch).
        num_microbatches: micro-batches whose activations are held at once
            (GPipe: all M of a step).
        optimizer_slots: per-weight optimizer tensors (see `OPTIMIZER_SLOTS`);
            or give `slot_bytes`, the measured bytes of the slots.
        compute_dtype: the activations' dtype; default: each layer's compute
            dtype (its mixed-precision policy).
        receives_input: the input came from another device (a pipeline stage
            after the first) and is kept here for the backward pass.
        input_dtype: that input's dtype (the previous stage's last compute
            dtype); default: `compute_dtype`, else the first layer's.
        remat: activations are recomputed in the backward pass (only the input
            and one micro-batch's recomputed outputs are held).

    Returns:
        A dict of bytes: `COLUMNS`, plus "activations_per_microbatch" and
        "activation_batch" (examples per micro-batch).
    """
    outputs = sum(_stack_output_bytes(layers, tuple(input_shape), compute_dtype))
    input_dtype = (input_dtype or compute_dtype
                   or getattr(layers[0], "compute_dtype", None) or "float32")
    received = (math.prod(int(d) for d in input_shape) * dtype_bytes(input_dtype)
                if receives_input else 0)
    return stage_footprint(layers, output_bytes=outputs, received_bytes=received,
                           micro_batch=micro_batch, num_microbatches=num_microbatches,
                           optimizer_slots=optimizer_slots, slot_bytes=slot_bytes, remat=remat)


def stage_footprint(layers, *, output_bytes: int, micro_batch: int, received_bytes: int = 0,
                    num_microbatches: int = 1, optimizer_slots: int | None = None,
                    slot_bytes: int | None = None, remat: bool = False) -> dict:
    """The training memory of one device holding `layers`, from the bytes
    per example of what it keeps for the backward pass (for any graph of
    layers; `stack_footprint` works them out for a stack).

    Args:
        layers: the device's built Keras layers (their variables are counted
            once each).
        output_bytes: bytes per example of the outputs of the layer calls
            the device runs.
        micro_batch: examples per forward pass.
        received_bytes: bytes per example of the input received from another
            device and kept for the backward pass (0: none).
        num_microbatches: micro-batches whose activations are held at once.
        optimizer_slots: per-weight optimizer tensors; or give `slot_bytes`.
        slot_bytes: the measured bytes of the optimizer slots.
        remat: only the received input is kept per micro-batch, plus one
            micro-batch's recomputed outputs.

    Returns:
        The dict `stack_footprint` returns.
    """
    trainable = [v for layer in layers for v in layer.trainable_weights]
    outputs = output_bytes * micro_batch
    kept_input = received_bytes * micro_batch
    per_micro = kept_input if remat else kept_input + outputs
    if slot_bytes is None:
        slot_bytes = (optimizer_slots or 0) * variables_bytes(trainable)
    row = {
        "parameters": variables_bytes(v for layer in layers for v in layer.weights),
        "gradients": variables_bytes(trainable),
        "optimizer_slots": int(slot_bytes),
        "activations": num_microbatches * per_micro + (outputs if remat else 0),
        "activations_per_microbatch": per_micro,
        "activation_batch": micro_batch,
    }
    row["total"] = sum(row[k] for k in COLUMNS[:-1])
    return row


def sharded_slot_bytes(variables, optimizer_slots: int, num_shards: int) -> int:
    """The bytes of the optimizer slots one of `num_shards` data-parallel
    replicas holds when they are sharded (`tfmulti.parallel.zero`): per slot,
    its shard of each variable (counted once), ceil(size / num_shards)
    elements at the variable's dtype."""
    seen, total = set(), 0
    for variable in variables:
        if id(variable) in seen:
            continue
        seen.add(id(variable))
        total += math.ceil(math.prod(variable.shape) / num_shards) * dtype_bytes(variable.dtype)
    return optimizer_slots * total


def slot_bytes_by_device(optimizer, canonical) -> dict[str, int]:
    """Measured bytes of a built optimizer's per-weight slots on each device
    (`canonical` normalizes a device name); scalar state (the iteration count,
    the learning rate) is not per-weight and not counted."""
    out: dict[str, int] = {}
    for v in optimizer.variables:
        if len(v.shape) == 0:
            continue
        device = canonical(v.value.device)
        out[device] = out.get(device, 0) + variables_bytes([v])
    return out


def format_footprint(rows: list[dict], *, title: str | None = None) -> str:
    """Rows of `stack_footprint` (with "device", "replica", "stage", and
    "shard" for tensor-parallel stages) as a table, each size in the unit that reads
    best (`1.55 MiB`, `20.5 KiB`)."""
    from tfmulti.utils.human import size
    from tfmulti.utils.tables import format_table

    places = ("device", "replica", "stage") + (
        ("shard",) if any(row.get("shard") for row in rows) else ())
    header = (*places, *COLUMNS)
    body = [(*(row[p] for p in places), *(size(row[k]) for k in COLUMNS)) for row in rows]
    table = format_table(header, body, left=(0,))
    return f"{title}\n{table}" if title else table


def layer_outputs(model, input_shape, input_dtype=None) -> list[tuple[object, int]]:
    """Every leaf layer call of one forward pass of `model` (any Keras model:
    functional, Sequential or subclassed, nested or not) on one example of
    zeros, as (layer, per-example output bytes).

    Only layers without sublayers are recorded, so a block's output is not
    counted twice; values a layer computes without a sublayer (attention
    scores inside `MultiHeadAttention`) are not counted.

    Args:
        model: a Keras model.
        input_shape: the per-example input shape (a dict of shapes for dict inputs).
        input_dtype: the inputs' dtype (a dict for dict inputs); default float32.
    """
    import keras
    import numpy as np

    def zeros(shape, dtype):
        name = getattr(dtype, "name", dtype) or "float32"
        if name == "string":  # a text feature (a StringLookup's input): one empty string
            return np.full((1, *shape), "", dtype=object)
        return np.zeros((1, *shape), dtype=name)

    if isinstance(input_shape, dict):
        dtypes = input_dtype if isinstance(input_dtype, dict) else {}
        inputs = {k: zeros(shape, dtypes.get(k)) for k, shape in input_shape.items()}
    else:
        inputs = zeros(tuple(input_shape), input_dtype)
    calls: list[tuple[object, int]] = []
    original = keras.layers.Layer.__call__

    def recording(layer, *args, **kwargs):
        outputs = original(layer, *args, **kwargs)
        if not getattr(layer, "_layers", None) and not isinstance(layer, keras.layers.InputLayer):
            size = sum(math.prod(int(d) for d in t.shape[1:]) * dtype_bytes(t.dtype)
                       for t in _flatten(outputs) if hasattr(t, "shape"))
            calls.append((layer, size))
        return outputs

    keras.layers.Layer.__call__ = recording
    try:
        model(inputs, training=False)
    finally:
        keras.layers.Layer.__call__ = original
    return calls


def _flatten(value):
    if isinstance(value, dict):
        return [x for v in value.values() for x in _flatten(v)]
    if isinstance(value, (list, tuple)):
        return [x for v in value for x in _flatten(v)]
    return [value]


def model_footprint(model, input_shape, *, micro_batch: int,
                    optimizer_slots: int | None = None, input_dtype=None) -> dict:
    """The training memory of one device holding all of `model` (a data
    parallel replica): parameters, gradients and optimizer slots from its
    variables, activations from the outputs of every layer call of one
    forward pass (`layer_outputs`) for `micro_batch` examples. The same
    columns as `stack_footprint`; for a stack of layers the two agree."""
    outputs = sum(size for _, size in layer_outputs(model, input_shape, input_dtype))
    return stage_footprint([model], output_bytes=outputs, micro_batch=micro_batch,
                           optimizer_slots=optimizer_slots)


def pipeline_footprint(pipeline, batch_size: int, optimizer: str | None = None) -> list[dict]:
    """Bytes per device of a built `tfmulti.parallel.PipelineModel`, by the
    memory model `tfmulti estimate-memory` uses: parameters, gradients,
    optimizer slots, and the activations kept for the backward pass (the
    outputs of every layer call of the stage), per micro-batch and at the
    step's peak (GPipe keeps all M micro-batches' until the backward pass
    starts; with remat only the stage inputs, plus one micro-batch's
    recomputed outputs). With accumulation, a round's batch (B / k rows) is
    what a step holds at once.

    Args:
        pipeline: a `PipelineModel` whose stages are built.
        batch_size: the global batch (split over accumulation rounds,
            replicas, then micro-batches).
        optimizer: the optimizer's name ("adam", "sgd") when the model is
            not compiled yet; a compiled model's built optimizer slots are
            measured instead.

    Returns:
        One row per device (replica-major) with "device", "replica",
        "stage" and the bytes of `stage_footprint`.

    Raises:
        RuntimeError: the stages are not built yet, or tensor-parallel
            stages, whose T devices each hold a share
            (`tfmulti.memory.estimate.estimate_memory` reports them).

    Example:
        >>> import keras, tfmulti
        >>> _ = tfmulti.configure_virtual_devices(2)
        >>> from tfmulti.memory import footprint
        >>> from tfmulti.parallel import PipelineModel
        >>> pipeline = PipelineModel([keras.layers.Dense(4), keras.layers.Dense(2)],
        ...                          input_shape=(8,), devices=["CPU:0", "CPU:1"],
        ...                          num_microbatches=2)
        >>> rows = footprint.pipeline_footprint(pipeline, batch_size=16, optimizer="adam")
        >>> [(row["stage"], row["parameters"], row["activation_batch"]) for row in rows]
        [(0, 144, 8), (1, 40, 8)]
    """
    from tfmulti.runtime.devices import canonical_device_name

    if pipeline.tensor_parallel > 1:
        raise RuntimeError(
            f"pipeline_footprint() counts one device per stage; these stages are split over "
            f"{pipeline.tensor_parallel} devices each: use tfmulti.memory.estimate."
            f"estimate_memory('transformer', tensor_parallel={pipeline.tensor_parallel}, ...), "
            f"which reports every device.")
    chain = pipeline.built_chain("pipeline_footprint()")
    micro = max(batch_size // (pipeline.accumulate_steps * pipeline.num_replicas
                               * pipeline.num_microbatches), 1)
    opt = getattr(pipeline, "optimizer", None)
    measured = (slot_bytes_by_device(opt, canonical_device_name)
                if opt is not None and opt.built else None)
    slots = OPTIMIZER_SLOTS.get(optimizer or "", 0)
    rows = []
    for r in range(pipeline.num_replicas):
        for s, (a, b) in enumerate(pipeline.stage_bounds):
            device = canonical_device_name(pipeline.stage_devices[r][s])
            entry = chain.blocks[a].entry
            rows.append({"device": device, "replica": r, "stage": s, **stage_footprint(
                pipeline.stage_layers(r, s),
                output_bytes=sum(output_bytes(node) for node in chain.stage_nodes(a, b)),
                received_bytes=0 if entry is None else tensor_bytes(entry),
                micro_batch=micro, num_microbatches=pipeline.num_microbatches,
                optimizer_slots=slots,
                slot_bytes=None if measured is None else measured.get(device, 0),
                remat=pipeline.remat and s < pipeline.num_stages - 1)})
    return rows
