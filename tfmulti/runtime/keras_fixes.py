"""The fixes tfmulti applies for upstream Keras and TensorFlow bugs.

Each fix is named by the symptom it cures and links its upstream issue:

* "several MirroredStrategy in one process" (tensorflow#61314):
  `mirrored_strategy` gives each strategy collective keys of its own.
* "fit under MultiWorkerMirroredStrategy" (keras#20585): a patch of Keras'
  symbolic build.
* "a first batch split unevenly over replicas" (keras#20585's build, under
  `MirroredStrategy`): the same patch of Keras' symbolic build.
* "logged scalars under MultiWorkerMirroredStrategy" (tensorflow#72388): a
  patch of Keras' reduction of the logs.
* "several steps per call with 2+ replicas" (keras#19246): a patch of Keras'
  multi-step function, whose loop is `run_steps`.
* "BatchNormalization statistics that differ between replicas"
  (tensorflow#46488): the moving statistics are made with the mean
  aggregation, as Keras 2 made them.
* "convolutions on an empty batch under oneDNN" (tensorflow#30968): a patch
  of Keras' TensorFlow convolutions.
* "a model without call under a strategy" (not reported yet; the symbolic
  build that keras#20051 added): the same patch of Keras' symbolic build
  builds nothing for a model that has no `call` (a GAN written around its
  own `train_step`), as one device does.
* "optimizers and layers built in the train step with 2+ replicas"
  (keras#23085): a patch of Keras' TensorFlow variables, made under
  `tf.init_scope()` where they are made inside a replica function.
* "rows repeated in a sparse gradient" (not reported yet; the scatter
  updates that keras#18692 added): an `Embedding`'s gradient comes as rows
  (`tf.IndexedSlices`), a row once per occurrence of its id in the batch (and
  once per replica that saw it); Keras' optimizers apply each occurrence on
  its own, so Adam, RMSprop, Adagrad... update a repeated row by other
  numbers than its summed gradient gives. A patch of Keras' TensorFlow update
  step sums each row's occurrences first, as Keras 2's optimizers did
  (`_deduplicate_indexed_slices`): the update is then the dense gradient's,
  as on the JAX backend.
* "sparse gradients all-reduced one table at a time" (tensorflow#53160):
  under 2+ replicas TensorFlow all-reduces each `tf.IndexedSlices` on its
  own, with a traced `tf.cond` and three all-gathers per gradient, so a
  model of many tables (a ranker's 39) spends its first epoch tracing them.
  A patch of Keras' gradient all-reduce packs the sparse gradients of one
  row shape into one `IndexedSlices` (each table's ids offset past the
  previous tables' rows), all-reduces that, and splits it back: the same
  rows in the same order, one cond and three all-gathers in all.
* "a lookup that copies its whole table" (keras-core#229, the symptom of
  keras#15376): Keras 3's `take` (an `Embedding`'s lookup) reads the whole
  table and gathers rows from that; after the table's first sparse update
  (SGD, a lazy update) TensorFlow keeps the variable in copy-on-read mode, so
  every such read copies the whole table (two tables of 1M x 32: 256 MB
  copied per step). A patch of Keras' TensorFlow `take` gathers the rows from
  the variable itself (`ResourceGather`): the same rows, the same gradient.
* "SlurmClusterResolver without GPUs" (tensorflow#56894):
  `slurm_cluster_resolver`.

The patches change Keras for the whole process, and only where their bug
shows. `apply_keras_fixes(strategy)` installs the ones a strategy needs, for
a strategy you built yourself; `tfmulti.get_strategy` calls it for the
strategies it builds. The first time a process gets any, one line on stderr
names them.

The patches replace private Keras functions (`keras.src...`), so each first
checks that every function it replaces is the one it was written for (the
SHA-256 of its source, `KERAS_ORIGINALS`); otherwise the fix stays off with a
warning naming the upstream issue and the Keras versions.

Each fix has a test (tests/unit/test_keras_fixes.py, and
tests/integration/test_keras_fixes.py for those that start processes) that
shows the upstream bug still happens without it on the pinned versions, so a fix can be dropped as
soon as upstream mends it. Gradient accumulation, which Keras' own fails at
with 2+ replicas (keras#20582), is a feature of its own:
`tfmulti.models.accumulation`.
"""

from __future__ import annotations

import dataclasses
import functools
import hashlib
import inspect
import itertools
import sys
import threading
import warnings
from typing import Mapping

import tensorflow as tf

__all__ = ["KERAS_ORIGINALS", "TESTED_KERAS", "active_fixes", "apply_keras_fixes",
           "apply_placement_fixes", "changed_keras_functions", "combined_rows",
           "mirrored_strategy", "packed_rows_all_reduce", "run_steps", "slurm_cluster_resolver"]


@dataclasses.dataclass(frozen=True)
class _Fix:
    """A fix that patches Keras: the symptom it cures (its name), the upstream
    issue, and the Keras functions it replaces (keys of KERAS_ORIGINALS)."""

    name: str
    issue: str
    url: str
    replaces: tuple[str, ...]

    def __str__(self) -> str:
        return f"{self.name} ({self.issue})"


_TRAINER = "keras.src.backend.tensorflow.trainer:"
_OPTIMIZER = "keras.src.backend.tensorflow.optimizer:"
_NN = "keras.src.backend.tensorflow.nn:"
_CONV_OPS = ("conv", "depthwise_conv", "separable_conv")

_FIT_MULTI_WORKER = _Fix(
    "fit under MultiWorkerMirroredStrategy", "keras#20585",
    "https://github.com/keras-team/keras/issues/20585",
    (_TRAINER + "TensorFlowTrainer._maybe_symbolic_build",))
_UNEVEN_FIRST_BATCH = _Fix(
    "a first batch split unevenly over replicas", "keras#20585",
    "https://github.com/keras-team/keras/issues/20585",
    (_TRAINER + "TensorFlowTrainer._maybe_symbolic_build",))
_SCALAR_LOGS_MULTI_WORKER = _Fix(
    "logged scalars under MultiWorkerMirroredStrategy", "tensorflow#72388",
    "https://github.com/tensorflow/tensorflow/issues/72388",
    (_TRAINER + "reduce_per_replica",))
_STEPS_PER_CALL = _Fix(
    "several steps per call with 2+ replicas", "keras#19246",
    "https://github.com/keras-team/keras/issues/19246",
    (_TRAINER + "TensorFlowTrainer._make_function",))
_BATCH_NORM_STATISTICS = _Fix(
    "BatchNormalization statistics that differ between replicas", "tensorflow#46488",
    "https://github.com/tensorflow/tensorflow/issues/46488",
    ("keras.src.layers.normalization.batch_normalization:BatchNormalization.build",))
_EMPTY_BATCH_CONV = _Fix(
    "convolutions on an empty batch under oneDNN", "tensorflow#30968",
    "https://github.com/tensorflow/tensorflow/pull/30968",
    tuple(_NN + name for name in _CONV_OPS))
