"""File writes that a crash cannot tear (pure Python).

    >>> import json, os, tempfile
    >>> from tfmulti.utils.atomic import write_json_atomic
    >>> path = os.path.join(tempfile.mkdtemp(), "out.json")
    >>> write_json_atomic(path, {"a": 1})
    >>> json.load(open(path))
    {'a': 1}
"""

from __future__ import annotations

import json
import math
import os
import shutil
import tempfile
from typing import Callable, Sequence

from tfmulti.utils.failpoints import failpoint

__all__ = ["fsync_path", "publish_staged", "sync_directory", "write_json_atomic"]


def fsync_path(path: str) -> None:
    """fsync a file or a folder by its path."""
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def sync_directory(folder: str) -> None:
    """fsync a folder, so the renames into it survive a power loss."""
    fsync_path(folder)


def publish_staged(folder: str, write: Callable[[str], None], order: Sequence[str]) -> None:
    """Writes outputs into a private staging folder inside `folder` (`write`
    gets its path), syncs them, then renames each of `order` into `folder`, in
    that order, and removes the staging folder (also after a failure).

    The last name marks a complete set: a crash part-way leaves it absent (or,
    when replacing, the set it belonged to), never paired with other files.

    Raises:
        FileNotFoundError: `write` did not write one of `order`.
    """
    os.makedirs(folder, exist_ok=True)
    stage = tempfile.mkdtemp(dir=folder, prefix=".staging-")
    try:
        write(stage)
        for name in order:
            path = os.path.join(stage, name)
            if not os.path.exists(path):
                raise FileNotFoundError(f"staged output {name!r} was not written")
            fsync_path(path)
        for name in order:
            failpoint("io.publish")
            os.replace(os.path.join(stage, name), os.path.join(folder, name))
        sync_directory(folder)
    finally:
        shutil.rmtree(stage, ignore_errors=True)


def _finite_or_none(value):
    """`value` with every NaN or infinite float (in lists, tuples and dicts) as None."""
    if isinstance(value, float):
        return value if math.isfinite(value) else None
    if isinstance(value, dict):
        return {k: _finite_or_none(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [_finite_or_none(v) for v in value]
    return value


def write_json_atomic(path: str, payload: dict, *, sort_keys: bool = False) -> None:
    """Writes `payload` as JSON to `path` through a uniquely named temporary
    file in the same folder and a rename: a reader, or a later crash, sees the
    old file or the new one, never a torn one. Creates the folder.

    The file is strict JSON: a NaN or infinite float is written as `null`
    (Python's `json` would write bare `NaN`, which strict parsers reject)."""
    text = json.dumps(_finite_or_none(payload), indent=2, sort_keys=sort_keys, allow_nan=False)
    folder = os.path.dirname(os.path.abspath(path))
    os.makedirs(folder, exist_ok=True)
    fd, tmp = tempfile.mkstemp(dir=folder, prefix=".tmp-", suffix=".json")
    try:
        os.fchmod(fd, 0o644)
        with os.fdopen(fd, "w") as f:
            f.write(text + "\n")
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
        sync_directory(folder)
    finally:
        if os.path.exists(tmp):
            os.remove(tmp)
