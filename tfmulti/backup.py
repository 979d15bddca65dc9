"""Backup and restore for long runs: resume at the next step after a crash,
a SIGKILL or a preemption, under any tfmulti strategy.

Keras 3's `keras.callbacks.BackupAndRestore` overwrites its weights and its
metadata file in place (a crash between the two pairs new weights with an old
epoch), lets every worker write the same files, and resumes only at an epoch
boundary. tfmulti's backup is built on `tf.train.Checkpoint` instead:

* **What is saved**: every model variable (weights, the dropout seed state),
  every optimizer variable (slots, iteration count, so the learning-rate
  schedule continues), the compiled metrics' running totals, and the global
  step, in one checkpoint: a step can never be paired with other weights.
* **Who writes**: the chief writes `backup_dir`; other workers save too (a
  save may need collectives) but into temporary directories they remove at
  once. `backup_dir` must be on a filesystem every worker can read (a local
  directory on one host; NFS, GCS, ... across hosts): all workers restore
  from it. The chief chooses the checkpoint and tells the others through
  TensorFlow's coordination service, and a worker that cannot read it fails
  with a message instead of silently training from other weights.
* **Atomic**: TensorFlow writes a checkpoint under a temporary name and
  renames it when complete; the `checkpoint` state file is replaced
  atomically. On restore, every tensor of the newest checkpoint is read and
  its checksum verified first; a truncated or garbled one is skipped with a
  warning naming the file, and the previous one is used. The newest `keep`
  (2) checkpoints are kept.
* **Data position**: the input pipeline is deterministic for a given seed,
  so resuming at global step `s` skips the first `s` global batches of the
  (repeated, reshuffled-per-epoch) stream: no batch is trained twice or
  skipped. `fit` here trains the rest of the interrupted epoch first, then the
  remaining epochs.
* **Preemption**: SIGTERM to any worker makes every worker save at the same
  step boundary (agreed through the coordination service, one call of steps
  after the signal) and exit with `exit_codes.PREEMPTED` (75). `tfmulti launch
  --max_restarts K` restarts the cluster, which resumes from the backup.
* **Clean end**: when training ends normally the backup is deleted (keep it
  with `delete_on_success=False`).

Example (one device; the same code runs under MirroredStrategy, a
multi-worker cluster or a PipelineModel):

    >>> import tempfile
    >>> import numpy as np, tensorflow as tf, keras
    >>> from tfmulti import backup
    >>> x = np.random.default_rng(0).random((256, 8), dtype=np.float32)
    >>> y = (x.sum(axis=1) > 4).astype(np.int32)
    >>> def dataset_from(step):  # the stream of batches, positioned at `step`
    ...     ds = tf.data.Dataset.from_tensor_slices((x, y)).batch(32).repeat()
    ...     return ds.skip(step)
    >>> model = keras.Sequential([keras.Input((8,)), keras.layers.Dense(2)])
    >>> model.compile("sgd", keras.losses.SparseCategoricalCrossentropy(from_logits=True))
    >>> result = backup.fit(model, dataset_from, epochs=2, steps_per_epoch=8,
    ...                     backup_dir=tempfile.mkdtemp(), verbose=0)
    >>> result.resumed_step, len(result.history["loss"]), int(model.optimizer.iterations)
    (0, 2, 16)
"""

from __future__ import annotations

import dataclasses
import glob
import itertools
import os
import re
import shutil
import signal
import sys
import tempfile
import threading
import time
import warnings
from typing import Callable

import tensorflow as tf

from tfmulti import _checks, _faults
from tfmulti.cluster import exit_codes, tf_config

__all__ = ["Backup", "FitResult", "Preempted", "ResumePoint", "checkpoints", "delete", "fit",
           "latest_valid", "verify"]