_MODEL_WITHOUT_CALL = _Fix(
    "a model without call under a strategy", "keras#20051",
    "https://github.com/keras-team/keras/pull/20051",
    (_TRAINER + "TensorFlowTrainer._maybe_symbolic_build",))
_BUILT_IN_THE_STEP = _Fix(
    "optimizers and layers built in the train step with 2+ replicas", "keras#23085",
    "https://github.com/keras-team/keras/issues/23085",
    ("keras.src.backend.tensorflow.core:Variable._initialize",))
_REPEATED_ROWS = _Fix(
    "rows repeated in a sparse gradient", "keras#18692",
    "https://github.com/keras-team/keras/pull/18692",
    (_OPTIMIZER + "TFOptimizer._distributed_tf_update_step",))
_PACKED_ROWS = _Fix(
    "sparse gradients all-reduced one table at a time", "tensorflow#53160",
    "https://github.com/tensorflow/tensorflow/issues/53160",
    (_OPTIMIZER + "TFOptimizer._all_reduce_sum_gradients",))
_WHOLE_TABLE_READ = _Fix(
    "a lookup that copies its whole table", "keras-core#229",
    "https://github.com/keras-team/keras-core/pull/229",
    ("keras.src.backend.tensorflow.numpy:take",))
_LOSS_SCALE = "keras.src.optimizers.loss_scale_optimizer:LossScaleOptimizer."
_ONE_REPLICAS_FINITE = _Fix(
    "loss scaling that checks one replica's gradients", "keras#18691",
    "https://github.com/keras-team/keras/pull/18691",
    (_LOSS_SCALE + "check_finite", _LOSS_SCALE + "_tf_apply"))

# --------------------------------------------------------------------------
# The guard: patch only the Keras functions the fixes were written for.
#
# The patches replace or wrap private Keras functions. A Keras release may
# change them; patching a changed function could train wrongly without an
# error. So each patch first compares the SHA-256 of the source of every
# function it replaces with the digest recorded here from the Keras version
# it was written and tested for (setup.cfg pins that minor version). On a
# mismatch the fix stays off with a warning (the upstream bug may be fixed,
# or may show).
# --------------------------------------------------------------------------

TESTED_KERAS = "3.15"
"""The Keras minor version the patched functions were read from."""

KERAS_ORIGINALS = {  # "module:qualified name" -> SHA-256 of its source in Keras 3.15
    _TRAINER + "TensorFlowTrainer._maybe_symbolic_build":
        "92a504f5eba9b29f81f1bf26180bdd5bf5186b06b7bda426534b90d2d02bc1c2",
    _TRAINER + "reduce_per_replica":
        "2e7d54b1e6edc29a8c6a7e6b66cd4c8be3ba7842412c93753ac3afe169fa7fb8",
    _TRAINER + "TensorFlowTrainer._make_function":
        "bb33b7a0da3d27406c70fac54b8e9617156ef225f452b93f6addf8cc34aca0d0",
    "keras.src.layers.normalization.batch_normalization:BatchNormalization.build":
        "d615e5ddb968b5d52a7414d6712da76975ebb18ffb50c7d858a6d0cd5d72345e",
    _NN + "conv":
        "1bae7c0469d44106255c586b417ef4463ed1b7524095f3331fbab2685b99d3e3",
    _NN + "depthwise_conv":
        "492c94d51f85389fa2d8aca5cf1b29b5dd3a7b1bf0548eef88dde2587852f0f0",
    _NN + "separable_conv":
        "d163319653f9a8465c41d90834941a4a2ceeafe9b049d81d1dc66e43c902b95e",
    "keras.src.backend.tensorflow.core:Variable._initialize":
        "ab759c22f87fb300c93b8283ea280ff99a52fc483376bd43d1edc26b0080601d",
    _OPTIMIZER + "TFOptimizer._distributed_tf_update_step":
        "ec83c95231ba33ee08aec21749ca92dff304cb6f77bdb21376621e183f513b20",
    _OPTIMIZER + "TFOptimizer._all_reduce_sum_gradients":
        "953512efa56c968002e3ddf9c13f593a893cad8770391ab6c7a1c001fde513b0",
    _LOSS_SCALE + "check_finite":
        "b0ce693a4ff0133b24ff258572b4279b2154ed1a3ff0478368ec5914272ea3a5",
    _LOSS_SCALE + "_tf_apply":
        "e702c4db1a0622e3b4da2f76d6cca4660f63c145e272d7510d96d674cf944814",
    "keras.src.backend.tensorflow.numpy:take":
        "795868a4c04bb1b45f0e7726525ccce27ba8d70e2ac83e36b92eb08ff3c08d32",
}
"""Each Keras function a fix replaces, with the SHA-256 of its source."""


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


def changed_keras_functions(recorded: Mapping[str, str]) -> list[str]:
    """Which recorded Keras functions the installed Keras has changed.

    The guard of every patch here, and of any code that copies a private
    Keras function (`tfmulti.models.accumulation`).

    Args:
        recorded: "module:qualified name" -> the SHA-256 of the function's
            source in the Keras it was read from (as `KERAS_ORIGINALS`).

    Returns:
        The names whose installed source has another digest, in order.

    Example:
        >>> from tfmulti.runtime import keras_fixes
        >>> keras_fixes.changed_keras_functions(keras_fixes.KERAS_ORIGINALS)
        []
    """
    return [name for name, digest in recorded.items()
            if _source_digest(_resolve(name)) != digest]


# --------------------------------------------------------------------------
# Applying the patches, once per process.
# --------------------------------------------------------------------------

_applied: set[str] = set()  # the names of the fixes whose patches are installed
_off: set[str] = set()  # the fixes left off: Keras changed the functions they replace
_announced = False  # whether this process printed its line of active fixes
_lock = threading.Lock()


def _install(fix: _Fix, patch) -> None:
    """Runs `patch()` once per process, unless Keras changed what `fix`
    replaces (then the fix stays off, with one warning)."""
    if fix.name in _applied or fix.name in _off:
        return
    changed = changed_keras_functions({name: KERAS_ORIGINALS[name] for name in fix.replaces})
    if changed:
        import keras

        warnings.warn(
            f"tfmulti's fix for {fix} was written for Keras {TESTED_KERAS}, and in the "
            f"installed Keras {keras.__version__} these functions differ: "
            f"{', '.join(changed)}. The fix stays off, so the upstream bug ({fix.url}) may "
            f"show; install keras=={TESTED_KERAS}.* (setup.cfg pins it).",
            RuntimeWarning, stacklevel=4)
        _off.add(fix.name)
        return
    patch()
    _applied.add(fix.name)


