"""`fit`: `model.fit` that resumes from a backup at the next step."""

from __future__ import annotations

import contextlib
import dataclasses
import itertools
import sys
from typing import Callable

import tensorflow as tf

from tfmulti.utils import checks
from tfmulti.utils.failpoints import failpoint
from tfmulti.training.backup._checkpoint import Backup, ResumePoint, say, delete
from tfmulti.training.backup._preemption import Preempted, PreemptionWatcher
from tfmulti.cluster import exit_codes

_runs = itertools.count()


@dataclasses.dataclass(frozen=True)
class FitResult:
    """What `fit` did: the merged Keras history of the epochs trained in this
    process, the global step it resumed from (0: a fresh start) and the
    checkpoint it resumed from; `delete_backup()` once the results are saved.

    A run resumed at its end (the backup is the finished run) trains nothing:
    `history` is empty, and the model's metrics hold the last epoch's totals
    (`model.get_metrics_result()`), as after the uninterrupted `fit`."""

    history: dict
    resumed_step: int
    resumed_from: str | None
    backup_dir: str | None = None
    chief: bool = True

    def delete_backup(self) -> None:
        """Deletes the backup (on the chief; other workers do nothing). Call it after
        saving the trained model: until then a crash can still resume from it.

        Raises:
            ValueError: another run holds `backup_dir` now.
        """
        if self.chief and self.backup_dir:
            delete(self.backup_dir)


def _callback_class():
    import keras

    class BackupCallback(keras.callbacks.Callback):
        """Saves every `every_steps` steps and at epoch ends; handles SIGTERM.

        `first_epoch`/`offset`: the epoch this `fit` starts at and the steps of
        it already trained (for the global step count). `validating`: `fit`
        evaluates validation data at each epoch end, which resets the metrics
        to count the validation's; the epoch's backup is then taken after its
        last step, before that, so that it holds the training totals (those a
        run resumed at its end reports).
        """

        def __init__(self, backup: Backup, point: ResumePoint, steps_per_epoch: int,
                     every_steps: int | None, every_epoch: bool, preemption: PreemptionWatcher,
                     offset: int, restore: bool, start_step: int, quiet: bool,
                     validating: bool = False):
            super().__init__()
            self.validating = validating
            self.backup, self.point = backup, point
            self.steps_per_epoch, self.every_steps = steps_per_epoch, every_steps
            self.every_epoch, self.preemption = every_epoch, preemption
            self.offset, self.restore, self.quiet = offset, restore, quiet
            self.epoch = 0
            self.last_saved = start_step  # the step this fit starts from

        def on_train_begin(self, logs=None):
            if self.restore and self.point.path:
                self.backup.restore(self.point)
                say(f"restored {self.point.path} (global step {self.point.step})")

        def on_epoch_begin(self, epoch, logs=None):
            self.epoch = epoch
            if self.restore and self.offset:
                self.backup.restore_metrics(self.point)  # mid-epoch: totals so far

        def _global_step(self, end_step: int) -> int:
            offset = self.offset if self.epoch == self.point.epoch(self.steps_per_epoch) else 0
            return self.epoch * self.steps_per_epoch + offset + end_step + 1

        def on_train_batch_end(self, batch, logs=None):
            step = self._global_step(batch)
            failpoint("backup.step")
            if self.preemption.should_save(step):
                self._save(step, "preempted")
                message = (f"preempted: saved a backup at global step {step} in "
                           f"{self.backup.backup_dir}; exiting with code "
                           f"{exit_codes.PREEMPTED}; rerun to resume")
                print(f"tfmulti: {message}", file=sys.stderr, flush=True)
                raise Preempted(message)
            if self.every_steps and step // self.every_steps > self.last_saved // self.every_steps:
                self._save(step, f"every {self.every_steps} steps")
            elif self.validating and self.every_epoch and step % self.steps_per_epoch == 0:
                self._save(step, "epoch end, before validation")

        def on_epoch_end(self, epoch, logs=None):
            step = (epoch + 1) * self.steps_per_epoch
            if self.every_epoch and step > self.last_saved:
                self._save(step, "epoch end")

        def _save(self, step: int, why: str) -> None:
            path = self.backup.save(step)
            self.last_saved = step
            if path and not self.quiet:
                say(f"backup at global step {step} ({why}): {path}")

    return BackupCallback


