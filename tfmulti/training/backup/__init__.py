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
* **Atomic**: TensorFlow writes a checkpoint (`tfmulti-ckpt-STEP.*`) under a
  temporary name and renames it when complete. On restore, every file of the
  newest checkpoint is read, then every tensor with its checksum verified; a
  corrupt one (its files read, their content does not check: truncated,
  garbled, a data file missing) is skipped with a warning naming the files,
  and the previous one is used. The newest `keep` (2) checkpoints are kept; an
  older one is removed only after the new one has read back whole. A full
  `backup_dir` stops the save with an OSError naming it ("no space left"),
  the previous checkpoints kept.
* **Unreadable is not corrupt**: a file the operating system cannot read
  (permissions, an I/O error, a missing mount) stops the run with
  `UnreadableBackup` (an OSError naming the file and the error), changing
  nothing: no fallback, no fresh start that would replace the backup, unless
  the caller says so (`discard_unreadable_backup=True`: a warning naming the
  file, a start from step 0).
* **One run per directory**: the chief locks `backup_dir` while it runs
  (`flock`; a second run gets an error naming the holder's host, pid, start
  and command; a killed run's lock dies with it). The run's fingerprint (the
  model's variables, the optimizer, the steps per epoch and per call, and the
  caller's fields such as global batch, dataset and seed) is stored with the
  checkpoints, and a resume with other settings is refused, naming them.
  Only tfmulti's own files are listed, restored, pruned or deleted: other
  checkpoints in the directory are left alone. `backup_dir` is a path, never
  a pattern (`runs/exp[12]` is that directory).
* **Data position**: the input pipeline is deterministic for a given seed,
  so resuming at global step `s` skips the first `s` global batches of the
  (repeated, reshuffled-per-epoch) stream: no batch is trained twice or
  skipped. `fit` here trains the rest of the interrupted epoch first, then the
  remaining epochs.
* **Preemption**: SIGTERM to any worker makes every worker save at the same
  step boundary (agreed through the coordination service, one call of steps
  after the signal) and exit with `exit_codes.PREEMPTED` (75); when the
  workers cannot agree within `PREEMPTION_AGREEMENT_S` (20 s), nothing is
  saved and they exit with `exit_codes.PREEMPTED_UNSAVED` (76). `tfmulti
  launch --max_restarts K` restarts the cluster, which resumes from the backup.
* **Clean end**: the backup stays until the caller has saved what it needs:
  call `result.delete_backup()` (or `delete(backup_dir)`) after saving the
  model; a crash or a full disk during that save still resumes from the
  backup (`delete_on_success=True` deletes it as `fit` returns).

Example (one device; the same code runs under MirroredStrategy, a
multi-worker cluster or a PipelineModel):

    >>> import os, tempfile
    >>> import numpy as np, tensorflow as tf, keras
    >>> from tfmulti.training import backup
    >>> x = np.random.default_rng(0).random((256, 8), dtype=np.float32)
    >>> y = (x.sum(axis=1) > 4).astype(np.int32)
    >>> def dataset_from(step):  # the stream of batches, positioned at `step`
    ...     ds = tf.data.Dataset.from_tensor_slices((x, y)).batch(32).repeat()
    ...     return ds.skip(step)
    >>> model = keras.Sequential([keras.Input((8,)), keras.layers.Dense(2)])
    >>> model.compile("sgd", keras.losses.SparseCategoricalCrossentropy(from_logits=True))
    >>> backup_dir = tempfile.mkdtemp()
    >>> result = backup.fit(model, dataset_from, epochs=2, steps_per_epoch=8,
    ...                     backup_dir=backup_dir, verbose=0)
    >>> result.resumed_step, len(result.history["loss"]), int(model.optimizer.iterations)
    (0, 2, 16)
    >>> model.save(os.path.join(tempfile.mkdtemp(), "model.keras"))  # the results first,
    >>> result.delete_backup()  # then the backup
    >>> os.path.exists(backup_dir)
    False
"""

from __future__ import annotations

from tfmulti.training.backup._checkpoint import (Backup, ResumePoint, checkpoints, delete,
                                                 latest_valid, lock, verify)
from tfmulti.training.backup._files import UnreadableBackup
from tfmulti.training.backup._fit import FitResult, fit
from tfmulti.training.backup._preemption import Preempted, PreemptedUnsaved

__all__ = ["Backup", "FitResult", "Preempted", "PreemptedUnsaved", "ResumePoint",
           "UnreadableBackup", "checkpoints", "delete", "fit", "latest_valid", "lock", "verify"]