def _needed(strategy) -> tuple[_Fix, ...]:
    """The patches `strategy` needs (None: all of them)."""
    if strategy is None or isinstance(strategy, tf.distribute.MultiWorkerMirroredStrategy):
        return (_FIT_MULTI_WORKER, _UNEVEN_FIRST_BATCH, _SCALAR_LOGS_MULTI_WORKER,
                _STEPS_PER_CALL, _BATCH_NORM_STATISTICS, _EMPTY_BATCH_CONV,
                _MODEL_WITHOUT_CALL, _BUILT_IN_THE_STEP, _REPEATED_ROWS, _PACKED_ROWS,
                _ONE_REPLICAS_FINITE, _WHOLE_TABLE_READ)
    if isinstance(strategy, tf.distribute.MirroredStrategy):
        return (_UNEVEN_FIRST_BATCH, _STEPS_PER_CALL, _BATCH_NORM_STATISTICS, _EMPTY_BATCH_CONV,
                _MODEL_WITHOUT_CALL, _BUILT_IN_THE_STEP, _REPEATED_ROWS, _PACKED_ROWS,
                _ONE_REPLICAS_FINITE, _WHOLE_TABLE_READ)
    if isinstance(strategy, tf.distribute.OneDeviceStrategy):
        return (_MODEL_WITHOUT_CALL, _REPEATED_ROWS, _WHOLE_TABLE_READ)
    return ()


def active_fixes() -> list[str]:
    """The names of the fixes whose patches this process has installed.

    Example:
        >>> from tfmulti.runtime import keras_fixes
        >>> set(keras_fixes.active_fixes()) <= {
        ...     "fit under MultiWorkerMirroredStrategy",
        ...     "a first batch split unevenly over replicas",
        ...     "logged scalars under MultiWorkerMirroredStrategy",
        ...     "several steps per call with 2+ replicas",
        ...     "BatchNormalization statistics that differ between replicas",
        ...     "convolutions on an empty batch under oneDNN",
        ...     "a model without call under a strategy",
        ...     "optimizers and layers built in the train step with 2+ replicas",
        ...     "rows repeated in a sparse gradient",
        ...     "sparse gradients all-reduced one table at a time",
        ...     "loss scaling that checks one replica's gradients",
        ...     "a lookup that copies its whole table"}
        True
    """
    return [fix.name for fix in _needed(None) if fix.name in _applied]


def apply_keras_fixes(strategy: tf.distribute.Strategy | None = None) -> list[str]:
    """Installs the fixes for the upstream Keras bugs that `strategy` meets.

    `tfmulti.get_strategy` does this for the strategies it builds; call it
    for one you built yourself (e.g. `tf.distribute.MirroredStrategy()` or
    `tf.distribute.MultiWorkerMirroredStrategy()`), before `fit`. The fixes
    patch Keras for the whole process and change its behaviour only where
    their bug shows:

    * a `MultiWorkerMirroredStrategy`: "fit under MultiWorkerMirroredStrategy"
      (keras#20585), "logged scalars under MultiWorkerMirroredStrategy"
      (tensorflow#72388), and the two below;
    * a `MirroredStrategy`: "a first batch split unevenly over replicas"
      (keras#20585's symbolic build: `evaluate` or `fit` whose first batch
      gives the replicas different numbers of rows, e.g. a test split smaller
      than the global batch), "several steps per call with 2+ replicas"
      (keras#19246, `steps_per_execution > 1`), "BatchNormalization
      statistics that differ between replicas" (tensorflow#46488: each
      replica's moving mean and variance drift apart and the saved model
      keeps replica 0's; the fix needs the model built after it, as
      `get_strategy` then building under its scope does), "convolutions
      on an empty batch under oneDNN" (tensorflow#30968, `evaluate` of a conv
      model when a replica's share of the last batch is empty), "optimizers
      and layers built in the train step with 2+ replicas" (keras#23085: a
      `train_step` of one's own whose optimizers or layers are built on its
      first call, as a GAN's two optimizers are), "loss scaling that checks
      one replica's gradients" (keras#18691's `LossScaleOptimizer` under a
      strategy: mixed_float16's overflow check reads the first replica's own
      gradients, before they are summed, so an overflow on another replica
      is applied, turning the weights infinite, or, across workers, one
      worker skips the step while another sums with it, and the job hangs)
      and the two below;
    * a `OneDeviceStrategy` too: "a model without call under a strategy"
      (the symbolic build that keras#20051 added: `fit` of a model without
      `call`, such as a GAN written around its `train_step`) and "rows
      repeated in a sparse gradient" (the scatter updates of keras#18692: an
      `Embedding` whose batch repeats an id, trained by Adam, RMSprop,
      Adagrad..., updated as if each occurrence were a step of its own),
      and "a lookup that copies its whole table" (keras-core#229: an
      `Embedding`'s lookup reads its whole table, which TensorFlow copies at
      every read once the table had a sparse update: SGD's, a lazy one);
    * any other strategy: none. None: all twelve (before the strategy exists).

    Calling it again does nothing more. The first call in a process that
    installs a fix prints one line to stderr naming the active fixes. A fix
    whose Keras functions changed (another Keras than setup.cfg pins) stays
    off with a `RuntimeWarning`. Collective keys of its own for each
    `MirroredStrategy` are given when the strategy is built, by
    `tfmulti.get_strategy("mirrored")` (`mirrored_strategy`), not here.

    Args:
        strategy: the strategy to train under, or None.

    Returns:
        The names of the fixes active for `strategy`, in a fixed order.

    Example:
        >>> import tensorflow as tf
        >>> import tfmulti
        >>> strategy = tf.distribute.MirroredStrategy(["CPU:0", "CPU:1"])
        >>> tfmulti.apply_keras_fixes(strategy)  # doctest: +NORMALIZE_WHITESPACE
        ['a first batch split unevenly over replicas', 'several steps per call with 2+ replicas',
         'BatchNormalization statistics that differ between replicas',
         'convolutions on an empty batch under oneDNN', 'a model without call under a strategy',
         'optimizers and layers built in the train step with 2+ replicas',
         'rows repeated in a sparse gradient', 'sparse gradients all-reduced one table at a time',
         "loss scaling that checks one replica's gradients", 'a lookup that copies its whole table']
    """
    return _apply(_needed(strategy))


def _apply(needed: tuple[_Fix, ...]) -> list[str]:
    """Installs the patches of `needed` (once per process); the first that
    installs any prints the line naming the active fixes. Returns the names
    of those of `needed` that are active."""
    global _announced
    patches = {_FIT_MULTI_WORKER: _patch_symbolic_build,
               _UNEVEN_FIRST_BATCH: _patch_symbolic_build,  # the same patch, installed once
               _SCALAR_LOGS_MULTI_WORKER: _patch_reduce_per_replica,
               _STEPS_PER_CALL: _patch_make_function,
               _BATCH_NORM_STATISTICS: _patch_batch_norm_statistics,
               _EMPTY_BATCH_CONV: _patch_conv,
               _MODEL_WITHOUT_CALL: _patch_symbolic_build,
               _BUILT_IN_THE_STEP: _patch_variables_in_replicas,
               _REPEATED_ROWS: _patch_repeated_rows,
               _PACKED_ROWS: _patch_packed_rows,
               _ONE_REPLICAS_FINITE: _patch_loss_scale_finite,
               _WHOLE_TABLE_READ: _patch_whole_table_reads}
    with _lock:
        for fix in needed:
            _install(fix, patches[fix])
        active = [fix.name for fix in needed if fix.name in _applied]
        if _applied and not _announced:
            _announced = True
            names = ", ".join(str(fix) for fix in _needed(None) if fix.name in _applied)
            print(f"tfmulti: Keras fixes active: {names}", file=sys.stderr, flush=True)
    return active


