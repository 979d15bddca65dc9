"""Every workaround tfmulti applies for an upstream Keras or TensorFlow bug.

Each fix names its upstream issue and has a test in tests/test_workarounds.py
that shows the upstream bug still happens without the fix on the pinned
versions, so a fix can be dropped as soon as upstream mends it.

The fixes that replace or copy private Keras functions (`keras.src...`)
check, before they patch, that each function is the one they were written
for (`KERAS_ORIGINALS`); otherwise the fix stays off with a warning naming
the upstream issue and the Keras versions, or, where the user asked for it
(`accumulate_gradients`), raises.
"""

from __future__ import annotations

import functools
import hashlib
import inspect
import itertools
import threading
import warnings

import tensorflow as tf

__all__ = ["KERAS_ORIGINALS", "TESTED_KERAS", "accumulate_gradients",
           "apply_empty_batch_conv_fix", "apply_multi_step_fix", "apply_multi_worker_fixes",
           "mirrored_strategy", "run_steps", "slurm_cluster_resolver", "sum_gradients"]

# --------------------------------------------------------------------------
# The guard: patch only the Keras functions the fixes were written for.
#
# Fixes 2, 3, 5, 6 and 7 replace, wrap or copy private Keras functions. A
# Keras release may change them; patching a changed function could train
# wrongly without an error. So each fix first compares the SHA-256 of the
# source of every function it replaces or copies with the digest recorded
# here from the Keras version it was written and tested for (setup.cfg pins
# that minor version). On a mismatch the automatic fixes stay off with a
# warning (the upstream bug may be fixed, or may show), and
# `accumulate_gradients` raises.
# --------------------------------------------------------------------------

TESTED_KERAS = "3.15"
"""The Keras minor version the patched functions were read from."""

KERAS_ORIGINALS = {  # "module:qualified name" -> SHA-256 of its source in Keras 3.15
    "keras.src.backend.tensorflow.trainer:TensorFlowTrainer._maybe_symbolic_build":
        "92a504f5eba9b29f81f1bf26180bdd5bf5186b06b7bda426534b90d2d02bc1c2",
    "keras.src.backend.tensorflow.trainer:reduce_per_replica":
        "2e7d54b1e6edc29a8c6a7e6b66cd4c8be3ba7842412c93753ac3afe169fa7fb8",
    "keras.src.backend.tensorflow.trainer:TensorFlowTrainer._make_function":
        "bb33b7a0da3d27406c70fac54b8e9617156ef225f452b93f6addf8cc34aca0d0",
    "keras.src.backend.tensorflow.nn:conv":
        "1bae7c0469d44106255c586b417ef4463ed1b7524095f3331fbab2685b99d3e3",
    "keras.src.backend.tensorflow.nn:depthwise_conv":
        "492c94d51f85389fa2d8aca5cf1b29b5dd3a7b1bf0548eef88dde2587852f0f0",
    "keras.src.backend.tensorflow.nn:separable_conv":
        "d163319653f9a8465c41d90834941a4a2ceeafe9b049d81d1dc66e43c902b95e",
    "keras.src.backend.tensorflow.trainer:TensorFlowTrainer.train_step":
        "debf0efab9d5794b017ade2937acbcc51886fc1dc5cf021e7d7e80f974ee707c",
}
"""Each Keras function a fix replaces or copies, with the SHA-256 of its source."""


def _resolve(name: str):
    import importlib

    module, _, path = name.partition(":")
    target = importlib.import_module(module)
    for part in path.split("."):
        target = getattr(target, part)
    return target


def _source_digest(function) -> str | None:
    """The SHA-256 of `function`'s source text (None where it has none)."""
    try:
        return hashlib.sha256(inspect.getsource(function).encode()).hexdigest()
    except (OSError, TypeError):
        return None


def _changed(names) -> list[str]:
    """Which of `names` (keys of KERAS_ORIGINALS) are not the recorded functions."""
    return [name for name in names if _source_digest(_resolve(name)) != KERAS_ORIGINALS[name]]


