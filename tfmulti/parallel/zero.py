"""Sharded data parallelism: the optimizer's state split over the replicas (ZeRO).

Data parallelism keeps a whole copy of the model's training state on every
replica: the parameters, the gradients and the optimizer's slots (Adam's two
moments: 8 bytes per float32 parameter). ZeRO (Rajbhandari et al., 2019;
DeepSpeed's stages, PyTorch's ZeroRedundancyOptimizer) splits that state over
the N data-parallel replicas instead:

- stage 1: each replica holds the optimizer's slots of 1/N of every variable
  (its *shard*: a contiguous 1/N of the variable's elements) and updates that
  share of the parameters; the updated shards are then all-gathered, so every
  replica again holds the whole, updated parameters;
- stage 2: also the gradients: each replica receives only its shard's sum
  over the replicas (a reduce-scatter), never the whole reduced gradient;
- stage 3: also the parameters: each replica holds only its shard of every
  parameter. A read of the parameter inside the replica's step gathers it
  whole from the replicas' shards (an all-gather whose gradient is the
  reduce-scatter of stage 2), so the backward gives each replica its shard's
  gradient, summed over the replicas, and the update needs no gather; a read
  outside the step (saving, `get_weights`, a checkpoint) gathers it whole, and
  an assignment of a whole value gives each replica its shard. Each layer of
  a model (Functional, Sequential or subclassed) gathers its own parameters
  just before its call, and its backward gathers them again and runs its
  call again (reading what the first run read, assigning nothing), as FSDP
  gathers a unit twice: a step holds one layer's wholes at a time, not the
  model's. A layer called inside a `tf.cond` or a `tf.while_loop` gathers
  before the condition or loop (the replicas exchange their shards where
  each runs the exchange once) and keeps its wholes until its gradient.

Embedding tables can be sharded by rows at any stage (`shard_embeddings`;
recommendation models): replica k holds whole rows [k * ceil(R / N),
(k + 1) * ceil(R / N)) of a table of R rows and the slots of those rows, and a
lookup goes to the rows' owners and back (`_routed_lookup`: the replicas'
ids all-gathered, each replica's own rows looked up, the looked-up rows
all-reduced), so no step holds a table whole; the backward gives each owner
its rows' gradient summed over the replicas. At stage 0 the other variables
stay whole, updated as Keras updates them.

`shard_optimizer` does this to a Keras optimizer under TensorFlow's own
`MirroredStrategy` or `MultiWorkerMirroredStrategy`, through the strategy's
collectives (`ReplicaContext.all_reduce`, `all_gather`; no transport of its
own). The optimizer stays the user's, with Keras' update rule: each replica
runs a copy of it (`from_config`) over its shards only, built on the
replica's device, so that copy's slots are 1/N of the whole. Every rule Keras
applies per element (Adam, AdamW, SGD with momentum, RMSprop, Adagrad, Lion,
...) updates a shard exactly as it updates the shard's elements of the whole
variable; what the rule does across elements (clipping by a norm, weight
decay, loss scaling) happens where Keras does it, before the update, on the
whole gradients (at stage 3, loss scaling's check for an overflow reads each
replica's shards, and the replicas' answers are summed: `keras_fixes`).
"""

from __future__ import annotations

import contextlib
import dataclasses
import itertools
import math
import os
import shutil
import tempfile
import threading
import weakref

import keras
import numpy as np
import tensorflow as tf
from keras.src.backend.common import global_state
from keras.src.backend.common.stateless_scope import (
    StatelessScope,
    get_stateless_scope,
    in_stateless_scope,
)
from keras.src.backend.common.symbolic_scope import in_symbolic_scope
from tensorflow.python.distribute import values as values_lib
from tensorflow.python.ops import control_flow_v2_func_graphs as control_flow_graphs
from tensorflow.python.trackable import base as trackable

from tfmulti.config.train_config import ZERO_STAGES
from tfmulti.models import optimizers
from tfmulti.utils.sizes import dtype_bytes

__all__ = ["STAGES", "GatheredOnce", "ShardedParameter", "WholeSlot", "ZeroSharding",
           "shard_optimizer", "sharding_of", "updating", "whole_slots"]

STAGES = ZERO_STAGES
"""The stages `shard_optimizer` takes (0: replication, Keras' own)."""

_ATTRIBUTE = "_tfmulti_zero"


class _Shard:
    """Stands for a replica's shard of one parameter in its copy of the
    optimizer. Keras' rules per element read a variable's dtype only and
    change it by `assign_add`, `assign_sub` or `assign`, which the copy
    applies to `value` (the shard's elements of the parameter, taken at each
    step) instead of to a variable: the replica holds no copy of its
    parameters' shards, only the slots. The copy keys its slots by
    `_unique_id`, as it keys variables."""

    _ids = itertools.count(1)

    def __init__(self, shape: tuple[int, ...], dtype, name: str):
        self.shape, self.dtype, self.name, self.path = shape, dtype, name, name
        self._unique_id = f"tfmulti_zero_{next(self._ids)}"
        self.value = None  # the step's shard, updated by the rule