def _build_for_restore(model, dataset, *, without_fit: bool = False) -> None:
    """Creates the model's, optimizer's and metrics' variables, so that a
    restore has them to fill.

    Keras builds a model made under a strategy's scope at the start of `fit`,
    before the callbacks' `on_train_begin` (where the backup is restored);
    one made outside any scope only when its first step is traced, after it:
    a restore then found no optimizer slots (Adam resumed with fresh moments
    and iteration count) or, for a model without an `Input`, no weights at
    all. `without_fit`: no `fit` follows (the backup is the finished run), so
    a model under a strategy is built here too. Built from the data's element
    spec (one replica's, for a distributed dataset), nothing is read.
    """
    strategy = getattr(model, "_distribute_strategy", None)
    if strategy is not None and not without_fit:
        return  # Keras builds it before the callbacks run
    spec = getattr(dataset, "element_spec", None)
    if spec is not None:  # a distributed dataset's per-replica specs: one replica's
        spec = tf.nest.map_structure(lambda s: getattr(s, "_value_specs", (s,))[0], spec)
    if spec is None or not all(isinstance(s, tf.TensorSpec) for s in tf.nest.flatten(spec)):
        raise ValueError(
            f"cannot build the model to restore its backup from data of type "
            f"{type(dataset).__name__}: pass a tf.data.Dataset from `dataset_from`, or "
            f"build the model (and `model.optimizer.build(model.trainable_variables)`) "
            f"before calling fit.")
    with strategy.scope() if strategy is not None else contextlib.nullcontext():
        model._symbolic_build(data_batch=spec)


def fit(model, dataset_from: Callable[[int], object], *, epochs: int, steps_per_epoch: int,
        backup_dir: str, save_every_steps: int | None = None, save_every_epoch: bool = True,
        keep: int = 2, delete_on_success: bool = False, preemption: bool = True,
        callbacks=(), verbose="auto", steps_per_execution: int | None = None,
        fingerprint: dict | None = None, discard_unreadable_backup: bool = False,
        **fit_kwargs) -> FitResult:
    """`model.fit` that resumes from `backup_dir` at the next step.

    Args:
        model (keras.Model): a compiled Keras model (under any strategy) or a PipelineModel.
        dataset_from: `dataset_from(step)` returns the training data positioned
            after `step` global batches (a dataset that repeats over epochs,
            e.g. `tfmulti.data.distribute(..., skip_steps=step).dataset`).
        epochs: the whole run's epochs.
        steps_per_epoch: global batches per epoch.
        backup_dir: where the chief keeps its checkpoints.
        save_every_steps: also save every this many steps (rounded up to the
            model's steps per execution); default: only at epoch ends.
        save_every_epoch: save at each epoch end.
        keep: checkpoints kept (2: a damaged newest one has a fallback).
        delete_on_success: remove the backup when training ends normally.
            Off by default: the backup is the only copy of the trained state
            until the caller has saved the model; call `delete_backup()` on
            the result (or `tfmulti.training.backup.delete(backup_dir)`) after that.
        preemption: on SIGTERM, save at an agreed step and raise `Preempted`
            (a SystemExit with code 75; `PreemptedUnsaved`, 76, when the
            workers could not agree on a step).
        callbacks (Sequence[keras.callbacks.Callback]): passed to `model.fit`.
        verbose (str | int): passed to `model.fit`; `verbose=0` also
            silences the line printed at each backup.
        **fit_kwargs (Any): passed to `model.fit`. With `validation_data`,
            each epoch's backup is taken after its last step, before `fit`
            validates (which resets the metrics' training totals).
        steps_per_execution: the model's (`fit` runs the compiled value);
            another value is refused.
        fingerprint: the caller's fields that must not change across a resume
            (JSON values, e.g. global batch, dataset, seed), stored with the
            checkpoints with what `fit` knows (the model's variables, the
            optimizer, `steps_per_epoch`, the steps per execution); resuming
            a backup whose fingerprint differs is refused, naming the fields.
        discard_unreadable_backup: start from step 0 when a file of the backup
            cannot be read (permissions, an I/O error, a missing mount),
            discarding the backup, with a warning naming the file; default: stop
            with `UnreadableBackup` and change nothing (see `Backup`).

    Returns:
        A `FitResult`: the merged `history.history` of the (one or two) `fit`
        calls (a resumed epoch's entry covers the whole epoch: its metric
        totals are restored too), and where training resumed.

    Raises:
        ValueError: bad arguments, a resume step that does not fit the run,
            a backup of a run with other settings, or a `backup_dir` in use
            by another run.
        UnreadableBackup: a file of the backup cannot be read (an OSError;
            nothing was changed).
        OSError: `backup_dir` is full (the previous backup is kept).
        Preempted: after saving on SIGTERM.
        PreemptedUnsaved: on SIGTERM, when the workers did not agree on a step.
    """
    checks.positive_int("epochs", epochs)
    checks.positive_int("steps_per_epoch", steps_per_epoch)
    checks.positive_int("save_every_steps", save_every_steps, none_ok=True)
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
    backup = Backup(backup_dir, model, keep=keep, run=run,
                    discard_unreadable_backup=discard_unreadable_backup, fingerprint={
        **(fingerprint or {}), "steps_per_epoch": steps_per_epoch,
        "steps_per_execution": steps_per_execution})
    try:
        history, point = _fit(model, backup, dataset_from, epochs, steps_per_epoch,
                              steps_per_execution, save_every_steps, save_every_epoch,
                              preemption, callbacks, verbose, fit_kwargs)
    finally:
        backup.release()
    result = FitResult(history, point.step, point.path, backup_dir, backup.chief)
    if delete_on_success:
        result.delete_backup()
    return result