def _explain(fix: str, upstream: str, changed: list[str]) -> str:
    import keras

    return (f"tfmulti's fix {fix} ({upstream}) was written for Keras {TESTED_KERAS}, and in "
            f"the installed Keras {keras.__version__} these functions differ: "
            f"{', '.join(changed)}")


def _keras_unchanged(fix: str, upstream: str, *names: str) -> bool:
    """Whether the functions fix `fix` patches are the recorded ones; if not,
    warns that the fix stays off."""
    changed = _changed(names)
    if changed:
        warnings.warn(
            f"{_explain(fix, upstream, changed)}. The fix stays off, so the upstream bug may "
            f"show; install keras=={TESTED_KERAS}.* (setup.cfg pins it).",
            RuntimeWarning, stacklevel=3)
    return not changed


# --------------------------------------------------------------------------
# Fix 1: several MirroredStrategy instances in one process share collective
# group keys.
#
# Upstream: https://github.com/tensorflow/tensorflow/issues/61314 and
# https://github.com/tensorflow/tensorflow/issues/62790. Every
# MirroredStrategy numbers its collective groups from the same start
# (`_collective_key_base`, 0 outside TensorFlow's own tests), so a second
# strategy over a different set of devices (a notebook trying 2 then 4
# replicas, a test suite, a sweep) reuses group key 1 with another group size
# and its first all-reduce fails with "Device ... is joining a group with
# size 4, but that group has size 2". TensorFlow's own tests avoid it by
# raising the base by 100000 for each strategy
# (tensorflow/python/distribute/strategy_combinations.py); we do the same.
# --------------------------------------------------------------------------

_KEY_STRIDE = 100_000
_key_bases = itertools.count(start=_KEY_STRIDE, step=_KEY_STRIDE)
_key_lock = threading.Lock()


def mirrored_strategy(devices, cross_device_ops=None) -> tf.distribute.MirroredStrategy:
    """`tf.distribute.MirroredStrategy` with collective keys of its own."""
    cls = tf.distribute.MirroredStrategy
    with _key_lock:
        previous = cls._collective_key_base  # pylint: disable=protected-access
        cls._collective_key_base = next(_key_bases)  # pylint: disable=protected-access
        try:
            return cls(devices=devices, cross_device_ops=cross_device_ops)
        finally:
            cls._collective_key_base = previous  # pylint: disable=protected-access


# --------------------------------------------------------------------------
# Fixes 2 and 3: Keras 3 `fit`/`evaluate`/`predict` under
# MultiWorkerMirroredStrategy (TensorFlow 2.21, Keras 3.15).
#
# Fix 2, symbolic build. `TensorFlowTrainer._maybe_symbolic_build` peeks at
# one distributed batch and reduces the whole `(x, y)` structure with one
# `strategy.reduce("MEAN", batch, axis=None)`; under MultiWorkerMirroredStrategy
# that is a collective over a nested structure and fails with "Attempt to
# convert a value (PerReplica...) to a Tensor". The build needs only shapes
# and dtypes, so we use the first local replica's batch instead: no
# collective at all. Upstream: https://github.com/keras-team/keras/issues/20585
# (also dict inputs: https://github.com/keras-team/keras/issues/20329).
#
# Fix 3, metric reduction. `reduce_per_replica(..., reduction="mean")`
# reduces every logged value with `strategy.reduce("MEAN", v, axis=0)` under
# MultiWorkerMirroredStrategy; logs are scalars, so it fails with "Invalid
# reduction dimension 0 for input with 0 dimensions". We reduce scalars with
# `axis=None` (the mean over replicas, as Keras does for one worker), all of
# them stacked in one collective per step instead of one per metric.
# Upstream: https://github.com/tensorflow/tensorflow/issues/72388 and
# https://github.com/keras-team/keras/issues/20585.
#
# Both patches change behaviour only under a multi-worker
# MultiWorkerMirroredStrategy and are installed by
# `apply_multi_worker_fixes()`, which `get_strategy("multi_worker")` calls.
# --------------------------------------------------------------------------

_applied: set[str] = set()  # the patches installed
_off: set[str] = set()  # the patches left off: Keras changed the functions they replace

_TRAINER = "keras.src.backend.tensorflow.trainer:"


