"""Contiguous pipeline-stage partitioner for a stack of Keras layers or a
chain of blocks.

Splits a stack of layers (a `keras.Sequential` or a list of layers) or a
functional model's chain of blocks (runs of layers between points crossed by
a single tensor, `tfmulti.parallel.chain`) into `num_stages` contiguous,
non-empty stages so that the most expensive stage is as cheap as possible,
the way GPipe/torchgpipe's `balance_by_time`/`balance_by_size` and
DeepSpeed's `PipelineModule(partition_method=...)` do. The cost of a layer
(block) is its parameter count ("params"), its estimated forward FLOPs per
example ("flops", attention and embeddings included) or its measured forward
time ("time"); stage sizes can also be given explicitly.

The numeric core (`partition_costs`, `validate_sizes`, `balance_ratio`) and
the one stage-count check (`check_stage_count`) are pure Python; Keras is
imported only inside the functions that look at layers.

Example:
    >>> import keras
    >>> from tfmulti.parallel import partition
    >>> model = keras.Sequential([
    ...     keras.Input((784,)),
    ...     keras.layers.Dense(512, name="fc1"),
    ...     keras.layers.Dense(256, name="fc2"),
    ...     keras.layers.Dense(10, name="logits"),
    ... ])
    >>> partition.partition_costs([1, 2, 3, 4, 5, 6, 7, 8, 9], 3)
    [5, 2, 2]
    >>> plan = partition.plan_partition(model, 2, method="params")
    >>> plan.sizes
    (1, 2)
    >>> [stage.num_params for stage in plan.stages]
    [401920, 133898]
    >>> plan
    PartitionPlan(method='params', sizes=(1, 2), balance=1.50)
"""

from __future__ import annotations

import dataclasses
import math
import numbers
import statistics
import time
from collections.abc import Sequence

from tfmulti.config.train_config import PARTITIONS
from tfmulti.utils import checks, human
from tfmulti.utils.tables import format_table, human_bytes
from tfmulti.utils.sizes import variables_bytes

__all__ = ["COST_METHODS", "PartitionPlan", "StagePlan", "balance_ratio", "check_stage_count",
           "layer_costs", "partition_costs", "per_example_shape", "plan_partition",
           "validate_sizes"]

COST_METHODS = PARTITIONS
"""Valid string values of `method` in `layer_costs` and `plan_partition`: the
`partition` values of `TrainConfig` (one tuple, defined there)."""

EXPLICIT = "explicit"
"""`PartitionPlan.method` when the stage sizes were given explicitly."""

_TIME_WARMUP = 1
_TIME_REPEATS = 5
_REL_TOL = 1e-9  # ties in the secondary criterion, for float costs


# ---------------------------------------------------------------------------
# Pure numeric core.
# ---------------------------------------------------------------------------


def check_stage_count(num_stages, num_layers: int | None = None, *, chain=None,
                      model: str | None = None, devices=None) -> int:
    """Checks a number of pipeline stages: a positive integer and, given the
    layers (or the chain of blocks) there are to cut, at most one stage per
    layer (block). The one stage-count check: the partitioner and
    `PipelineModel` both call it.

    Args:
        num_stages: the number of stages asked for.
        num_layers: the layers of a stack to cut; None (and no `chain`):
            check `num_stages` alone.
        chain: the chain of blocks to cut (`tfmulti.parallel.chain.Chain`),
            instead of `num_layers`: the message names the model and what
            prevents more cuts (`Chain.why_not`).
        model: the model's name, for the message (a chain names its own).
        devices: the devices `num_stages` came from, named in the message.

    Returns:
        `num_stages` as an int.

    Raises:
        ValueError: `num_stages` is not an integer >= 1, or exceeds the
            layers (blocks).

    Example:
        >>> from tfmulti.parallel.partition import check_stage_count
        >>> check_stage_count(2, 3)
        2
        >>> check_stage_count(4, 3, model="mlp")
        Traceback (most recent call last):
            ...
        ValueError: model 'mlp' cannot be cut into 4 stages: it has 3 layers; use at most 3 stages.
    """
    num_stages = checks.positive_int(
        "num_stages", num_stages, hint="pass e.g. num_stages=2 (1: a single stage, no pipeline)")
    unit, reason, num_units = "layers", None, num_layers
    if chain is not None:
        unit, reason, num_units = chain.unit, chain.why_not, len(chain.blocks)
        model = chain.name
    if num_units is None or num_stages <= num_units:
        return num_stages
    what = "the model" if model is None else f"model {model!r}"
    asked = (f"{num_stages} stages" if devices is None
             else f"{num_stages} stages per replica (`devices` lists {len(devices)})")
    cut = " (a cut needs a point crossed by a single tensor)" if unit == "blocks" else ""
    fix = (f"use at most {human.count(num_units, 'stage')}" if devices is None
           else f"pass at most {human.count(num_units, 'device')} per replica")
    raise ValueError(f"{what} cannot be cut into {asked}: it has "
                     f"{human.count(num_units, unit[:-1])}{cut}; "
                     f"{fix}.{' ' + reason if reason else ''}")


