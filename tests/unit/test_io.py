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


def _strict(constant):
    raise ValueError(f"not JSON: {constant}")


def test_non_finite_numbers_are_written_as_null_in_strict_json(tmp_path):
    """Issue 27: metrics.json held bare NaN, which strict JSON parsers reject."""
    path = tmp_path / "metrics.json"
    write_json_atomic(str(path), {"train_loss": float("nan"), "test_loss": float("inf"),
                                  "epoch_seconds": [1.5, float("-inf")],
                                  "nested": {"mae": float("nan"), "ok": 2.0}, "name": "nan"})
    assert json.loads(path.read_text(), parse_constant=_strict) == {
        "train_loss": None, "test_loss": None, "epoch_seconds": [1.5, None],
        "nested": {"mae": None, "ok": 2.0}, "name": "nan"}
