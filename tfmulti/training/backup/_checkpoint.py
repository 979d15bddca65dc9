"""The checkpoints of one run in `backup_dir`: list, verify, save, restore, delete."""

from __future__ import annotations

import contextlib
import dataclasses
import errno
import glob
import json
import os
import shutil
import sys
import tempfile
import warnings

import tensorflow as tf

from tfmulti.utils import checks
from tfmulti.utils.failpoints import failpoint
from tfmulti.runtime import strategy as strategy_lib
# Module names of their own, so that a test can fake the coordination service here.
from tfmulti.runtime.roles import coordination_available as _coordination_available
from tfmulti.runtime.roles import coordination_store as _kv
from tfmulti.training.backup import _files, _keys

# A coordination-service key per `fit` call (`run` counts the calls, which
# every worker makes in the same order), since a key can be set only once.
_RESUME_KEY = "tfmulti/training/backup/{run}/resume"
# How long the other workers wait for the chief's resume point: it reads every
# tensor of the newest checkpoints first (a large model on a network filesystem).
_RESUME_WAIT_S = 300.0


@dataclasses.dataclass(frozen=True)
class ResumePoint:
    """Where training resumes: `step` global steps are already trained."""

    step: int
    path: str | None  # the checkpoint restored from; None for a fresh start

    def epoch(self, steps_per_epoch: int) -> int:
        return self.step // steps_per_epoch

    def step_in_epoch(self, steps_per_epoch: int) -> int:
        return self.step % steps_per_epoch


def say(message: str) -> None:
    """Prints a backup message on its own line, `tfmulti: ...`."""
    print(f"tfmulti: {message}", flush=True)


def checkpoints(backup_dir: str) -> list[str]:
    """tfmulti's complete-looking checkpoints in `backup_dir`, newest (highest step) first.

    Listed from the files (names matched literally, never as patterns);
    unfinished saves and checkpoints tfmulti did not write are not listed.
    """
    return _files.checkpoint_prefixes(backup_dir)


UnreadableBackup = _files.UnreadableBackup


# The end of TensorFlow's message for a file the OS failed to read ("PATH; Permission
# denied"): a read failure, unless the file is simply absent (an incomplete checkpoint).
_OS_REASONS = tuple(f"; {os.strerror(n)}" for n in sorted(errno.errorcode)
                    if n != errno.ENOENT)


def verify(path: str) -> int:
    """Reads every file of the checkpoint at `path` to its end, then every tensor
    (TensorFlow verifies each one's checksum), and returns its global step.

    A file the operating system cannot read is a read failure, which says nothing
    about the checkpoint; files that read but whose content does not check (a
    checksum, a truncated or garbled file, a missing data file) are corruption.

    Raises:
        UnreadableBackup: a file cannot be read (permissions, an I/O error, a
            missing mount); an OSError.
        ValueError: the checkpoint is truncated, corrupt, incomplete, or has no step.
    """
    backup_dir = os.path.dirname(path)
    index = path + ".index"
    names = _files.checkpoint_files(path)
    if os.path.basename(index) not in names:  # listed a moment ago: the folder went away?
        raise _files.unreadable(index, "it is no longer listed in its folder", backup_dir)
    for name in names:
        full = os.path.join(backup_dir, name)
        try:
            _files.read_through(full)
        except OSError as e:
            raise _files.unreadable(full, e.strerror or str(e), backup_dir) from e
    try:
        with _literal(path) as literal:
            reader = tf.train.load_checkpoint(literal)
            names = reader.get_variable_to_shape_map()
            for name in names:
                reader.get_tensor(name)
    except Exception as e:  # pylint: disable=broad-except  (OpError, IndexError "Read less
        # bytes than requested" from a truncated file, ...: unusable either way)
        message = str(e).strip().splitlines()[0] if str(e).strip() else type(e).__name__
        reason = next((r for r in _OS_REASONS if message.endswith(r)), None)
        if reason:  # the OS failed TensorFlow's read, after ours (a transient error)
            raise _files.unreadable(message[: -len(reason)], reason[2:], backup_dir) from e
        raise ValueError(f"{message[:300]}") from e
    step_keys = [n for n in names if n.startswith("step/")]
    if not step_keys:
        raise ValueError("it has no global step (not a tfmulti backup)")
    return int(reader.get_tensor(step_keys[0]))


