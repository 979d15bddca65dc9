"""A model as a chain of blocks: where a pipeline can cut it.

A `keras.Sequential` or a list of layers is a chain of one-layer blocks. A
functional model is cut where exactly one tensor crosses: its layers, in the
order Keras runs them (a depth-first walk from each output, arguments in
order), are split at every point where a single tensor made before the point
is used after it. Residual connections inside a transformer block keep the
block whole; the residual stream between blocks is where it is cut.

A model may have several outputs (a dict or list: a shared trunk and its
heads). They all leave the model from the last block: no cut follows the
first output computed (a stage hands on one tensor, not an output as well),
so a head on an early layer ends the cuts there (`Chain.why_not` names it).

Side inputs are not counted as crossing: the model's inputs (an attention
mask, positions) and what is computed from them alone by layers without
state (a cast, a reshape of the mask) reach every block that uses them; a
stage receives the model inputs its blocks need and recomputes those
stateless side computations itself. A layer with weights used at two places
(a shared layer, tied embeddings) keeps everything between its uses in one
block, since its weights live on one stage.

A stage is a run of whole blocks, built as a functional sub-model of the
given layer objects (`Chain.stage_model`, a `StageModel`), whose inputs are
the tensor that enters its first block (none for the first stage) and its
side inputs. A mask a layer takes (an `LSTM`'s, from an
`Embedding(mask_zero=True)`) is part of Keras' graph, computed from the
token ids: a side computation, made again by the stage that needs it.

Example:
    >>> import keras
    >>> from tfmulti.parallel import chain as blocks
    >>> x = keras.Input((8,), name="x")
    >>> h = keras.layers.Dense(8, name="first")(x)
    >>> r = keras.layers.Add(name="residual")([h, keras.layers.Dense(8, name="inner")(h)])
    >>> chain = blocks.chain_of(keras.Model(x, keras.layers.Dense(2, name="head")(r)))
    >>> [block.name for block in chain.blocks]
    ['first', 'inner..residual', 'head']
"""

from __future__ import annotations

import dataclasses
import math

import keras
from keras.src.models.functional import Functional

__all__ = ["Block", "Chain", "StageModel", "chain_of", "inlined", "node_of",
           "per_example_elements", "run_graph", "stack_graph", "stack_of"]


@dataclasses.dataclass(frozen=True, eq=False)
class Block:
    """A run of layers that one tensor enters and one tensor leaves.

    Attributes:
        nodes: the calls (Keras graph nodes) of its layers with state, or
            that depend on the block's entry, in the order Keras runs them;
            empty for a stack whose shapes are not known yet.
        layers: the distinct layers (and operations) of those calls.
        free_nodes: stateless calls on side inputs alone that `nodes` use
            (recomputed by every stage that needs them).
        entry: the tensor entering the block (None for the first block).
        exit: the tensor leaving it; for the last block, the model's output
            (its structure, a list or dict, for several outputs).
        side_keys: indices into the model's flat inputs that the block uses
            besides `entry`.
    """

    nodes: tuple
    layers: tuple
    free_nodes: tuple = ()
    entry: object = None
    exit: object = None
    side_keys: tuple[int, ...] = ()

    @property
    def name(self) -> str:
        names = [op.name for op in self.layers]
        return names[0] if len(names) == 1 else f"{names[0]}..{names[-1]}"