def _check_costs(costs, what: str = "costs") -> list[float]:
    if isinstance(costs, (str, bytes)) or not isinstance(costs, Sequence):
        try:
            costs = list(costs)
        except TypeError:
            raise ValueError(
                f"{what} must be a sequence of numbers, one per layer; "
                f"received {type(costs).__name__}.") from None
    if len(costs) == 0:
        raise ValueError(f"{what} is empty; pass one cost per layer (at least one layer).")
    checked = []
    for i, cost in enumerate(costs):
        if isinstance(cost, bool) or not isinstance(cost, numbers.Real):
            raise ValueError(
                f"{what}[{i}] is not a number ({cost!r}); "
                "layer costs must be finite numbers >= 0.")
        cost = float(cost)
        if not math.isfinite(cost):
            raise ValueError(
                f"{what}[{i}] is not finite ({cost}); layer costs must be finite numbers >= 0.")
        if cost < 0:
            raise ValueError(
                f"{what}[{i}] is negative ({cost}); layer costs must be finite numbers >= 0.")
        checked.append(cost)
    return checked


def partition_costs(costs: Sequence[float], num_stages: int) -> list[int]:
    """Splits per-layer costs into contiguous stages minimizing the largest stage.

    Exact: a dynamic program over prefix sums (O(num_stages * N^2) time,
    O(num_stages * N) memory) finds the minimal possible maximum stage cost M*.
    Among all splits whose largest stage costs M*, ties are broken
    deterministically by, in order:

    1. the smallest sum of squared stage costs (the most balanced split; float
       sums within a relative 1e-9 count as equal);
    2. the smallest sum of squared stage sizes (the most even layer counts,
       which decides e.g. for zero-cost layers);
    3. the earliest boundaries (lexicographically smallest `sizes`, i.e.
       earlier stages get fewer layers).

    Args:
        costs: One finite, non-negative cost per layer, in stack order.
        num_stages: The number of stages, 1 <= num_stages <= len(costs).

    Returns:
        The stage sizes (layers per stage, each >= 1), summing to len(costs).

    Raises:
        ValueError: If `costs` is empty or holds a negative, non-finite or
            non-numeric value; if `num_stages` is not an integer, is < 1 or
            exceeds the number of layers.
    """
    costs = _check_costs(costs)
    n = len(costs)
    num_stages = check_stage_count(num_stages, n)
    prefix = [0.0]
    for cost in costs:
        prefix.append(prefix[-1] + cost)

    def seg(i: int, j: int) -> float:  # cost of layers i..j-1
        return prefix[j] - prefix[i]

    # Phase 1: best[i] = minimal largest stage for costs[i:] split into s stages.
    # Stage cost grows with j and the rest's optimum shrinks, so stop early.
    best = [seg(i, n) for i in range(n)]
    for s in range(2, num_stages + 1):
        new = [math.inf] * n
        for i in range(n - s + 1):
            value = math.inf
            for j in range(i + 1, n - s + 2):
                head = seg(i, j)
                if head >= value:
                    break
                value = min(value, max(head, best[j]))
            new[i] = value
        best = new
    limit = best[0]  # M*; every seg() value is computed the same way below.

    # Phase 2: among splits with every stage <= M*, minimize
    # (sum of squared costs, sum of squared sizes); the earliest j wins ties.
    inf = (math.inf, math.inf)
    score = [(seg(i, n) ** 2, (n - i) ** 2) if seg(i, n) <= limit else inf for i in range(n)]
    choices: list[list[int]] = []
    for s in range(2, num_stages + 1):
        new_score = [inf] * n
        choice = [-1] * n
        for i in range(n - s + 1):
            top = inf
            for j in range(i + 1, n - s + 2):
                head = seg(i, j)
                if head > limit:
                    break
                rest = score[j]
                if rest[0] == math.inf:
                    continue
                cand = (rest[0] + head * head, rest[1] + (j - i) ** 2)
                if _better(cand, top):
                    top, choice[i] = cand, j
            new_score[i] = top
        score = new_score
        choices.append(choice)

    sizes, i = [], 0
    for choice in reversed(choices):
        j = choice[i]
        sizes.append(j - i)
        i = j
    sizes.append(n - i)
    return sizes