@contextlib.contextmanager
def _literal(path: str):
    """`path`, or while a folder name in it holds glob characters (`runs/exp[12]`),
    the same checkpoint through a link without them: TensorFlow's checkpoint
    reader matches its path as a pattern."""
    if not glob.has_magic(path):
        yield path
        return
    scratch = tempfile.mkdtemp(prefix="tfmulti-read-")
    try:
        os.symlink(os.path.abspath(os.path.dirname(path)), os.path.join(scratch, "backup"))
        yield os.path.join(scratch, "backup", os.path.basename(path))
    finally:
        shutil.rmtree(scratch, ignore_errors=True)


def latest_valid(backup_dir: str) -> ResumePoint:
    """The newest checkpoint in `backup_dir` that reads back completely.

    A corrupt, truncated or incomplete newer one is skipped with a warning
    naming its files. Returns `ResumePoint(0, None)` when there is none.

    Raises:
        UnreadableBackup: a file of the newest checkpoint that is not corrupt cannot
            be read: nothing is skipped, nothing is known (the message names the
            file, the error and the fixes).
    """
    for path in checkpoints(backup_dir):
        try:
            return ResumePoint(verify(path), path)
        except UnreadableBackup:
            raise
        except ValueError as e:
            files = ", ".join(_files.checkpoint_files(path))
            message = (f"backup checkpoint {path} ({files}) cannot be restored ({e}); "
                       "falling back to the previous one")
            warnings.warn(message, RuntimeWarning, stacklevel=2)
            say(f"warning: {message}")
    return ResumePoint(0, None)


def lock(backup_dir: str, strategy: tf.distribute.Strategy | None = None
         ) -> contextlib.AbstractContextManager:
    """Holds `backup_dir` for this run on its chief (a no-op on other workers): a
    second run on the same directory gets a ValueError naming this one. `fit`
    holds it while it trains; hold it longer around `fit`, the evaluation, the
    writes and `delete`, so no other run can take the finished backup meanwhile.

    Args:
        backup_dir: the run's backup directory (created if needed).
        strategy: the run's strategy, whose cluster resolver says who the chief
            is (TF_CONFIG, SLURM, ...); default: the current strategy.

    Returns:
        A context manager.

    Example:
        >>> import tempfile
        >>> from tfmulti.training import backup
        >>> with backup.lock(tempfile.mkdtemp()):
        ...     pass  # fit, evaluate, save the model, backup.delete(...)

    Raises:
        ValueError: another run holds it, or `backup_dir` cannot be written.
    """
    if strategy_lib.cluster_role(strategy).is_chief:
        return _files.DirLock(backup_dir)
    return contextlib.nullcontext()