@dataclasses.dataclass(frozen=True, eq=False)
class Chain:
    """A model cut into blocks (see the module docstring).

    Attributes:
        name: the model's name.
        blocks: the blocks, input to output.
        inputs: the model's flat symbolic inputs (None for a stack whose
            input shape is not known yet).
        input_struct: the structure of the model's inputs (a tensor, list or
            dict of them), as Keras flattens it into `inputs`.
        stack: the layers, when the chain was given as a stack of layers.
        why_not: for each place between consecutive layers that is not a
            cut, the reason, for error messages.
        graph: the functional model whose graph the blocks' nodes belong to
            (the model given, or its nested models' layers called in line:
            `inlined`); None for a stack whose input shape is not known yet.
    """

    name: str
    blocks: tuple[Block, ...]
    inputs: tuple | None = None
    input_struct: object = None
    stack: tuple | None = None
    why_not: str | None = None
    graph: object = None

    @property
    def layers(self) -> list:
        """Every layer (not the operations such as `keras.ops.cast`), once,
        in the order Keras runs them (a stack: its layers)."""
        if self.stack is not None:
            return list(self.stack)
        seen, out = set(), []
        for block in self.blocks:
            for node in (*block.free_nodes, *block.nodes):
                op = node.operation
                if isinstance(op, keras.layers.Layer) and id(op) not in seen:
                    seen.add(id(op))
                    out.append(op)
        return out

    def stage_nodes(self, start: int, stop: int) -> list:
        """The graph nodes a stage of blocks[start:stop] runs, each once."""
        seen, out = set(), []
        for block in self.blocks[start:stop]:
            for node in (*block.free_nodes, *block.nodes):
                if id(node) not in seen:
                    seen.add(id(node))
                    out.append(node)
        return out

    def stage_side_keys(self, start: int, stop: int) -> tuple[int, ...]:
        return tuple(sorted({k for b in self.blocks[start:stop] for k in b.side_keys}))

    def stage_model(self, start: int, stop: int, name: str) -> keras.Model:
        """A `StageModel` running blocks[start:stop] with the given layer
        objects. Its inputs, a list: the tensor entering blocks[start] (none
        when start is 0), then the model inputs at
        `stage_side_keys(start, stop)`; its output: the last block's exit
        (the model's outputs, as the model returns them, for the last)."""
        if self.inputs is None:
            raise RuntimeError("the chain's input shape is not known yet; build it first.")
        first = self.blocks[start]
        inputs = ([first.entry] if first.entry is not None else []) + [
            self.inputs[k] for k in self.stage_side_keys(start, stop)]
        # Given an intermediate tensor, Keras makes the sub-model from copies of
        # the graph's nodes (`clone_graph_nodes`), and given a model input too,
        # it keeps that input's tensor but points its history at its copied
        # node: the model it came from then no longer writes its config
        # ("Internal error: could not find node key"), so it would not save
        # whole. Its inputs' histories are put back.
        histories = [(t, t._keras_history) for t in self.inputs]  # pylint: disable=protected-access
        try:
            return StageModel(inputs, self.blocks[stop - 1].exit, name=name)
        finally:
            for tensor, history in histories:
                tensor._keras_history = history  # pylint: disable=protected-access

    @property
    def unit(self) -> str:
        """What a block is, for messages: "layers" for a stack, else "blocks"."""
        return "layers" if self.stack is not None else "blocks"


class StageModel(Functional):
    """A functional sub-model of given layer objects (a pipeline stage, a
    timed block) that returns the Keras masks its layers compute: the mask
    its output carries (an `Embedding(mask_zero=True)`'s, which `Dense`
    layers pass on to a sequence output) stays on it for the next stage and
    the loss. Given a masked tensor, a plain functional model warns at every
    call that it drops the mask (Keras' warning for a layer without
    `compute_mask`), although its layers receive it."""

    def compute_mask(self, inputs, previous_mask=None):
        # The outputs keep the masks their own layers set; none is made up
        # from the inputs' masks (a pooled output has no time steps to mask).
        return None


# ---------------------------------------------------------------------------
# Building chains.
# ---------------------------------------------------------------------------


def _single_output(layer, out):
    if isinstance(out, dict) or (isinstance(out, (list, tuple))):
        raise ValueError(
            f"layer {layer.name!r} has several outputs; a pipeline stack needs one tensor "
            "between consecutive layers (a functional model can route them inside a block).")
    return out


def stack_graph(layers, input_shape: tuple, dtype="float32", name: str = "stack"):
    """A functional model over the given layer objects (each feeds the
    next), from a per-example input shape; builds unbuilt layers."""
    inputs = keras.Input(tuple(input_shape), dtype=dtype)
    x = inputs
    for layer in layers:
        x = _single_output(layer, layer(x))
    return keras.Model(inputs, x, name=name)


