"""Gradient accumulation: one optimizer update per k micro-batches, under
any strategy.

`accumulate_gradients(model, k)` gives a Keras model a train step that splits
each replica's batch (k*b rows) into k contiguous micro-batches of b rows,
runs forward and backward on each in turn in a `tf.while_loop` (one
iteration at a time, so only one micro-batch's activations are alive), sums
the gradients of loss_j / k in loop-carried tensors, and applies them with
ONE `apply_gradients` after the loop, where Keras' own train step applies: k
micro-steps of B rows are one step of k*B rows. The loss tracker and the
compiled metrics see every micro-batch. The loss is scaled by the optimizer
(`scale_loss`) before the gradients and unscaled by `apply_gradients` once,
so a `LossScaleOptimizer` (mixed float16) checks and unscales the summed
gradients. Sparse gradients (embeddings) are summed dense, except where the
optimizer updates rows lazily (`tfmulti.models.sparse_updates`): there each
table's rows are gathered over the micro-batches and applied as rows. `sum_gradients`
is the loop itself, shared with `tfmulti.training.loops`.

Why not Keras' own, `optimizer(gradient_accumulation_steps=k)`: it decides
on every step whether to apply or to add to its accumulators with an
`ops.cond` inside the replica function; the applying branch all-reduces the
gradients and updates the mirrored variables, both `merge_call`s, and
TensorFlow does not allow a `merge_call` inside control flow in a replica
context: under MirroredStrategy with 2+ replicas the first step fails with
"RuntimeError: `merge_call` called while defining a new graph or a
tf.function" (on one device it works). Upstream, Keras 3:
https://github.com/keras-team/keras/issues/20582 (open); the same error with
Keras 2 custom train steps: https://github.com/keras-team/keras/issues/17429
and https://github.com/tensorflow/tensorflow/issues/59487. Here nothing is
conditional.

The micro-batch step copies Keras' TensorFlow train step, so, like the
patches of `tfmulti.runtime.keras_fixes`, it checks that step against the
SHA-256 of its source (`KERAS_COPIED`) and refuses to run on another.
"""

from __future__ import annotations

import functools
import warnings

import tensorflow as tf

from tfmulti.runtime import keras_fixes
from tfmulti.utils import human

__all__ = ["KERAS_COPIED", "accumulate_gradients", "sum_gradients"]

_TRAIN_STEP = "keras.src.backend.tensorflow.trainer:TensorFlowTrainer.train_step"

KERAS_COPIED = {  # "module:qualified name" -> SHA-256 of its source in Keras 3.15
    _TRAIN_STEP: "debf0efab9d5794b017ade2937acbcc51886fc1dc5cf021e7d7e80f974ee707c",
}
"""The Keras function the micro-batch step copies, with the SHA-256 of its
source (checked as `keras_fixes.KERAS_ORIGINALS` is)."""

_ACCUMULATE_HOOK = "accumulate_gradients"  # a model class's own implementation


def _micro_batches(data, steps: int):
    """Each tensor of `data` reshaped to [steps, rows // steps, ...] (contiguous chunks)."""
    tensors = [t for t in tf.nest.flatten(data) if t is not None]
    if not tensors:
        raise ValueError("accumulate_steps needs a batch of tensors, got none.")
    rows = tensors[0].shape[0]
    if rows is not None and rows % steps:
        replicas = tf.distribute.get_strategy().num_replicas_in_sync
        raise ValueError(
            f"Each replica's batch ({rows} rows) must be divisible by accumulate_steps "
            f"({steps}); make the global batch a multiple of {steps} x "
            f"{human.count(replicas, 'replica')}, e.g. {steps * replicas * max(1, rows // steps)}.")

    def split(t):
        t = tf.convert_to_tensor(t)
        checks = [] if t.shape[0] is not None else [tf.debugging.assert_equal(
            tf.shape(t)[0] % steps, 0,
            message=f"each replica's batch must be divisible by accumulate_steps ({steps}); "
                    f"drop the remainder (drop_remainder=True) or use a multiple of it")]
        with tf.control_dependencies(checks):
            shape = tf.concat([[steps, -1], tf.shape(t)[1:]], 0)
        micro = None if t.shape[0] is None else t.shape[0] // steps
        return tf.ensure_shape(tf.reshape(t, shape), [steps, micro, *t.shape[1:]])

    return tf.nest.map_structure(lambda t: None if t is None else split(t), data)