def _better(cand: tuple[float, float], top: tuple[float, float]) -> bool:
    """Lexicographic `cand < top` with a relative tolerance on the float part."""
    if top[0] == math.inf:
        return True
    tol = _REL_TOL * max(abs(cand[0]), abs(top[0]))
    if cand[0] < top[0] - tol:
        return True
    if cand[0] > top[0] + tol:
        return False
    return cand[1] < top[1]


def validate_sizes(sizes: Sequence[int], num_layers: int, num_stages: int,
                   unit: str = "layers") -> list[int]:
    """Checks explicitly given stage sizes against the stack.

    Args:
        sizes: Layers (blocks) per stage, in stack order.
        num_layers: The number of layers (blocks) in the stack.
        num_stages: The number of stages the sizes must describe.
        unit: what the sizes count, for messages: "layers" (the default) or
            "blocks".

    Returns:
        The sizes as a list of ints.

    Raises:
        ValueError: If `num_stages` is not an integer >= 1, there is not one
            size per stage, a size is not an integer or is < 1, or the sizes do
            not add up to `num_layers`.
    """
    num_stages = check_stage_count(num_stages)
    if isinstance(sizes, (str, bytes)) or not isinstance(sizes, Sequence):
        raise ValueError(
            f"stage sizes must be a sequence of integers, one per stage; received {sizes!r}.")
    sizes = list(sizes)
    if len(sizes) != num_stages:
        raise ValueError(
            f"got {len(sizes)} stage sizes {tuple(sizes)} for num_stages={num_stages}; "
            "give exactly one size per stage.")
    for i, size in enumerate(sizes):
        if not checks.is_int(size):
            raise ValueError(
                f"sizes[{i}] must be an integer number of {unit}; "
                f"received {size!r} ({type(size).__name__}).")
        if size < 1:
            raise ValueError(
                f"sizes[{i}] is {size}; every stage needs at least one {unit[:-1]}.")
    sizes = [int(size) for size in sizes]
    if sum(sizes) != num_layers:
        raise ValueError(
            f"stage sizes {tuple(sizes)} sum to {sum(sizes)} but the stack has {num_layers} "
            f"{unit}; the sizes must add up to {num_layers}.")
    return sizes


def balance_ratio(stage_costs: Sequence[float]) -> float:
    """max / mean of the stage costs: 1.0 is perfect balance.

    Also 1.0 when every stage costs 0.

    Raises:
        ValueError: If `stage_costs` is empty or holds a negative or
            non-finite value.
    """
    costs = _check_costs(stage_costs, what="stage_costs")
    total = math.fsum(costs)
    if total == 0:
        return 1.0
    return max(costs) / (total / len(costs))