def _may_patch(key: str, fix: str, upstream: str, *names: str) -> bool:
    """Whether to install patch `key` now: not installed yet, and the Keras
    functions it replaces are the recorded ones (else it stays off; one warning)."""
    if key in _applied or key in _off:
        return False
    if _keras_unchanged(fix, upstream, *names):
        return True
    _off.add(key)
    return False


def _is_multi_worker(strategy) -> bool:
    return isinstance(strategy, tf.distribute.MultiWorkerMirroredStrategy) and (
        strategy.extended._in_multi_worker_mode()  # pylint: disable=protected-access
    )


def apply_multi_worker_fixes() -> None:
    """Installs fixes 2 and 3 (idempotent)."""
    from keras.src.backend.tensorflow import trainer as tf_trainer
    from keras.src import tree

    if _may_patch("symbolic_build", "2", "keras-team/keras#20585",
                  _TRAINER + "TensorFlowTrainer._maybe_symbolic_build"):
        original_build = tf_trainer.TensorFlowTrainer._maybe_symbolic_build

        def _maybe_symbolic_build(self, iterator=None, data_batch=None):
            strategy = self._distribute_strategy
            if iterator is None or strategy is None or not _is_multi_worker(strategy):
                return original_build(self, iterator=iterator, data_batch=data_batch)
            for _, _, it in iterator:
                batch = next(it)
                data_batch = tree.map_structure(
                    lambda v: strategy.experimental_local_results(v)[0]
                    if isinstance(v, tf.distribute.DistributedValues) else v,
                    batch,
                )
                break
            with strategy.scope():
                self._symbolic_build(data_batch=data_batch)

        _maybe_symbolic_build.__wrapped__ = original_build
        tf_trainer.TensorFlowTrainer._maybe_symbolic_build = _maybe_symbolic_build
        _applied.add("symbolic_build")

    if _may_patch("reduce_per_replica", "3", "tensorflow/tensorflow#72388",
                  _TRAINER + "reduce_per_replica"):
        original_reduce = tf_trainer.reduce_per_replica

        def reduce_per_replica(values, strategy, reduction):
            if not _is_multi_worker(strategy) or reduction not in ("auto", "mean"):
                return original_reduce(values, strategy, reduction)
            flat = tree.flatten(values)
            local = [strategy.experimental_local_results(v)[0] for v in flat]
            scalars = [i for i, v in enumerate(local) if v.shape.rank == 0]
            # All scalar logs of one dtype in one collective: every collective
            # is a barrier between the workers, and this runs every step.
            for dtype in sorted({local[i].dtype for i in scalars}, key=str):
                group = [i for i in scalars if local[i].dtype == dtype]
                stacked = strategy.run(lambda *v: tf.stack(v), args=[flat[i] for i in group])
                means = tf.unstack(strategy.reduce("MEAN", stacked, axis=None), len(group))
                for i, mean in zip(group, means):
                    flat[i] = mean
            for i, v in enumerate(local):
                if v.shape.rank != 0:
                    flat[i] = original_reduce(flat[i], strategy, reduction)
            return tree.pack_sequence_as(values, flat)

        reduce_per_replica.__wrapped__ = original_reduce
        tf_trainer.reduce_per_replica = reduce_per_replica
        _applied.add("reduce_per_replica")


# --------------------------------------------------------------------------
# Fix 4: SlurmClusterResolver on nodes without GPUs.
#
# `SlurmClusterResolver` asks `nvidia-smi` for the GPU count (a crash with
# FileNotFoundError where it does not exist), and given `gpus_per_node=0` it
# pairs every task with a GPU slot (`zip(range(tasks), range(0, gpus, per_task))`)
# and fails with "range() arg 3 must not be zero" (or lists no tasks at all).
# Upstream: https://github.com/tensorflow/tensorflow/issues/56894
# ("SlurmClusterResolver cannot be configured to use no GPUs"). On CPU-only nodes we give it one placeholder
# GPU slot per task and turn `auto_set_gpu` off, so it computes the cluster
# and never touches CUDA_VISIBLE_DEVICES.
# --------------------------------------------------------------------------