def sum_gradients(loss_fn, data, variables, steps: int, rows=frozenset()):
    """The gradients of `loss_fn` summed over `steps` micro-batches of `data`.

    Splits every tensor of `data` along its first axis into `steps`
    contiguous chunks and, one chunk after the other in a `tf.while_loop`
    (only one chunk's activations alive at a time), adds the gradients of
    `loss_fn(chunk)` with respect to `variables`. No synchronization happens
    inside the loop: the caller applies the sum once, after it (at ZeRO stage
    3, the parameters are gathered once before the loop and the sum
    reduce-scattered after it: `tfmulti.parallel.zero.GatheredOnce`). With
    `steps == 1`, the gradients of `loss_fn(data)`, no loop. Shared by
    `accumulate_gradients` (Keras' `fit`) and `tfmulti.training.loops`.

    Args:
        loss_fn: chunk -> (loss to differentiate, a scalar to report); runs
            once per chunk (side effects such as metric updates happen once
            per chunk).
        data: a nest of tensors with a common first (batch) axis; None leaves
            stay None.
        variables: the variables to differentiate against.
        steps: the number of chunks (>= 1).
        rows: ids of the variables (embedding tables, under lazy sparse
            updates: `tfmulti.models.sparse_updates`) whose gradient is kept
            as rows: each chunk's rows (`tf.IndexedSlices`; a dense gradient
            as all its rows) gathered over the chunks, never summed into a
            dense table.

    Returns:
        (one gradient per variable, dense (rows for `rows`), or None where
        the loss does not depend on the variable; the sum of the reported
        scalars).

    Raises:
        ValueError: a static batch not divisible by `steps` (a dynamic one
            fails a run-time assertion with the same advice), or, with 2+
            replicas, a forward pass that assigns a variable summed across
            replicas or otherwise exchanges data across them (a `merge_call`
            inside the loop). A variable synchronized by its mean
            (BatchNormalization's statistics, with tfmulti's fix) is assigned
            on each replica's copy inside the loop, and the copies made their
            mean after it.
    """
    variables = list(variables)
    if steps == 1:
        with tf.GradientTape() as tape:
            loss, report = loss_fn(data)
        return tape.gradient(loss, variables), report
    chunks = _micro_batches(data, steps)
    no_gradient = []  # per variable: found when the loop body is traced
    # ZeRO stage 3 (tfmulti.parallel.zero): the sharded parameters gathered once, before
    # the loop, where the replicas can exchange them; their summed gradient scattered after.
    sharding = next((v._tfmulti_sharding for v in variables  # pylint: disable=protected-access
                     if hasattr(v, "_tfmulti_sharding")), None)
    gathered = sharding.gathered_once(variables) if sharding is not None else None

    synchronized: dict[int, object] = {}  # variables the loop assigned each replica's copy of
    # The tables kept as rows: each chunk's rows written to a TensorArray (by position).
    kept = {j: n for n, j in enumerate(
        j for j, v in enumerate(variables) if id(v) in rows and gathered is None)}

    def body(i, reported, sums, kept_rows):
        chunk = tf.nest.map_structure(lambda t: None if t is None else t[i], chunks)
        mapping, sources = ([], variables) if gathered is None else gathered.micro_batch()
        with _micro_batch_scope(mapping, synchronized), tf.GradientTape() as tape:
            if gathered is not None:
                tape.watch([sources[p] for p in gathered.positions])
            loss, report = loss_fn(chunk)
        grads = tape.gradient(loss, sources)
        no_gradient[:] = [g is None for g in grads]
        kept_rows = list(kept_rows)
        for j, n in kept.items():
            if grads[j] is not None:
                values, indices = kept_rows[n]
                g = _as_rows(grads[j])
                kept_rows[n] = (values.write(i, tf.cast(g.values, values.dtype)),
                                indices.write(i, tf.cast(g.indices, tf.int64)))
        sums = [s if g is None or j in kept else s + tf.cast(tf.convert_to_tensor(g), s.dtype)
                for j, (s, g) in enumerate(zip(sums, grads))]
        return i + 1, reported + tf.cast(report, tf.float32), sums, kept_rows

    zeros = [tf.zeros([] if j in kept else v.shape, v.dtype) for j, v in enumerate(variables)]
    empty = [(tf.TensorArray(variables[j].dtype, size=steps, infer_shape=False,
                             element_shape=tf.TensorShape([None, *variables[j].shape[1:]])),
              tf.TensorArray(tf.int64, size=steps, infer_shape=False,
                             element_shape=tf.TensorShape([None])))
             for j in kept]
    try:
        _, reported, sums, kept_rows = tf.while_loop(
            lambda i, *_: i < steps, body, (tf.constant(0), tf.constant(0.0), zeros, empty),
            parallel_iterations=1)
    except RuntimeError as e:
        if "merge_call" not in str(e):
            raise
        raise ValueError(
            f"With {steps} micro-batches per update, the forward pass runs inside a loop, and "
            f"a layer there exchanges data across replicas (a merge_call), which TensorFlow "
            f"cannot do inside control flow; train without accumulation, or keep that "
            f"exchange out of the layer's call.") from e
    for variable in synchronized.values():  # each replica's copy made their mean (or first)
        variable.assign(variable.value)
    for j, n in kept.items():
        if no_gradient[j]:  # nothing written
            continue
        values, indices = kept_rows[n]
        sums[j] = tf.IndexedSlices(values.concat(), indices.concat(),
                                   tf.constant(list(variables[j].shape), tf.int64))
    sums = [None if missing else s for s, missing in zip(sums, no_gradient)]
    return (sums if gathered is None else gathered.scatter(sums)), reported


