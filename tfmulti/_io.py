"""File writes that a crash cannot tear (pure Python).

    >>> import json, os, tempfile
    >>> from tfmulti._io import write_json_atomic
    >>> path = os.path.join(tempfile.mkdtemp(), "out.json")
    >>> write_json_atomic(path, {"a": 1})
    >>> json.load(open(path))
    {'a': 1}
"""

from __future__ import annotations

import json
import os
import tempfile

__all__ = ["write_json_atomic"]


def write_json_atomic(path: str, payload: dict, *, sort_keys: bool = False) -> None:
    """Writes `payload` as JSON to `path` through a uniquely named temporary
    file in the same folder and a rename: a reader, or a later crash, sees the
    old file or the new one, never a torn one. Creates the folder."""
    folder = os.path.dirname(os.path.abspath(path))
    os.makedirs(folder, exist_ok=True)
    fd, tmp = tempfile.mkstemp(dir=folder, prefix=".tmp-", suffix=".json")
    try:
        os.fchmod(fd, 0o644)
        with os.fdopen(fd, "w") as f:
            json.dump(payload, f, indent=2, sort_keys=sort_keys)
            f.write("\n")
        os.replace(tmp, path)
    finally:
        if os.path.exists(tmp):
            os.remove(tmp)