def apply_placement_fixes() -> list[str]:
    """Installs the fixes that a model placed on devices by hand meets (no
    strategy: tfmulti's pipeline and hybrid): "a lookup that copies its
    whole table" (keras-core#229). As `apply_keras_fixes`, once per process,
    one line on stderr at the first fix installed.

    Returns:
        The names of the fixes active for such a model.

    Example:
        >>> from tfmulti.runtime import keras_fixes
        >>> keras_fixes.apply_placement_fixes()
        ['a lookup that copies its whole table']
    """
    return _apply((_WHOLE_TABLE_READ,))


# --------------------------------------------------------------------------
# Several MirroredStrategy in one process share collective group keys.
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
# A strategy already built keeps its keys, so this fix is in how
# `get_strategy("mirrored")` builds one, not in `apply_keras_fixes`.
# --------------------------------------------------------------------------

_KEY_STRIDE = 100_000
_key_bases = itertools.count(start=_KEY_STRIDE, step=_KEY_STRIDE)
_key_lock = threading.Lock()


def mirrored_strategy(devices, cross_device_ops=None) -> tf.distribute.MirroredStrategy:
    """`tf.distribute.MirroredStrategy` with collective keys of its own
    (several MirroredStrategy in one process, tensorflow#61314).

    Example:
        >>> from tfmulti.runtime import keras_fixes
        >>> keras_fixes.mirrored_strategy(["CPU:0", "CPU:1"]).num_replicas_in_sync
        2
    """
    cls = tf.distribute.MirroredStrategy
    with _key_lock:
        previous = cls._collective_key_base  # pylint: disable=protected-access
        cls._collective_key_base = next(_key_bases)  # pylint: disable=protected-access
        try:
            return cls(devices=devices, cross_device_ops=cross_device_ops)
        finally:
            cls._collective_key_base = previous  # pylint: disable=protected-access


# --------------------------------------------------------------------------
# Fit under MultiWorkerMirroredStrategy, and its logged scalars (TensorFlow
# 2.21, Keras 3.15).
#
# The symbolic build. `TensorFlowTrainer._maybe_symbolic_build` peeks at one
# distributed batch and reduces the whole `(x, y)` structure with one
# `strategy.reduce("MEAN", batch, axis=None)`; under
# MultiWorkerMirroredStrategy that is a collective over a nested structure
# and fails with "Attempt to convert a value (PerReplica...) to a Tensor".
# The build needs only shapes and dtypes, so we take them from the first
# replica's spec of the distributed dataset where every dimension is known
# (a training split: whole batches), else from the first local replica's
# batch: no collective at all. Nothing is read where nothing needs building
# (Keras reads a batch anyway: a whole iterator made, its shuffle buffer
# filled and thrown away, before every `fit` and `evaluate`).
# Upstream: https://github.com/keras-team/keras/issues/20585 (also dict
# inputs: https://github.com/keras-team/keras/issues/20329).
# The same reduction fails under MirroredStrategy when the first batch gives
# the replicas different numbers of rows (`evaluate` of a test split smaller
# than the global batch: "Inputs to operation AddN ... must have the same size
# and shape. Input 0: [128,28,28,1] != input 1: [112,28,28,1]"), and where
# the batch holds booleans (keras-hub's padding mask: "Value for attr 'T' of
# bool is not in the list of allowed values", an AddN); the same patch cures
# both, for every strategy of 2+ replicas.
#
# The logged scalars. `reduce_per_replica(..., reduction="mean")` reduces
# every logged value with `strategy.reduce("MEAN", v, axis=0)` under
# MultiWorkerMirroredStrategy; logs are scalars, so it fails with "Invalid
# reduction dimension 0 for input with 0 dimensions". We reduce scalars with
# `axis=None` (the mean over replicas, as Keras does for one worker), all of
# them in one collective per step instead of one per metric.
# Upstream: https://github.com/tensorflow/tensorflow/issues/72388 (and
# https://github.com/keras-team/keras/issues/20585). A `train_step` of one's
# own may log more than metrics: a tensor of fixed shape (Keras' `axis=0`
# would average its elements into one number) is reduced the same way, in
# the same collective, and keeps its shape, as for one worker; a Python number
# (which Keras' reduction fails on) is logged as it is.
#
# A model without `call`. A model written around its own `train_step`
# (keras-io's GAN: a `keras.Model` holding a generator, a discriminator and
# two optimizers, with no `call`) trains on one device, where Keras builds
# nothing ahead. Under any strategy, one device's included, Keras builds
# ahead (since https://github.com/keras-team/keras/pull/20051, so that the
# optimizer's variables are made outside the replicas) and calls the model
# on a symbolic batch: "Unable to automatically build the model ... does not
# have a `call()` method" (Keras 3.15 and its master; not reported yet). For
# such a model the build does nothing, as on one device: its layers, metrics
# and optimizers are built where its `train_step` first uses them (with 2+
# replicas, inside the replica function: "optimizers and layers built in the
# train step" below). So `self.optimizer`, the default "rmsprop" that its
# `super().compile()` made, gets no slots for a `train_step` that never uses
# it, as on one device (Keras' build would give it a copy of every trainable
# variable, saved with the model); one that does use it builds it on its
# first `apply`, for the variables it applies to.
#
# The scalar patch changes behaviour only under a multi-worker
# MultiWorkerMirroredStrategy; the build's, under any strategy of 2+ replicas
# (and there only where the build reads its shapes from), and for a model
# without `call` under any strategy.
# --------------------------------------------------------------------------

def _is_multi_worker(strategy) -> bool:
    return isinstance(strategy, tf.distribute.MultiWorkerMirroredStrategy) and (
        strategy.extended._in_multi_worker_mode()  # pylint: disable=protected-access
    )


def _patch_symbolic_build() -> None:
    from keras.src import tree
    from keras.src.backend.tensorflow import trainer as tf_trainer

    original_build = tf_trainer.TensorFlowTrainer._maybe_symbolic_build
    if getattr(original_build, "__wrapped__", None) is not None:
        return  # installed for the other fix that shares it

    def _maybe_symbolic_build(self, iterator=None, data_batch=None):
        strategy = self._distribute_strategy
        if strategy is not None and not _has_call(self):
            return  # nothing to call: built where its train_step uses it, as on one device
        if iterator is None or strategy is None or strategy.num_replicas_in_sync < 2:
            return original_build(self, iterator=iterator, data_batch=data_batch)
        data_batch = None  # nothing to build but the optimizer at most: no batch read
        if _build_needs_data(self):
            data_batch = _first_replica_spec(iterator)  # the shapes every batch has
            if data_batch is None:  # a dimension unknown: one replica's first batch
                for _, _, it in iterator:
                    data_batch = tree.map_structure(
                        lambda v: strategy.experimental_local_results(v)[0]
                        if isinstance(v, tf.distribute.DistributedValues) else v,
                        next(it),
                    )
                    break
        with strategy.scope():
            self._symbolic_build(data_batch=data_batch)

    _maybe_symbolic_build.__wrapped__ = original_build
    tf_trainer.TensorFlowTrainer._maybe_symbolic_build = _maybe_symbolic_build