def slurm_cluster_resolver(port_base: int):
    """`SlurmClusterResolver` that also works on CPU-only nodes."""
    import os
    import shutil

    from tensorflow.python.distribute.cluster_resolver import slurm_cluster_resolver as slurm

    resolver_cls = tf.distribute.cluster_resolver.SlurmClusterResolver
    if "CUDA_VISIBLE_DEVICES" in os.environ or shutil.which("nvidia-smi"):
        return resolver_cls(port_base=port_base)
    max_tasks = max(slurm.expand_tasks_per_node(os.environ["SLURM_STEP_TASKS_PER_NODE"]))
    return resolver_cls(port_base=port_base, gpus_per_node=max_tasks, gpus_per_task=1,
                        auto_set_gpu=False)


# --------------------------------------------------------------------------
# Fix 5: `steps_per_execution > 1` with 2 or more replicas.
#
# Keras 3 runs several steps per call in a `tf.while_loop` whose body calls
# `strategy.run` inside a `tf.cond` over optional inputs; under
# MirroredStrategy with 2+ replicas that graph fails with "You must feed a
# value for placeholder tensor '.../while/cond/Placeholder_1'".
# Upstream: https://github.com/keras-team/keras/issues/19246. With 2+
# replicas we build the multi-step function the way TensorFlow's own custom
# training loops do: the first step outside the loop, then a `tf.while_loop`
# over `get_next_as_optional()` whose body calls `strategy.run` directly (no
# `tf.cond` around it); only the fetch of the next batch is conditional, so no
# batch is consumed beyond `steps_per_execution`. The loop carries the
# per-replica logs and reduces them once, after the last step (the logs are
# the metrics' running results, so only the last step's count): under
# MultiWorkerMirroredStrategy that reduction is a collective, a barrier
# between the workers, so a block of K steps has K + 1 barriers, not 2K.
# --------------------------------------------------------------------------

def run_steps(one_step, iterator, steps: int, outputs=None):
    """Runs `outputs = one_step(batch, outputs)` on up to `steps` batches of
    `iterator` (fix 5's loop; inside a `tf.function`).

    The first step runs outside the loop (it fixes the outputs' structure),
    then a `tf.while_loop` over `get_next_as_optional()` whose body calls
    `one_step` directly (no `tf.cond` around `strategy.run`); only the fetch
    of the next batch is conditional, so no batch is consumed beyond `steps`.

    Args:
        one_step: (batch, previous outputs) -> outputs; `previous` is
            `outputs` on the first step.
        iterator: a `tf.data.Iterator` or `tf.distribute.DistributedIterator`.
        steps: the most steps to run (>= 1; fewer where the data ends).
        outputs: what the first step gets as its previous outputs.

    Returns:
        (the number of steps run, an int32 tensor; the last step's outputs).

    Raises:
        tf.errors.OutOfRangeError: the iterator had no batch at all.
    """
    outputs = one_step(iterator.get_next(), outputs)

    def more(i, outputs, next_inputs):
        return tf.logical_and(i < steps, next_inputs.has_value())

    def body(i, outputs, next_inputs):
        outputs = one_step(next_inputs.get_value(), outputs)
        next_inputs = tf.cond(i + 1 < steps, iterator.get_next_as_optional,
                              lambda: next_inputs)
        return i + 1, outputs, next_inputs

    if steps == 1:
        return tf.constant(1), outputs
    done, outputs, _ = tf.while_loop(
        more, body, [tf.constant(1), outputs, iterator.get_next_as_optional()])
    return done, outputs