# ---------------------------------------------------------------------------
# Layer stacks and their costs (Keras imported lazily).
# ---------------------------------------------------------------------------


def per_example_shape(input_shape) -> tuple:
    """A per-example input shape (an int or a sequence, without the batch
    dimension) as a tuple of ints (None for unknown sizes).

    Raises:
        ValueError: not a shape, or a dimension < 1.
    """
    if checks.is_int(input_shape):
        input_shape = (int(input_shape),)
    try:
        shape = tuple(None if d is None else int(d) for d in input_shape)
    except (TypeError, ValueError):
        raise ValueError(
            f"input_shape must be the per-example shape without the batch dimension, "
            f"e.g. (784,) or (28, 28, 1); received {input_shape!r}.") from None
    if any(d is not None and d < 1 for d in shape):
        raise ValueError(
            f"input_shape {shape} has a dimension < 1; pass the per-example shape "
            "without the batch dimension, e.g. (784,).")
    return shape


def _chain(layers, input_shape):
    """The model's chain of blocks (`tfmulti.parallel.chain`): a stack's
    layers, a functional model's blocks; a chain passes through."""
    from tfmulti.parallel import chain as blocks

    if isinstance(layers, blocks.Chain):
        return layers
    shape = per_example_shape(input_shape) if input_shape is not None else None
    chain = blocks.chain_of(layers, input_shape=shape)
    if chain.inputs is None:  # a stack of unknown input shape: its layers must be built
        unbuilt = [layer for layer in chain.stack if not layer.built]
        if unbuilt:
            raise ValueError(
                f"layer {unbuilt[0].name!r} is not built, so its weights and costs are "
                "unknown; pass input_shape=(...) (the per-example shape, without the batch "
                "dimension) or build the model first, e.g. with keras.Input.")
    return chain


def _check_shapes(chain, method: str) -> None:
    """Shapes known along the chain, for "flops" and "time"."""
    if chain.inputs is None:
        raise ValueError(
            f'method "{method}" needs the input shape; pass input_shape=(...) (the '
            "per-example shape, without the batch dimension), e.g. input_shape=(784,).")
    for tensor in chain.inputs:
        shape = tuple(tensor.shape[1:])
        if any(d is None for d in shape):
            raise ValueError(
                f'method "{method}" needs a fully known input shape; received {shape}. '
                "Pass concrete sizes, e.g. a typical sequence length.")


def _argument(node, index: int, name: str):
    """A call argument of a graph node, by keyword or position."""
    kwargs, args = node.arguments.kwargs, node.arguments.args
    if kwargs.get(name) is not None:
        return kwargs[name]
    return args[index] if len(args) > index else None


def _attention_flops(layer, node) -> float:
    """MultiHeadAttention: the query, key, value and output projections and
    the two attention products (scores, weighted values)."""
    from tfmulti.parallel.chain import per_example_elements

    query, value = _argument(node, 0, "query"), _argument(node, 1, "value")
    key = _argument(node, 2, "key")
    key = value if key is None else key
    heads, key_dim = layer.num_heads, layer.key_dim
    value_dim = layer.value_dim or key_dim

    def positions(tensor):
        return per_example_elements(tensor) // int(tensor.shape[-1])

    tq, tk, tv = positions(query), positions(key), positions(value)
    out_dim = per_example_elements(node.outputs[0]) // tq
    macs = (tq * int(query.shape[-1]) * heads * key_dim + tk * int(key.shape[-1]) * heads * key_dim
            + tv * int(value.shape[-1]) * heads * value_dim + tq * tk * heads * key_dim
            + tq * tk * heads * value_dim + tq * heads * value_dim * out_dim)
    return 2.0 * macs


