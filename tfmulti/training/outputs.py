"""What a run owns in `model_dir`: its run file, its claim and its published outputs.

A run's outputs are `metrics.json`, its model and TensorBoard event files
under `logs/`; the model is `model.keras`, or `model.weights.h5` (its weights)
when a `model.keras` would not load back (`tfmulti.training.saving`). The run
file, `.tfmulti-run.json`, records the configuration of the run that claimed
the folder and every file a run published there, so `overwrite` replaces only
those: a folder without a run file, or a file under `metrics.json`,
`model.keras`, `model.weights.h5` or `logs/` that no run file records (the
user's `logs/notes.txt`), is refused, and nothing else in the folder is touched.

The old outputs stay in place until the new run publishes its own: during the
run its TensorBoard logs go to `.tfmulti-pending/logs`, and at the end
`metrics.json` and the model file are staged and renamed into place
(`tfmulti.utils.atomic.publish_staged`), the new event files join `logs/`,
and only then are the old run's recorded files removed. A failed or killed
run publishes nothing, so its rerun finds the folder as it was before.

Example:
    >>> import os, tempfile
    >>> from tfmulti.training import outputs
    >>> folder = os.path.join(tempfile.mkdtemp(), "run")
    >>> outputs.claim(folder, {"epochs": 1}, overwrite=False, resumable=False)
    False
    >>> def write(stage):
    ...     for name in ("metrics.json", "model.keras"):
    ...         open(os.path.join(stage, name), "w").close()
    >>> outputs.publish(folder, {"epochs": 1}, write)
    >>> outputs.read_record(folder).published
    ['metrics.json', 'model.keras']
"""

from __future__ import annotations

import contextlib
import dataclasses
import errno
import fcntl
import functools
import json
import os
import re
import shutil
from typing import Callable

from tfmulti.utils import human
from tfmulti.utils.atomic import fsync_path, publish_staged, sync_directory, write_json_atomic

__all__ = ["MODEL_FILES", "OTHER_WORKER_LINE", "OUTPUTS", "PENDING", "RUN_FILE", "Record", "claim", "lock",
           "pending_logs", "publish", "published_model", "read_record", "summary_line"]

RUN_FILE = ".tfmulti-run.json"
PENDING = ".tfmulti-pending"
"""The folder that holds a run's TensorBoard logs until it publishes them."""
MODEL_FILES = ("model.keras", "model.weights.h5")
"""A run's model file: the whole model, or its weights where the whole model
would not load back (one or the other)."""
_PUBLISHED_NAMES = ("metrics.json", *MODEL_FILES, "logs")
OUTPUTS = (*_PUBLISHED_NAMES, RUN_FILE)
"""What a finished run may leave in `model_dir` (one of `MODEL_FILES`)."""
_STAGING = ".staging-"  # publish_staged's folders (a killed publish leaves one)
SUMMARY_KEYS = ("test_accuracy", "test_loss", "test_mae", "val_loss", "examples_per_second",
                "num_replicas", "distribution", "epochs_completed")
"""The metrics of a run's results line, in its order (those a run has)."""
_SCORES = SUMMARY_KEYS[:4]  # shown as key=value, for the scripts that read the line
OTHER_WORKER_LINE = "tfmulti: done; the chief reports the results and writes the outputs"
"""What a worker other than the chief prints instead of the results line."""


def _main_metric(metrics: dict, output: str) -> str | None:
    """The test figure the results line shows for `output` (one of several):
    its accuracy, else its mean absolute error, else its first metric other
    than its loss."""
    prefix = f"test_{output}_"
    for name in ("accuracy", "mae"):
        if prefix + name in metrics:
            return prefix + name
    return next((k for k in sorted(metrics) if k.startswith(prefix) and k != prefix + "loss"),
                None)