_CHECKPOINT_PREFIX = "ckpt"
# Coordination-service keys, one set per `fit` call (`run` counts the calls,
# which every worker makes in the same order), since a key can be set only once.
_RESUME_KEY = "tfmulti/backup/{run}/resume"
_PREEMPT_KEY = "tfmulti/backup/{run}/preempt"
_ACK_KEY = "tfmulti/backup/{run}/ack/{index}"
_runs = itertools.count()
_DONE = "done"
_AGREE_TIMEOUT_S = 60.0


class Preempted(SystemExit):
    """Raised after every worker saved on SIGTERM; exits with `exit_codes.PREEMPTED`."""

    def __init__(self, message: str):
        super().__init__(exit_codes.PREEMPTED)
        self.message = message

    def __str__(self) -> str:
        return self.message


@dataclasses.dataclass(frozen=True)
class ResumePoint:
    """Where training resumes: `step` global steps are already trained."""

    step: int
    path: str | None  # the checkpoint restored from; None for a fresh start

    def epoch(self, steps_per_epoch: int) -> int:
        return self.step // steps_per_epoch

    def step_in_epoch(self, steps_per_epoch: int) -> int:
        return self.step % steps_per_epoch


def _say(message: str) -> None:
    print(f"tfmulti: {message}", flush=True)


def _checkpoint_number(path: str) -> int:
    match = re.search(rf"{_CHECKPOINT_PREFIX}-(\d+)$", path)
    return int(match.group(1)) if match else -1


def checkpoints(backup_dir: str) -> list[str]:
    """The complete-looking checkpoints in `backup_dir`, newest (highest step) first.

    Listed from the files, not the `checkpoint` state file, so a damaged
    state file does not hide good checkpoints; unfinished saves (TensorFlow's
    `*_temp` directories) are not listed.
    """
    paths = [p[: -len(".index")]
             for p in glob.glob(os.path.join(backup_dir, f"{_CHECKPOINT_PREFIX}-*.index"))]
    paths = [p for p in paths if _checkpoint_number(p) >= 0]
    return sorted(paths, key=_checkpoint_number, reverse=True)


def verify(path: str) -> int:
    """Reads every tensor of the checkpoint at `path` (TensorFlow verifies each
    one's checksum) and returns its global step.

    Raises:
        ValueError: the checkpoint is unreadable, truncated, corrupt, or has no step.
    """
    try:
        reader = tf.train.load_checkpoint(path)
        names = reader.get_variable_to_shape_map()
        for name in names:
            reader.get_tensor(name)
    except Exception as e:  # pylint: disable=broad-except  (OpError, IndexError "Read less
        # bytes than requested" from a truncated file, ...: unusable either way)
        message = str(e).strip().splitlines()[0] if str(e).strip() else type(e).__name__
        raise ValueError(f"{message[:300]}") from e
    step_keys = [n for n in names if n.startswith("step/")]
    if not step_keys:
        raise ValueError("it has no global step (not a tfmulti backup)")
    return int(reader.get_tensor(step_keys[0]))


def latest_valid(backup_dir: str) -> ResumePoint:
    """The newest checkpoint in `backup_dir` that reads back completely.

    A corrupt or truncated newer one is skipped with a warning naming its
    files. Returns `ResumePoint(0, None)` when there is none.
    """
    for path in checkpoints(backup_dir):
        try:
            return ResumePoint(verify(path), path)
        except ValueError as e:
            files = ", ".join(sorted(os.path.basename(f) for f in glob.glob(path + ".*")))
            message = (f"backup checkpoint {path} ({files}) cannot be restored ({e}); "
                       "falling back to the previous one")
            warnings.warn(message, RuntimeWarning, stacklevel=2)
            _say(f"warning: {message}")
    return ResumePoint(0, None)


def _coordination_available() -> bool:
    from tensorflow.python.eager import context

    return context.context().coordination_service is not None


def _kv():
    from tensorflow.python.eager import context

    return context.context()