def _multi_step_function(trainer, step_function):
    from keras.src.backend.tensorflow import trainer as tf_trainer

    strategy = trainer.distribute_strategy
    steps = trainer.steps_per_execution

    @tf.autograph.experimental.do_not_convert
    def one_step_on_data(data):
        return strategy.run(step_function, args=(data,))

    if not trainer.run_eagerly:
        one_step_on_data = tf.function(one_step_on_data, reduce_retracing=True,
                                       jit_compile=trainer.jit_compile)

    def reduce(outputs):
        return tf_trainer.reduce_per_replica(outputs, strategy, reduction="auto")

    @tf.autograph.experimental.do_not_convert
    def multi_step_on_iterator(iterator):
        _, outputs = run_steps(lambda data, _: one_step_on_data(data), iterator, steps)
        return reduce(outputs)

    if not trainer.run_eagerly:
        multi_step_on_iterator = tf.function(multi_step_on_iterator, reduce_retracing=True)

    def function(iterator):
        if isinstance(iterator, (tf.data.Iterator, tf.distribute.DistributedIterator)):
            try:
                return multi_step_on_iterator(iterator)
            except tf.errors.OutOfRangeError:
                raise StopIteration from None
        outputs = None
        for _, data in zip(range(steps), iterator):
            outputs = one_step_on_data(data)
        return outputs if outputs is None else reduce(outputs)

    return function


def apply_multi_step_fix() -> None:
    """Installs fix 5 (idempotent); Keras' own code still runs for 1 replica
    or `steps_per_execution == 1`."""
    from keras.src.backend.tensorflow import trainer as tf_trainer

    if not _may_patch("multi_step", "5", "keras-team/keras#19246",
                      _TRAINER + "TensorFlowTrainer._make_function"):
        return
    original = tf_trainer.TensorFlowTrainer._make_function

    def _make_function(self, step_function):
        if self.steps_per_execution > 1 and self.distribute_strategy.num_replicas_in_sync > 1:
            return _multi_step_function(self, step_function)
        return original(self, step_function)

    _make_function.__wrapped__ = original
    tf_trainer.TensorFlowTrainer._make_function = _make_function
    _applied.add("multi_step")


# --------------------------------------------------------------------------
# Fix 6: convolutions on an empty batch (oneDNN).
#
# oneDNN is TensorFlow's default on x86 CPUs with AVX-512 neural-network
# features (VNNI, BF16, AMX); TF_ENABLE_ONEDNN_OPTS=1 turns it on elsewhere
# (an AVX2-only CPU), =0 off. With oneDNN on, `Conv2D`, `Conv3D` and
# `DepthwiseConv2dNative` given a batch of 0 examples return a tensor of
# their *input's* shape: a 3x3, 32 -> 64 convolution of (0, 14, 14, 32) gives
# (0, 14, 14, 32), not (0, 12, 12, 64), and the next layer fails ("input
# depth must be evenly divisible by filter depth: 1 vs 32", or "Incompatible
# shapes" at the bias add). Empty batches are normal under tf.distribute:
# when the last evaluation batch is smaller than the replica count times the
# per-replica batch, the replicas past the data get 0 examples
# (Fashion-MNIST's 10,000 test images at global batch 256 on 2 workers: the
# last batch has 16, worker 1 gets none). So `model.evaluate` of any conv
# model crashes on such a split. With TF_ENABLE_ONEDNN_OPTS=0 the shape is
# right. Upstream: the same oneDNN ("MKL") conv kernel was fixed once for
# Conv3D, https://github.com/tensorflow/tensorflow/pull/30968; the
# Conv2D/depthwise case is not reported there yet (TF 2.21.0).
#
# The fix wraps Keras' TensorFlow-backend `conv`, `depthwise_conv` and
# `separable_conv`: where the batch size is not known to be positive when the
# graph is built (evaluation's last batch; training batches are static and
# full, so training graphs are unchanged), a `tf.cond` computes an empty
# batch as one zero example sliced to 0 rows, which has the right shape.
# Installed (for the whole process) by `get_strategy` for MirroredStrategy and
# MultiWorkerMirroredStrategy.
# --------------------------------------------------------------------------

def _empty_batch_safe(op):
    @functools.wraps(op)
    def wrapper(inputs, *args, **kwargs):
        batch = inputs.shape[0] if hasattr(inputs, "shape") else None
        if batch is not None and batch > 0:
            return op(inputs, *args, **kwargs)  # static, non-empty: as upstream
        inputs = tf.convert_to_tensor(inputs)

        def empty():
            one = tf.zeros(tf.concat([[1], tf.shape(inputs)[1:]], 0), inputs.dtype)
            return op(one, *args, **kwargs)[:0]

        if batch == 0:
            return empty()
        return tf.cond(tf.shape(inputs)[0] > 0, lambda: op(inputs, *args, **kwargs), empty)

    return wrapper