def _fit(model, backup: Backup, dataset_from, epochs: int, steps_per_epoch: int,
         steps_per_execution: int, save_every_steps, save_every_epoch: bool, preemption: bool,
         callbacks, verbose, fit_kwargs) -> tuple[dict, ResumePoint]:
    """`fit` once `backup` is made: (the merged history, where it resumed)."""
    backup_dir = backup.backup_dir
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
        say(f"resuming from {point.path}: global step {point.step}, the end of the run; "
             "restoring its weights, optimizer and last epoch's metrics, nothing left to train")
    elif point.path:
        say(f"resuming from {point.path}: global step {point.step} = epoch "
             f"{point.epoch(steps_per_epoch) + 1}, step {point.step_in_epoch(steps_per_epoch)}"
             f" of {steps_per_epoch}; the input skips {point.step} batches")
    watcher = PreemptionWatcher(backup.task_index, backup.num_workers, steps_per_execution,
                          backup.run)
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
        _build_for_restore(model, dataset_from(phases[0][3] if phases else point.step),
                           without_fit=not phases)
        if model.built:  # else Keras builds it in `fit`, and `restore` checks it there
            backup.check_fingerprint()
    if preemption:
        watcher.install()
    try:
        if not phases:
            # The backup is the finished run (a crash came during the caller's
            # evaluation or writes): the model as `fit` left it, optimizer and
            # the last epoch's metric totals included, since the caller saves it.
            backup.restore(point)
        for i, (initial, end, steps, skip, phase_offset) in enumerate(phases):
            if i and model.stop_training:  # a callback stopped the resumed epoch
                break
            callback = callback_cls(backup, point, steps_per_epoch, save_every_steps,
                                    save_every_epoch, watcher, phase_offset, restore=i == 0,
                                    start_step=skip, quiet=verbose == 0,
                                    validating=fit_kwargs.get("validation_data") is not None)
            result = model.fit(dataset_from(skip), initial_epoch=initial, epochs=end,
                               steps_per_epoch=steps, callbacks=[*callbacks, callback],
                               verbose=verbose, **fit_kwargs)
            for key, values in result.history.items():
                history.setdefault(key, []).extend(values)
    finally:
        watcher.uninstall()
    return history, point