def _as_rows(gradient) -> tf.IndexedSlices:
    """A table's gradient as rows: as it came, or (a table also used densely,
    e.g. tied to an output layer) every row of it."""
    if isinstance(gradient, tf.IndexedSlices):
        return gradient
    gradient = tf.convert_to_tensor(gradient)
    return tf.IndexedSlices(gradient, tf.range(tf.shape(gradient, out_type=tf.int64)[0]))


@functools.cache
def _micro_batch_scope_class():
    from keras.src.backend.common.stateless_scope import StatelessScope
    from tensorflow.python.distribute import values as values_lib

    class MicroBatchScope(StatelessScope):
        """Keras' variables as a micro-batch's forward reads and assigns them
        inside the loop: each in `state_mapping` (ZeRO stage 3's gathered
        parameters) read as mapped, any other as it is; a variable synchronized on write across
        replicas (BatchNormalization's statistics, mean-aggregated by
        tfmulti's fix for tensorflow#46488), whose assignment is a merge_call
        that a loop cannot hold, assigned on this replica's copy only and
        recorded in `synchronized` (`sum_gradients` assigns the mean of the
        copies after the loop: for a moving average, the same as each
        micro-batch's mean); any other assigned as without a scope; the
        losses the layers add kept in `losses` (a model's `losses` reads them
        inside the scope)."""

        def __init__(self, state_mapping, synchronized: dict):
            super().__init__(state_mapping=state_mapping, collect_losses=True,
                             initialize_variables=False)
            self.synchronized = synchronized

        def get_current_value(self, variable):
            # Keras reads a variable from its scope (a regularizer's loss takes the value
            # it returns): the mapped value, else the variable's own, read now.
            value = super().get_current_value(variable)
            inner = getattr(variable, "_value", None)
            if value is not None or inner is None or hasattr(variable, "_tfmulti_sharding"):
                return value
            return tf.convert_to_tensor(inner)

        def add_update(self, update):
            variable, value = update
            if id(variable) in self.state_mapping or hasattr(
                    variable, "_tfmulti_sharding"):  # (a sharded parameter: read as assigned)
                self.state_mapping[id(variable)] = value
                return
            inner = getattr(variable, "_value", None)
            aggregation = getattr(inner, "aggregation", tf.VariableAggregation.NONE)
            if (not isinstance(inner, values_lib.MirroredVariable)
                    or aggregation == tf.VariableAggregation.NONE
                    or tf.distribute.get_replica_context() is None):
                variable._direct_assign(value)  # pylint: disable=protected-access
                return
            if aggregation == tf.VariableAggregation.SUM:
                raise ValueError(
                    f"With accumulate_steps above 1 the forward pass runs in a loop, and it "
                    f"assigns {variable.path}, summed across replicas (aggregation 'sum'), "
                    f"which a loop cannot do; make it aggregation='mean' or 'none', or train "
                    f"without accumulation.")
            local = inner._get_on_device_or_primary()  # pylint: disable=protected-access
            local.assign(tf.cast(value, local.dtype))
            self.synchronized[id(variable)] = variable

    return MicroBatchScope