_CONV_OPS = ("conv", "depthwise_conv", "separable_conv")


def apply_empty_batch_conv_fix() -> None:
    """Installs fix 6 (idempotent)."""
    from keras.src.backend.tensorflow import nn as tf_nn

    if not _may_patch("empty_batch_conv", "6", "tensorflow/tensorflow#30968",
                      *(f"keras.src.backend.tensorflow.nn:{name}" for name in _CONV_OPS)):
        return
    for name in _CONV_OPS:
        setattr(tf_nn, name, _empty_batch_safe(getattr(tf_nn, name)))
    _applied.add("empty_batch_conv")


# --------------------------------------------------------------------------
# Fix 7: gradient accumulation with 2 or more replicas.
#
# Keras 3's own accumulation, `optimizer(gradient_accumulation_steps=k)`,
# decides on every step whether to apply or to add to its accumulators with
# an `ops.cond` inside the replica function; the applying branch all-reduces
# the gradients and updates the mirrored variables, both `merge_call`s, and
# TensorFlow does not allow a `merge_call` inside control flow in a replica
# context: under MirroredStrategy with 2+ replicas the first step fails with
# "RuntimeError: `merge_call` called while defining a new graph or a
# tf.function" (on one device it works). Upstream, Keras 3:
# https://github.com/keras-team/keras/issues/20582 (open); the same error with
# Keras 2 custom train steps: https://github.com/keras-team/keras/issues/17429
# and https://github.com/tensorflow/tensorflow/issues/59487.
#
# tfmulti accumulates inside one training step instead, so nothing is
# conditional: `accumulate_gradients(model, k)` gives the model a train step
# that splits each replica's batch (k*b rows) into k contiguous micro-batches
# of b rows, runs forward and backward on each in turn in a `tf.while_loop`
# (one iteration at a time, so only one micro-batch's activations are alive),
# sums the gradients of loss_j / k in loop-carried tensors, and applies them
# with ONE `apply_gradients` after the loop, where Keras' own train step
# applies: k micro-steps of B rows are one step of k*B rows. The loss tracker
# and the compiled metrics see every micro-batch. The loss is scaled by the
# optimizer (`scale_loss`) before the gradients and unscaled by
# `apply_gradients` once, so a `LossScaleOptimizer` (mixed float16) checks
# and unscales the summed gradients. Sparse gradients (embeddings) are
# summed dense.
# --------------------------------------------------------------------------

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
            f"({steps}); make the global batch a multiple of {steps} x {replicas} "
            f"replica(s), e.g. {steps * replicas * max(1, rows // steps)}.")

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


def sum_gradients(loss_fn, data, variables, steps: int):
    """The gradients of `loss_fn` summed over `steps` micro-batches of `data`.

    Splits every tensor of `data` along its first axis into `steps`
    contiguous chunks and, one chunk after the other in a `tf.while_loop`
    (only one chunk's activations alive at a time), adds the gradients of
    `loss_fn(chunk)` with respect to `variables`. No synchronization happens
    inside the loop: the caller applies the sum once, after it (fix 7). With
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

    Returns:
        (one gradient per variable, dense, or None where the loss does not
        depend on the variable; the sum of the reported scalars).

    Raises:
        ValueError: a static batch not divisible by `steps` (a dynamic one
            fails a run-time assertion with the same advice), or, with 2+
            replicas, a forward pass that updates a variable synchronized
            across replicas (a `merge_call` inside the loop).
    """
    variables = list(variables)
    if steps == 1:
        with tf.GradientTape() as tape:
            loss, report = loss_fn(data)
        return tape.gradient(loss, variables), report
    chunks = _micro_batches(data, steps)
    no_gradient = []  # per variable: found when the loop body is traced

    def body(i, reported, sums):
        chunk = tf.nest.map_structure(lambda t: None if t is None else t[i], chunks)
        with tf.GradientTape() as tape:
            loss, report = loss_fn(chunk)
        grads = tape.gradient(loss, variables)
        no_gradient[:] = [g is None for g in grads]
        sums = [s if g is None else s + tf.cast(tf.convert_to_tensor(g), s.dtype)
                for s, g in zip(sums, grads)]
        return i + 1, reported + tf.cast(report, tf.float32), sums

    zeros = [tf.zeros(v.shape, v.dtype) for v in variables]
    try:
        _, reported, sums = tf.while_loop(lambda i, *_: i < steps, body,
                                          (tf.constant(0), tf.constant(0.0), zeros),
                                          parallel_iterations=1)
    except RuntimeError as e:
        if "merge_call" not in str(e):
            raise
        raise ValueError(
            f"With {steps} micro-batches per update, the forward pass runs inside a loop, and "
            f"a layer there updates a variable synchronized across replicas (aggregation "
            f"'sum', 'mean' or 'only_first_replica'), which TensorFlow cannot do inside "
            f"control flow; create that variable with aggregation='none' (as Keras' own "
            f"layers do: each replica keeps its copy) or train without accumulation.") from e
    return [None if missing else s for s, missing in zip(sums, no_gradient)], reported


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
            f"(tfmulti.runtime.keras_fixes.accumulate_gradients).")