class _Preemption:
    """SIGTERM on any worker -> all workers save at one agreed step boundary.

    The worker that gets the signal publishes `target = its boundary + one
    call of steps` under a coordination-service key and waits until every worker has
    acknowledged it. No worker can pass that boundary before: each step's
    gradient all-reduce needs every worker, and the signalled one only starts
    its next call after the acknowledgements. Each worker watches the key
    from a thread (no per-step cost). Without a cluster the flag is local.
    """

    def __init__(self, task_index: int, num_workers: int, steps_per_execution: int,
                 run: int = 0):
        self.task_index, self.num_workers = task_index, num_workers
        self.steps_per_execution = steps_per_execution
        self.key = _PREEMPT_KEY.format(run=run)
        self.ack_key = lambda index: _ACK_KEY.format(run=run, index=index)
        self.cluster = num_workers > 1 and _coordination_available()
        self.own_signal = False
        self.announced = False
        self.target: int | None = None
        self._event = threading.Event()
        self._previous_handler = None
        self._thread: threading.Thread | None = None

    def install(self) -> None:
        if threading.current_thread() is threading.main_thread():
            self._previous_handler = signal.signal(signal.SIGTERM, self._on_sigterm)
        if self.cluster:
            self._thread = threading.Thread(target=self._watch, daemon=True,
                                            name="tfmulti-preemption-watcher")
            self._thread.start()

    def uninstall(self) -> None:
        if self._previous_handler is not None:
            signal.signal(signal.SIGTERM, self._previous_handler)
            self._previous_handler = None
        if self._thread is not None:
            try:  # wake the watchers; a worker that already announced wins
                _kv().set_config_key_value(self.key, _DONE)
            except Exception:  # pylint: disable=broad-except  (already set, peer gone)
                pass
            self._thread.join(timeout=5.0)
            self._thread = None

    def _on_sigterm(self, signum, frame) -> None:
        self.own_signal = True
        print(f"tfmulti: worker {self.task_index} got SIGTERM; saving a backup at the next "
              "agreed step, then exiting", file=sys.stderr, flush=True)

    def _watch(self) -> None:
        try:
            value = _kv().get_config_key_value(self.key)
        except Exception:  # pylint: disable=broad-except  (service gone: training fails anyway)
            return
        if value == _DONE:
            return
        self.target = int(value)
        self._event.set()  # before the ack: the announcer resumes only after every ack
        _faults.point("backup.agreement")
        try:
            _kv().set_config_key_value(self.ack_key(self.task_index), value)
        except Exception:  # pylint: disable=broad-except
            pass

    def should_save(self, boundary: int) -> bool:
        """Called at the end of each call of steps (global step `boundary`): True when every
        worker saves here and exits."""
        if not self.cluster:
            return self.own_signal
        if self.own_signal and not self.announced:
            self.announced = True
            try:
                _kv().set_config_key_value(self.key, str(boundary + self.steps_per_execution))
            except Exception:  # pylint: disable=broad-except
                # Another worker announced first (its step holds, the watcher
                # thread has it), or training is over ("done"): nothing to add.
                return self._due(boundary)
            _faults.point("backup.agreement")
            deadline = time.monotonic() + _AGREE_TIMEOUT_S
            for index in range(self.num_workers):
                left_ms = max(1, int((deadline - time.monotonic()) * 1000))
                try:
                    _kv().get_config_key_value(self.ack_key(index), left_ms)
                except Exception as e:  # pylint: disable=broad-except
                    raise Preempted(
                        f"worker {self.task_index} got SIGTERM but worker {index} did not "
                        f"acknowledge the save step within {_AGREE_TIMEOUT_S:g} s ({e}); "
                        "exiting without a new backup") from e
        return self._due(boundary)

    def _due(self, boundary: int) -> bool:
        return self._event.is_set() and self.target is not None and boundary >= self.target


@dataclasses.dataclass(frozen=True)
class FitResult:
    """What `fit` did: the merged Keras history of the epochs trained in this
    process, and the global step it resumed from (0: a fresh start)."""

    history: dict
    resumed_step: int
    resumed_from: str | None