def _has_call(model) -> bool:
    """Whether `model` has a `call` of its own (Keras' `Model.call` raises)."""
    from keras.src.layers.layer import Layer
    from keras.src.models.model import Model

    return type(model).call not in (Model.call, Layer.call)


def _build_needs_data(model) -> bool:
    """Whether Keras' symbolic build of `model` reads a batch
    (`Trainer._symbolic_build`: the model, its compiled metrics or loss unbuilt)."""
    metrics, loss = model._compile_metrics, model._compile_loss  # pylint: disable=protected-access
    return (not all(layer.built for layer in model._flatten_layers())  # pylint: disable=protected-access
            or (metrics is not None and not metrics.built)
            or (loss is not None and not loss.built))


def _first_replica_spec(epoch_iterator):
    """The first replica's batch spec of the distributed dataset `epoch_iterator`
    (Keras' `TFEpochIterator`) reads, where every dimension of it is known (then
    every batch has those shapes); None otherwise."""
    from tensorflow.python.distribute import values

    dataset = getattr(epoch_iterator, "_distributed_dataset", None)
    spec = getattr(dataset, "element_spec", None)
    if spec is None:
        return None
    flat = [s._value_specs[0] if isinstance(s, values.PerReplicaSpec) else s  # pylint: disable=protected-access
            for s in tf.nest.flatten(spec)]
    if not all(isinstance(s, tf.TensorSpec) and s.shape.is_fully_defined() for s in flat):
        return None
    return tf.nest.pack_sequence_as(spec, flat)


def _patch_reduce_per_replica() -> None:
    from keras.src import tree
    from keras.src.backend.tensorflow import trainer as tf_trainer

    original_reduce = tf_trainer.reduce_per_replica

    def reduce_per_replica(values, strategy, reduction):
        if not _is_multi_worker(strategy) or reduction not in ("auto", "mean"):
            return original_reduce(values, strategy, reduction)
        flat = tree.flatten(values)
        local = [strategy.experimental_local_results(v)[0] for v in flat]
        fixed = [i for i, v in enumerate(local) if tf.is_tensor(v) and v.shape.is_fully_defined()]
        # All the logs of one dtype and a fixed shape in one collective:
        # every collective is a barrier between the workers, and this runs
        # every step.
        for dtype in sorted({local[i].dtype for i in fixed}, key=str):
            group = [i for i in fixed if local[i].dtype == dtype]
            joined = strategy.run(lambda *v: tf.concat([tf.reshape(t, [-1]) for t in v], 0),
                                  args=[flat[i] for i in group])
            means = tf.split(strategy.reduce("MEAN", joined, axis=None),
                             [local[i].shape.num_elements() for i in group])
            for i, mean in zip(group, means):
                flat[i] = tf.reshape(mean, local[i].shape)
        for i, v in enumerate(local):
            if not tf.is_tensor(v):  # a Python number: as one worker keeps it
                flat[i] = v
            elif i not in fixed:  # a dimension unknown: Keras' reduction
                flat[i] = original_reduce(flat[i], strategy, reduction)
        return tree.pack_sequence_as(values, flat)

    reduce_per_replica.__wrapped__ = original_reduce
    tf_trainer.reduce_per_replica = reduce_per_replica


# --------------------------------------------------------------------------
# SlurmClusterResolver without GPUs.
#
# `SlurmClusterResolver` asks `nvidia-smi` for the GPU count (a crash with
# FileNotFoundError where it does not exist), and given `gpus_per_node=0` it
# pairs every task with a GPU slot (`zip(range(tasks), range(0, gpus, per_task))`)
# and fails with "range() arg 3 must not be zero" (or lists no tasks at all).
# Upstream: https://github.com/tensorflow/tensorflow/issues/56894
# ("SlurmClusterResolver cannot be configured to use no GPUs"). On CPU-only
# nodes we give it one placeholder GPU slot per task and turn `auto_set_gpu`
# off, so it computes the cluster and never touches CUDA_VISIBLE_DEVICES.
# --------------------------------------------------------------------------

def slurm_cluster_resolver(port_base: int):
    """`SlurmClusterResolver` that also works on CPU-only nodes
    (SlurmClusterResolver without GPUs, tensorflow#56894).

    Without GPUs the resolver cannot be made with 0 GPUs per task (its task
    layout divides by them), so it is made with one placeholder GPU slot per
    task, not exported (`auto_set_gpu=False`), and reports no accelerator: the
    strategy then lays its replicas out on the CPU, as under a TF_CONFIG
    cluster, instead of on a `GPU:0` that TensorFlow places on the CPU by soft
    placement (same results, about 15 % fewer examples/s measured under srun).
    """
    import os
    import shutil

    from tensorflow.python.distribute.cluster_resolver import slurm_cluster_resolver as slurm

    resolver_cls = tf.distribute.cluster_resolver.SlurmClusterResolver
    if "CUDA_VISIBLE_DEVICES" in os.environ or shutil.which("nvidia-smi"):
        return resolver_cls(port_base=port_base)

    class CpuSlurmClusterResolver(resolver_cls):
        def num_accelerators(self, task_type=None, task_id=None, config_proto=None):
            return {}

    max_tasks = max(slurm.expand_tasks_per_node(os.environ["SLURM_STEP_TASKS_PER_NODE"]))
    return CpuSlurmClusterResolver(port_base=port_base, gpus_per_node=max_tasks,
                                   gpus_per_task=1, auto_set_gpu=False)


# --------------------------------------------------------------------------
# Several steps per call with 2+ replicas.
#
# Keras 3 runs several steps per call (`steps_per_execution > 1`) in a
# `tf.while_loop` whose body calls `strategy.run` inside a `tf.cond` over
# optional inputs; under MirroredStrategy with 2+ replicas that graph fails
# with "You must feed a value for placeholder tensor
# '.../while/cond/Placeholder_1'".
# Upstream: https://github.com/keras-team/keras/issues/19246. With 2+
# replicas we build the multi-step function the way TensorFlow's own custom
# training loops do (`run_steps`): the first step outside the loop, then a
# `tf.while_loop` over `get_next_as_optional()` whose body calls
# `strategy.run` directly (no `tf.cond` around it); only the fetch of the
# next batch is conditional, so no batch is consumed beyond
# `steps_per_execution`. The loop carries the per-replica logs and reduces
# them once, after the last step (the logs are the metrics' running results,
# so only the last step's count): under MultiWorkerMirroredStrategy that
# reduction is a collective, a barrier between the workers, so a block of K
# steps has K + 1 barriers, not 2K. Keras' own code still runs for 1 replica
# or `steps_per_execution == 1`. `tfmulti.training.loops` runs its steps in
# the same loop.
# --------------------------------------------------------------------------