def chain_of(model, input_shape=None) -> Chain:
    """The chain of blocks of a model.

    Args:
        model: a functional `keras.Model`, a `keras.Sequential` or a list of
            layers (a stack: each layer is a block).
        input_shape: a stack's per-example input shape, when its layers do
            not tell (unbuilt, or built without `keras.Input`); with it, the
            stack becomes a functional graph over the same layer objects
            (unbuilt ones get built). Ignored for functional models.

    Returns:
        A `Chain`.

    Raises:
        ValueError: not a model or list of layers, a subclassed model, a
            layer used twice in a stack, a model output that is one of its
            inputs, or a model whose outputs are computed from its inputs by
            stateless operations only.
    """
    if isinstance(model, keras.Model) and not isinstance(model, keras.Sequential):
        if not hasattr(model, "_inputs_struct") or not getattr(model, "outputs", None):
            raise ValueError(
                f"model {model.name!r} ({type(model).__name__}) is a subclassed model, whose "
                "graph Keras does not record; pass a functional model, a keras.Sequential or "
                "a list of layers.")
        return _graph_chain(inlined(model))
    layers, name, shape, dtype = stack_of(model)
    if input_shape is not None:
        shape = tuple(input_shape)
    if shape is None:
        return Chain(name=name, stack=tuple(layers),
                     blocks=tuple(Block(nodes=(), layers=(layer,)) for layer in layers))
    # Every layer of a stack is a block of its own (also a stateless first
    # layer, which a functional model would recompute as a side computation).
    chain = _graph_chain(stack_graph(layers, shape, dtype, name=name), side_computations=False)
    return dataclasses.replace(chain, stack=tuple(layers))


def _is_plain_graph(op) -> bool:
    """Whether `op` is a functional model whose behaviour is its graph (its
    class keeps `Functional`'s `call`): a nested backbone, an encoder."""
    return isinstance(op, Functional) and not isinstance(op, keras.Sequential) and (
        type(op).call is Functional.call)


def inlined(model):
    """`model` itself, or, where its graph calls nested functional models
    (keras-hub's backbone inside its task model, an encoder model called as a
    layer), a functional model of the same inputs and outputs whose graph calls
    their layers directly (the same layer objects, so the same weights), so
    that a pipeline can cut between them.

    Example:
        >>> import keras
        >>> x = keras.Input((4,), name="x")
        >>> inner = keras.Model(x, keras.layers.Dense(3, name="b")(keras.layers.Dense(3, name="a")(x)))
        >>> y = keras.Input((4,), name="y")
        >>> outer = keras.Model(y, keras.layers.Dense(2, name="head")(inner(y)))
        >>> [layer.name for layer in chain_of(outer).layers]
        ['a', 'b', 'head']
    """
    nodes = [node for nodes in model._nodes_by_depth.values() for node in nodes]  # pylint: disable=protected-access
    if not any(_is_plain_graph(node.operation) for node in nodes):
        return model
    from keras import tree

    outputs = _run_inlined(model, tree.flatten(model._inputs_struct))  # pylint: disable=protected-access
    return keras.Model(model._inputs_struct, tree.pack_sequence_as(  # pylint: disable=protected-access
        model._outputs_struct, outputs), name=model.name)  # pylint: disable=protected-access


def _run_inlined(model, inputs: list) -> list:
    """`model`'s flat outputs, its graph called on the symbolic `inputs`
    (`run_graph`), a nested functional model's graph in turn (the layers
    called anew, making nodes of the new graph)."""
    from keras import tree

    def call(node, args, kwargs):
        op = node.operation
        # Called with its inputs alone (Keras records `mask=None`): its graph in line.
        if _is_plain_graph(op) and len(args) == 1 and all(
                v is None for v in tree.flatten(kwargs)) and _same_structure(
                args[0], op._inputs_struct):  # pylint: disable=protected-access
            return _run_inlined(op, tree.flatten(args[0]))
        return tree.flatten(op(*args, **kwargs))

    values = run_graph(model, inputs, call)
    return [values[id(x)] for x in tree.flatten(model._outputs_struct)]  # pylint: disable=protected-access