@dataclasses.dataclass
class ZeroSharding:
    """How an optimizer's state is sharded.

    Attributes:
        stage: 1 (slots), 2 (slots and gradients) or 3 (also the parameters).
        num_shards: N, the replicas in sync.
        devices: each local replica's device, by its index among this
            process's replicas.
        first_replica: the global index of this process's first replica.
        variables: the model's trainable variables, in the optimizer's order.
        shards: each local replica's shards (global index -> a `_Shard` of
            ceil(size / N) elements per model variable).
        optimizers: each local replica's copy of the optimizer, built on its
            shards (global index -> optimizer).
    """

    stage: int
    num_shards: int
    devices: tuple[str, ...]
    first_replica: int
    variables: list
    shards: dict[int, list]
    optimizers: dict[int, keras.optimizers.Optimizer]
    strategy: tf.distribute.Strategy
    slots: list[tuple[int, int, str]] = dataclasses.field(default_factory=list)
    """Each slot of the copies: (its index in a copy's `variables`, the index
    of the model variable it is the slot of, its name: "momentum", ...), in
    the copies' order, which is the order an unsharded optimizer of the same
    class lists them in."""
    rows: dict[int, int] = dataclasses.field(default_factory=dict)
    """The embedding tables sharded by rows (`shard_embeddings`): each one's
    elements per row, by the id of its variable. A table's shard is whole rows
    (ceil(rows / N) of them), its parameters sharded as at stage 3 at any
    stage, its lookups routed to the rows' owners (`_route_lookups`)."""
    whole: frozenset = frozenset()
    """The ids of the variables kept whole on every replica (stage 0 beside
    tables sharded by rows): their slots whole in every copy, their gradients
    all-reduced, as Keras' own update."""
    _checkpointed: tuple[int, dict] | None = None
    _kept: tuple[int, list[str]] | None = None
    _finalizer: weakref.finalize | None = None
    _gather_function: object = None

    def chunk(self, variable) -> int:
        """The elements of `variable` in each shard (the last ones padded):
        whole rows of a table sharded by rows, all of a variable kept whole."""
        size = _size(variable)
        if id(variable) in self.whole:
            return size
        width = self.rows.get(id(variable))
        if width:
            return math.ceil(size // width / self.num_shards) * width
        return math.ceil(size / self.num_shards)

    def routed(self, variable) -> bool:
        """Whether `variable` is a table sharded by rows whose lookups are
        routed to the rows' owners."""
        return id(variable) in self.rows and isinstance(variable, ShardedParameter)

    def gathered_once(self, variables: list) -> "GatheredOnce | None":
        """At stage 3 in a step's replica context, `variables`' sharded ones
        gathered once for several micro-batches (`GatheredOnce`); else None."""
        context = _step_context(self)
        if self.stage != 3 or context is None or not any(
                isinstance(v, ShardedParameter) for v in variables):
            return None
        return GatheredOnce(list(variables), self, context)

    def whole_slots(self) -> list[np.ndarray]:
        """Each slot whole (the model variable's shape), in `slots`' order,
        gathered from the replicas' shards. Where some shards are other
        processes' (multi-worker), every process must call it at the same
        point: it is a collective (one all-gather per bucket of slots)."""
        return list(self.each_whole_slot())

    def each_whole_slot(self):
        """`whole_slots` one at a time, gathered a bucket of slots at a time
        (`BUCKET_BYTES`), so that the process never holds them all: from the
        files `keep_whole` wrote at this step where it did, else from the
        replicas (a collective where some shards are other processes')."""
        kept = self._kept
        if kept is not None and kept[0] == self._step():
            for path in kept[1]:
                yield np.load(path)
            return
        for bucket in self._slot_buckets():
            yield from self._gather(bucket)

    def keep_whole(self, keep: bool) -> None:
        """Gathers every slot whole, a bucket at a time, for this step's
        `each_whole_slot` (a collective where some shards are other processes':
        every process calls it at the same point). Where `keep`, this process
        writes them to files in a temporary directory (removed by
        `drop_whole`, or when the sharding goes), so that saving reads them
        back one at a time; else it only takes its part in the collectives."""
        self.drop_whole()
        directory = tempfile.mkdtemp(prefix="tfmulti-zero-") if keep else None
        paths = []
        for bucket in self._slot_buckets():
            names = [os.path.join(directory, f"slot_{n}.npy") for n in bucket] if keep else []
            if len(self.devices) == self.num_shards:  # every shard is here
                for path, value in zip(names, self._gather(bucket) if keep else ()):
                    np.save(path, value)
            else:
                self._stream_gathered(bucket, names)
            paths.extend(names)
        if directory is not None:
            self._kept = (self._step(), paths)
            self._finalizer = weakref.finalize(self, shutil.rmtree, directory, True)

    def _stream_gathered(self, bucket: list[int], paths: list[str]) -> None:
        """The slots of `bucket` gathered from every process's shards
        (`gather_across_processes`) straight into the `.npy` files `paths`
        (one per slot), a piece at a time: the process never holds a slot
        whole (one of 122 MiB gathered whole, then saved, raised each of 2
        workers' peak RSS by 250 MiB, measured). Without `paths`, it only
        takes its part in the collectives."""
        if not paths:
            self._gathered(bucket, into=lambda start, end, pieces: None)
            return
        variables = [self.variables[self.slots[n][1]] for n in bucket]
        chunks = [self.chunk(v) for v in variables]
        offsets = np.cumsum([0, *chunks])
        with contextlib.ExitStack() as files:
            opened = []
            optimizer = self.optimizers[self.first_replica]
            for path, variable, n in zip(paths, variables, bucket, strict=True):
                f = files.enter_context(open(path, "wb"))
                slot = optimizer.variables[self.slots[n][0]]
                dtype = np.dtype(tf.as_dtype(slot.dtype).as_numpy_dtype)
                np.lib.format.write_array_header_2_0(f, {
                    "descr": np.lib.format.dtype_to_descr(dtype), "fortran_order": False,
                    "shape": tuple(variable.shape)})
                opened.append((f, f.tell(), dtype.itemsize, _size(variable)))

            def write(start: int, end: int, pieces: np.ndarray) -> None:
                # Replica r's flat is its chunk of each slot, one after the other; its
                # chunk of slot k is elements [r * chunk, (r + 1) * chunk) of the slot,
                # padded past the slot's size (the padding is not written).
                for k, (f, first, itemsize, size) in enumerate(opened):
                    low, high = max(start, offsets[k]), min(end, offsets[k + 1])
                    for replica in range(self.num_shards):
                        at = replica * chunks[k] + low - offsets[k]
                        stop = min(high - low, size - at)
                        if stop > 0:
                            f.seek(first + at * itemsize)
                            f.write(pieces[replica, low - start:low - start + stop])

            self._gathered(bucket, into=write)

    def drop_whole(self) -> None:
        """Removes what `keep_whole` wrote."""
        self._kept = None
        if self._finalizer is not None:
            self._finalizer()
            self._finalizer = None

    def checkpointed_slot(self, n: int) -> np.ndarray:
        """Slot `n` whole for a checkpoint, which serializes every slot before
        it writes: the slots are gathered once per step (a collective, as
        `whole_slots`) and each is let go once served."""
        step = self._step()
        if self._checkpointed is None or self._checkpointed[0] != step or \
                n not in self._checkpointed[1]:
            self._checkpointed = (step, dict(enumerate(self.whole_slots())))
        value = self._checkpointed[1].pop(n)
        if not self._checkpointed[1]:
            self._checkpointed = None
        return value

    def assign_whole(self, n: int, value) -> None:
        """Slot `n` (of `slots`) given whole: each local replica's copy takes
        its shard of it (no collective: the value is every process's)."""
        j, i, _ = self.slots[n]
        variable = self.variables[i]
        value = tf.convert_to_tensor(value, dtype=variable.dtype)
        for replica, optimizer in self.optimizers.items():
            optimizer.variables[j].assign(
                _shard(value, variable, replica, self))
        self._checkpointed = None
        self.drop_whole()

    def _step(self) -> int:
        return int(self.optimizers[self.first_replica].iterations.numpy())

    def _slot_buckets(self) -> list[list[int]]:
        sizes = [_bytes(self.variables[i]) for _, i, _ in self.slots]
        return buckets(sizes, BUCKET_BYTES)

    def _gather(self, bucket: list[int]) -> list[np.ndarray]:
        """The slots of `bucket` (indices into `slots`) whole, from every
        replica's shards."""
        if len(self.devices) == self.num_shards:  # every shard is here
            flats = [self._flat(replica, bucket).numpy() for replica in range(self.num_shards)]
        else:
            flats = self._gathered(bucket)
            if len(bucket) == 1:  # (the rows, one after the other, are the whole: no copy)
                variable = self.variables[self.slots[bucket[0]][1]]
                return [flats.reshape(-1)[:_size(variable)].reshape(variable.shape)]
        chunks = [self.chunk(self.variables[self.slots[n][1]]) for n in bucket]
        offsets = np.cumsum([0, *chunks])
        whole = []
        for k, n in enumerate(bucket):
            variable = self.variables[self.slots[n][1]]
            parts = [flat[offsets[k]:offsets[k + 1]] for flat in flats]
            whole.append(np.concatenate(parts)[:_size(variable)].reshape(variable.shape))
        return whole

    def _flat(self, replica: int, bucket: list[int]):
        """Replica `replica`'s shards of the slots of `bucket`, flat, one
        after the other."""
        optimizer = self.optimizers[replica]
        return tf.concat([tf.reshape(_plain(optimizer.variables[self.slots[n][0]]), [-1])
                          for n in bucket], axis=0)

    def _gathered(self, bucket: list[int], into=None) -> np.ndarray | None:
        """Every replica's `_flat` of `bucket`, a row by replica, through the
        strategy's all-gather (`gather_across_processes`, with `into`)."""
        return self.gather_across_processes(
            lambda replica: self._flat(replica, bucket),
            "the sharded optimizer's slots", "saves the model (calls model.save, the others to "
            "a temporary path)", into=into)

    def gather_across_processes(self, flat_of, what: str, reads: str, into=None,
                                multiple: int = 1) -> np.ndarray | None:
        """Every replica's `flat_of(global replica index)` (one length), by
        replica (a row each), on every process through the strategy's
        all-gather: a collective, waiting `GATHER_TIMEOUT_S` at most for the
        other processes, then raising that every worker `reads` `what` at the
        same point. Gathered `GATHER_PIECE_BYTES` of each replica's at a
        time, into the result: the process holds the whole once, not the
        collective's copies of it too (a table's shard of 64 MB gathered at
        once left 600 MB more resident on each of 2 workers, measured). Where
        `into` is given, each piece goes to `into(start, end, pieces)` instead
        (`pieces[r]`: replica r's elements [start, end), `start` a multiple of
        `multiple`), and nothing is returned."""
        local = {replica: flat_of(replica) for replica in
                 range(self.first_replica, self.first_replica + len(self.devices))}
        first = local[self.first_replica]
        length = int(first.shape[0])
        out = None if into else np.empty((self.num_shards, length), first.dtype.as_numpy_dtype)
        step = max(1, GATHER_PIECE_BYTES // first.dtype.size // multiple) * multiple
        function = self._gather_replica_function()
        for start in range(0, length, step):
            end = min(start + step, length)
            pieces = self.strategy.experimental_distribute_values_from_function(
                lambda context, start=start, end=end:
                local[context.replica_id_in_sync_group][start:end])
            try:
                result = self.strategy.run(function, args=(pieces,))
            except tf.errors.DeadlineExceededError:
                raise RuntimeError(
                    f"gathering {what} waited {GATHER_TIMEOUT_S} s for the other workers: it "
                    f"is a collective, so every worker {reads} at the same point.") from None
            gathered = self.strategy.experimental_local_results(result)[0].numpy()
            pieces = gathered.reshape(self.num_shards, end - start)
            if into:
                into(start, end, pieces)
            else:
                out[:, start:end] = pieces
        return out

    def _gather_replica_function(self):
        """The replica function of `gather_across_processes`: one
        `tf.function` for every length."""
        if self._gather_function is None:
            options = tf.distribute.experimental.CommunicationOptions(
                timeout_seconds=GATHER_TIMEOUT_S)

            def gather(flat):
                context = tf.distribute.get_replica_context()
                replica = int(tf.get_static_value(context.replica_id_in_sync_group))
                # (a collective's destinations are where its input is)
                with tf.device(self.devices[replica - self.first_replica]):
                    return context.all_gather(tf.identity(flat), axis=0, options=options)

            self._gather_function = tf.function(gather, reduce_retracing=True)
        return self._gather_function

    def bytes_by_device(self) -> dict[str, int]:
        """The bytes of the sharded state on each of this process's devices,
        read from the variables themselves (their devices and sizes): the
        replicas' copies of the optimizer (their slots, step count and
        learning rate)."""
        held: dict[str, int] = {}
        for optimizer in self.optimizers.values():
            for variable in optimizer.variables:
                plain = _plain(variable)
                device = tf.DeviceSpec.from_string(plain.device).to_string()
                held[device] = held.get(device, 0) + _bytes(plain)
        return held

    def unshard_parameters(self, keep: bool = True) -> None:
        """The sharded parameters (stage 3's, the tables sharded by rows) made
        whole again, each an ordinary (mirrored) variable of its class, its
        shards let go: at the end of a run, so that the model saves, exports
        and evaluates as any. A collective where some shards are other
        processes' (every process calls it at the same point). Where not
        `keep` (a worker that writes nothing), the tables sharded by rows
        across processes stay so: the process only takes its part in the
        gathers of the others (a whole table nobody reads is not made)."""
        for variable in self.variables:
            if not isinstance(variable, ShardedParameter):
                continue
            aggregation = variable._value.aggregation  # pylint: disable=protected-access
            # Made as `_shard_parameter` makes the shards: every process gathers the same
            # whole, so the strategy's broadcast of a new variable's value (a collective that
            # held 400 MB more for a table of 128 MB, measured) has nothing to do.
            if id(variable) in self.rows and len(self.devices) < self.num_shards:
                if not keep:
                    self._table_gathered_in_place(variable, keep=False)
                    continue
                components = self._table_gathered_in_place(variable)
            else:
                whole = _gathered_whole(variable, self)
                variable._value = None  # pylint: disable=protected-access  (the shards go)
                components = []
                for device in self.devices:
                    with tf.device(device):
                        components.append(tf.Variable(whole, trainable=variable.trainable,
                                                      name=variable.name))
                del whole
            variable.__class__ = type(variable).__mro__[2]  # its own (after ShardedParameter)
            variable._value = values_lib.MirroredVariable(  # pylint: disable=protected-access
                self.strategy, tuple(components), aggregation)

    def _table_gathered_in_place(self, table, keep: bool = True) -> list:
        """A table sharded by rows, gathered from the other processes into
        variables of its whole shape (one per local device), a piece of rows
        at a time: the process holds the whole once, with its own shard,
        never a gathered copy of it beside the variable. Where not `keep`,
        the process only takes its part in the gathers, its shards kept."""
        shards = table._value.values  # pylint: disable=protected-access
        width = self.rows[id(table)]
        per = self.chunk(table) // width
        rows = table.shape[0]
        components = []
        for device in self.devices if keep else ():
            with tf.device(device):
                components.append(tf.Variable(lambda: tf.zeros(table.shape, table.dtype),
                                              trainable=table.trainable, name=table.name))

        def place(start: int, end: int, pieces: np.ndarray) -> None:
            for replica in range(self.num_shards):
                first = replica * per + start // width
                last = min(replica * per + end // width, rows)
                if last > first:
                    block = pieces[replica, :(last - first) * width].reshape(last - first, width)
                    for component in components:
                        component[first:last].assign(block)

        self.gather_across_processes(
            lambda replica: tf.convert_to_tensor(shards[replica - self.first_replica]),
            "a sharded table (shard_embeddings)", "reads the weights (saves, calls "
            "get_weights)", into=place, multiple=width)
        if not keep:
            return components
        table._value = None  # pylint: disable=protected-access  (the shards go)
        return components

    def parameter_bytes_by_device(self) -> dict[str, int]:
        """The bytes of the model's trainable parameters on each of this
        process's devices, read from the variables themselves: at stage 3 each
        replica's shards, else the whole copies."""
        held: dict[str, int] = {}
        for variable in self.variables:
            value = variable._value  # pylint: disable=protected-access
            for component in getattr(value, "values", (value,)):
                device = tf.DeviceSpec.from_string(component.device).to_string()
                held[device] = held.get(device, 0) + _bytes(component)
        return held


class WholeSlot(trackable.Trackable):
    """Slot `n` of a sharded optimizer as a checkpoint holds an unsharded
    optimizer's slot: its whole value (gathered from the shards when saved;
    a collective where shards are other processes'), restored by
    `assign(value)` into this process's shards. A backup of a sharded run is
    thus the backup of the same run unsharded, restored at any stage on any
    number of replicas."""

    def __init__(self, sharding: ZeroSharding, n: int):
        self._sharding, self._n = sharding, n

    def assign(self, value) -> None:
        self._sharding.assign_whole(self._n, value)

    def _serialize_to_tensors(self):
        return {trackable.VARIABLE_VALUE_KEY: tf.constant(self._sharding.checkpointed_slot(self._n))}

    def _restore_from_tensors(self, restored_tensors):
        self.assign(restored_tensors[trackable.VARIABLE_VALUE_KEY])
        return tf.no_op()


def whole_slots(optimizer) -> list[tuple[object, str, WholeSlot]]:
    """For a sharded `optimizer`: each slot as (its model variable, the slot's
    name, a `WholeSlot` to save and restore it); [] for another."""
    sharding = sharding_of(optimizer)
    if sharding is None:
        return []
    return [(sharding.variables[i], name, WholeSlot(sharding, n))
            for n, (_, i, name) in enumerate(sharding.slots)]


def sharding_of(optimizer) -> ZeroSharding | None:
    """The sharding `shard_optimizer` gave `optimizer` (a loss-scale
    optimizer's inner one; None: not sharded, or no optimizer)."""
    return getattr(updating(optimizer), _ATTRIBUTE, None)


def updating(optimizer):
    """The optimizer that holds the slots: a loss-scale optimizer's inner one,
    else `optimizer` itself (None for None)."""
    return getattr(optimizer, "inner_optimizer", optimizer)


def shard_optimizer(optimizer: keras.optimizers.Optimizer, variables: list,
                    strategy: tf.distribute.Strategy, stage: int,
                    model: keras.Model | None = None, tables: list = ()) -> keras.optimizers.Optimizer:
    """Shards `optimizer`'s state for `variables` over `strategy`'s replicas
    (ZeRO stage `stage`, see the module doc), and the embedding tables of
    `tables` by rows; returns the optimizer.

    Call it before the optimizer is built (before the first training step),
    outside the strategy's scope, with the model's trainable variables (made
    under `strategy`). The optimizer then updates them only inside the
    strategy's replica context (`model.fit`, or `strategy.run` of a step that
    calls `apply_gradients`), as Keras does.

    Args:
        optimizer: a Keras optimizer (not yet built), or the loss-scale
            optimizer that wraps it (`model.optimizer` under mixed_float16:
            its inner optimizer's state is sharded).
        variables: the variables it will update, in the order of its
            gradients (`model.trainable_variables`).
        strategy: a `MirroredStrategy` or `MultiWorkerMirroredStrategy`.
        stage: 1 (optimizer slots), 2 (slots and gradients) or 3 (also
            the parameters: `variables` become `ShardedParameter`s); 0 leaves
            the optimizer as it is, but for `tables`.
        model: at stage 3, the model whose calls read `variables`: the
            layers of each of its models (itself, and those it holds: a
            VAE's encoder and decoder) gather their own at their call
            (`_gather_at_call`), outside the loops and conditions in the
            layer (an RNN's, a convolution's guard for an empty batch), and
            before those around it (`_outside_control_flow`), where the
            replicas cannot exchange them; a model's own weights, when it is
            called.
        tables: `keras.layers.Embedding` layers (the class's own `call`)
            whose tables are sharded by rows at any stage (`shard_embeddings`):
            each replica holds ceil(rows / N) of a table's rows and their
            slots, and a lookup goes to the rows' owners and back
            (`_route_lookups`); the table is never gathered whole in a step.

    Raises:
        ValueError: a stage other than 0 to 3; an optimizer already built; no
            variables (a model not built yet); an
            optimizer whose rule is not per element; at stage 3 or with
            `tables`, what reads a parameter or a gradient whole in the update
            (`clipnorm`, `global_clipnorm`, `use_ema`, Keras'
            `gradient_accumulation_steps`); stage 3 without `model`; a table
            that is not an `Embedding`'s, or not among `variables`.
    """
    if stage not in STAGES:
        raise ValueError(f"zero_stage={stage!r} is not a sharding stage; use one of "
                         f"{', '.join(map(str, STAGES))}.")
    tables = list(tables)
    if stage == 0 and not tables:
        return optimizer
    given, optimizer = optimizer, updating(optimizer)  # a loss-scale optimizer's inner one
    _check_rule(optimizer)
    if stage == 3 or tables:
        _check_whole_reads(optimizer, "zero_stage=3" if stage == 3 else "shard_embeddings")
    if stage == 3 and not isinstance(model, keras.Model):
        raise ValueError(
            f"zero_stage=3 gathers the parameters where the model is called: pass the model "
            f"(shard_optimizer(..., model=model)), got {type(model).__name__}.")
    if getattr(optimizer, "built", False):
        raise ValueError(f"{type(optimizer).__name__} is already built: its slots are whole on "
                         f"every replica; shard it before its first step.")
    if tf.distribute.in_cross_replica_context() and tf.distribute.has_strategy():
        raise ValueError("shard_optimizer makes each replica's own variables: call it outside "
                         "the strategy's scope.")
    if not list(variables):
        raise ValueError(
            "shard_optimizer got no variables to shard: the model has none yet (a subclassed "
            "model makes them at its first call; model.build(shape) makes none without a "
            "build method); call the model on a batch first, then pass "
            "model.trainable_variables.")
    variables = list(variables)
    rows = _table_rows(tables, variables)
    extended = strategy.extended
    devices = tuple(extended.worker_devices)
    num_shards = strategy.num_replicas_in_sync
    first = _first_replica(strategy)
    with strategy.scope():
        # The optimizer's own variables (iterations, an EMA, Keras' gradient
        # accumulators) stay mirrored; its slots are the shards' optimizers'.
        keras.optimizers.Optimizer.build(optimizer, variables)
    whole = frozenset(id(v) for v in variables if id(v) not in rows) if stage == 0 \
        else frozenset()
    sharding = ZeroSharding(stage, num_shards, devices, first, variables, {}, {}, strategy,
                            rows=rows, whole=whole)
    for local, device in enumerate(devices):
        replica = first + local
        sharding.shards[replica] = [
            _Shard((sharding.chunk(v),), v.dtype, f"zero_shard_{i}")
            for i, v in enumerate(variables)]
        sharding.optimizers[replica] = _copy(optimizer, sharding.shards[replica], device)
    sharding.slots = _slots(sharding.optimizers[first], sharding.shards[first])
    setattr(optimizer, _ATTRIBUTE, sharding)
    parameters = variables if stage == 3 else [v for v in variables if id(v) in rows]
    keys = {}
    for variable in parameters:
        keys[id(variable)] = optimizer._var_key(variable)
        _shard_parameter(variable, sharding)
    # The optimizer knows each variable by the key it had when built (Keras reads it
    # from the variable's value, which is now the gathered whole), and so does the
    # loss-scale optimizer that wraps it (mixed_float16), which Keras builds too.
    wrappers = {given, getattr(model, "optimizer", None)}
    for holder in {optimizer} | {w for w in wrappers if updating(w) is optimizer}:
        holder._var_key = _known_keys(holder._var_key, keys)
    # A sharded parameter's decay is its shards' own (`_update_parameter_shards`), before
    # the rule, as Keras'; the others' is Keras'.
    optimizer._apply_weight_decay = _decaying_whole(optimizer._apply_weight_decay)
    for layer in tables:
        _route_lookups(layer, sharding)
    if stage == 3:
        for layer in model._flatten_layers(include_self=True):  # pylint: disable=protected-access
            if isinstance(layer, keras.Model):
                _gather_when_called(layer, sharding)
    optimizer._backend_update_step = _update_step(optimizer, sharding)
    optimizer.save_own_variables = _save_own_variables(optimizer, sharding)
    return given


def _decaying_whole(decay):
    """`decay` (an optimizer's `_apply_weight_decay`) applied to the variables
    that are not sharded parameters only (a merge call, skipped where none)."""
    def apply_weight_decay(variables):
        variables = [v for v in variables if not isinstance(v, ShardedParameter)]
        if variables:
            decay(variables)
    return apply_weight_decay


def table_layers(model, replicas: int) -> list:
    """The layers of `model` whose tables `shard_embeddings` splits by rows
    over `replicas`: every `keras.layers.Embedding` (Keras' own call, not
    quantized, no LoRA) with a trainable table of at least `replicas` rows.
    The run shards these (`tfmulti.training.run`), and `estimate-memory`
    counts them."""
    trainable = {id(v) for v in model.trainable_variables}
    return [layer for layer in model._flatten_layers(include_self=False)  # pylint: disable=protected-access
            if isinstance(layer, keras.layers.Embedding)
            and type(layer).call is keras.layers.Embedding.call
            and not layer.quantization_mode and not layer.lora_enabled
            and layer.trainable and layer.input_dim >= replicas
            and id(layer.embeddings) in trainable]


def _table_rows(tables: list, variables: list) -> dict[int, int]:
    """`ZeroSharding.rows` of `tables` (Embedding layers): each table's
    elements per row, by the id of its variable; refuses a layer whose call is
    not `Embedding.call` (a lookup routed by rows is that call's), or whose
    table is not among `variables`."""
    rows = {}
    known = {id(v) for v in variables}
    for layer in tables:
        if not isinstance(layer, keras.layers.Embedding) or \
                type(layer).call is not keras.layers.Embedding.call:
            raise ValueError(
                f"shard_embeddings routes an Embedding's lookups to the rows' owners; "
                f"{layer.name} ({type(layer).__name__}) is not a keras.layers.Embedding "
                f"with Keras' own call.")
        table = layer.embeddings
        if id(table) not in known:
            raise ValueError(f"shard_embeddings: {layer.name}'s table is not among the "
                             f"variables the optimizer updates (a frozen table: leave it out).")
        rows[id(table)] = math.prod(table.shape[1:])
    return rows


def _known_keys(var_key, keys: dict):
    """`var_key` (an optimizer's), answering for the variables of `keys` (by id) their
    key there."""
    return lambda variable: keys.get(id(variable)) or var_key(variable)


ACROSS_ELEMENTS = ("Lamb", "Adafactor", "Muon")
"""Keras optimizers whose rule reads a whole variable (a norm, a factored
second moment, an orthogonalized matrix): a shard alone cannot be updated."""


def _check_rule(optimizer) -> None:
    """Refuses an optimizer whose update a shard cannot take: one of
    `ACROSS_ELEMENTS`, or one that changes the update of all variables at once
    (Nadam's running product: its own `_backend_update_step`)."""
    name = type(optimizer).__name__
    classes = type(optimizer).__mro__
    # The first class defining the step: Keras' TensorFlow backend's, or the rule's own.
    own = next(c for c in classes if "_backend_update_step" in vars(c)).__name__ != "TFOptimizer"
    if any(c.__name__ in ACROSS_ELEMENTS for c in classes) or own:
        why = ("its update reads each variable whole" if not own else
               "its update step changes state shared by all variables")
        raise ValueError(
            f"{name} cannot be sharded (zero_stage): {why}; use an optimizer whose rule is per "
            f"element (Adam, AdamW, SGD, RMSprop, Adagrad, Adamax, Lion, ...), or zero_stage=0.")


def _copy(optimizer, shards: list[_Shard], device: str):
    """A copy of `optimizer` applying its rule to `shards`, its slots on
    `device`."""
    # The copy applies the rule only: the optimizer itself clips, decays the
    # weights, accumulates and keeps the moving average, on the whole variables.
    with tf.device(device):  # its own variables (step count, learning rate) too
        copy = type(optimizer).from_config({
            **optimizer.get_config(), "use_ema": False, "gradient_accumulation_steps": None})
    base = next(c for c in type(copy).__mro__ if c.__name__ == "BaseOptimizer")

    def add_variable_from_reference(reference_variable, name=None, initializer="zeros"):
        with tf.device(device):  # (not colocated with a variable: a shard is none)
            return base.add_variable_from_reference(copy, reference_variable, name=name,
                                                    initializer=initializer)

    def changes(original, how):
        def change(variable, value):
            if not isinstance(variable, _Shard):
                return original(variable, value)
            value = tf.cast(value, variable.dtype)
            variable.value = how(variable.value, value)
            return None
        return change

    if optimizers.is_fused(optimizer) and not optimizer.amsgrad:
        # The fused kernel's arithmetic, as the unsharded optimizer's update: the same bits.
        def update_step(gradient, variable, learning_rate):
            index = copy._get_variable_index(variable)
            m, v = copy._momentums[index], copy._velocities[index]
            new_m, new_v, variable.value = optimizers.fused_values(
                copy, gradient, tf.convert_to_tensor(m), tf.convert_to_tensor(v),
                variable.value, learning_rate)
            m.assign(new_m)
            v.assign(new_v)

        copy.update_step = update_step
    copy.add_variable_from_reference = add_variable_from_reference
    copy.assign = changes(copy.assign, lambda _, new: new)
    copy.assign_add = changes(copy.assign_add, lambda old, x: old + x)
    copy.assign_sub = changes(copy.assign_sub, lambda old, x: old - x)
    with tf.device(device):
        copy.build(shards)
    del copy.add_variable_from_reference  # back to the class's
    return copy


def _slots(copy, shards) -> list[tuple[int, int, str]]:
    """`ZeroSharding.slots` of `copy`, built on `shards`: Keras names a slot
    after its variable's path, "zero_shard_3_momentum"."""
    found = []
    for j, variable in enumerate(copy.variables):
        for i, shard in enumerate(shards):
            prefix = shard.path.replace("/", "_") + "_"
            if variable.name.startswith(prefix) and tuple(variable.shape) == tuple(shard.shape):
                found.append((j, i, variable.name[len(prefix):]))
                break
    return found


def _save_own_variables(optimizer, sharding: ZeroSharding):
    """`save_own_variables` writing what the unsharded optimizer would: its own
    variables, then each slot whole, so that `model.keras` is an ordinary
    model whose optimizer loads into the unsharded class."""
    def save_own_variables(store):
        for i, variable in enumerate(optimizer.variables):
            store[str(i)] = variable.numpy()
        # One whole slot at a time: not held while the next is read (nor by `enumerate`,
        # whose result tuple keeps its last item until the next one is read).
        n = len(optimizer.variables)
        for value in sharding.each_whole_slot():
            store[str(n)] = _Handed(value)
            del value
            n += 1

    return save_own_variables


class _Handed:
    """An array handed to Keras' weights writer to keep: `np.array(_Handed(a))`
    is `a` itself, not the copy `np.array(a)` makes (NumPy 2 asks `__array__`
    for the copy and takes what it returns). Keras' store converts each value
    with `np.array` before writing it, so a table of 122 MiB written from a
    variable held two copies of it at once beside the variable (its `numpy()`
    and that), measured; handed, none. `a` must be nobody else's to change:
    a slot read back from its file, or a snapshot of a variable's buffer
    (`_handing`: TensorFlow copies a variable on write while a read of it
    lives)."""

    def __init__(self, array: np.ndarray):
        self.array = array

    def __array__(self, dtype=None, copy=None):
        del copy  # (the array is the writer's: no copy to make)
        return self.array if dtype is None else self.array.astype(dtype, copy=False)


class _HandingStore:
    """A layer's weights store whose values are handed to the store they
    wrap without a copy (`_Handed`): each a snapshot of its variable."""

    def __init__(self, store):
        self._store = store

    def __setitem__(self, key, value):
        self._store[key] = _Handed(np.asarray(tf.convert_to_tensor(value)))

    def __getattr__(self, name):
        return getattr(self._store, name)


def _handing(save_own_variables):
    """`save_own_variables` of a layer (a table's) handing its variables to
    Keras' writer without copies (`_HandingStore`): the chief, saving the
    tables made whole at the end of a run, holds no copy of them beside."""
    def save(store):
        return save_own_variables(_HandingStore(store))

    return save


def _update_step(optimizer, sharding: ZeroSharding):
    """The sharded `_backend_update_step` of `optimizer` (see the module doc):
    bucket by bucket (`BUCKET_BYTES` of parameters), each bucket's reduction
    waiting for the previous bucket's parameters to be assigned, so that the
    step holds one bucket's transients (its reduced gradients, its gathered
    parameters) at a time, not the whole model's."""
    original = optimizer._backend_update_step

    def update_step(grads, trainable_variables, learning_rate):
        context = _step_context(sharding)
        if context is None:
            return original(grads, trainable_variables, learning_rate)
        replica = int(tf.get_static_value(context.replica_id_in_sync_group))
        index = {id(_plain(v)): i for i, v in enumerate(sharding.variables)}
        pairs = [(g, index[id(_plain(v))]) for g, v in zip(grads, trainable_variables)
                 if g is not None]
        if not pairs:
            return None
        copy = sharding.optimizers[replica]
        device = sharding.devices[replica - sharding.first_replica]
        with tf.device(device):
            # The copy counts the optimizer's steps (Adam's bias correction reads them).
            copy.iterations.assign(optimizer.iterations)
        sharded = [(g, p) for g, p in pairs
                   if isinstance(sharding.variables[p], ShardedParameter)]
        rest = [(g, p) for g, p in pairs
                if not isinstance(sharding.variables[p], ShardedParameter)]
        if sharded:  # (stage 3's, and tables sharded by rows)
            _update_parameter_shards(optimizer, sharding, replica, sharded, learning_rate)
        done = []
        sizes = [_bytes(sharding.variables[p]) for _, p in rest]
        for bucket in buckets(sizes, BUCKET_BYTES):
            with tf.control_dependencies(done):
                done = _update_bucket(context, sharding, replica, [rest[i] for i in bucket],
                                      learning_rate)
        return None

    return update_step


GATHER_TIMEOUT_S = 600
"""Seconds a gather of the slots (to save them) waits for the other workers."""

GATHER_PIECE_BYTES = 4 << 20
"""The bytes of each replica's part a gather outside the step
(`ZeroSharding.gather_across_processes`) exchanges at once."""

BUCKET_BYTES = 25 << 20
"""The parameters' bytes a sharded step reduces, updates and gathers at once
(as PyTorch's DistributedDataParallel buckets its gradients, 25 MiB by
default): small variables share one collective, and a step's transients are
one bucket's."""


def _update_bucket(context, sharding: ZeroSharding, replica: int, pairs, learning_rate):
    """One bucket of a sharded step on `replica`: its gradients reduced to this
    replica's shards, the shards updated by the replica's copy of the optimizer,
    gathered, and assigned to the parameters (variables kept whole, stage 0
    beside tables sharded by rows: all-reduced, and each replica's update is
    the whole). Returns the assignments."""
    variables = [sharding.variables[p] for _, p in pairs]
    grads = [g for g, _ in pairs]
    if sharding.stage < 2 or len(sharding.devices) < sharding.num_shards:
        reduced = context.all_reduce(tf.distribute.ReduceOp.SUM, grads)
        grad_shards = [_shard(g, v, replica, sharding) for g, v in zip(reduced, variables)]
    else:
        grad_shards = _reduce_scatter(context, grads, variables, sharding)
    own = sharding.shards[replica]
    copy = sharding.optimizers[replica]
    with tf.device(sharding.devices[replica - sharding.first_replica]):
        # (on the replica's device: a collective's destinations are where its input is)
        updated = []
        for grad, (_, position), variable in zip(grad_shards, pairs, variables):
            shard = own[position]
            shard.value = _shard(_plain(variable), variable, replica, sharding)
            copy.update_step(grad, shard, learning_rate)
            updated.append(tf.identity(shard.value))
            shard.value = None
        if sharding.whole:  # (stage 0 beside tables: each replica updated the wholes)
            gathered = updated
        else:
            gathered = _all_gather(context, sharding, updated)
    values = [tf.reshape(flat[:_size(v)], v.shape) for flat, v in zip(gathered, variables)]
    return _assign(context, variables, values)


def _assign(context, variables: list, values: list) -> list:
    """Each of `values` (this replica's, whole) assigned to its variable of
    `variables` (mirrored) on every local replica: a merge call."""
    def assign(strategy, targets, news):
        return [strategy.extended.update(target, lambda var, value: var.assign(value),
                                         args=(new,), group=False)
                for target, new in zip(targets, news)]

    assigned = context.merge_call(assign, args=([_plain(v) for v in variables], values))
    return tf.nest.flatten(assigned)


def _all_gather(context, sharding: ZeroSharding, shards: list):
    """Each of `shards` (this replica's, all of one size) gathered from every
    replica, in replica order: the whole, flat and padded, on every replica.
    Within one process, each device concatenates the replicas' shards; across
    processes, the strategy's collective all-gather of equal shapes (its
    launchers' `_all_gather`: `ReplicaContext.all_gather` first exchanges the
    shapes, pads and unpads, copying the whole twice more each step), else
    `ReplicaContext.all_gather`."""
    if len(sharding.devices) == sharding.num_shards:
        def concatenate(strategy, per_replica):
            out = []
            for value in per_replica:
                parts = strategy.experimental_local_results(value)
                whole = []
                for device in sharding.devices:
                    with tf.device(device):
                        whole.append(tf.concat(parts, axis=0))
                out.append(values_lib.Mirrored(tuple(whole)))
            return out

        return context.merge_call(concatenate, args=(shards,))
    launchers = getattr(getattr(sharding.strategy.extended, "_cross_device_ops", None),
                        "_launchers", None)
    if not launchers or not all(hasattr(launcher, "_all_gather") for launcher in launchers):
        return context.all_gather(shards, axis=0)  # another TensorFlow's strategy

    def gather(strategy, per_replica):
        options = tf.distribute.experimental.CommunicationOptions()
        return [values_lib.PerReplica(tuple(
            launcher._all_gather(part, options)  # pylint: disable=protected-access
            for launcher, part in zip(launchers, strategy.experimental_local_results(value))))
            for value in per_replica]

    return context.merge_call(gather, args=(shards,))


def _reduce_scatter(context, grads, variables, sharding: ZeroSharding):
    """Each replica's shard of the gradients' sum over the replicas: on each
    replica's device, the sum of every replica's slice for it."""
    def scatter(strategy, per_replica):
        out = []
        for grad, variable in zip(per_replica, variables):
            locals_ = strategy.experimental_local_results(grad)
            shards = []
            for local, device in enumerate(sharding.devices):
                replica = sharding.first_replica + local
                with tf.device(device):
                    shards.append(tf.add_n([_shard(g, variable, replica, sharding)
                                            for g in locals_]))
            out.append(values_lib.PerReplica(tuple(shards)))
        return out

    return context.merge_call(scatter, args=(grads,))


def _shard(tensor, variable, replica: int, sharding: ZeroSharding):
    """Replica `replica`'s shard of `tensor` (`variable`'s shape): elements
    [replica * chunk, (replica + 1) * chunk) of it flattened, padded with zeros
    where they run past its end (the last shards): sliced first, so that only
    the shard is copied. A gradient given as rows
    (`tf.IndexedSlices`, an embedding's) is made dense first, as Keras' rules
    make it when they combine it with a slot."""
    size, chunk = _size(variable), sharding.chunk(variable)
    flat = tf.reshape(tf.convert_to_tensor(tensor), [size])
    if id(variable) in sharding.whole:  # every replica's is the whole
        return flat
    start = min(replica * chunk, size)
    end = min(start + chunk, size)
    piece = flat[start:end]
    if end - start < chunk:
        piece = tf.pad(piece, [[0, chunk - (end - start)]])
    return piece


def buckets(sizes: list[int], cap: int) -> list[list[int]]:
    """Consecutive indices of `sizes` grouped so that each group's total is at
    most `cap` (a size over it alone in its group): the units a sharded step
    reduces, updates and gathers one after the other, so that no more than one
    group's whole gradients and parameters are in flight at once."""
    groups: list[list[int]] = []
    total = cap + 1
    for i, size in enumerate(sizes):
        if total + size > cap:
            groups.append([])
            total = 0
        groups[-1].append(i)
        total += size
    return groups


def _step_context(sharding: ZeroSharding):
    """The replica context of a step over `sharding`'s replicas, else None
    (cross-replica, or another strategy's replicas)."""
    context = tf.distribute.get_replica_context()
    if context is None or context.num_replicas_in_sync != sharding.num_shards:
        return None
    return context


def _first_replica(strategy) -> int:
    resolver = getattr(strategy, "cluster_resolver", None)
    if resolver is None or not resolver.cluster_spec().as_dict():
        return 0
    return int(resolver.task_id) * len(strategy.extended.worker_devices)


def _plain(variable):
    if isinstance(variable, ShardedParameter):
        return variable
    return variable.value if isinstance(variable, keras.Variable) else variable


def _size(variable) -> int:
    return math.prod(variable.shape)


def _bytes(variable) -> int:
    return _size(variable) * dtype_bytes(variable.dtype)


# ---------------------------------------------------------------------------
# Stage 3: the parameters sharded.

STAGE_3_REFUSED = {
    "clipnorm": "clips each gradient by its whole norm",
    "global_clipnorm": "clips the gradients by their whole norm",
    "use_ema": "keeps a moving average of the whole parameters",
    "gradient_accumulation_steps": "accumulates the whole gradients (use tfmulti's "
                                   "accumulate_steps, which accumulates before the step)",
}
"""What an optimizer may not do at stage 3, and why: each reads a whole
parameter or gradient in the update, where a replica holds its shard only."""


def _check_whole_reads(optimizer, sharded: str) -> None:
    """Refuses, where parameters are sharded (`sharded`: "zero_stage=3", or
    "shard_embeddings" for tables), an optimizer that reads whole what a
    replica holds a shard of (`STAGE_3_REFUSED`). (A variable's regularizer
    reads it whole where Keras adds the penalty to the loss, in the step:
    gathered there, kept until its gradient. A loss-scale optimizer's check
    for an overflow reads what it is given, here a replica's shards; the
    answers are made to agree over the replicas by `keras_fixes`' "loss
    scaling that checks one replica's gradients".)"""
    other = "zero_stage=2" if sharded == "zero_stage=3" else "shard_embeddings=False"
    for name, why in STAGE_3_REFUSED.items():
        if getattr(optimizer, name, None):
            raise ValueError(
                f"{sharded} cannot shard {type(optimizer).__name__} with {name}="
                f"{getattr(optimizer, name)!r}: it {why}, and each replica holds a shard of "
                f"the parameters; leave {name} unset, or use {other}.")


class ShardedParameter:
    """A Keras variable whose value each replica holds a shard of (stage 3).

    `shard_optimizer` gives each parameter this class (mixed into its own
    Keras variable class), and replaces its value by a `MirroredVariable`
    whose component on each local replica's device is that replica's shard
    (ceil(size / N) elements, flat; the last padded). Then:

    - in a replica's step, `value` is the parameter gathered whole from the
      shards (the gradient of the gather is the reduce-scatter: the tape's
      gradient for the variable is the replica's shard of the summed
      gradient), and `handle` is the replica's shard, so that Keras' trainer
      and a user's `train_step` take gradients as they do of any variable;
    - elsewhere (saving, `get_weights`, a checkpoint, a callback) `value` is
      the whole, gathered (a collective where some shards are other
      processes': every process reads at the same point, as Keras' saving and
      callbacks do), and in Keras' symbolic build, zeros of its shape;
    - `assign` of a whole value (restoring, `set_weights`, a constraint)
      gives each replica its shard.
    """

    _tfmulti_sharding: ZeroSharding
    _tfmulti_shared_name: str

    @property
    def value(self):
        if in_stateless_scope():  # (Keras' stateless calls, mapped as it maps them)
            mapped = get_stateless_scope().get_current_value(self)
            if mapped is not None:
                return self._maybe_autocast(mapped)
        if in_symbolic_scope():
            return self._maybe_autocast(tf.zeros(self._shape, self._dtype))
        return self._maybe_autocast(self._whole())

    @property
    def handle(self):
        return self._value.handle

    def numpy(self):
        return self._whole().numpy()

    def _whole(self):
        sharding = self._tfmulti_sharding
        context = _step_context(sharding)
        if context is not None:
            return _gather_parameter(self._value, self, context, sharding)
        return _whole_across_replicas(self, sharding)

    def _direct_assign(self, value):
        sharding = self._tfmulti_sharding
        value = tf.cast(value, self._value.dtype)
        context = _step_context(sharding)
        if context is not None:
            replica = int(tf.get_static_value(context.replica_id_in_sync_group))
            local = self._value._get_on_device_or_primary()  # pylint: disable=protected-access
            return local.assign(_shard(value, self, replica, sharding))
        for local, component in enumerate(self._value.values):
            component.assign(_shard(value, self, sharding.first_replica + local, sharding))
        return None

    @property
    def _shared_name(self):  # the whole variable's, as a checkpoint names it
        return self._tfmulti_shared_name

    def _serialize_to_tensors(self):
        return {trackable.VARIABLE_VALUE_KEY: self._whole()}

    def _copy_trackable_to_cpu(self, object_map):
        object_map[self] = tf.Variable(self._whole())

    def _restore_from_tensors(self, restored_tensors):
        self._direct_assign(restored_tensors[trackable.VARIABLE_VALUE_KEY])
        return tf.no_op()


_SHARDED_CLASSES: dict[type, type] = {}


def _shard_parameter(variable, sharding: ZeroSharding) -> None:
    """`variable` (the model's, mirrored) made a `ShardedParameter`: its value
    replaced by the local replicas' shards of it, its whole let go."""
    cls = type(variable)
    if cls not in _SHARDED_CLASSES:
        _SHARDED_CLASSES[cls] = type(f"Sharded{cls.__name__}", (ShardedParameter, cls), {})
    whole = variable._value  # pylint: disable=protected-access
    # (read, not copied: each shard is sliced from the variable's own buffer)
    primary = tf.convert_to_tensor(whole.values[0] if hasattr(whole, "values") else whole)
    components = []
    for local, device in enumerate(sharding.devices):
        replica = sharding.first_replica + local
        with tf.device(device):
            components.append(tf.Variable(
                _shard(primary, variable, replica, sharding), trainable=True,
                name=f"{variable.name}_zero_shard_{replica}"))
    variable._value = values_lib.MirroredVariable(  # pylint: disable=protected-access
        sharding.strategy, tuple(components), tf.VariableAggregation.NONE)
    variable._tfmulti_sharding = sharding  # pylint: disable=protected-access
    variable._tfmulti_shared_name = whole._shared_name  # pylint: disable=protected-access
    variable.__class__ = _SHARDED_CLASSES[cls]


def _gather_when_called(model, sharding: ZeroSharding) -> None:
    """Each layer of `model` (not a model: it does this for its own) made to
    gather its parameters at its call (`_gather_at_call`), and `model.call`
    to gather the rest, the model's own weights, first, in a replica's step:
    its layers read them from a `_GatheredScope` that maps each to its
    gathered whole. A model called in a step that gathered them already
    (`GatheredOnce`) reads those. The losses its layers add in the call are
    its replica's own (`model.losses` in that replica's step)."""
    if getattr(model, _UNIT, False):  # its parent's layer: it gathers at its call
        return
    call = model.call
    own = [v for v in model.trainable_variables if isinstance(v, ShardedParameter)]
    covered = set()
    for layer in model.layers:
        if not isinstance(layer, keras.Model):  # (a model gathers its own layers')
            _gather_at_call(layer, sharding)
        covered.update(id(v) for v in layer.trainable_variables)
    own = [v for v in own if id(v) not in covered]  # (the model's own weights)
    # The losses its layers added in the call (add_loss, activity regularizers), kept per
    # replica: the replicas' calls interleave at each gather, and a model's own list of
    # losses is one for all of them.
    added = threading.local()

    def gathering_call(*args, **kwargs):
        context = _gathering_context(own, sharding)
        if context is None:
            return call(*args, **kwargs)
        outputs, added.losses = _called_gathered(call, own, context, sharding, args, kwargs)
        return outputs

    def get_own_losses():
        own = type(model)._get_own_losses(model)  # pylint: disable=protected-access
        return own + getattr(added, "losses", [])

    def clear():
        added.losses = []
        type(model)._clear_losses(model)  # pylint: disable=protected-access

    model.call = gathering_call
    model._get_own_losses = get_own_losses  # pylint: disable=protected-access
    model._clear_losses = clear  # pylint: disable=protected-access


_UNIT = "_tfmulti_zero_gathers_at_call"


def _gather_at_call(layer, sharding: ZeroSharding) -> None:
    """`layer.call` made to gather the sharded parameters of `layer` (and of
    the layers it holds) just before it runs, in a replica's step, as FSDP
    gathers a unit: the wholes are let go once the call's operations have read
    them, and gathered again for its backward, where the call runs again
    (`_recomputed`), so that a step holds one layer's gathered parameters at a
    time, not the model's."""
    own = [v for v in layer.trainable_variables if isinstance(v, ShardedParameter)]
    if not own or getattr(layer, _UNIT, False):
        return
    setattr(layer, _UNIT, True)
    call = layer.call

    def gathering_call(*args, **kwargs):
        context = _gathering_context(own, sharding)
        if context is None:
            return call(*args, **kwargs)
        if _in_control_flow():  # (called in a branch or a loop: gathered before it, kept)
            outputs, losses = _called_gathered(call, own, context, sharding, args, kwargs)
        else:
            outputs, losses = _recomputed(layer, call, own, context, sharding, args, kwargs)
        for loss in losses:  # to the model's scope, the replica's own
            layer.add_loss(loss)
        return outputs

    layer.call = gathering_call


def _route_lookups(layer, sharding: ZeroSharding) -> None:
    """`layer` (a `keras.layers.Embedding` whose table is sharded by rows)
    made to look its ids up where their rows are, in a replica's step
    (`_routed_lookup`); elsewhere (Keras' symbolic build, a read outside the
    step, the table made whole again) its own call. Stage 3's gather at a
    layer's call leaves it."""
    setattr(layer, _UNIT, True)
    call = layer.call
    table = layer.embeddings

    def routed_call(*args, **kwargs):
        inputs = args[0] if args else kwargs.get("inputs")
        context = _step_context(sharding) if sharding.routed(table) else None
        if context is None or in_symbolic_scope() or _mapped([table]) or \
                not isinstance(inputs, tf.Tensor):  # (ragged or sparse ids: gathered whole)
            return call(*args, **kwargs)
        return tf.cast(_routed_lookup(inputs, table, context, sharding), layer.compute_dtype)

    layer.call = routed_call
    layer.save_own_variables = _handing(layer.save_own_variables)


def _routed_lookup(ids, table, context, sharding: ZeroSharding):
    """The rows of `table` (sharded by rows) for `ids`, on this replica,
    without the table whole anywhere: every replica's ids exchanged
    (`_everyones_ids`: two all-reduces of integers), each
    replica looks up those of its own rows (zeros for the others'), and the
    sum over the replicas (an all-reduce of the looked-up rows, the batch's
    size, not the table's) gives each replica its own ids' rows. Its gradient
    runs back the same way: the all-reduce's gradient is the all-reduce of the
    rows' gradients, so each replica's shard receives the gradient of its rows
    from every replica's batch, summed (no further reduction). Negative ids
    count from the end, as Keras' `take`; an id past the end finds no owner
    and reads zeros (Keras on a CPU stops with an error; on a GPU, zeros)."""
    replica = int(tf.get_static_value(context.replica_id_in_sync_group))
    width = sharding.rows[id(table)]
    per = sharding.chunk(table) // width  # rows on each replica
    ids = tf.cast(ids, tf.int64)
    ids = tf.where(ids < 0, ids + table.shape[0], ids)
    flat = tf.reshape(ids, [-1])
    with tf.device(sharding.devices[replica - sharding.first_replica]):
        local = table._value._get_on_device_or_primary()  # pylint: disable=protected-access
        own_rows = tf.reshape(tf.convert_to_tensor(local), [per, width])
        everyone, counts = _everyones_ids(flat, context, replica)
        first = replica * per
        owned = tf.where((everyone >= first) & (everyone < first + per))
        found = tf.gather(own_rows, tf.gather_nd(everyone, owned) - first)
        partial = tf.scatter_nd(owned, found, tf.stack([tf.size(everyone, out_type=tf.int64),
                                                        tf.constant(width, tf.int64)]))
        total = context.all_reduce(tf.distribute.ReduceOp.SUM, partial)
        start = tf.reduce_sum(counts[:replica])
        mine = total[start:start + tf.size(flat, out_type=tf.int64)]
    rows = tf.reshape(mine, tf.concat([tf.shape(ids), [width]], axis=0))
    rows.set_shape(ids.shape.concatenate([width]))
    return rows


def _everyones_ids(flat, context, replica: int):
    """Every replica's `flat` (int64 ids, as many as each replica has),
    replica after replica, and how many each has: (ids, counts). Two
    all-reduces of integers: the counts (each replica's in its own place),
    then each replica's ids in its own row of a matrix as wide as the most
    (zeros elsewhere), whose sum holds them all. TensorFlow's all-gather of a
    tensor whose size may differ between replicas is itself two collectives
    (the sizes, then the data padded), so the ids and their count took four,
    with their padding and transposes traced per table."""
    mine = tf.constant([[replica]], tf.int64)
    replicas = tf.constant([context.num_replicas_in_sync], tf.int64)
    size = tf.size(flat, out_type=tf.int64)
    counts = context.all_reduce(tf.distribute.ReduceOp.SUM,
                                tf.scatter_nd(mine, size[None], replicas))
    width = tf.reduce_max(counts)
    row = tf.pad(flat, tf.stack([[tf.constant(0, tf.int64), width - size]]))
    rows = context.all_reduce(tf.distribute.ReduceOp.SUM,
                              tf.scatter_nd(mine, row[None], tf.concat([replicas, [width]], 0)))
    return tf.boolean_mask(rows, tf.range(width)[None, :] < counts[:, None]), counts


_DRAWS = ("RandomUniform", "RandomStandardNormal", "RandomGamma", "RandomPoisson",
          "RandomShuffle", "RandomCrop", "StatefulUniform", "StatefulStandardNormal",
          "StatefulTruncatedNormal", "StatefulRandomBinomial", "TruncatedNormal",
          "ParameterizedTruncatedNormal", "Multinomial", "RngReadAndSkip", "RngSkip")
"""The beginnings of the types of TensorFlow's operations that draw from a
state of their own (`tf.random.uniform`, `tf.nn.dropout`, a `tf.random.
Generator`): run again, they draw other numbers. Keras' draws are stateless
ones, seeded from a `SeedGenerator`'s variable. `_recomputed` looks for them
among the operations a layer's call adds, and in the functions those call
(`_draws`); a draw made by Python code outside TensorFlow's operations
(`tf.numpy_function`) is not seen."""


def _recomputed(layer, call, own, context, sharding: ZeroSharding, args, kwargs):
    """`call(*args, **kwargs)` on `own` gathered, as one operation whose
    gradient gathers them again and runs the call again to differentiate it,
    so that nothing gathered is kept from the forward pass to the backward:
    (the call's outputs, the losses it added). The second run reads the
    layer's other variables (BatchNormalization's statistics, a dropout's
    seed) as the first read them, and assigns nothing: it computes what the
    first computed. Where the first drew numbers that a second would draw
    anew (`_DRAWS`: TensorFlow's own random operations, not Keras'), the
    gradient is taken of the first run's operations instead, which keeps its
    wholes until then. The gradient with respect to each parameter's shard is
    the gather's: the replica's shard of the sum over the replicas."""
    flat = tf.nest.flatten((args, kwargs))
    positions = [i for i, x in enumerate(flat)
                 if tf.is_tensor(x) and (x.dtype.is_floating or x.dtype.is_complex)]
    shards = [tf.convert_to_tensor(v._value) for v in own]  # pylint: disable=protected-access
    # The layer's other variables as the first run reads them (read before it assigns them).
    state = [v for v in layer.non_trainable_variables if not isinstance(v, ShardedParameter)]
    read = [tf.cast(v.value, v.dtype) for v in state]
    # And Keras' context of the call, which the backward pass is outside of: the `training`
    # its layers take from it (a Dropout called without one), the dtype they compute in.
    keras_context = (global_state.get_global_attribute("current_call_ctx"),
                     global_state.get_global_attribute("autocast_scope"))
    first = {}

    def run(xs, after, replay: bool):
        values = list(flat)
        for i, x in zip(positions, xs):
            values[i] = x
        call_args, call_kwargs = tf.nest.pack_sequence_as((args, kwargs), values)
        # Gathered only once `after` is computed: else the graph would run every layer's
        # gather as soon as the step starts (they read only the shards), all wholes at once.
        with tf.control_dependencies(after):
            mapping = [(v, _gather_parameter(s, v, context, sharding))
                       for v, s in zip(own, xs[len(positions):])]
        if replay:
            mapping += list(zip(state, read))
        with _GatheredScope(mapping, replay=replay) as scope, \
                _keras_context(keras_context if replay else None):
            outputs = call(*call_args, **call_kwargs)
        return outputs, list(scope.losses)

    @tf.custom_gradient
    def unit(*xs):
        graph = tf.compat.v1.get_default_graph()
        made = len(graph.get_operations())
        # (the forward: after the layer's inputs; the backward's: after its outputs' gradients)
        first["result"] = result = run(list(xs), xs[:len(positions)], replay=False)
        # This replica's operations of the call: the other replicas' threads add theirs too.
        scope = graph.get_name_scope()
        draws = _draws(graph, [op.node_def for op in graph.get_operations()[made:]
                               if not scope or op.name.startswith(scope + "/")])

        def grad(*upstream, variables=None):
            sources = [*xs, *(variables or [])]
            if draws:  # the first run's operations, differentiated
                targets, seeds = _differentiable(tf.nest.flatten(result), upstream)
                grads = tf.gradients(targets, sources, grad_ys=seeds)
            else:
                with tf.GradientTape() as tape:
                    tape.watch(xs)
                    after = [u.values if isinstance(u, tf.IndexedSlices) else u
                             for u in upstream if u is not None]
                    again = tf.nest.flatten(run(list(xs), after, replay=True))
                targets, seeds = _differentiable(again, upstream)
                grads = tape.gradient(targets, sources, output_gradients=seeds)
            if variables:
                return grads[:len(xs)], grads[len(xs):]
            return grads

        return result, grad

    outputs, losses = unit(*[flat[i] for i in positions], *shards)
    for mine, theirs in zip(tf.nest.flatten(outputs), tf.nest.flatten(first["result"][0])):
        mask = getattr(theirs, "_keras_mask", None)  # (a mask the call set on its outputs)
        if mask is not None:
            mine._keras_mask = mask  # pylint: disable=protected-access
    return outputs, losses


def _draws(graph, nodes, seen=None) -> list[str]:
    """The types of `_DRAWS` operations among `nodes` (`NodeDef`s of `graph`)
    and in the functions they call, at any depth: a `tf.function` inside the
    call, a branch of `tf.cond`, the body of a loop."""
    seen = set() if seen is None else seen
    found = []
    for node in nodes:
        if node.op.startswith(_DRAWS):
            found.append(node.op)
        for value in node.attr.values():
            name = value.func.name if value.HasField("func") else None
            if name and name not in seen:
                seen.add(name)
                function = graph._get_function(name)  # pylint: disable=protected-access
                if function is not None:
                    found += _draws(graph, function.definition.node_def, seen)
    return found


def _differentiable(outputs: list, upstream) -> tuple[list, list]:
    """The floating-point `outputs` that have an upstream gradient, and those
    gradients: (targets, their output gradients)."""
    pairs = [(t, u) for t, u in zip(outputs, upstream) if u is not None and t.dtype.is_floating]
    return [t for t, _ in pairs], [u for _, u in pairs]


@contextlib.contextmanager
def _keras_context(context):
    """Keras' call context and autocast scope set to `context` (a pair, as
    `_recomputed` read them in the first run) for the block, then restored;
    None: left as they are."""
    if context is None:
        yield
        return
    names = ("current_call_ctx", "autocast_scope")
    before = [global_state.get_global_attribute(name) for name in names]
    for name, value in zip(names, context):
        global_state.set_global_attribute(name, value)
    try:
        yield
    finally:
        for name, value in zip(names, before):
            global_state.set_global_attribute(name, value)


def _called_gathered(call, own, context, sharding: ZeroSharding, args, kwargs):
    """`call(*args, **kwargs)` reading `own` (sharded parameters) gathered
    whole, kept until their gradient: (its outputs, the losses it added)."""
    gathered = [(v, _gather_parameter(v._value, v, context, sharding))  # pylint: disable=protected-access
                for v in own]
    with _GatheredScope(gathered) as scope:
        outputs = call(*args, **kwargs)
    return outputs, list(scope.losses)


def _gathering_context(own, sharding: ZeroSharding):
    """The replica context in which a call gathers `own` (its sharded
    parameters); None where it reads them as they are: outside a replica's
    step, in Keras' symbolic build, or where an enclosing call gathered them
    already."""
    context = _step_context(sharding)
    if context is None or in_symbolic_scope() or _mapped(own):
        return None
    return context


def _mapped(variables) -> bool:
    """Whether a scope already maps every one of `variables` to a value."""
    return in_stateless_scope() and all(
        get_stateless_scope().get_current_value(v) is not None for v in variables)


class _GatheredScope(StatelessScope):
    """A Keras `StatelessScope` in which the layers read each sharded
    parameter as its gathered whole (`state_mapping`), and the rest as
    without a scope: another variable's assignment (BatchNormalization's
    statistics, a dropout's seed) is made where the layer makes it, and the
    losses the layers add (`add_loss`, an activity regularizer) are kept in
    `losses` (Keras' stateless scope would drop them). A `replay` (a call run
    again for its gradient) assigns nothing: each assignment is kept in the
    mapping, read back in the call, then dropped."""

    def __init__(self, state_mapping, replay: bool = False):
        super().__init__(state_mapping=state_mapping, collect_losses=True,
                         initialize_variables=False)
        self.replay = replay

    def add_update(self, update):
        variable, value = update
        if self.replay or isinstance(variable, ShardedParameter):
            self.state_mapping[id(variable)] = value  # read back as assigned, in this call
        else:
            variable._direct_assign(value)  # pylint: disable=protected-access


class GatheredOnce:
    """Stage 3 over several micro-batches (`accumulate_steps`): each sharded
    parameter gathered once, before the micro-batches' loop (inside it the
    replicas cannot exchange data), each micro-batch's gradient taken with
    respect to the gathered wholes and summed, and the sum reduce-scattered
    once, after the loop (`scatter`): the gathered parameters and their
    summed gradient are whole for the step, as at stage 2.

    Made by `ZeroSharding.gathered_once`; `tfmulti.models.accumulation.
    sum_gradients` uses it."""

    def __init__(self, variables: list, sharding: ZeroSharding, context):
        self.variables = variables
        self.positions = [i for i, v in enumerate(variables) if isinstance(v, ShardedParameter)]
        with tf.GradientTape() as tape:  # (it sees each replica's read of its own shard)
            self.whole = [_gather_parameter(variables[i]._value,  # pylint: disable=protected-access
                                            variables[i], context, sharding)
                          for i in self.positions]
        self._tape = tape

    def micro_batch(self) -> tuple[list, list]:
        """For one micro-batch's forward and backward, inside the loop: the
        state mapping of a scope to read the sharded parameters from (each to
        its gathered whole: an identity of it, made in the loop's body, so that
        a tape there sees it), and the sources of its gradient (the variables,
        each sharded one replaced by that identity: watch `sources[i]` for i
        in `positions`)."""
        local = [tf.identity(w) for w in self.whole]
        sources = list(self.variables)
        for i, tensor in zip(self.positions, local):
            sources[i] = tensor
        return [(self.variables[i], t) for i, t in zip(self.positions, local)], sources

    def scatter(self, gradients: list) -> list:
        """The summed gradients (whole, one per variable or None), each
        sharded variable's reduce-scattered: this replica's shard of the sum
        over the replicas, as stage 3's step gives it."""
        out = list(gradients)
        used = [(k, i) for k, i in enumerate(self.positions) if gradients[i] is not None]
        if used:
            shards = self._tape.gradient(
                [self.whole[k] for k, _ in used], [self.variables[i] for _, i in used],
                output_gradients=[gradients[i] for _, i in used])
            for (_, i), shard in zip(used, shards):
                out[i] = shard
        return out


def _gather_parameter(shards, variable, context, sharding: ZeroSharding):
    """`variable` whole on this replica, gathered from every replica's shard
    (`shards`: the mirrored shards; read here, so that the tape sees the
    replica's own): the gradient of the gather gives this replica its shard of
    the gradient summed over the replicas (a reduce-scatter)."""
    replica = int(tf.get_static_value(context.replica_id_in_sync_group))
    device = sharding.devices[replica - sharding.first_replica]

    @tf.custom_gradient
    def gather(own):
        with tf.device(device):
            (flat,) = _all_gather(context, sharding, [own])

        def grad(upstream):
            # (the padding's gradient is 0: the whole is the gather's first `size` elements)
            upstream = tf.convert_to_tensor(upstream)[:_size(variable)]
            with tf.device(device):
                if len(sharding.devices) == sharding.num_shards:
                    (scattered,) = _reduce_scatter(context, [upstream], [variable], sharding)
                    return scattered
                total = context.all_reduce(tf.distribute.ReduceOp.SUM, upstream)
                return _shard(total, variable, replica, sharding)

        return flat, grad

    with _outside_control_flow().as_default():
        flat = gather(tf.convert_to_tensor(shards))
        return tf.reshape(flat[:_size(variable)], variable.shape)


_CONTROL_FLOW_GRAPHS = (control_flow_graphs.CondBranchFuncGraph,
                        control_flow_graphs.WhileBodyFuncGraph,
                        control_flow_graphs.WhileCondFuncGraph)
"""The graphs TensorFlow builds a branch of `tf.cond` (`tf.switch_case`) or
the condition and body of a `tf.while_loop` (`tf.map_fn`, `tf.scan`) in."""


def _in_control_flow() -> bool:
    """Whether the graph being built is a branch, or a loop's condition or
    body."""
    return isinstance(tf.compat.v1.get_default_graph(), _CONTROL_FLOW_GRAPHS)


def _outside_control_flow():
    """The graph being built, or, where that is a branch or a loop's body, the
    nearest graph around it that is neither: a gather is built there, before
    the condition or loop (which captures the whole as an input), since the
    replicas exchange their shards only where each of them runs it once."""
    graph = tf.compat.v1.get_default_graph()
    while isinstance(graph, _CONTROL_FLOW_GRAPHS):
        graph = graph.outer_graph
    return graph


def _whole_across_replicas(variable, sharding: ZeroSharding):
    """`variable` whole outside a replica's step (`_gathered_whole`), a tensor."""
    return tf.convert_to_tensor(_gathered_whole(variable, sharding))


def _gathered_whole(variable, sharding: ZeroSharding):
    """`variable` whole outside a replica's step: the local shards joined where
    every shard is here, else gathered from the other processes (a collective,
    `GATHER_TIMEOUT_S` at most) into an array, not copied again."""
    components = variable._value.values  # pylint: disable=protected-access
    if len(sharding.devices) == sharding.num_shards:
        flat = tf.concat([tf.convert_to_tensor(c) for c in components], axis=0)
        return tf.reshape(flat[:_size(variable)], variable.shape)
    flat = sharding.gather_across_processes(
        lambda replica: tf.convert_to_tensor(components[replica - sharding.first_replica]),
        "a sharded parameter (zero_stage=3, shard_embeddings)",
        "reads the weights (saves, calls get_weights)").reshape(-1)
    return flat[:_size(variable)].reshape(variable.shape)


def _update_parameter_shards(optimizer, sharding: ZeroSharding, replica: int, pairs,
                             learning_rate):
    """Stage 3's update on `replica`: each gradient is already the replica's
    shard of the sum (the gather's gradient), so the replica's copy of the
    optimizer updates its shard of the parameter in place (its decay first, as
    Keras decays before the rule); nothing is gathered. One parameter after
    the other, in the order the backward pass gives their gradients (the
    last layer's first), each waiting for the assignment before it: the step
    holds one parameter's transients of the rule at a time (a table's shard
    and its moments), and no gradient waits for another's."""
    own = sharding.shards[replica]
    copy = sharding.optimizers[replica]
    updates = []
    with tf.device(sharding.devices[replica - sharding.first_replica]):
        for grad, position in reversed(pairs):
            with tf.control_dependencies(updates[-1:]):
                variable = sharding.variables[position]
                local = variable._value._get_on_device_or_primary()  # pylint: disable=protected-access
                shard = own[position]
                shard.value = tf.convert_to_tensor(local)
                if optimizer.weight_decay is not None and optimizer._use_weight_decay(variable):
                    rate = tf.cast(learning_rate, shard.value.dtype)
                    shard.value = shard.value - shard.value * tf.cast(
                        optimizer.weight_decay, shard.value.dtype) * rate
                copy.update_step(tf.identity(grad), shard, learning_rate)
                updates.append(local.assign(shard.value))
                shard.value = None
    return updates