def summary_line(metrics: dict) -> str:
    """The results line a run's chief prints (`tfmulti train`, recipes/train.py): the
    scores as `key=value` (four decimals), then the speed, the replicas, the
    distribution and the epochs in words. metrics.json keeps every figure whole.

    A run of a model with several outputs (`outputs` lists them) shows each
    output's main figure after the total loss: its accuracy, else its mean
    absolute error, else its first metric.

    Example:
        >>> summary_line({"test_accuracy": 0.8125, "test_loss": 0.50118, "num_replicas": 4,
        ...               "examples_per_second": 25655.8623, "distribution": "mirrored",
        ...               "epochs_completed": 5, "loss": [0.5]})
        'tfmulti: test_accuracy=0.8125, test_loss=0.5012, 25,656 examples/s, 4 replicas, \
mirrored, 5 epochs'
    """
    keys = [k for k in _SCORES[:3] if k in metrics]
    keys += [k for k in map(functools.partial(_main_metric, metrics), metrics.get("outputs") or ())
             if k is not None]
    keys += [k for k in _SCORES[3:] if k in metrics]
    parts = [f"{k}={metrics[k]:.4f}" if isinstance(metrics[k], float) else f"{k}={metrics[k]}"
             for k in keys]
    if metrics.get("examples_per_second") is not None:
        parts.append(human.rate(metrics["examples_per_second"], "examples/s"))
    if "num_replicas" in metrics:
        parts.append(human.count(metrics["num_replicas"], "replica"))
    if "distribution" in metrics:
        parts.append(str(metrics["distribution"]))
    if "epochs_completed" in metrics:
        parts.append(human.count(metrics["epochs_completed"], "epoch"))
    return "tfmulti: " + ", ".join(parts)


@dataclasses.dataclass
class Record:
    """A run file's content.

    Attributes:
        config: the configuration of the run that claimed the folder last.
        finished: whether that run published the outputs listed.
        published: the files a run published there (relative paths), which
            `overwrite` may replace.
        publishing: the files the run of `config` was publishing when it
            stopped (a kill part-way; its next publish keeps them).
    """

    config: dict
    finished: bool
    published: list
    publishing: list = dataclasses.field(default_factory=list)


def read_record(folder: str) -> Record | None:
    """The run file in `folder`, or None without a readable one."""
    try:
        with open(os.path.join(folder, RUN_FILE)) as f:
            content = json.load(f)
    except (OSError, ValueError):
        return None
    if not isinstance(content, dict):
        return None
    if "published" not in content:  # an earlier tfmulti's: the configuration alone
        return Record(content, True, _tensorboard_outputs(folder))
    return Record(content.get("config"), bool(content.get("finished")),
                  list(content.get("published") or []), list(content.get("publishing") or []))


def _tensorboard_outputs(folder: str) -> list:
    """An earlier tfmulti's outputs, by name: metrics.json, model.keras and the
    TensorBoard event files under logs/."""
    logs = [f for f in _files_under(folder, "logs")
            if os.path.basename(f).startswith("events.out.tfevents.")]
    return sorted([n for n in ("metrics.json", "model.keras")
                   if os.path.isfile(os.path.join(folder, n))] + logs)


def _files_under(folder: str, name: str) -> list:
    """The files (and links, and anything not a folder) at or under
    `folder/name`, as paths relative to `folder`."""
    top = os.path.join(folder, name)
    if not os.path.isdir(top) or os.path.islink(top):
        return [name] if os.path.lexists(top) else []
    found = []
    for root, dirs, files in os.walk(top):
        found += [os.path.relpath(os.path.join(root, f), folder) for f in files]
        found += [os.path.relpath(os.path.join(root, d), folder) for d in dirs
                  if os.path.islink(os.path.join(root, d))]
    return sorted(found)


def _write_record(folder: str, config: dict, *, finished: bool, published,
                  publishing=()) -> None:
    write_json_atomic(os.path.join(folder, RUN_FILE),
                      {"config": config, "finished": finished, "published": sorted(published),
                       "publishing": sorted(publishing)}, sort_keys=True)


def _shown(names) -> str:
    return ", ".join(names[:5]) + (" ..." if len(names) > 5 else "")