def run_graph(model, inputs: list, call) -> dict:
    """Runs the functional `model`'s graph on its flat `inputs` node by node,
    in the order Keras runs it (`Function._run_through_graph`): `call(node,
    args, kwargs)` gives a node's flat outputs from its arguments. Returns the
    id of each tensor of the graph reached -> its value."""
    from keras import tree

    values = {id(x): y for x, y in zip(tree.flatten(model._inputs_struct), inputs)}  # pylint: disable=protected-access
    for depth in sorted(model._nodes_by_depth, reverse=True):  # pylint: disable=protected-access
        for node in model._nodes_by_depth[depth]:  # pylint: disable=protected-access
            if not node.operation or node.is_input:
                continue
            if any(id(x) not in values for x in node.input_tensors):
                continue
            args, kwargs = node.arguments.fill_in(values)
            for x, y in zip(node.outputs, call(node, args, kwargs)):
                values[id(x)] = y
    return values


def _same_structure(a, b) -> bool:
    from keras import tree

    try:
        tree.assert_same_structure(a, b)
    except (ValueError, TypeError):
        return False
    return True


def stack_of(model):
    """(layers, name, per-example input shape or None, input dtype) of a
    stack: a `keras.Sequential` or a list of layers.

    Raises:
        ValueError: a single layer, something else than a stack, an empty
            stack, or a layer that appears twice.
    """
    if isinstance(model, keras.Sequential):
        layers, name = list(model.layers), model.name
        try:
            shape, dtype = tuple(model.inputs[0].shape[1:]), model.inputs[0].dtype
        except (AttributeError, ValueError, TypeError, IndexError):
            shape, dtype = None, "float32"
    elif isinstance(model, keras.layers.Layer):
        raise ValueError(
            f"got a single layer {model.name!r}; pass a keras.Sequential, a functional "
            "model or a list of layers.")
    elif isinstance(model, (list, tuple)):
        layers, name, shape, dtype = list(model), "stack", None, "float32"
        for i, layer in enumerate(layers):
            if not isinstance(layer, keras.layers.Layer):
                raise ValueError(
                    f"layers[{i}] is a {type(layer).__name__}, not a keras layer; "
                    "pass a keras.Sequential, a functional model or a list of keras layers.")
        if layers and layers[0].built:  # called before, e.g. inside a model
            try:
                shape, dtype = tuple(layers[0].input.shape[1:]), layers[0].input.dtype
            except (AttributeError, ValueError, TypeError):
                pass
    else:
        raise ValueError(
            "expected a keras.Sequential, a functional model or a list of layers; "
            f"received {type(model).__name__}.")
    if not layers:
        raise ValueError("the layer stack is empty; pass at least one layer.")
    seen = set()
    for layer in layers:
        if id(layer) in seen:
            raise ValueError(
                f"layer {layer.name!r} appears more than once in the stack; a layer's weights "
                "live on one stage, so a shared layer cannot be pipelined: use separate layers.")
        seen.add(id(layer))
    return layers, name, shape, dtype


def node_of(tensor):
    """The Keras graph node that made a symbolic tensor, or None for a
    model input (or a tensor made outside a Keras graph)."""
    history = getattr(tensor, "_keras_history", None)
    if history is None or history.operation is None:
        return None
    return history.operation._inbound_nodes[history.node_index]


def _nodes_in_order(input_ids: set, outputs) -> list:
    """The graph's nodes from the inputs to `outputs` in the order Keras runs
    them: a depth-first walk from each output in turn, arguments in order."""
    order, state = [], {}
    for output in outputs:
        start = node_of(output)
        if start is None or state.get(id(start)) is not None:
            continue
        stack = [(start, iter(start.input_tensors))]
        state[id(start)] = 1
        while stack:
            node, pending = stack[-1]
            for tensor in pending:
                if id(tensor) in input_ids:
                    continue
                parent = node_of(tensor)
                if parent is None or parent.is_input:
                    raise ValueError(
                        f"tensor {tensor.name!r} used by {node.operation.name!r} is not "
                        "computed from the model's inputs.")
                if state.get(id(parent)) is None:
                    state[id(parent)] = 1
                    stack.append((parent, iter(parent.input_tensors)))
                    break
            else:
                stack.pop()
                state[id(node)] = 2
                order.append(node)
    return order


