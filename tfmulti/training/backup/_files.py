"""What tfmulti keeps in a `backup_dir`, and nothing else (pure Python).

    tfmulti-ckpt-STEP.index, tfmulti-ckpt-STEP.data-*  a checkpoint at global step STEP
    tfmulti-ckpt-STEP_temp/   a save under way (TensorFlow renames it when complete)
    tfmulti-backup.json       the manifest: the run's fingerprint, what must not change
                              across a resume
    tfmulti-backup.lock       locked (flock) by the run's chief while it runs; the
                              holder's host, pid, start time and command inside

A worker other than the chief writes each save into a private folder of its own
in TMPDIR, `tfmulti-backup-XXXXXXXX/` (`private_scratch`), locked while in use
and removed after; one left by a worker killed mid-save is removed by the next
save on that host (its lock free: no process holds it).

Names are matched literally (`os.listdir` and a regex), never as glob patterns:
a `backup_dir` such as `runs/exp[12]` names one directory. Other files,
TensorFlow checkpoints written by anything else included, are never listed,
restored, pruned or deleted.

    >>> import tempfile
    >>> from tfmulti.training.backup import _files
    >>> d = tempfile.mkdtemp()
    >>> for name in ("tfmulti-ckpt-8.index", "tfmulti-ckpt-12.index", "ckpt-3.index"):
    ...     open(os.path.join(d, name), "w").close()
    >>> [os.path.basename(p) for p in _files.checkpoint_prefixes(d)]
    ['tfmulti-ckpt-12', 'tfmulti-ckpt-8']
    >>> _files.foreign_checkpoints(d)
    ['ckpt-3']
    >>> with _files.DirLock(d):
    ...     print(os.path.basename(_files.lock_path(d)))
    tfmulti-backup.lock
"""

from __future__ import annotations

import contextlib
import errno
import fcntl
import json
import os
import re
import shutil
import socket
import stat
import sys
import tempfile
import threading
import time

from tfmulti.utils.failpoints import failpoint
from tfmulti.utils.atomic import write_json_atomic

PREFIX = "tfmulti-ckpt"
MANIFEST = "tfmulti-backup.json"
LOCK = "tfmulti-backup.lock"
_FORMAT = 1
_OWN = re.compile(rf"^{re.escape(PREFIX)}-(\d+)(\.index|\.data-\d+-of-\d+|_temp)$")
_STATE_FILE = "checkpoint"  # TensorFlow's CheckpointManager state file
_MISSING = "(not recorded)"


def _entries(backup_dir: str) -> list[str]:
    try:
        return os.listdir(backup_dir)
    except (FileNotFoundError, NotADirectoryError):
        return []


def _own(backup_dir: str) -> dict[int, list[str]]:
    """tfmulti's checkpoint entries (files and unfinished-save directories) by step."""
    steps: dict[int, list[str]] = {}
    for name in _entries(backup_dir):
        match = _OWN.match(name)
        if match:
            steps.setdefault(int(match.group(1)), []).append(name)
    return steps


def checkpoint_prefixes(backup_dir: str) -> list[str]:
    """The paths of tfmulti's complete-looking checkpoints (an `.index` file, which
    TensorFlow writes last), newest (highest step) first."""
    steps = [step for step, names in _own(backup_dir).items()
             if f"{PREFIX}-{step}.index" in names]
    return [os.path.join(backup_dir, f"{PREFIX}-{step}") for step in sorted(steps, reverse=True)]


def checkpoint_files(prefix: str) -> list[str]:
    """The file names of the checkpoint at `prefix` (for messages)."""
    folder, base = os.path.split(prefix)
    return sorted(n for n in _entries(folder) if n.startswith(base + ".") and _OWN.match(n))


def checkpoint_bytes(prefix: str) -> int:
    """The size of the checkpoint at `prefix`, its files together."""
    folder = os.path.dirname(prefix)
    total = 0
    for name in checkpoint_files(prefix):
        try:
            total += os.path.getsize(os.path.join(folder, name))
        except OSError:
            pass
    return total


def foreign_checkpoints(backup_dir: str) -> list[str]:
    """TensorFlow checkpoints in `backup_dir` that tfmulti did not write (their
    prefixes), and TensorFlow's `checkpoint` state file: left alone."""
    names = _entries(backup_dir)
    foreign = sorted(n[: -len(".index")] for n in names
                     if n.endswith(".index") and not _OWN.match(n))
    return foreign + ([_STATE_FILE] if _STATE_FILE in names else [])


_noted: set[str] = set()