class Backup:
    """The checkpoint of one training run: what to save, where, and restore.

    What `fit` uses, and what a training loop of your own uses the same way:
    every worker calls `resume_point()`, then `restore(point)`, trains from
    global step `point.step` (its input skipping `point.step` batches), and
    calls `save(step)` at the same steps (e.g. every N steps); the chief
    writes. After saving the trained model, the chief calls `delete()`.

    Args:
        backup_dir: the chief's directory (created when the chief first uses it).
        model (keras.Model): a Keras model (any strategy, or a PipelineModel), built before
            `save` or `restore`. Its variables are keyed by their place in the
            model, so a backup restores with another replica count, on one
            device, or from a pipeline into its `to_sequential()` and back.
        optimizer (keras.optimizers.Optimizer | None): the optimizer whose variables (slots,
            iteration count) are saved; default: `model.optimizer` (None: none).
        keep: how many checkpoints the chief keeps (>= 1; 2 by default, so a
            damaged newest one has a fallback).
        fingerprint: the caller's fields that must not change across a resume
            (JSON values: global batch, dataset, seed, ...), stored with the
            checkpoints next to the model's variable shapes and the
            optimizer; a resume with other values is refused.
        strategy: the strategy whose cluster resolver (TF_CONFIG, SLURM, ...)
            says which worker is the chief and how many there are; default:
            the model's (`model.distribute_strategy`).
        chief: override: whether this worker writes `backup_dir`.
        task_index: override: this worker's rank (chief 0).
        discard_unreadable_backup: when a file of the backup cannot be read
            (permissions, an I/O error, a missing mount), start from step 0,
            discarding the backup (its checkpoints are replaced by this run's),
            with a warning naming the file; default: stop with an
            `UnreadableBackup` error and change nothing. A corrupt checkpoint
            (it reads, its content does not check) is skipped either way.

    The chief locks `backup_dir` when it first uses it (see `lock`), until
    `release()`, the end of a `with Backup(...)` block, or the object's deletion.

    Example (a loop of your own, one device):
        >>> import tempfile
        >>> import numpy as np, tensorflow as tf, keras
        >>> from tfmulti.training import backup
        >>> model = keras.Sequential([keras.Input((4,)), keras.layers.Dense(1)])
        >>> optimizer = keras.optimizers.SGD(0.1)
        >>> optimizer.build(model.trainable_variables)
        >>> x, y = np.ones((8, 4), np.float32), np.ones((8, 1), np.float32)
        >>> def train_step():
        ...     with tf.GradientTape() as tape:
        ...         loss = tf.reduce_mean((model(x) - y) ** 2)
        ...     grads = tape.gradient(loss, model.trainable_variables)
        ...     optimizer.apply_gradients(zip(grads, model.trainable_variables))
        >>> with backup.Backup(tempfile.mkdtemp(), model, optimizer) as saver:
        ...     point = saver.resume_point()  # ResumePoint(0, None): a fresh start
        ...     saver.restore(point)
        ...     for step in range(point.step, 6):
        ...         train_step()
        ...         if (step + 1) % 3 == 0:
        ...             _ = saver.save(step + 1)
        ...     saver.resume_point().step, int(optimizer.iterations)
        (6, 6)
    """

    def __init__(self, backup_dir: str, model, optimizer=None, *, keep: int = 2,
                 fingerprint: dict | None = None,
                 strategy: tf.distribute.Strategy | None = None, chief: bool | None = None,
                 task_index: int | None = None, run: int = 0,
                 discard_unreadable_backup: bool = False):
        if not backup_dir:
            raise ValueError("`backup_dir` must be a directory path, got an empty value.")
        if os.path.exists(backup_dir) and not os.path.isdir(backup_dir):
            raise ValueError(f"`backup_dir` {backup_dir!r} exists and is not a directory; "
                             "pass a directory path.")
        checks.positive_int("keep", keep, hint="use 2 so a damaged newest checkpoint has a "
                             "fallback")
        self.extra_fingerprint = _json_fields(fingerprint)
        self.backup_dir = backup_dir
        self.keep = keep
        self.strategy = (strategy or getattr(model, "distribute_strategy", None)
                         or tf.distribute.get_strategy())
        role = strategy_lib.cluster_role(self.strategy)
        self.chief = role.is_chief if chief is None else chief
        self.task_index = role.worker_index if task_index is None else task_index
        self.num_workers = role.num_workers
        self.model = model
        self.optimizer = optimizer if optimizer is not None else getattr(model, "optimizer", None)
        self.run = run
        self.resume_key = _RESUME_KEY.format(run=run)
        self.step = tf.Variable(0, dtype=tf.int64, trainable=False, name="tfmulti_global_step")
        self._restored = False  # then `restore_metrics` puts the totals back at epoch starts
        self._lock = _files.DirLock(backup_dir)
        self._fingerprint_checked = False
        self.discard_unreadable_backup = bool(discard_unreadable_backup)
        self._discarding = False  # the backup could not be read and is being replaced

    def __enter__(self) -> "Backup":
        return self

    def __exit__(self, *exc) -> None:
        self.release()

    def acquire(self) -> None:
        """The chief locks `backup_dir` (once; a no-op on other workers).

        Raises:
            ValueError: another run holds it, or it cannot be written.
        """
        if self.chief:
            self._lock.acquire()

    def release(self) -> None:
        """Releases the lock on `backup_dir`, if this object holds it."""
        self._lock.release()

    # ------------------------------------------------------------ fingerprint

    def fingerprint(self) -> dict:
        """What must not change across a resume: the model's variables (shapes and
        dtypes), the optimizer's class and the caller's fields."""
        fields = dict(self.extra_fingerprint)
        if self.model is not None:
            fields["variables"] = {key: f"{list(variables[0].shape)} {variables[0].dtype}"
                                   for key, variables in _keys.model_variables(self.model).items()}
        if self.optimizer is not None:
            fields["optimizer"] = type(self.optimizer).__name__
        return json.loads(json.dumps(fields))  # as stored: tuples become lists

    def check_fingerprint(self) -> None:
        """Refuses to resume from a backup of a run with other settings.

        Raises:
            ValueError: naming each differing field (old -> new) and the fix.
        """
        if self._fingerprint_checked:
            return
        stored = _files.read_fingerprint(self.backup_dir)
        if stored is None:
            raise ValueError(
                f"the backup in {self.backup_dir} has no {_files.MANIFEST}, so nothing shows "
                "which run wrote it; pass a new `backup_dir` (or delete this backup: "
                f"tfmulti.training.backup.delete({self.backup_dir!r})).")
        differences = _files.fingerprint_differences(stored, self.fingerprint())
        if differences:
            raise _files.mismatch_error(self.backup_dir, differences)
        self._fingerprint_checked = True

    def _store_fingerprint(self) -> None:
        """Before the chief's first save: the fingerprint goes with the checkpoints. One
        of another run's kept checkpoints (which no resume checked) is refused."""
        if self._fingerprint_checked:
            return
        current = self.fingerprint()
        if self._discarding:  # what it held is unknown: this run's replaces it
            _files.write_fingerprint(self.backup_dir, current)
            self._fingerprint_checked = True
            return
        stored = _files.read_fingerprint(self.backup_dir)
        if stored is not None and stored != current and checkpoints(self.backup_dir):
            raise _files.mismatch_error(self.backup_dir,
                                        _files.fingerprint_differences(stored, current))
        if stored != current:
            _files.write_fingerprint(self.backup_dir, current)
        self._fingerprint_checked = True

    # ------------------------------------------------------------ save / restore

    # The variables are looked up when saving or restoring, after Keras created
    # the optimizer's and the metrics' (at the start of `fit`).
    def _sections(self, *, optimizer: bool = True, metrics: bool = True) -> dict:
        """{"model"|"optimizer"|"metrics": {key: [variables]}} (see `_keys`)."""
        model_keys = _keys.model_variables(self.model)
        sections = {"model": model_keys}
        if optimizer and self.optimizer is not None and self.optimizer.built:
            sections["optimizer"] = _keys.optimizer_variables(self.optimizer, model_keys)
        if metrics:
            sections["metrics"] = _keys.metric_variables(self.model)
        return sections

    def _checkpoint(self) -> tf.train.Checkpoint:
        """What is saved: each key's first variable (the others are copies)."""
        items = {name: {key: variables[0] for key, variables in keyed.items()}
                 for name, keyed in self._sections().items()}
        return tf.train.Checkpoint(step=self.step, **items)

    def _read(self, path: str, sections: dict) -> None:
        """Assigns every variable of `sections` its key's value in the checkpoint at
        `path` (a section the checkpoint does not have at all, e.g. an optimizer
        saved before its first step, is left as it is).

        Raises:
            ValueError: the checkpoint lacks some of the keys.
        """
        with _literal(path) as literal:
            self._read_from(tf.train.load_checkpoint(literal), path, sections)

    @staticmethod
    def _read_from(reader, path: str, sections: dict) -> None:
        suffix = "/.ATTRIBUTES/VARIABLE_VALUE"
        stored = {}
        for name in reader.get_variable_to_shape_map():
            section, _, rest = name.partition("/")
            if rest.endswith(suffix):
                stored[(section, _keys.unescape(rest[: -len(suffix)]))] = name
        present = {section for section, _ in stored}
        sections = {name: keyed for name, keyed in sections.items()
                    if name == "model" or name in present}
        missing = [f"{name}/{key}" for name, keyed in sections.items() for key in keyed
                   if (name, key) not in stored]
        if missing:
            raise ValueError(
                f"the backup {path} has no value for {len(missing)} of this run's variables "
                f"({', '.join(missing[:4])}{', ...' if len(missing) > 4 else ''}): it was "
                "written for another model or optimizer; pass a new `backup_dir`.")
        for name, keyed in sections.items():
            for key, variables in keyed.items():
                value = reader.get_tensor(stored[(name, key)])
                for variable in variables:
                    variable.assign(value)

    def _build_optimizer(self) -> None:
        """Creates the optimizer's slots (a loop of your own may restore before its
        first step), so that they can be restored."""
        if self.optimizer is not None and not self.optimizer.built:
            with self.strategy.scope():
                self.optimizer.build(self.model.trainable_variables)

    def save(self, step: int) -> str | None:
        """Saves at global step `step`; every worker must call it at the same step.
        Returns the chief's checkpoint path (None on other workers).

        The chief removes an older checkpoint (beyond `keep`) only after the new one
        has read back whole (`verify`). The other workers write into private
        temporary directories (a save may need collectives), removed at once,
        also when the save fails (`_files.private_scratch`; one a killed worker
        left goes at the next save on its host).

        Raises:
            OSError: `backup_dir` is full (the message names it and says "no space
                left"); the previous checkpoints are kept.
            ValueError: the new checkpoint does not read back, or `backup_dir`
                cannot be written; the previous checkpoints are kept.
        """
        failpoint("backup.save")
        self.step.assign(step)
        checkpoint = self._checkpoint()
        if self.chief:
            self.acquire()
            try:
                self._store_fingerprint()
                path = checkpoint.write(os.path.join(self.backup_dir, f"{_files.PREFIX}-{step}"))
            except (tf.errors.OpError, OSError) as e:
                _files.remove_unfinished(self.backup_dir, step)
                raise self._save_error(step, e) from e
            failpoint("backup.saved")
            doomed = _files.prunable(self.backup_dir, self.keep, step,
                                     all_others=self._discarding)
            if doomed:
                try:
                    verify(path)
                except (ValueError, OSError) as e:
                    if not isinstance(e, UnreadableBackup):  # proven corrupt: not kept
                        _files.remove_steps(self.backup_dir, [step])
                    raise ValueError(
                        f"the backup just saved, {path}, does not read back ({e}); the "
                        f"previous backups in {self.backup_dir} are kept; check the "
                        "filesystem of `backup_dir` (or pass another) and rerun to resume "
                        "from them.") from e
                _files.remove_steps(self.backup_dir, doomed)
            self._discarding = False
            return path
        with _files.private_scratch() as scratch:
            checkpoint.write(os.path.join(scratch, _files.PREFIX))
            failpoint("backup.saved")
        return None

    def _save_error(self, step: int, error: Exception) -> Exception:
        """A full or unwritable `backup_dir` as one line; other errors as they are."""
        text = str(error).strip().splitlines()[0] if str(error).strip() else type(error).__name__
        text = text.replace("{{", "(").replace("}}", ")")[-300:]
        full = (isinstance(error, tf.errors.ResourceExhaustedError)
                or getattr(error, "errno", None) in (errno.ENOSPC, errno.EDQUOT)
                or os.strerror(errno.ENOSPC) in text)
        denied = (isinstance(error, (tf.errors.PermissionDeniedError, PermissionError))
                  or text.endswith(f"; {os.strerror(errno.EACCES)}"))
        if not (full or denied):
            return error
        previous = next((p for p in checkpoints(self.backup_dir)
                         if not p.endswith(f"-{step}")), None)
        kept = (f"the backup at global step {previous.rsplit('-', 1)[1]} is kept" if previous
                else "no backup was saved before")
        if full:
            size = _files.checkpoint_bytes(previous) if previous else 0
            room = (f" (room for {self.keep + 1} checkpoints of {size / 2**20:.1f} MiB: this "
                    f"run keeps {self.keep} and writes the next before removing the oldest)"
                    if size else "")
            return OSError(
                f"no space left on the device of `backup_dir` {self.backup_dir!r} while "
                f"saving the backup at global step {step} ({text}); {kept}: free space there"
                f"{room} or pass another `backup_dir`, then rerun to resume.")
        return ValueError(
            f"cannot write the backup at global step {step} in `backup_dir` "
            f"{self.backup_dir!r} ({text}); {kept}: pass a directory this process can "
            "write, then rerun to resume.")

    def resume_point(self) -> ResumePoint:
        """The checkpoint to resume from, the same on every worker.

        The chief locks `backup_dir`, verifies the newest checkpoints (falling
        back past damaged ones) and publishes its choice, or its error; the
        other workers take it.

        Raises:
            UnreadableBackup: a file of the backup cannot be read (and
                `discard_unreadable_backup` is off): nothing was changed.
            ValueError: `backup_dir` is another run's, or a worker cannot read the
                chief's choice (backup_dir not shared).
        """
        multi = self.num_workers > 1 and _coordination_available()
        if self.chief or not multi:
            try:
                self.acquire()
                _files.note_foreign(self.backup_dir, say)
                point = self._choose()
            except (ValueError, OSError) as e:
                if multi:
                    _kv().set_config_key_value(self.resume_key, f"error|{e}")
                raise
            if multi:
                _kv().set_config_key_value(self.resume_key, f"ok|{point.step}|{point.path or ''}")
            return point
        value = _kv().get_config_key_value(self.resume_key, int(_RESUME_WAIT_S * 1000))
        status, _, rest = value.partition("|")
        if status == "error":
            raise ValueError(f"the chief cannot resume: {rest}")
        step_text, _, path = rest.partition("|")
        if not path:
            return ResumePoint(0, None)
        try:
            verify(path)
        except (ValueError, OSError) as e:
            raise ValueError(
                f"the chief resumes from {path} but worker {self.task_index} cannot read it "
                f"({e}); `backup_dir` must be on a filesystem every worker shares.") from e
        return ResumePoint(int(step_text), path)

    def _choose(self) -> ResumePoint:
        """The chief's resume point: the newest checkpoint that reads back, its
        manifest readable too; on a read failure, stop (UnreadableBackup) or, if
        told so, discard the backup and start from step 0."""
        try:
            point = latest_valid(self.backup_dir)
            _files.read_fingerprint(self.backup_dir)  # compared with this run's later
            return point
        except UnreadableBackup as e:
            if not self.discard_unreadable_backup:
                raise
            print(f"tfmulti: warning: discarding the backup in {self.backup_dir} "
                  f"(discard_unreadable_backup): the file {e.path} cannot be read ({e.reason}); "
                  "starting from step 0", file=sys.stderr, flush=True)
            self._discarding = True
            return ResumePoint(0, None)

    def restore(self, point: ResumePoint) -> None:
        """Restores the model's variables, the optimizer's (building its slots
        first if needed) and the metrics' totals from `point.path`, after
        checking that the backup is this run's (`check_fingerprint`); nothing
        for a fresh start (`point.path` None). Every worker calls it.

        Raises:
            ValueError: the backup is another run's (settings or variables differ).
        """
        if point.path is None:
            return
        failpoint("backup.restore")
        self.check_fingerprint()
        self._build_optimizer()
        self._read(point.path, self._sections())
        self._restored = True

    def restore_weights(self, point: ResumePoint) -> None:
        """Restores only the model's variables (nothing left to train).

        Raises:
            ValueError: the backup is another run's (settings or variables differ).
        """
        if point.path is not None:
            failpoint("backup.restore")
            self.check_fingerprint()
            self._read(point.path, self._sections(metrics=False, optimizer=False))

    def restore_metrics(self, point: ResumePoint) -> None:
        """Puts the interrupted epoch's running metric totals back (Keras resets
        them at every epoch start)."""
        if point.path is not None and self._restored:
            self._read(point.path, {"metrics": _keys.metric_variables(self.model)})

    def delete(self) -> None:
        """The chief removes the backup (see `delete`); other workers do nothing."""
        if self.chief:
            delete(self.backup_dir)


def _json_fields(fingerprint: dict | None) -> dict:
    if fingerprint is None:
        return {}
    if not isinstance(fingerprint, dict) or not all(isinstance(k, str) for k in fingerprint):
        raise ValueError(f"`fingerprint` must be a dict with str keys, got {fingerprint!r}.")
    for name, value in fingerprint.items():
        try:
            json.dumps(value)
        except (TypeError, ValueError):
            raise ValueError(f"`fingerprint` field {name!r} must be a JSON value (str, number, "
                             f"bool, None, list, dict), got {value!r}.") from None
    return dict(fingerprint)


def delete(backup_dir: str) -> None:
    """Removes tfmulti's checkpoints, manifest and lock from `backup_dir`, and the
    directory if that leaves it empty. Anything else in it, TensorFlow checkpoints
    that tfmulti did not write included, is left alone.

    Raises:
        ValueError: another run holds `backup_dir` (see `lock`).
    """
    _files.delete(backup_dir)