def _has_state(op) -> bool:
    return bool(getattr(op, "variables", None))


def _output_labels(model, outputs) -> list[str]:
    """How messages name each output: its layer, and its key in a dict of outputs."""
    names = list(getattr(model, "output_names", None) or [t.name for t in outputs])
    struct = getattr(model, "_outputs_struct", None)
    keys = list(struct) if isinstance(struct, dict) else [None] * len(outputs)
    return [f"output {key!r} (layer {name!r})" if key not in (None, name)
            else f"output {name!r}" for key, name in zip(keys, names)]


def _graph_chain(model, side_computations: bool = True) -> Chain:
    inputs = tuple(model.inputs)
    outputs = list(model.outputs)
    labels = _output_labels(model, outputs)
    input_index = {id(t): i for i, t in enumerate(inputs)}
    for output, label in zip(outputs, labels):
        if id(output) in input_index or node_of(output) is None:
            what = "output" if len(outputs) == 1 else label
            raise ValueError(
                f"model {model.name!r} has no layers between its inputs and {what}.")
    # Outputs that need fewer layers first: a head on an early layer then
    # comes right after it, where the message below names it.
    needs = [len(_nodes_in_order(set(input_index), [t])) for t in outputs]
    order = _nodes_in_order(set(input_index), [outputs[i] for i in sorted(
        range(len(outputs)), key=needs.__getitem__)])

    # Free nodes: stateless computations on side inputs alone.
    free_tensors: set = set()
    free, placed = [], []
    for node in order:
        if side_computations and not _has_state(node.operation) and all(
                id(t) in input_index or id(t) in free_tensors for t in node.input_tensors):
            free.append(node)
            free_tensors.update(id(t) for t in node.outputs)
        else:
            placed.append(node)
    if not placed:
        raise ValueError(
            f"model {model.name!r}: its output is computed from its inputs by stateless "
            "operations only; there is nothing to pipeline.")

    # Live ranges of the tensors placed nodes make: index made -> last use.
    made = {}
    for i, node in enumerate(placed):
        for t in node.outputs:
            made[id(t)] = (i, t, node)
    last_use: dict = {}
    for j, node in enumerate(placed):
        for t in node.input_tensors:
            if id(t) in made:
                last_use[id(t)] = max(last_use.get(id(t), -1), j)
    n = len(placed)
    crossing = [0] * (n + 1)  # crossing[k]: tensors made before placed[k], used at or after
    longest = None
    for key, j in last_use.items():
        i, tensor, node = made[key]
        if j > i:
            crossing[i + 1] += 1
            crossing[j + 1] -= 1
            if longest is None or j - i > longest[0]:
                longest = (j - i, node.operation.name, placed[j].operation.name)
    for k in range(1, n + 1):
        crossing[k] += crossing[k - 1]
    valid = [crossing[k] == 1 for k in range(n + 1)]
    # A layer with state used by several nodes: no cut between its uses.
    uses: dict = {}
    shared = None
    for i, node in enumerate(placed):
        op = node.operation
        if _has_state(op):
            if id(op) in uses and uses[id(op)][0] < i:
                first = uses[id(op)][0]
                for k in range(first + 1, i + 1):
                    valid[k] = False
                if shared is None or i - first > shared[0]:
                    shared = (i - first, op.name)
                uses[id(op)] = (first, op)
            else:
                uses[id(op)] = (i, op)

    # Every output leaves the model from the last stage (a stage hands on one
    # tensor): no cut after the first output a placed node makes.
    index = {id(node): i for i, node in enumerate(placed)}
    made_at = [(index[id(node_of(t))], label) for t, label in zip(outputs, labels)
               if id(node_of(t)) in index]
    first_output, early = min(made_at)
    heads = {id(node_of(t)) for t in outputs}
    carried = [(made[id(t)][0], last_use[id(t)]) for t in outputs if id(t) in last_use]
    # The cuts an early output takes away: not those between heads on the
    # same trunk, which would leave a stage of heads only.
    lost = [k for k in range(first_output + 1, n) if valid[k] and (
        any(id(node) not in heads for node in placed[k:])
        or any(i < k <= j for i, j in carried))]
    cuts = [k for k in range(1, min(first_output, n - 1) + 1) if valid[k]]
    bounds = [0, *cuts, n]
    free_of = {id(t): node for node in free for t in node.outputs}
    blocks = []
    for a, b in zip(bounds, bounds[1:]):
        nodes = placed[a:b]
        entry = None if a == 0 else _used_output(placed[a - 1], last_use)
        if b < n:
            exit_ = _used_output(placed[b - 1], last_use)
        else:  # the model's outputs, as the model returns them
            exit_ = outputs[0] if len(outputs) == 1 else model._outputs_struct
        # The last block also computes outputs made from side inputs alone.
        needed, sides = _side_parts(nodes, input_index, free_of, free,
                                    extra=outputs if b == n else ())
        layers, seen = [], set()
        for node in nodes:
            if id(node.operation) not in seen:
                seen.add(id(node.operation))
                layers.append(node.operation)
        blocks.append(Block(nodes=tuple(nodes), layers=tuple(layers), free_nodes=needed,
                            entry=entry, exit=exit_, side_keys=sides))
    why_not = None
    if lost:
        why_not = (f"{early[0].upper()}{early[1:]} is computed before layer "
                   f"{placed[first_output + 1].operation.name!r}, and every output leaves "
                   "the model from the last stage, so no stage can start after it.")
    elif shared is not None:
        why_not = (f"Layer {shared[1]!r} is used at two places (shared or tied weights), "
                   "which stay in one block; untie them or use separate layers.")
    elif longest is not None and n > 1 and len(blocks) < n:
        why_not = (f"The output of layer {longest[1]!r} is used by layer {longest[2]!r}, "
                   "crossing every point between them; move that branch inside one layer "
                   "(a custom layer or a nested model).")
    return Chain(name=model.name, blocks=tuple(blocks), inputs=inputs,
                 input_struct=model._inputs_struct, why_not=why_not, graph=model)