def claim(folder: str, config: dict, *, overwrite: bool, resumable: bool,
          own: tuple = ()) -> bool:
    """Makes `folder` (a `model_dir`) this run's, before anything else is written
    there; returns whether this same run has published its outputs there already.

    A folder is this run's again (a resumed run: its logs so far stay) when its
    run file holds `config` and the run is `resumable` (it has a `backup_dir`),
    unless `overwrite` asks to train a finished run again. Otherwise it must
    hold nothing but tfmulti's bookkeeping (the run file of a run that failed,
    published nothing, or whose outputs `overwrite` replaces), besides files of
    the user's that `overwrite` leaves alone.

    Args:
        folder: the run's `model_dir` (created if needed).
        config: the run's configuration as JSON (what a rerun must match).
        overwrite: replace the outputs a run published there.
        resumable: the run resumes from a backup.
        own: names in `folder` that are this run's and not outputs (its
            `backup_dir`, when that is inside `model_dir`): not counted, not touched.

    Raises:
        ValueError: the folder holds another run's outputs or other files (and
            not `overwrite`), or files tfmulti did not write where `overwrite`
            would replace them; the message names them and the fixes.
    """
    entries = sorted(os.listdir(folder)) if os.path.isdir(folder) else []
    record = read_record(folder)
    staged = [e for e in entries if e.startswith(_STAGING)]
    ours = {RUN_FILE, PENDING} if record is not None else set()
    others = [e for e in entries
              if e not in ours and e not in own and not e.startswith(_STAGING)]
    resumed = (record is not None and resumable and record.config == config
               and not (overwrite and record.finished))
    if others and not resumed:
        _check_replaceable(folder, record, others, overwrite)
    if resumed or overwrite:
        _remove(folder, staged)  # a killed publish's (the same run's, or replaced)
    if resumed:
        return record.finished
    if record is not None:
        _remove(folder, [PENDING])  # a failed run's unpublished logs
    _write_record(folder, config, finished=False,
                  published=record.published if record is not None else [])
    return False


def _check_replaceable(folder: str, record: Record | None, others: list,
                       overwrite: bool) -> None:
    if record is None:
        raise ValueError(
            f"`model_dir` {folder!r} holds files tfmulti did not write ({_shown(others)}; no "
            f"readable {RUN_FILE} there), and overwrite=True replaces only a tfmulti run's "
            "outputs: choose another model_dir, or move those files out of it.")
    if not overwrite:
        held = "another run's outputs" if record.published else "other files"
        raise ValueError(
            f"`model_dir` {folder!r} is not empty ({_shown(others)}): it holds {held}; pass "
            "overwrite=True to replace the outputs of a tfmulti run there (files of yours "
            "beside them stay), or choose another model_dir (a resumed run keeps its "
            "model_dir when its configuration is unchanged and it has a backup_dir).")
    published = set(record.published)
    foreign = [f for name in _PUBLISHED_NAMES for f in _files_under(folder, name)
               if f not in published]
    if foreign:
        raise ValueError(
            f"`model_dir` {folder!r} holds {_shown(foreign)}, which no tfmulti run wrote "
            f"(not in its {RUN_FILE}): overwrite=True replaces only a run's own outputs; "
            "move it out of the model_dir, or choose another model_dir.")


def _remove(folder: str, names) -> None:
    for name in names:
        path = os.path.join(folder, name)
        if os.path.isdir(path) and not os.path.islink(path):
            shutil.rmtree(path)
        elif os.path.lexists(path):
            os.remove(path)


def pending_logs(folder: str) -> str:
    """Where the run writes its TensorBoard logs until it publishes them."""
    return os.path.join(folder, PENDING, "logs")