class Backup:
    """The checkpoint of one training run: what to save, where, and restore.

    Args:
        backup_dir: the chief's directory (created on the first save).
        model: a built, compiled Keras model (any strategy, or a PipelineModel).
        keep: how many checkpoints the chief keeps (>= 1; 2 by default, so a
            damaged newest one has a fallback).
        chief: whether this worker writes `backup_dir` (default: from TF_CONFIG).
        task_index: this worker's index (default: from TF_CONFIG).
    """

    def __init__(self, backup_dir: str, model, *, keep: int = 2, chief: bool | None = None,
                 task_index: int | None = None, run: int = 0):
        if not backup_dir:
            raise ValueError("`backup_dir` must be a directory path, got an empty value.")
        if os.path.exists(backup_dir) and not os.path.isdir(backup_dir):
            raise ValueError(f"`backup_dir` {backup_dir!r} exists and is not a directory; "
                             "pass a directory path.")
        _checks.positive_int("keep", keep, hint="use 2 so a damaged newest checkpoint has a "
                             "fallback")
        config = tf_config.from_environ()
        self.backup_dir = backup_dir
        self.keep = keep
        self.chief = tf_config.is_chief(config) if chief is None else chief
        self.task_index = (int(config["task"]["index"]) if config and "task" in config
                           else 0) if task_index is None else task_index
        self.num_workers = tf_config.num_tasks(config) if config else 1
        self.model = model
        self.resume_key = _RESUME_KEY.format(run=run)
        self.step = tf.Variable(0, dtype=tf.int64, trainable=False, name="tfmulti_global_step")
        self._metric_values: list | None = None

    # The checkpoint is built when saving or restoring, after Keras created the
    # optimizer's and the metrics' variables (at the start of `fit`).
    def _checkpoint(self, *, metrics: bool = True, optimizer: bool = True) -> tf.train.Checkpoint:
        items = {"model": list(self.model.variables), "step": self.step}
        opt = getattr(self.model, "optimizer", None)
        if optimizer and opt is not None and opt.built:
            items["optimizer"] = list(opt.variables)
        if metrics:
            items["metrics"] = list(self.model.metrics_variables)
        return tf.train.Checkpoint(**items)

    def save(self, step: int) -> str | None:
        """Saves at global step `step`; every worker must call it at the same step.
        Returns the chief's checkpoint path (None on other workers)."""
        _faults.point("backup.save")
        self.step.assign(step)
        checkpoint = self._checkpoint()
        if self.chief:
            manager = tf.train.CheckpointManager(checkpoint, self.backup_dir,
                                                 max_to_keep=self.keep,
                                                 checkpoint_name=_CHECKPOINT_PREFIX)
            path = manager.save(checkpoint_number=step)
            _faults.point("backup.saved")
            return path
        # One fixed scratch dir per backup and worker: a leftover of a worker
        # killed while saving is removed by the next save.
        scratch = self._scratch_dir()
        shutil.rmtree(scratch, ignore_errors=True)
        try:
            tf.train.CheckpointManager(checkpoint, scratch, max_to_keep=1).save(
                checkpoint_number=step)
            _faults.point("backup.saved")
        finally:
            shutil.rmtree(scratch, ignore_errors=True)
        return None

    def _scratch_dir(self) -> str:
        import hashlib

        digest = hashlib.sha256(os.path.abspath(self.backup_dir).encode()).hexdigest()[:12]
        return os.path.join(tempfile.gettempdir(),
                            f"tfmulti-backup-{digest}-worker{self.task_index}")

    def resume_point(self) -> ResumePoint:
        """The checkpoint to resume from, the same on every worker.

        The chief verifies the newest checkpoints (falling back past damaged
        ones) and publishes its choice; the other workers take it.

        Raises:
            ValueError: a worker cannot read the chief's choice (backup_dir not shared).
        """
        multi = self.num_workers > 1 and _coordination_available()
        if self.chief or not multi:
            point = latest_valid(self.backup_dir)
            if multi:
                _kv().set_config_key_value(self.resume_key, f"{point.step}|{point.path or ''}")
            return point
        value = _kv().get_config_key_value(self.resume_key, int(_AGREE_TIMEOUT_S * 1000))
        step_text, _, path = value.partition("|")
        if not path:
            return ResumePoint(0, None)
        try:
            verify(path)
        except ValueError as e:
            raise ValueError(
                f"the chief resumes from {path} but worker {self.task_index} cannot read it "
                f"({e}); `backup_dir` must be on a filesystem every worker shares.") from e
        return ResumePoint(int(step_text), path)

    def restore(self, point: ResumePoint) -> None:
        """Restores model, optimizer, metrics and step from `point.path`."""
        if point.path is None:
            return
        _faults.point("backup.restore")
        status = self._checkpoint().read(point.path)
        status.assert_existing_objects_matched().expect_partial()  # save_counter: unused
        self._metric_values = [v.numpy() for v in self.model.metrics_variables]

    def restore_weights(self, point: ResumePoint) -> None:
        """Restores only the model's variables (nothing left to train)."""
        if point.path is not None:
            _faults.point("backup.restore")
            self._checkpoint(metrics=False, optimizer=False).read(point.path).expect_partial()

    def restore_metrics(self, point: ResumePoint) -> None:
        """Puts the interrupted epoch's running metric totals back (Keras resets
        them at every epoch start)."""
        if point.path is not None and self._metric_values is not None:
            tf.train.Checkpoint(metrics=list(self.model.metrics_variables)).read(
                point.path).expect_partial()

    def delete(self) -> None:
        """The chief removes the backup (see `delete`); other workers do nothing."""
        if self.chief:
            delete(self.backup_dir)