def _used_output(node, last_use):
    """The output of `node` used later (a cut's single crossing tensor)."""
    for t in node.outputs:
        if id(t) in last_use:
            return t
    raise AssertionError("a cut's crossing tensor is missing")  # a valid cut has one


def _side_parts(nodes, input_index, free_of, free, extra=()):
    """(free nodes the block's nodes need, in order; model input indices
    used), for the block's nodes and the `extra` tensors it returns."""
    needed, seen, sides = [], set(), set()
    pending = [t for node in nodes for t in node.input_tensors] + list(extra)
    while pending:
        t = pending.pop()
        if id(t) in input_index:
            sides.add(input_index[id(t)])
        elif id(t) in free_of:
            node = free_of[id(t)]
            if id(node) not in seen:
                seen.add(id(node))
                needed.append(node)
                pending.extend(node.input_tensors)
    order = {id(node): i for i, node in enumerate(free)}
    needed.sort(key=lambda node: order[id(node)])
    return tuple(needed), tuple(sorted(sides))


def per_example_elements(tensor) -> int:
    """Elements of one example of a symbolic tensor (its shape without the batch axis).

    Raises:
        ValueError: a dimension other than the batch is unknown.
    """
    shape = tuple(tensor.shape[1:])
    if any(d is None for d in shape):
        raise ValueError(
            f"tensor {tensor.name!r} has shape {tuple(tensor.shape)}; this needs fully known "
            "shapes: give the model's inputs concrete sizes (e.g. a sequence length).")
    return math.prod(int(d) for d in shape)