def run_steps(one_step, iterator, steps: int, outputs=None):
    """Runs `outputs = one_step(batch, outputs)` on up to `steps` batches of
    `iterator` (inside a `tf.function`).

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

    Example:
        >>> import tensorflow as tf
        >>> from tfmulti.runtime import keras_fixes
        >>> iterator = iter(tf.data.Dataset.range(10))
        >>> add = lambda batch, total: total + batch
        >>> done, total = tf.function(lambda: keras_fixes.run_steps(
        ...     add, iterator, 3, outputs=tf.constant(0, tf.int64)))()
        >>> int(done), int(total)  # 0 + 1 + 2
        (3, 3)
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


def _patch_make_function() -> None:
    from keras.src.backend.tensorflow import trainer as tf_trainer

    original = tf_trainer.TensorFlowTrainer._make_function

    def _make_function(self, step_function):
        if self.steps_per_execution > 1 and self.distribute_strategy.num_replicas_in_sync > 1:
            return _multi_step_function(self, step_function)
        return original(self, step_function)

    _make_function.__wrapped__ = original
    tf_trainer.TensorFlowTrainer._make_function = _make_function


# --------------------------------------------------------------------------
# Convolutions on an empty batch under oneDNN.
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


# --------------------------------------------------------------------------
# BatchNormalization's moving statistics under 2+ replicas (TensorFlow 2.21,
# Keras 3.15).
#
# Keras 3 makes `moving_mean` and `moving_variance` with the default
# aggregation, "none": under a MirroredStrategy each replica assigns its own
# batch's statistics to its own copy, the copies drift apart, and everything
# evaluated afterwards (by all replicas) differs from the saved model (replica
# 0's copy). Keras 2 made them with the mean aggregation: each assignment
# takes the mean over the replicas, so the copies stay equal (for the mean:
# equal to one device's on the whole batch). We do the same, for the
# non-trainable weights BatchNormalization makes; the patch adds an
# `add_weight` to the class and replaces nothing.
#
# A mean-aggregated assignment in a replica's forward is a `merge_call`: the
# replicas' threads then take turns within the model's call, and a layer's
# list of added losses (`add_loss`, an activity regularizer), one for all
# replicas, mixed them: a replica's loss took in another's terms (measured: a
# model with BatchNormalization and `add_loss` on 2 replicas reported 2.21
# instead of 2.18 and trained to other weights). So, with the fix, the
# losses added inside a replica function are kept per replica (per thread):
# `Layer.add_loss`, `_get_own_losses` and `_clear_losses` wrapped, Keras'
# own run as they are.
# Upstream: https://github.com/tensorflow/tensorflow/issues/46488.
# --------------------------------------------------------------------------

_replica_losses = threading.local()


def _replica_loss_key(layer) -> tuple[int, int]:
    """`layer` in the graph being traced (a list kept from another trace is not read)."""
    return id(layer), id(tf.compat.v1.get_default_graph())


def _own_replica_losses(layer) -> list:
    """`layer`'s losses added in this thread's replica function."""
    by_layer = getattr(_replica_losses, "by_layer", None)
    if by_layer is None:
        by_layer = _replica_losses.by_layer = {}
    return by_layer.setdefault(_replica_loss_key(layer), [])


def _patch_batch_norm_statistics() -> None:
    import keras
    from keras.src.backend.common.stateless_scope import in_stateless_scope
    from keras.src.layers.normalization import batch_normalization

    def add_weight(self, *args, **kwargs):
        if kwargs.get("trainable", True) is False and kwargs.get("aggregation", "none") == "none":
            kwargs["aggregation"] = "mean"
        return keras.layers.Layer.add_weight(self, *args, **kwargs)

    batch_normalization.BatchNormalization.add_weight = add_weight

    layer_class = keras.layers.Layer
    if getattr(layer_class._clear_losses, "_tfmulti_per_replica", False):  # pylint: disable=protected-access
        return  # (wrapped already: a test reinstalling the fixes)
    add_loss, get_own_losses, clear_losses = (
        layer_class.add_loss, layer_class._get_own_losses,  # pylint: disable=protected-access
        layer_class._clear_losses)  # pylint: disable=protected-access

    def per_replica(self) -> bool:
        return _in_replica_function() and not in_stateless_scope()

    @functools.wraps(add_loss)
    def add_loss_per_replica(self, loss):
        if not per_replica(self):
            return add_loss(self, loss)
        before = len(self._losses)  # pylint: disable=protected-access
        add_loss(self, loss)
        _own_replica_losses(self).extend(self._losses[before:])  # pylint: disable=protected-access
        del self._losses[before:]  # pylint: disable=protected-access
        return None

    @functools.wraps(get_own_losses)
    def get_own_losses_per_replica(self):
        own = get_own_losses(self)
        return own + _own_replica_losses(self) if per_replica(self) else own

    @functools.wraps(clear_losses)
    def clear_losses_per_replica(self):
        by_layer = getattr(_replica_losses, "by_layer", None)
        if by_layer:
            by_layer.pop(_replica_loss_key(self), None)
        clear_losses(self)

    for wrapper in (add_loss_per_replica, get_own_losses_per_replica, clear_losses_per_replica):
        wrapper._tfmulti_per_replica = True  # pylint: disable=protected-access
    layer_class.add_loss = add_loss_per_replica
    layer_class._get_own_losses = get_own_losses_per_replica  # pylint: disable=protected-access
    layer_class._clear_losses = clear_losses_per_replica  # pylint: disable=protected-access


# --------------------------------------------------------------------------
# Optimizers and layers built in the train step with 2+ replicas.
#
# A `train_step` of one's own builds what it uses on its first call: an
# optimizer that `compile` did not build (a GAN's `d_optimizer` and
# `g_optimizer`, on their first `apply`), a layer first called there. Under
# a strategy of 2+ replicas that call is inside the replica function, and
# the variables Keras 3 makes there (Adam's slots, a layer's kernel), their
# initial values computed inside the traced step, fail it: "You must feed a
# value for placeholder tensor '.../cond/Placeholder_1' with dtype int32".
# Keras 2's optimizers built their slots under `tf.init_scope()`, outside the
# traced step; Keras 3.15's build in place.
# Upstream: https://github.com/keras-team/keras/issues/23085, fixed for
# optimizer variables after Keras 3.15 by
# https://github.com/keras-team/keras/pull/23087 (`TFOptimizer.add_variable`
# under `tf.init_scope()`). We make every Keras variable that has an
# initializer under `tf.init_scope()` where it is made inside a replica
# function of a strategy of 2+ replicas, as Keras' deferred initialization
# (`Variable._deferred_initialize`) makes its variables: the first replica
# makes the strategy's variable, mirrored as if built before `fit`, and the
# others find it built. An optimizer then holds slots for exactly the
# variables it applies to, as on one device. Elsewhere (one replica, outside
# a replica function, a variable given a tensor) Keras' code runs as it is.
# --------------------------------------------------------------------------

def _in_replica_function() -> bool:
    """Whether this code is traced inside a replica function of a strategy
    of 2+ replicas (`strategy.run` within a `tf.function`)."""
    if not tf.inside_function() or not tf.distribute.has_strategy():
        return False
    context = tf.distribute.get_replica_context()  # None: cross-replica
    return context is not None and context.num_replicas_in_sync > 1


def _patch_variables_in_replicas() -> None:
    from keras.src.backend.tensorflow import core

    original = core.Variable._initialize  # pylint: disable=protected-access

    def _initialize(self, value):
        if callable(value) and _in_replica_function():  # an initializer, not a tensor
            with tf.init_scope():
                return original(self, value)
        return original(self, value)

    _initialize.__wrapped__ = original
    core.Variable._initialize = _initialize  # pylint: disable=protected-access


# --------------------------------------------------------------------------
# Rows repeated in a sparse gradient (the scatter updates of keras#18692).
#
# An `Embedding`'s gradient is a `tf.IndexedSlices`: a row per occurrence of
# an id in the batch, and, after MirroredStrategy's all-reduce, the replicas'
# rows one after the other. Keras 3's TensorFlow optimizers compute their
# rule on those rows and scatter the result (`assign_add` of an
# IndexedSlices is `scatter_add`), so a row that occurs k times is updated by
# k rules applied to its k parts: Adam's second moment takes g1^2 + g2^2, not
# (g1 + g2)^2, and its first moment's decay is counted k times. The loss's
# gradient is the sum, which the JAX backend and Keras 2 (its optimizers'
# `_deduplicate_indexed_slices`) update by. The patch sums each row's
# occurrences before the rule runs, on the device that updates the variable.
# --------------------------------------------------------------------------

def combined_rows(gradient):
    """`gradient` with each row once, its occurrences summed, where it is a
    `tf.IndexedSlices`; any other gradient as it is.

    Example:
        >>> import tensorflow as tf
        >>> from tfmulti.runtime import keras_fixes
        >>> rows = tf.IndexedSlices(tf.constant([[1.0], [2.0], [4.0]]), tf.constant([3, 0, 3]),
        ...                         tf.constant([5, 1]))
        >>> combined = keras_fixes.combined_rows(rows)
        >>> combined.indices.numpy().tolist(), combined.values.numpy().ravel().tolist()
        ([3, 0], [5.0, 2.0])
    """
    if not isinstance(gradient, tf.IndexedSlices):
        return gradient
    rows, positions = tf.unique(gradient.indices)
    values = tf.math.unsorted_segment_sum(gradient.values, positions, tf.shape(rows)[0])
    return tf.IndexedSlices(values, rows, gradient.dense_shape)


def _patch_repeated_rows() -> None:
    from keras.src.backend.tensorflow import optimizer as tf_optimizer

    original = tf_optimizer.TFOptimizer._distributed_tf_update_step

    # Keras' own, the gradient's rows combined before its rule.
    def _distributed_tf_update_step(self, distribution, grads_and_vars, learning_rate):
        def apply_grad_to_update_var(var, grad, learning_rate):
            return self.update_step(combined_rows(grad), var, learning_rate)

        for grad, var in grads_and_vars:
            distribution.extended.update(var, apply_grad_to_update_var,
                                         args=(grad, learning_rate), group=False)

    _distributed_tf_update_step.__wrapped__ = original
    tf_optimizer.TFOptimizer._distributed_tf_update_step = _distributed_tf_update_step


# --------------------------------------------------------------------------
# Sparse gradients all-reduced one table at a time (tensorflow#53160).
#
# Keras sums the replicas' gradients with one `ReplicaContext.all_reduce` of
# the list. TensorFlow's collectives pack the dense ones, but reduce each
# `tf.IndexedSlices` on its own (`CollectiveReplicaLauncher.
# all_reduce_indexed_slices`): an all-gather of its length, then a traced
# `tf.cond` between two pairs of all-gathers (padded or not). A model of many
# tables traces that per table and per replica: the Deep & Cross Network of
# the corpus (39 tables) spent about 35 s of its first epoch on 2 replicas
# there, and runs 4 collectives per table each step. The patch packs the
# sparse gradients of one dtype and row shape into one `IndexedSlices` (each
# table's ids offset past the rows of the tables before it), all-reduces it
# with the rest, and partitions the result back by table. An all-reduce of
# rows concatenates the replicas' rows without adding them, so each table
# gets the rows the unpacked reduction gives, in the same order: the same
# numbers. The rows are summed by id later, per table (`combined_rows`).
# --------------------------------------------------------------------------

def _row_key(gradient):
    """The packing group of a sparse gradient (None: reduced on its own):
    its values' dtype and row shape, its ids' dtype."""
    if not isinstance(gradient, tf.IndexedSlices) or gradient.dense_shape is None:
        return None
    shape = gradient.values.shape[1:]
    if not shape.is_fully_defined():
        return None
    return gradient.values.dtype, tuple(shape), gradient.indices.dtype


def packed_rows_all_reduce(context, gradients: list) -> list:
    """`context.all_reduce(SUM, gradients)` (a replica context of 2+
    replicas) with the `tf.IndexedSlices` among `gradients` reduced in packs:
    those of one dtype and row shape as one, split back after; the same
    result as reducing each on its own.

    Example:
        >>> import tensorflow as tf
        >>> from tfmulti import get_strategy
        >>> from tfmulti.runtime import keras_fixes
        >>> strategy = get_strategy("mirrored", devices=["CPU:0", "CPU:1"])
        >>> def step():
        ...     r = tf.cast(tf.distribute.get_replica_context().replica_id_in_sync_group, tf.float32)
        ...     a = tf.IndexedSlices(tf.fill([1, 2], r), tf.constant([1]), tf.constant([3, 2]))
        ...     b = tf.IndexedSlices(tf.fill([2, 2], r + 5), tf.constant([0, 4]), tf.constant([5, 2]))
        ...     ctx = tf.distribute.get_replica_context()
        ...     return keras_fixes.packed_rows_all_reduce(ctx, [a, b])
        >>> a, b = strategy.experimental_local_results(tf.function(lambda: strategy.run(step))())[0]
        >>> a.indices.numpy().tolist(), a.values.numpy()[:, 0].tolist()
        ([1, 1], [0.0, 1.0])
        >>> b.indices.numpy().tolist(), b.values.numpy()[:, 0].tolist()
        ([0, 4, 0, 4], [5.0, 5.0, 6.0, 6.0])
    """
    groups: dict = {}
    for i, gradient in enumerate(gradients):
        key = _row_key(gradient)
        if key is not None:
            groups.setdefault(key, []).append(i)
    packs = [members for members in groups.values() if len(members) > 1]
    if not packs:
        return context.all_reduce(tf.distribute.ReduceOp.SUM, gradients)
    packed = {i for members in packs for i in members}
    alone = [i for i in range(len(gradients)) if i not in packed]
    inputs, bounds = [gradients[i] for i in alone], []
    for members in packs:
        parts = [gradients[i] for i in members]
        ids = parts[0].indices.dtype
        rows = tf.stack([tf.cast(g.dense_shape[0], ids) for g in parts])
        ends = tf.cumsum(rows)
        starts = ends - rows
        inputs.append(tf.IndexedSlices(
            tf.concat([g.values for g in parts], 0),
            tf.concat([g.indices + starts[k] for k, g in enumerate(parts)], 0),
            tf.concat([ends[-1:], tf.cast(parts[0].dense_shape[1:], ids)], 0)))
        bounds.append((starts, ends))
    reduced = context.all_reduce(tf.distribute.ReduceOp.SUM, inputs)
    out = [None] * len(gradients)
    for i, gradient in zip(alone, reduced[:len(alone)]):
        out[i] = gradient
    for members, (starts, ends), rows in zip(packs, bounds, reduced[len(alone):]):
        table = tf.cast(tf.searchsorted(ends, rows.indices, side="right"), tf.int32)
        ids = rows.indices - tf.gather(starts, table)
        values = tf.dynamic_partition(rows.values, table, len(members))
        indices = tf.dynamic_partition(ids, table, len(members))
        for k, i in enumerate(members):
            out[i] = tf.IndexedSlices(values[k], indices[k], gradients[i].dense_shape)
    return out


def _patch_packed_rows() -> None:
    from keras.src.backend.tensorflow import optimizer as tf_optimizer

    original = tf_optimizer.TFOptimizer._all_reduce_sum_gradients

    # Keras' own, its all-reduce packed (None gradients kept where they were).
    def _all_reduce_sum_gradients(self, grads_and_vars):
        context = tf.distribute.get_replica_context()
        grads_and_vars = list(grads_and_vars)
        if not context or context.num_replicas_in_sync == 1:
            return original(self, grads_and_vars)
        filtered = tf_optimizer.filter_empty_gradients(grads_and_vars)
        reduced = iter(packed_rows_all_reduce(context, [g for g, _ in filtered])
                       if filtered else [])
        return [(None, v) if g is None else (next(reduced), v) for g, v in grads_and_vars]

    _all_reduce_sum_gradients.__wrapped__ = original
    tf_optimizer.TFOptimizer._all_reduce_sum_gradients = _all_reduce_sum_gradients


# --------------------------------------------------------------------------
# A lookup that copies its whole table (keras-core#229; keras#15376).
#
# Keras 3's `Embedding` looks its ids up with `ops.take(self.embeddings, ids)`,
# whose TensorFlow version converts the table to a tensor (a `ReadVariableOp`
# of the whole table) and gathers the rows from that. TensorFlow keeps a
# variable that had a sparse update (`scatter_sub`: SGD's update of an
# `IndexedSlices` gradient, a lazy update's) in copy-on-read mode, where every
# whole read copies the buffer: a table of 1M x 32 floats, 128 MB copied at
# every lookup, per table, per replica, per step, whatever the batch. Gathering
# from the variable itself (`ResourceGather`, as `tf.nn.embedding_lookup` and
# Keras 2's `Embedding` do) copies the batch's rows only. The patch does that
# for Keras' own variables (the table of any layer that `take`s from one, axis
# 0, dense ids), outside Keras' symbolic and stateless scopes and where no
# autocast applies; the rows, negative ids counted from the end as Keras
# counts them, and the gradient (an `IndexedSlices` of the same rows) are
# Keras' own.
# --------------------------------------------------------------------------

def _variable_rows_source(x, indices, axis):
    """The TensorFlow variable that `take(x, indices, axis)` may gather from
    instead of reading it whole (None: Keras' own `take`): that of Keras'
    own variable class (not a subclass: tfmulti's sharded parameters read
    otherwise), a resource variable or, mirrored, this replica's copy (the
    one a whole read reads); its rows (axis 0), dense ids, no Keras scope
    that reads the variable as another value."""
    import keras
    from keras.src.backend.common import variables as common_variables
    from keras.src.backend.common.stateless_scope import in_stateless_scope
    from keras.src.backend.common.symbolic_scope import in_symbolic_scope
    from tensorflow.python.distribute import values as values_lib
    from tensorflow.python.ops import resource_variable_ops

    if type(x) is not keras.Variable or axis != 0:
        return None
    if isinstance(indices, (tf.SparseTensor, tf.RaggedTensor)):
        return None
    if in_stateless_scope() or in_symbolic_scope():
        return None
    if x._autocast and common_variables.get_autocast_scope() is not None:  # pylint: disable=protected-access
        return None
    table = x._value  # pylint: disable=protected-access
    if isinstance(table, values_lib.MirroredVariable):
        table = table._get_on_device_or_primary()  # pylint: disable=protected-access
    return table if isinstance(table, resource_variable_ops.BaseResourceVariable) else None


def _patch_whole_table_reads() -> None:
    from keras.src.backend.tensorflow import numpy as tf_numpy

    original = tf_numpy.take

    # Keras' own, its rows gathered from the variable where it holds them.
    def take(x, indices, axis=None):
        table = _variable_rows_source(x, indices, axis)
        if table is None:
            return original(x, indices, axis=axis)
        indices = tf_numpy.convert_to_tensor(indices)
        indices = tf.where(indices < 0, indices + tf.cast(x.shape[0], indices.dtype), indices)
        return tf.gather(table, indices)

    take.__wrapped__ = original
    tf_numpy.take = take


# --------------------------------------------------------------------------
# Loss scaling that checks one replica's gradients (mixed_float16 under a
# strategy of 2+ replicas; the code of keras#18691).
#
# `LossScaleOptimizer._tf_apply` checks the gradients for an overflow in a
# merge call, on each replica, and takes the first replica's answer ("each
# replica computed the same `finite` value, since `grads` is all-reduced"),
# but Keras 3's TensorFlow optimizer sums the gradients later, in its
# `_backend_update_step`: the check reads each replica's own. An overflow on
# another replica's batch is then applied: the sum is infinite and so are the
# weights after the step, where one device skips the step and halves the
# scale. Across workers, each worker takes its own first replica's answer:
# one skips the step while another enters the gradients' all-reduce, and the
# job hangs. The patch makes the check agree: each replica's answer is
# summed over all of them (the replicas that overflowed: one collective of one number), so
# every replica and worker takes the branch one device would on the whole
# batch. The same makes it right where each replica holds a shard of the
# gradients (`tfmulti.parallel.zero`).
# --------------------------------------------------------------------------

def _patch_loss_scale_finite() -> None:
    from keras.src.optimizers import loss_scale_optimizer

    cls = loss_scale_optimizer.LossScaleOptimizer
    original = cls.check_finite

    def check_finite(self, grads):
        finite = original(self, grads)
        if not tf.distribute.has_strategy() or tf.distribute.in_cross_replica_context():
            return finite
        context = tf.distribute.get_replica_context()
        if context.num_replicas_in_sync < 2:
            return finite
        overflows = context.all_reduce(tf.distribute.ReduceOp.SUM,
                                       tf.cast(tf.logical_not(finite), tf.float32))
        return tf.equal(overflows, 0.0)

    check_finite.__wrapped__ = original
    cls.check_finite = check_finite


def _patch_conv() -> None:
    from keras.src.backend.tensorflow import nn as tf_nn

    for name in _CONV_OPS:
        setattr(tf_nn, name, _empty_batch_safe(getattr(tf_nn, name)))