def _node_flops(node) -> float:
    """Forward FLOPs per example of one call of a layer (see `layer_costs`)."""
    import keras

    from tfmulti.parallel.chain import per_example_elements

    layer = node.operation
    for tensor in node.outputs:
        if any(d is None for d in tensor.shape[1:]):
            raise ValueError(
                f"the output shape of layer {layer.name!r} is {tuple(tensor.shape)}; FLOPs "
                "need fully known shapes, so pass a concrete input_shape.")
    out_elements = sum(per_example_elements(t) for t in node.outputs)
    if isinstance(layer, keras.layers.Dense):
        # Every output element is a dot product over the last input axis.
        flops = 2 * int(node.input_tensors[0].shape[-1]) * out_elements
        return float(flops + (out_elements if layer.use_bias else 0))
    if isinstance(layer, (keras.layers.Conv1D, keras.layers.Conv2D, keras.layers.Conv3D)):
        # kernel = (*kernel_size, cin / groups, filters): a multiply-add per kernel
        # entry at every output position.
        positions = out_elements // layer.filters
        flops = 2 * math.prod(layer.kernel.shape) * positions
        return float(flops + (out_elements if layer.use_bias else 0))
    if isinstance(layer, keras.layers.MultiHeadAttention):
        return _attention_flops(layer, node)
    # Embedding is a gather (one read per output element, no arithmetic);
    # anything else counts as elementwise work on its outputs.
    return float(out_elements)


def _sync(outputs) -> None:
    """Waits for an (async) device result by fetching one element of it."""
    import keras

    tensor = keras.tree.flatten(outputs)[0]
    index = (0,) * len(tensor.shape)
    keras.ops.convert_to_numpy(tensor[index] if index else tensor)


def _sample_inputs(chain, batch_size: int) -> list:
    """A batch for the chain's inputs: floats uniform in [0, 1), integers 0,
    booleans True (valid token ids, positions and masks)."""
    import numpy as np

    checks.positive_int("batch_size", batch_size)
    rng = np.random.default_rng(0)
    batch = []
    for tensor in chain.inputs:
        shape = (int(batch_size), *(int(d) for d in tensor.shape[1:]))
        dtype = np.dtype(tensor.dtype)
        if dtype.kind == "f":
            batch.append(rng.random(shape).astype(dtype))
        else:
            batch.append(np.ones(shape, dtype) if dtype.kind == "b" else np.zeros(shape, dtype))
    return batch


def _block_times(chain, batch_size: int) -> list[float]:
    inputs = _sample_inputs(chain, batch_size)
    times, carry = [], None
    for b, block in enumerate(chain.blocks):
        model = chain.stage_model(b, b + 1, name=f"timed_block{b}")
        args = ([carry] if block.entry is not None else []) + [
            inputs[k] for k in chain.stage_side_keys(b, b + 1)]
        for _ in range(_TIME_WARMUP):
            carry = model(args)
            _sync(carry)
        samples = []
        for _ in range(_TIME_REPEATS):
            start = time.perf_counter()
            carry = model(args)
            _sync(carry)
            samples.append(time.perf_counter() - start)
        times.append(float(statistics.median(samples)))
    return times


def _layer_params(layers) -> int:
    return sum(int(layer.count_params()) for layer in layers if hasattr(layer, "count_params"))