def note_foreign(backup_dir: str, say) -> None:
    """Says once per directory and process that foreign checkpoints are left alone."""
    foreign = foreign_checkpoints(backup_dir)
    key = os.path.realpath(backup_dir)
    if foreign and key not in _noted:
        _noted.add(key)
        shown = ", ".join(foreign[:5]) + (f" and {len(foreign) - 5} more" if len(foreign) > 5
                                          else "")
        say(f"note: {backup_dir} also holds checkpoints tfmulti did not write ({shown}); "
            f"they are left alone (tfmulti uses only its own {PREFIX}-* files)")


def _remove(backup_dir: str, names: list[str]) -> None:
    for name in names:
        path = os.path.join(backup_dir, name)
        if os.path.isdir(path) and not os.path.islink(path):
            shutil.rmtree(path, ignore_errors=True)
        else:
            try:
                os.remove(path)
            except FileNotFoundError:
                pass


def prunable(backup_dir: str, keep: int, saved_step: int, *, all_others: bool = False
             ) -> list[int]:
    """The steps whose entries go after a save at `saved_step`: tfmulti's checkpoints
    past it (a later timeline's, which the resume skipped as corrupt, or an
    unfinished save's) and all but the newest `keep` before it; every other step
    with `all_others` (a discarded backup's). Remove them (`remove_steps`) only once
    the checkpoint at `saved_step` reads back."""
    steps = _own(backup_dir)
    if all_others:
        return [s for s in steps if s != saved_step]
    older = sorted((s for s in steps if s <= saved_step), reverse=True)
    return [s for s in steps if s > saved_step] + older[keep:]


def remove_steps(backup_dir: str, steps: list[int]) -> None:
    """Removes tfmulti's entries (checkpoint files, unfinished saves) of `steps`."""
    own = _own(backup_dir)
    for step in steps:
        _remove(backup_dir, own.get(step, []))


def remove_unfinished(backup_dir: str, step: int) -> None:
    """Removes the temporary directory of a save at `step` that failed."""
    _remove(backup_dir, [n for n in _own(backup_dir).get(step, []) if n.endswith("_temp")])


# ---------------------------------------------------------------------------- reading

class UnreadableBackup(OSError):
    """A file of the backup cannot be read (permissions, an I/O error, a missing
    mount): its content is unknown, so it is neither used nor discarded; the run
    stops and changes nothing. Its message names the file, the error and the two
    ways on; `path` is the file, `reason` the error."""

    def __init__(self, message: str, path: str, reason: str):
        super().__init__(message)
        self.path, self.reason = path, reason


def unreadable(path: str, reason: str, backup_dir: str) -> UnreadableBackup:
    """The error for a backup file that cannot be read."""
    return UnreadableBackup(
        f"cannot read the backup file {path} ({reason}); nothing in it was changed: make it "
        "readable (its permissions, the filesystem or its mount) and rerun to resume, or pass "
        f"discard_unreadable_backup=True to start from step 0, discarding the backup in "
        f"{backup_dir}.", path, reason)


_CHUNK = 1 << 22


def read_through(path: str) -> None:
    """Reads the file at `path` to its end, through the operating system.

    Raises:
        OSError: it cannot be opened or read (the OS's error).
    """
    with open(path, "rb") as f:
        while f.read(_CHUNK):
            pass


# ---------------------------------------------------------------------------- lock

def lock_path(backup_dir: str) -> str:
    return os.path.join(backup_dir, LOCK)


# Locks this process holds: realpath of the lock file -> [fd, holders, remove
# the file on the last release]. flock conflicts between two opens of one file
# even in one process, so a process takes each lock once and counts its holders
# (`fit` inside a caller's `lock`).
_held: dict[str, list] = {}
_held_guard = threading.Lock()


def _holder_text(fd: int) -> str:
    try:
        info = json.loads(os.pread(fd, 65536, 0).decode() or "{}")
    except (OSError, ValueError, UnicodeDecodeError):
        info = {}
    if not info.get("pid"):
        return "its details are not written yet"
    text = f"pid {info['pid']} on {info.get('host', '?')}, since {info.get('since', '?')}"
    return text + (f": {info['command']}" if info.get("command") else "")