def _micro_batch_scope(state_mapping, synchronized: dict):
    return _micro_batch_scope_class()(state_mapping, synchronized)


def _check_keras_accumulation(model, steps: int) -> None:
    optimizer = getattr(model, "optimizer", None)
    keras_steps = getattr(optimizer, "gradient_accumulation_steps", None)
    inner = getattr(optimizer, "inner_optimizer", None)  # a LossScaleOptimizer
    keras_steps = keras_steps or getattr(inner, "gradient_accumulation_steps", None)
    if not keras_steps:
        return
    replicas = model.distribute_strategy.num_replicas_in_sync
    if steps > 1:
        raise ValueError(
            f"The optimizer sets Keras' own gradient_accumulation_steps ({keras_steps}) and "
            f"tfmulti accumulates too (accumulate_steps={steps}); leave "
            f"gradient_accumulation_steps unset and use accumulate_steps alone.")
    if replicas > 1:
        raise ValueError(
            f"Keras' own gradient_accumulation_steps ({keras_steps}) fails with {replicas} "
            f"replicas (keras-team/keras#20582: merge_call inside a cond); leave it unset in "
            f"the optimizer and use tfmulti's accumulate_steps={keras_steps} "
            f"(tfmulti.models.accumulation.accumulate_gradients).")


def _accumulating_train_step(model, data):
    """Keras' TensorFlow train step (keras/src/backend/tensorflow/trainer.py),
    over `model._tfmulti_accumulate_steps` micro-batches."""
    import keras
    from keras.src.losses import loss as loss_module

    steps = model._tfmulti_accumulate_steps  # pylint: disable=protected-access
    _check_keras_accumulation(model, steps)
    if steps == 1:
        return type(model).train_step(model, data)
    if not model.built or (model.optimizer is not None and not model.optimizer.built):
        # Without a strategy Keras builds the model and the optimizer in the
        # first traced step; their variables must exist before the loop.
        model._symbolic_build(data_batch=data)  # pylint: disable=protected-access

    def loss_fn(chunk):
        x, y, sample_weight = chunk
        y_pred = model(x, training=True) if model._call_has_training_arg else model(x)
        loss = model._compute_loss(x=x, y=y, y_pred=y_pred, sample_weight=sample_weight,
                                   training=True)
        model._loss_tracker.update_state(
            loss_module.unscale_loss_for_distribution(loss),
            sample_weight=tf.shape(next(i for i in tf.nest.flatten(x) if i is not None))[0])
        model.compute_metrics(x, y, y_pred, sample_weight=sample_weight)
        if model.optimizer is not None:
            loss = model.optimizer.scale_loss(loss)
        return loss / steps, 0.0

    trainable = model.trainable_weights
    gradients, _ = sum_gradients(loss_fn, keras.utils.unpack_x_y_sample_weight(data),
                                 trainable, steps, rows=_lazy_tables(model))
    if trainable:
        model.optimizer.apply_gradients(zip(gradients, trainable))
    else:
        warnings.warn("The model does not have any trainable weights.")
    return model.get_metrics_result()


def _lazy_tables(model) -> frozenset:
    """Ids of the embedding tables whose summed gradient stays rows: those a
    lazy optimizer updates by rows (`tfmulti.models.sparse_updates.row_tables`);
    none where the optimizer is not lazy."""
    from tfmulti.models import sparse_updates

    optimizer = getattr(model, "optimizer", None)
    optimizer = getattr(optimizer, "inner_optimizer", optimizer)  # a LossScaleOptimizer's
    if optimizer is None or not sparse_updates.is_lazy(optimizer):
        return frozenset()
    return frozenset(id(layer.embeddings) for layer in sparse_updates.row_tables(model))