def _accumulating_train_step(model, data):
    """Keras' TensorFlow train step (keras/src/backend/tensorflow/trainer.py),
    over `model._tfmulti_accumulate_steps` micro-batches (fix 7)."""
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
                                 trainable, steps)
    if trainable:
        model.optimizer.apply_gradients(zip(gradients, trainable))
    else:
        warnings.warn("The model does not have any trainable weights.")
    return model.get_metrics_result()


def accumulate_gradients(model, steps: int):
    """Makes `model.fit` apply one update per `steps` micro-batches (fix 7).

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
            `accumulate_gradients(steps)`, which is called instead.
        steps: micro-batches per update (>= 1).

    Returns:
        The model.

    Raises:
        ValueError: `steps` is not an integer >= 1; the model overrides
            `train_step` (a step tfmulti cannot split) or is a PipelineModel
            without its own support; the optimizer also sets Keras'
            `gradient_accumulation_steps` (or sets it under 2+ replicas,
            where Keras' fails: use this instead). Some of these are raised
            when `fit` traces the step (the optimizer, the batch size).
        RuntimeError: the installed Keras changed the train step this copies
            (see `KERAS_ORIGINALS`).

    Example:
        >>> import keras, numpy as np
        >>> from tfmulti.runtime import keras_fixes as workarounds
        >>> model = keras.Sequential([keras.Input((3,)), keras.layers.Dense(1)])
        >>> model.compile("sgd", "mse")
        >>> model = workarounds.accumulate_gradients(model, 4)
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
        if any(c.__name__ == "PipelineModel" and c.__module__ == "tfmulti.parallel.pipeline"
               for c in type(model).__mro__):
            raise ValueError(
                f"PipelineModel runs its own micro-batch schedule and does not accumulate "
                f"gradients over batches (accumulate_steps={steps}) yet "
                f"(tfmulti/parallel/pipeline.py); use accumulate_steps=1 with it, and a larger "
                f"`num_microbatches` for less memory per micro-batch.")
        raise ValueError(
            f"{type(model).__name__} overrides `train_step`, which tfmulti cannot split into "
            f"micro-batches (accumulate_steps={steps}); sum the gradients in your own step "
            f"(tfmulti.runtime.keras_fixes.sum_gradients), or train with tfmulti.training.loops.")
    changed = _changed([_TRAINER + "TensorFlowTrainer.train_step"]) if steps > 1 else []
    if changed:
        raise RuntimeError(
            f"{_explain('7', 'keras-team/keras#20582', changed)}: "
            f"its micro-batch step copies Keras' train step and could train wrongly; install "
            f"keras=={TESTED_KERAS}.* (setup.cfg pins it) to accumulate gradients.")
    _check_keras_accumulation(model, steps)
    model._tfmulti_accumulate_steps = steps  # pylint: disable=protected-access
    model.train_step = functools.partial(_accumulating_train_step, model)
    model.train_function = None  # made again, with this step, by the next fit
    return model