class DirLock:
    """An exclusive lock on `backup_dir` for one run: `fcntl.flock` on
    `tfmulti-backup.lock`, re-entrant within this process.

    The kernel releases a flock when its holder dies, so a killed run never
    blocks its rerun; the holder details in the file are read only while the
    lock is held, and cleared on release. On NFS, Linux maps flock to NFS
    byte-range locks (NFSv4, or v3 with the lock manager).

    Raises (acquire):
        ValueError: another run holds it (the message names its host, pid, start
            and command), or `backup_dir` cannot be created or written.
    """

    def __init__(self, backup_dir: str):
        self.backup_dir = backup_dir
        self._key: str | None = None

    def acquire(self) -> None:
        if self._key is not None:
            return
        try:
            os.makedirs(self.backup_dir, exist_ok=True)
        except OSError as e:
            raise ValueError(f"cannot create `backup_dir` {self.backup_dir!r} ({e.strerror}); "
                             "pass a directory this process can write.") from e
        path = lock_path(self.backup_dir)
        key = os.path.realpath(path)
        with _held_guard:
            if key in _held:
                _held[key][1] += 1
                self._key = key
                return
            fd = self._lock(path)
            info = {"host": socket.gethostname(), "pid": os.getpid(),
                    "since": time.strftime("%Y-%m-%d %H:%M:%S %z"),
                    "command": " ".join(sys.argv)[:500]}
            os.ftruncate(fd, 0)
            os.pwrite(fd, json.dumps(info).encode(), 0)
            _held[key] = [fd, 1, False]
            self._key = key

    def _lock(self, path: str) -> int:
        for _ in range(10):
            try:
                fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_NOFOLLOW | os.O_CLOEXEC, 0o644)
            except OSError as e:
                reason = ("it is a symbolic link" if e.errno == errno.ELOOP else e.strerror)
                raise ValueError(f"cannot open the lock file {path!r} ({reason}); pass a "
                                 "`backup_dir` this process can write.") from e
            try:
                fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
            except BlockingIOError:
                holder = _holder_text(fd)
                os.close(fd)
                raise ValueError(
                    f"`backup_dir` {self.backup_dir!r} is in use by another run ({holder}); "
                    "two runs must not share a backup: wait for it to end or stop it, or "
                    "pass another `backup_dir`.") from None
            try:  # still the file at `path`? (a `delete` may have removed it meanwhile)
                same = os.path.samestat(os.fstat(fd), os.stat(path, follow_symlinks=False))
            except FileNotFoundError:
                same = False
            if same:
                return fd
            os.close(fd)
        raise ValueError(f"could not lock {path!r}: it keeps being replaced; is another "
                         "process deleting this `backup_dir`?")

    def release(self) -> None:
        key, self._key = self._key, None
        if key is None:
            return
        with _held_guard:
            entry = _held[key]
            entry[1] -= 1
            if entry[1] == 0:
                del _held[key]
                try:
                    if entry[2]:  # deleted while an outer holder held it
                        _remove(self.backup_dir, [LOCK])
                        _remove_dir_if_empty(self.backup_dir)
                    else:
                        os.ftruncate(entry[0], 0)  # no stale holder details
                finally:
                    os.close(entry[0])  # releases the flock

    def remove_on_release(self) -> None:
        """Removes the lock file when the last holder in this process releases it."""
        _held[self._key][2] = True

    def __del__(self) -> None:  # an owner that forgot to release (a loop of one's own)
        try:
            self.release()
        except Exception:  # pylint: disable=broad-except  (interpreter shutdown)
            pass

    def __enter__(self) -> "DirLock":
        self.acquire()
        return self

    def __exit__(self, *exc) -> None:
        self.release()


# ---------------------------------------------------------------------------- scratch

SCRATCH_PREFIX = "tfmulti-backup-"
_SCRATCH_LOCK = ".tfmulti-scratch.lock"


@contextlib.contextmanager
def private_scratch():
    """A fresh folder of this process's own in TMPDIR (`mkdtemp`, mode 0700) for
    a save it does not keep; locked (`flock` on a file inside) while in use and
    removed after, also when the save fails. First removes the folders that
    earlier saves on this host left (`remove_abandoned_scratch`)."""
    remove_abandoned_scratch()
    folder = tempfile.mkdtemp(prefix=SCRATCH_PREFIX)
    # Locked under another name, then renamed: the lock file is never seen unlocked.
    pending = os.path.join(folder, _SCRATCH_LOCK + ".new")
    fd = os.open(pending, os.O_CREAT | os.O_RDWR | os.O_NOFOLLOW, 0o600)
    try:
        fcntl.flock(fd, fcntl.LOCK_EX)
        os.rename(pending, os.path.join(folder, _SCRATCH_LOCK))
        yield folder
    finally:
        shutil.rmtree(folder, ignore_errors=True)
        os.close(fd)


def remove_abandoned_scratch(tmp: str | None = None) -> list[str]:
    """Removes the `private_scratch` folders in `tmp` (default: TMPDIR) whose lock
    no process holds: their save was cut short (SIGKILL, a crash) and nothing will
    remove them. Only this user's folders with tfmulti's lock file inside; links,
    other users' folders and folders in use are left. Returns the removed paths."""
    tmp = tmp or tempfile.gettempdir()
    try:
        names = [n for n in os.listdir(tmp) if n.startswith(SCRATCH_PREFIX)]
    except OSError:
        return []
    removed = []
    for name in names:
        path = os.path.join(tmp, name)
        try:
            info = os.lstat(path)
            if not stat.S_ISDIR(info.st_mode) or info.st_uid != os.getuid():
                continue
            fd = os.open(os.path.join(path, _SCRATCH_LOCK), os.O_RDWR | os.O_NOFOLLOW)
        except OSError:
            continue  # not a folder of ours, or no lock file: not proven abandoned
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except OSError:
            os.close(fd)
            continue  # in use
        try:
            shutil.rmtree(path)
            removed.append(path)
        except OSError:
            pass
        finally:
            os.close(fd)
    return removed