def delete(backup_dir: str) -> None:
    """Removes the checkpoints and state file in `backup_dir`, and the directory
    if that leaves it empty (other files are the user's)."""
    if not os.path.isdir(backup_dir):
        return
    for path in glob.glob(os.path.join(backup_dir, f"{_CHECKPOINT_PREFIX}-*")) + \
            [os.path.join(backup_dir, "checkpoint")]:
        _faults.point("backup.delete")
        if os.path.isdir(path):
            shutil.rmtree(path, ignore_errors=True)
        elif os.path.exists(path):
            os.remove(path)
    try:
        os.rmdir(backup_dir)
    except OSError:
        pass


def _callback_class():
    import keras

    class BackupCallback(keras.callbacks.Callback):
        """Saves every `every_steps` steps and at epoch ends; handles SIGTERM.

        `first_epoch`/`offset`: the epoch this `fit` starts at and the steps of
        it already trained (for the global step count).
        """

        def __init__(self, backup: Backup, point: ResumePoint, steps_per_epoch: int,
                     every_steps: int | None, every_epoch: bool, preemption: _Preemption,
                     offset: int, restore: bool, start_step: int, quiet: bool):
            super().__init__()
            self.backup, self.point = backup, point
            self.steps_per_epoch, self.every_steps = steps_per_epoch, every_steps
            self.every_epoch, self.preemption = every_epoch, preemption
            self.offset, self.restore, self.quiet = offset, restore, quiet
            self.epoch = 0
            self.last_saved = start_step  # the step this fit starts from

        def on_train_begin(self, logs=None):
            if self.restore and self.point.path:
                self.backup.restore(self.point)
                _say(f"restored {self.point.path} (global step {self.point.step})")

        def on_epoch_begin(self, epoch, logs=None):
            self.epoch = epoch
            if self.restore and self.offset:
                self.backup.restore_metrics(self.point)  # mid-epoch: totals so far

        def _global_step(self, end_step: int) -> int:
            offset = self.offset if self.epoch == self.point.epoch(self.steps_per_epoch) else 0
            return self.epoch * self.steps_per_epoch + offset + end_step + 1

        def on_train_batch_end(self, batch, logs=None):
            step = self._global_step(batch)
            _faults.point("backup.step")
            if self.preemption.should_save(step):
                self._save(step, "preempted")
                message = (f"preempted: saved a backup at global step {step} in "
                           f"{self.backup.backup_dir}; exiting with code "
                           f"{exit_codes.PREEMPTED}; rerun to resume")
                print(f"tfmulti: {message}", file=sys.stderr, flush=True)
                raise Preempted(message)
            if self.every_steps and step // self.every_steps > self.last_saved // self.every_steps:
                self._save(step, f"every {self.every_steps} steps")

        def on_epoch_end(self, epoch, logs=None):
            step = (epoch + 1) * self.steps_per_epoch
            if self.every_epoch and step > self.last_saved:
                self._save(step, "epoch end")

        def _save(self, step: int, why: str) -> None:
            path = self.backup.save(step)
            self.last_saved = step
            if path and not self.quiet:
                _say(f"backup at global step {step} ({why}): {path}")

    return BackupCallback


