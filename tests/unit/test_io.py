"""tfmulti/utils/atomic.py: writes a crash cannot tear."""

from __future__ import annotations

import json
import os

from tfmulti.utils.atomic import write_json_atomic


def test_write_json_atomic_replaces_the_file_and_leaves_no_temporary(tmp_path):
    path = str(tmp_path / "sub" / "out.json")
    write_json_atomic(path, {"a": 1})
    write_json_atomic(path, {"a": 2})
    assert json.loads(open(path).read()) == {"a": 2}
    assert os.listdir(tmp_path / "sub") == ["out.json"]
    assert oct(os.stat(path).st_mode & 0o777) == "0o644"