def layer_costs(layers, method: str, input_shape=None, batch_size: int = 32) -> list[float]:
    """One cost per layer of a stack, or per block of a functional model
    (`tfmulti.parallel.chain`: the runs of layers between single-tensor cuts).

    Methods:
        "params": the parameter count of the layer (`layer.count_params()`),
            or of the block's layers.
        "flops": estimated forward FLOPs per example, summed over the
            block's layer calls. Dense: 2*in*out per output position, + out
            for the bias; Conv1D/2D/3D: 2*kh*kw*(cin/groups)*cout per output
            position, + cout for the bias; MultiHeadAttention: its four
            projections and the two attention products, for self-attention
            of width d over T positions 2*(4*T*d^2 + 2*T^2*d) (biases and
            the softmax not counted); Embedding: a gather, its number of
            output elements; any other layer: its number of output elements
            (an elementwise cost). Shapes come from the model's graph (a
            stack's from `input_shape`).
        "time": the measured eager forward time in seconds of each layer or
            block on a batch of `batch_size` examples (each gets the
            previous one's output; model inputs: floats uniform in [0, 1),
            integers 0, booleans True): one warm-up call, then the median of
            5 calls timed with `time.perf_counter`. Noisy: it depends on the
            machine, its load, the device and the batch size; use it on the
            target hardware and prefer "flops" for reproducible plans.

    Args:
        layers: A keras.Sequential, a functional model or a list of layers
            (built, or buildable from `input_shape`), or its chain of blocks.
        method: One of "params", "flops", "time".
        input_shape: A stack's per-example input shape, without the batch
            dimension. Defaults to None: the model's own input shape when it
            has one; required for "flops" and "time" otherwise.
        batch_size: Batch size for "time"; defaults to 32.

    Returns:
        A list of non-negative floats, one per layer (block).

    Raises:
        ValueError: For an unknown method, a model that cannot be cut (see
            `tfmulti.parallel.chain.chain_of`), unbuilt layers without
            `input_shape`, or shapes that are not fully known for
            "flops"/"time".
    """
    if method not in COST_METHODS:
        raise ValueError(
            f"unknown cost method {method!r}; valid methods: {', '.join(COST_METHODS)} "
            "(or pass explicit stage sizes to plan_partition).")
    return _costs(_chain(layers, input_shape), method, batch_size)


def _costs(chain, method: str, batch_size: int) -> list[float]:
    if method == "params":
        return [float(_layer_params(block.layers)) for block in chain.blocks]
    _check_shapes(chain, method)
    if method == "flops":
        return [math.fsum(_node_flops(node) for node in block.nodes) for block in chain.blocks]
    return _block_times(chain, batch_size)


# ---------------------------------------------------------------------------
# Plans.
# ---------------------------------------------------------------------------


@dataclasses.dataclass(frozen=True)
class StagePlan:
    """One pipeline stage: a contiguous run of layers.

    Attributes:
        layer_names: Names of the stage's layers, in stack order.
        num_params: Parameter count of the stage (trainable and not).
        param_bytes: Memory of the stage's variables: elements * dtype size.
        cost: The stage's cost under the plan's method.
    """

    layer_names: tuple[str, ...]
    num_params: int
    param_bytes: int
    cost: float

    @property
    def num_layers(self) -> int:
        return len(self.layer_names)


@dataclasses.dataclass(frozen=True, repr=False)
class PartitionPlan:
    """A split of a layer stack into pipeline stages.

    Attributes:
        stages: One `StagePlan` per stage, in order.
        method: The cost method ("params", "flops", "time"), or "explicit"
            when the sizes were given (stage costs are then parameter counts).
        sizes: Layers per stage.
    """

    stages: tuple[StagePlan, ...]
    method: str
    sizes: tuple[int, ...]

    @property
    def num_stages(self) -> int:
        return len(self.stages)

    @property
    def costs(self) -> tuple[float, ...]:
        """Each stage's cost."""
        return tuple(stage.cost for stage in self.stages)

    @property
    def slices(self) -> tuple[slice, ...]:
        """Each stage's slice into the layer stack."""
        out, start = [], 0
        for size in self.sizes:
            out.append(slice(start, start + size))
            start += size
        return tuple(out)

    @property
    def balance(self) -> float:
        """max / mean of the stage costs; 1.0 is perfect balance."""
        return balance_ratio(self.costs)

    def table(self) -> str:
        """An aligned text table of the stages, ending with the balance ratio."""
        unit = {"params": "params", "flops": "FLOPs", "time": "s", EXPLICIT: "params"}.get(
            self.method, self.method)
        total = math.fsum(self.costs)
        header = ("stage", "layers", "count", "params", "bytes", f"cost ({unit})", "share")
        rows = []
        for i, stage in enumerate(self.stages):
            names = stage.layer_names
            span = names[0] if len(names) == 1 else f"{names[0]}..{names[-1]}"
            share = f"{100 * stage.cost / total:.1f}%" if total > 0 else "-"
            rows.append((str(i), span, str(len(names)), f"{stage.num_params:,}",
                         human_bytes(stage.param_bytes), _format_cost(stage.cost), share))
        return (format_table(header, rows, left=(0, 1))
                + f"\nbalance (max/mean stage cost, 1.00 is perfect): {self.balance:.2f}")

    def __repr__(self) -> str:
        return (f"PartitionPlan(method={self.method!r}, sizes={self.sizes}, "
                f"balance={self.balance:.2f})")