def _build_for_restore(model, dataset) -> None:
    """Creates the model's, optimizer's and metrics' variables, so that a
    restore has them to fill.

    Keras builds a model made under a strategy's scope at the start of `fit`,
    before the callbacks' `on_train_begin` (where the backup is restored);
    one made outside any scope only when its first step is traced, after it:
    a restore then found no optimizer slots (Adam resumed with fresh moments
    and iteration count) or, for a model without an `Input`, no weights at
    all. Built here from the data's element spec, nothing is read.
    """
    if getattr(model, "_distribute_strategy", None) is not None:
        return  # Keras builds it before the callbacks run
    spec = getattr(dataset, "element_spec", None)
    if spec is None or not all(isinstance(s, tf.TensorSpec) for s in tf.nest.flatten(spec)):
        raise ValueError(
            f"cannot build the model to restore its backup from data of type "
            f"{type(dataset).__name__}: pass a tf.data.Dataset from `dataset_from`, or "
            f"build the model (and `model.optimizer.build(model.trainable_variables)`) "
            f"before calling fit.")
    model._symbolic_build(data_batch=spec)


def fit(model, dataset_from: Callable[[int], object], *, epochs: int, steps_per_epoch: int,
        backup_dir: str, save_every_steps: int | None = None, save_every_epoch: bool = True,
        keep: int = 2, delete_on_success: bool = True, preemption: bool = True,
        callbacks=(), verbose="auto", steps_per_execution: int | None = None,
        **fit_kwargs) -> FitResult:
    """`model.fit` that resumes from `backup_dir` at the next step.

    Args:
        model: a compiled Keras model (under any strategy) or a PipelineModel.
        dataset_from: `dataset_from(step)` returns the training data positioned
            after `step` global batches (a dataset that repeats over epochs,
            e.g. `tfmulti.data.distribute(..., skip_steps=step).dataset`).
        epochs, steps_per_epoch: the whole run (steps are global batches).
        backup_dir: where the chief keeps its checkpoints.
        save_every_steps: also save every this many steps (rounded up to the
            model's steps per execution); default: only at epoch ends.
        save_every_epoch: save at each epoch end.
        keep: checkpoints kept (2: a damaged newest one has a fallback).
        delete_on_success: remove the backup when training ends normally.
        preemption: on SIGTERM, save at an agreed step and raise `Preempted`
            (a SystemExit with code 75).
        callbacks, verbose, fit_kwargs: passed to `model.fit`; `verbose=0` also
            silences the line printed at each backup.
        steps_per_execution: the model's (`fit` runs the compiled value);
            another value is refused.

    Returns:
        A `FitResult`: the merged `history.history` of the (one or two) `fit`
        calls (a resumed epoch's entry covers the whole epoch: its metric
        totals are restored too), and where training resumed.

    Raises:
        ValueError: bad arguments, or a resume step that does not fit the run.
        Preempted: after saving on SIGTERM.
    """
    _checks.positive_int("epochs", epochs)
    _checks.positive_int("steps_per_epoch", steps_per_epoch)
    _checks.positive_int("save_every_steps", save_every_steps, none_ok=True)
    compiled = getattr(model, "steps_per_execution", 1) or 1
    if steps_per_execution is not None and steps_per_execution != compiled:
        raise ValueError(f"`steps_per_execution` ({steps_per_execution}) differs from the "
                         f"model's ({compiled}), which is what `fit` runs; compile the model "
                         f"with steps_per_execution={steps_per_execution} or leave it unset.")
    steps_per_execution = compiled
    if steps_per_epoch % steps_per_execution:
        raise ValueError(f"the model's steps per execution ({steps_per_execution}) must divide "
                         f"`steps_per_epoch` ({steps_per_epoch}) for step-exact resumes.")
    run = next(_runs)
    backup = Backup(backup_dir, model, keep=keep, run=run)
    point = backup.resume_point()
    total = epochs * steps_per_epoch
    if point.step > total:
        raise ValueError(f"the backup in {backup_dir} is at global step {point.step}, beyond "
                         f"this run's {epochs} epochs x {steps_per_epoch} steps = {total}; "
                         "use a new `backup_dir` or more `epochs`.")
    if point.step % steps_per_execution:
        raise ValueError(f"the backup in {backup_dir} is at global step {point.step}, not a "
                         f"multiple of the steps per execution ({steps_per_execution}); resume "
                         "with the steps per execution it was saved with.")
    if point.path and point.step == total:
        _say(f"resuming from {point.path}: global step {point.step}, the end of the run; "
             "restoring its weights, nothing left to train")
    elif point.path:
        _say(f"resuming from {point.path}: global step {point.step} = epoch "
             f"{point.epoch(steps_per_epoch) + 1}, step {point.step_in_epoch(steps_per_epoch)}"
             f" of {steps_per_epoch}; the input skips {point.step} batches")
    watcher = _Preemption(backup.task_index, backup.num_workers, steps_per_execution, run)
    callback_cls = _callback_class()
    history: dict[str, list] = {}
    first_epoch, offset = point.epoch(steps_per_epoch), point.step_in_epoch(steps_per_epoch)
    phases = []  # (initial_epoch, epochs, steps, skip, offset)
    if offset:
        phases.append((first_epoch, first_epoch + 1, steps_per_epoch - offset, point.step,
                       offset))
        first_epoch += 1
    if first_epoch < epochs:
        phases.append((first_epoch, epochs, steps_per_epoch, first_epoch * steps_per_epoch, 0))
    fit_kwargs.setdefault("shuffle", False)  # the data comes positioned: never reorder
    if point.path:
        _build_for_restore(model, dataset_from(phases[0][3] if phases else point.step))
    watcher.install()
    try:
        if not phases:  # the backup is the finished run: only the weights matter
            backup.restore_weights(point)
        for i, (initial, end, steps, skip, phase_offset) in enumerate(phases):
            if i and model.stop_training:  # a callback stopped the resumed epoch
                break
            callback = callback_cls(backup, point, steps_per_epoch, save_every_steps,
                                    save_every_epoch, watcher, phase_offset, restore=i == 0,
                                    start_step=skip, quiet=verbose == 0)
            result = model.fit(dataset_from(skip), initial_epoch=initial, epochs=end,
                               steps_per_epoch=steps, callbacks=[*callbacks, callback],
                               verbose=verbose, **fit_kwargs)
            for key, values in result.history.items():
                history.setdefault(key, []).extend(values)
    finally:
        watcher.uninstall()
    if delete_on_success:
        backup.delete()
    return FitResult(history, point.step, point.path)
