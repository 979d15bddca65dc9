"""The checkpoints of one run in `backup_dir`: list, verify, save, restore, delete."""

from __future__ import annotations

import dataclasses
import glob
import os
import re
import shutil
import tempfile
import warnings

import tensorflow as tf

from tfmulti import _checks
from tfmulti.backup._preemption import _AGREE_TIMEOUT_S, _coordination_available, _kv
from tfmulti.cluster import tf_config

_CHECKPOINT_PREFIX = "ckpt"
# A coordination-service key per `fit` call (`run` counts the calls, which
# every worker makes in the same order), since a key can be set only once.
_RESUME_KEY = "tfmulti/backup/{run}/resume"


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
        self.step.assign(step)
        checkpoint = self._checkpoint()
        if self.chief:
            manager = tf.train.CheckpointManager(checkpoint, self.backup_dir,
                                                 max_to_keep=self.keep,
                                                 checkpoint_name=_CHECKPOINT_PREFIX)
            return manager.save(checkpoint_number=step)
        # One fixed scratch dir per backup and worker: a leftover of a worker
        # killed while saving is removed by the next save.
        scratch = self._scratch_dir()
        shutil.rmtree(scratch, ignore_errors=True)
        try:
            tf.train.CheckpointManager(checkpoint, scratch, max_to_keep=1).save(
                checkpoint_number=step)
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
        status = self._checkpoint().read(point.path)
        status.assert_existing_objects_matched().expect_partial()  # save_counter: unused
        self._metric_values = [v.numpy() for v in self.model.metrics_variables]

    def restore_weights(self, point: ResumePoint) -> None:
        """Restores only the model's variables (nothing left to train)."""
        if point.path is not None:
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
        if os.path.isdir(path):
            shutil.rmtree(path, ignore_errors=True)
        elif os.path.exists(path):
            os.remove(path)
    try:
        os.rmdir(backup_dir)
    except OSError:
        pass