def accumulate_gradients(model, steps: int):
    """Makes `model.fit` apply one update per `steps` micro-batches.

    Each replica splits its per-replica batch (`steps` x b rows) into `steps`
    contiguous micro-batches of b rows, runs forward and backward on each in
    turn (only one micro-batch's activations alive at a time), sums the
    gradients of loss / `steps`, and applies them once: `steps` micro-steps
    of global batch B equal one step of `steps` x B, under one device,
    MirroredStrategy and MultiWorkerMirroredStrategy, with any
    `steps_per_execution`. The loss and the compiled metrics see every
    micro-batch. BatchNormalization's moving statistics are updated per
    micro-batch (b rows), so they differ from the big batch's.

    Call it before or after `model.compile` (the step is replaced on the
    model object; compiling again keeps it). `steps=1` trains with Keras' own
    step, and still refuses Keras' `gradient_accumulation_steps` under 2+
    replicas with a clear message. The global batch must be divisible by
    `steps` x replicas (and so must a last partial batch: use
    `drop_remainder=True`).

    Args:
        model: a Keras model (functional, Sequential or subclassed) that keeps
            Keras' own `train_step`, built under its strategy's scope. A
            model class that accumulates by itself defines a method
            `accumulate_gradients(steps)`, which is called instead (as
            `tfmulti.PipelineModel` does: `steps` rounds of its schedule).
        steps: micro-batches per update (>= 1).

    Returns:
        The model.

    Raises:
        ValueError: `steps` is not an integer >= 1; the model overrides
            `train_step` (a step tfmulti cannot split); the optimizer also sets Keras'
            `gradient_accumulation_steps` (or sets it under 2+ replicas,
            where Keras' fails: use this instead). Some of these are raised
            when `fit` traces the step (the optimizer, the batch size).
        RuntimeError: the installed Keras changed the train step this copies
            (see `KERAS_COPIED`).

    Example:
        >>> import keras, numpy as np
        >>> from tfmulti.models import accumulation
        >>> model = keras.Sequential([keras.Input((3,)), keras.layers.Dense(1)])
        >>> model.compile("sgd", "mse")
        >>> model = accumulation.accumulate_gradients(model, 4)
        >>> x, y = np.ones((32, 3), "float32"), np.ones((32, 1), "float32")
        >>> _ = model.fit(x, y, batch_size=16, verbose=0)  # 2 updates of 4 x 4 rows
        >>> int(model.optimizer.iterations)
        2
    """
    if isinstance(steps, bool) or not isinstance(steps, int) or steps < 1:
        raise ValueError(f"`accumulate_steps` must be an integer >= 1, got {steps!r}.")
    own = getattr(type(model), _ACCUMULATE_HOOK, None)
    if own is not None:
        return own(model, steps) or model
    from keras.src.backend.tensorflow.trainer import TensorFlowTrainer

    if steps > 1 and type(model).train_step is not TensorFlowTrainer.train_step:
        raise ValueError(
            f"{type(model).__name__} overrides `train_step`, which tfmulti cannot split into "
            f"micro-batches (accumulate_steps={steps}); sum the gradients in your own step "
            f"(tfmulti.models.accumulation.sum_gradients), or train with tfmulti.training.loops.")
    changed = keras_fixes.changed_keras_functions(KERAS_COPIED) if steps > 1 else []
    if changed:
        import keras

        raise RuntimeError(
            f"tfmulti's gradient accumulation was written for Keras "
            f"{keras_fixes.TESTED_KERAS}, and in the installed Keras {keras.__version__} these "
            f"functions differ: {', '.join(changed)}: its micro-batch step copies Keras' train "
            f"step and could train wrongly; install keras=={keras_fixes.TESTED_KERAS}.* "
            f"(setup.cfg pins it) to accumulate gradients.")
    _check_keras_accumulation(model, steps)
    model._tfmulti_accumulate_steps = steps  # pylint: disable=protected-access
    model.train_step = functools.partial(_accumulating_train_step, model)
    model.train_function = None  # made again, with this step, by the next fit
    return model
