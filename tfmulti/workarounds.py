"""Every workaround tfmulti applies for an upstream Keras or TensorFlow bug.

Each fix names its upstream issue and has a test in tests/test_workarounds.py
that shows the upstream bug still happens without the fix on the pinned
versions, so a fix can be dropped as soon as upstream mends it.
"""

from __future__ import annotations

import functools
import itertools
import threading

import tensorflow as tf

__all__ = ["apply_empty_batch_conv_fix", "apply_multi_step_fix", "apply_multi_worker_fixes",
           "mirrored_strategy", "slurm_cluster_resolver"]

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

_applied: set[str] = set()


def _is_multi_worker(strategy) -> bool:
    return isinstance(strategy, tf.distribute.MultiWorkerMirroredStrategy) and (
        strategy.extended._in_multi_worker_mode()  # pylint: disable=protected-access
    )


def apply_multi_worker_fixes() -> None:
    """Installs fixes 2 and 3 (idempotent)."""
    from keras.src.backend.tensorflow import trainer as tf_trainer
    from keras.src import tree

    if "symbolic_build" not in _applied:
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

    if "reduce_per_replica" not in _applied:
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
        outputs = one_step_on_data(iterator.get_next())

        def more(i, outputs, next_inputs):
            return tf.logical_and(i < steps, next_inputs.has_value())

        def body(i, outputs, next_inputs):
            outputs = one_step_on_data(next_inputs.get_value())
            next_inputs = tf.cond(i + 1 < steps, iterator.get_next_as_optional,
                                  lambda: next_inputs)
            return i + 1, outputs, next_inputs

        if steps > 1:
            _, outputs, _ = tf.while_loop(
                more, body, [tf.constant(1), outputs, iterator.get_next_as_optional()])
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

    if "multi_step" in _applied:
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


def apply_empty_batch_conv_fix() -> None:
    """Installs fix 6 (idempotent)."""
    from keras.src.backend.tensorflow import nn as tf_nn

    if "empty_batch_conv" in _applied:
        return
    for name in ("conv", "depthwise_conv", "separable_conv"):
        setattr(tf_nn, name, _empty_batch_safe(getattr(tf_nn, name)))
    _applied.add("empty_batch_conv")