# ---------------------------------------------------------------------------- manifest

def read_fingerprint(backup_dir: str) -> dict | None:
    """The fingerprint stored with the checkpoints, or None when there is no manifest.

    Raises:
        UnreadableBackup: the manifest cannot be read (nothing is known of it).
        ValueError: it reads, but is not a manifest (garbled).
    """
    path = os.path.join(backup_dir, MANIFEST)
    try:
        with open(path, "rb") as f:
            raw = f.read()
    except FileNotFoundError:
        return None
    except OSError as e:
        raise unreadable(path, e.strerror or str(e), backup_dir) from e
    try:
        manifest = json.loads(raw.decode())
        if not isinstance(manifest, dict):
            raise ValueError(f"a JSON {type(manifest).__name__}, not an object")
    except ValueError as e:  # UnicodeDecodeError included
        raise ValueError(f"the backup manifest {path!r} is not one ({e}); delete the "
                         "backup or use another `backup_dir`.") from e
    return manifest.get("fingerprint", {})


def write_fingerprint(backup_dir: str, fingerprint: dict) -> None:
    """Stores `fingerprint` with the checkpoints (atomically: a crash leaves the old one)."""
    write_json_atomic(os.path.join(backup_dir, MANIFEST),
                      {"format": _FORMAT, "fingerprint": fingerprint}, sort_keys=True)


def _show(value) -> str:
    return value if value is _MISSING else json.dumps(value)


def _variable_differences(old, new) -> str:
    old, new = old or {}, new or {}
    if isinstance(old, list) or isinstance(new, list):  # positional
        old = {str(i): v for i, v in enumerate(old)} if isinstance(old, list) else old
        new = {str(i): v for i, v in enumerate(new)} if isinstance(new, list) else new
    removed = [k for k in old if k not in new]
    added = [k for k in new if k not in old]
    changed = [f"{k}: {old[k]} -> {new[k]}" for k in old if k in new and old[k] != new[k]]
    parts = []
    for label, items in (("changed", changed), ("removed", removed), ("added", added)):
        if items:
            parts.append(f"{label} " + ", ".join(items[:4])
                         + (f" and {len(items) - 4} more" if len(items) > 4 else ""))
    return f"model variables ({len(old)} -> {len(new)}): " + "; ".join(parts)


def fingerprint_differences(old: dict, new: dict) -> list[str]:
    """The fields that differ, each as `name: old -> new`."""
    differences = []
    for name in sorted(set(old) | set(new)):
        before, after = old.get(name, _MISSING), new.get(name, _MISSING)
        if before == after:
            continue
        if name == "variables":
            differences.append(_variable_differences(old.get(name), new.get(name)))
        else:
            differences.append(f"{name}: {_show(before)} -> {_show(after)}")
    return differences


def mismatch_error(backup_dir: str, differences: list[str]) -> ValueError:
    return ValueError(
        f"the backup in {backup_dir} belongs to a run with other settings "
        f"({'; '.join(differences)}); rerun with the original settings to resume it, or "
        f"pass a new `backup_dir` to start afresh (or delete this backup: "
        f"tfmulti.training.backup.delete({backup_dir!r})).")


# ---------------------------------------------------------------------------- delete

def delete(backup_dir: str) -> None:
    """Removes tfmulti's checkpoints, manifest and lock from `backup_dir`, and the
    directory if that leaves it empty; anything else in it is left alone.

    Raises:
        ValueError: another run holds the backup's lock.
    """
    if not os.path.isdir(backup_dir):
        return
    with DirLock(backup_dir) as lock:
        # Oldest first, each one's index first: interrupted (a kill right after the
        # caller saved its results), the newest checkpoint is still whole, and a
        # restart resumes at the end instead of training again.
        own = _own(backup_dir)
        for step in sorted(own):
            failpoint("backup.delete")
            _remove(backup_dir, sorted(own[step], key=lambda name: not name.endswith(".index")))
        _remove(backup_dir, [MANIFEST])
        lock.remove_on_release()  # the lock file last, by its last holder here


def _remove_dir_if_empty(backup_dir: str) -> None:
    try:
        os.rmdir(backup_dir)
    except OSError:
        pass