def publish(folder: str, config: dict, write: Callable[[str], None],
            model_file: str = MODEL_FILES[0]) -> None:
    """Publishes the run's outputs in `folder`, replacing a previous run's: `write`
    writes `metrics.json` and `model_file` into a staging folder (its argument),
    they are renamed into place (`metrics.json` last), the pending TensorBoard
    event files move into `logs/`, the previous run's recorded files are
    removed (its other model file among them; folders under `logs/` only when
    empty: a file of the user's there stays), and the run file records the new
    set. Until then it records both sets, so a kill part-way leaves no file of
    tfmulti's unrecorded; a `write` that raises leaves the run file as it was
    (nothing was renamed), so publishing again with the other model file
    records only what it writes.

    Args:
        folder: the run's `model_dir`.
        config: the run's configuration as JSON (its run file's).
        write: writes the outputs into the folder it is given.
        model_file: the model's file, one of `MODEL_FILES`.

    Raises:
        ValueError: `model_file` is not one of `MODEL_FILES`.
        OSError: the outputs could not be written (a full disk, no permission);
            the message names `folder`. Before the renames, the previous outputs
            are untouched.
    """
    if model_file not in MODEL_FILES:
        raise ValueError(f"`model_file` must be one of {MODEL_FILES}, got {model_file!r}.")
    record = read_record(folder)
    old = set(record.published) if record is not None else set()
    pending = os.path.join(folder, PENDING)
    logs = _files_under(pending, "logs")
    new = {"metrics.json", model_file, *logs}
    if record is not None and record.config == config:  # this run's publish, killed part-way
        new |= set(record.publishing) & old
    written = []

    def staged(stage: str) -> None:
        write(stage)
        written.append(stage)

    try:
        # Recorded first, so a crash part-way leaves every file of tfmulti's known as such.
        _write_record(folder, config, finished=False, published=old | new, publishing=new)
        publish_staged(folder, staged, order=(model_file, "metrics.json"))
        for name in logs:
            target = os.path.join(folder, name)
            os.makedirs(os.path.dirname(target), exist_ok=True)
            fsync_path(os.path.join(pending, name))
            os.replace(os.path.join(pending, name), target)
        for path in {os.path.dirname(os.path.join(folder, name)) for name in logs}:
            sync_directory(path)
        for name in sorted(old - new):
            with contextlib.suppress(FileNotFoundError):
                os.remove(os.path.join(folder, name))
        _write_record(folder, config, finished=True, published=new)
    except OSError as e:
        _unrecord(folder, config, record, written)
        number = _errno(e)
        fix = {errno.ENOSPC: "free space there", errno.EDQUOT: "free space there",
               errno.EACCES: "make it writable", errno.EROFS: "make it writable"}.get(
                   number, "fix that")
        why = e.strerror or e
        if number and "\n" in str(why):  # HDF5's report: its error number in words
            why = os.strerror(number)
        raise OSError(f"cannot write the outputs to `model_dir` {folder!r}: "
                      f"{why}; {fix}, or choose another model_dir.") from e
    except Exception:
        _unrecord(folder, config, record, written)
        raise
    _remove_empty_folders(os.path.join(folder, "logs"))
    shutil.rmtree(pending, ignore_errors=True)


def _errno(error: OSError) -> int | None:
    """The system's error number of `error`, also where HDF5 (h5py, which
    writes Keras' weights) gives it only in its report ("... errno = 28,
    error message = 'No space left on device' ..."), a message of several
    lines."""
    if error.errno is not None:
        return error.errno
    found = re.search(r"\berrno = (\d+)", str(error))
    return int(found.group(1)) if found else None


def _unrecord(folder: str, config: dict, record: Record | None, written: list) -> None:
    """After a failed publish: the run file as it was before it, when `write`
    failed (nothing was renamed into place; the staging folder is gone)."""
    if written:
        return
    with contextlib.suppress(OSError):
        if record is None:
            _write_record(folder, config, finished=False, published=())
        else:
            _write_record(folder, record.config, finished=record.finished,
                          published=record.published, publishing=record.publishing)


def published_model(folder: str) -> str | None:
    """The model file (one of `MODEL_FILES`) in `folder`, or None."""
    return next((name for name in MODEL_FILES if os.path.isfile(os.path.join(folder, name))),
                None)


def _remove_empty_folders(top: str) -> None:
    for root, _, _ in sorted(os.walk(top), key=lambda entry: -len(entry[0])):
        if root != top:
            with contextlib.suppress(OSError):
                os.rmdir(root)  # only when empty


@contextlib.contextmanager
def lock(folder: str):
    """Holds `folder` for this run while it trains and publishes (a `flock` on
    the folder, released by the kernel when the process dies, so a killed run
    never blocks its rerun). Where the file system cannot lock a folder (some
    network file systems), the run goes on without it.

    Raises:
        ValueError: another run holds it now.
    """
    os.makedirs(folder, exist_ok=True)
    fd = os.open(folder, os.O_RDONLY)
    try:
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            raise ValueError(f"`model_dir` {folder!r} is in use by another run now; wait "
                             "for it to end, or choose another model_dir.") from None
        except OSError as e:
            if e.errno not in (errno.ENOLCK, errno.EBADF, errno.EINVAL, errno.EOPNOTSUPP):
                raise
        yield
    finally:
        os.close(fd)