def _format_cost(cost: float) -> str:
    if cost == int(cost) and abs(cost) < 1e15:
        return f"{int(cost):,}"
    return f"{cost:.4g}"


def plan_partition(layers, num_stages: int, method="params", input_shape=None,
                   batch_size: int = 32) -> PartitionPlan:
    """Plans contiguous pipeline stages for a stack of layers or a chain of blocks.

    Args:
        layers (keras.Model | Sequence[keras.layers.Layer] | Chain): A keras.Sequential (its
            `model.layers`), a list of layers, a functional model (cut into blocks where a single
            tensor crosses; see `tfmulti.parallel.chain`), or the chain of blocks of one of them
            (`tfmulti.parallel.chain.chain_of`), used as it is: a caller that holds the chain hands
            it over instead of having it derived again.
        num_stages: The number of stages, 1 <= num_stages <= number of layers
            (blocks).
        method (str | Sequence[int]): "params" (the default), "flops" or "time" (see `layer_costs`),
            balanced exactly by `partition_costs`; or a sequence of stage sizes
            in layers (blocks), checked by `validate_sizes` (stage costs are
            then parameter counts).
        input_shape (tuple[int, ...] | None): A stack's per-example input shape, without the batch
            dimension. Defaults to None: the model's own input shape when it
            has one. Needed to build unbuilt layers (called in order on a
            `keras.Input` of that shape) and for "flops"/"time".
        batch_size: Batch size for "time"; defaults to 32.

    Returns:
        A `PartitionPlan`.

    Raises:
        ValueError: If the model cannot be cut into `num_stages` stages (a
            branch crossing every cut, an output computed before the cuts, a
            subclassed model, a layer used twice in a stack), layers are unbuilt and
            `input_shape` is missing, `method` is unknown, explicit sizes are
            invalid, or `num_stages` is invalid for the model.
    """
    num_stages = check_stage_count(num_stages)
    if isinstance(method, str):
        if method not in COST_METHODS:
            raise ValueError(
                f"unknown method {method!r}; valid methods: {', '.join(COST_METHODS)}, "
                "or a list of stage sizes.")
        chain = _chain(layers, input_shape)
        check_stage_count(num_stages, chain=chain)
        costs = _costs(chain, method, batch_size)
        sizes = partition_costs(costs, num_stages)
        name = method
    elif isinstance(method, Sequence):
        chain = _chain(layers, input_shape)
        sizes = validate_sizes(method, len(chain.blocks), num_stages, unit=chain.unit)
        costs = _costs(chain, "params", batch_size)
        name = EXPLICIT
    else:
        raise ValueError(
            f"method must be one of {', '.join(COST_METHODS)} or a list of stage sizes; "
            f"received {method!r}.")

    stages, start = [], 0
    for size in sizes:
        group = [layer for block in chain.blocks[start:start + size] for layer in block.layers]
        stages.append(StagePlan(
            layer_names=tuple(layer.name for layer in group),
            num_params=_layer_params(group),
            param_bytes=variables_bytes(v for layer in group
                                        for v in getattr(layer, "weights", ())),
            cost=math.fsum(costs[start:start + size]),
        ))
        start += size
    return PartitionPlan(stages=tuple(stages), method=name, sizes=tuple(sizes))

