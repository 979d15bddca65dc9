"""The numeric flags of `tfmulti env`, `diagnose`, `estimate-memory` and the
paths of `export` are refused in one line with their range, before TensorFlow
starts (issue 27, finding 8). In-process, through `cli.main`, with the module
that does each command's work made unimportable: a check that came too late
would reach it and fail differently.

recipes/train.py's flags are TrainConfig's: tests/unit/test_config_flags.py.
"""

from __future__ import annotations

import importlib
import sys

import pytest

from tests._util import cli_main

_WORK = {"env": "tfmulti.runtime.devices", "diagnose": "tfmulti.insight.diagnose",
         "estimate-memory": "tfmulti.memory.estimate", "export": "tfmulti.training.export"}


@pytest.fixture
def no_work(monkeypatch):
    """Each command's work module (and TensorFlow behind it) cannot be imported."""
    for name in _WORK.values():
        parent, _, leaf = name.rpartition(".")
        monkeypatch.setitem(sys.modules, name, None)
        monkeypatch.delattr(importlib.import_module(parent), leaf, raising=False)


def _error(argv, capsys) -> str:
    code, err, out = cli_main(argv, capsys)
    assert (code, len(err), out) == (2, 1, ""), (code, err, out)
    prefix = f"tfmulti {argv[0]}: error: "
    assert err[0].startswith(prefix), err
    return err[0][len(prefix):]


@pytest.mark.parametrize("argv, message", [
    (["env", "--num_virtual_devices=100000"],
     "--num_virtual_devices must be an integer from 0 to 256, got 100000; 0 leaves the "
     "devices as they are."),
    (["env", "--num_virtual_devices=-1"],
     "--num_virtual_devices must be an integer from 0 to 256"),
    (["env", "--gpus_per_worker=-1"],
     "--gpus_per_worker must be an integer from 0 to 256, got -1."),
    (["env", "--num_workers=0"], "--num_workers must be an integer from 1 to 2147483647, got 0."),
    (["diagnose", "--seed=-5"], "--seed must be an integer from 0 to 4294967295 (or None), got -5."),
    (["diagnose", "--num_virtual_devices=100000"],
     "--num_virtual_devices must be an integer from 0 to 256, got 100000"),
    (["diagnose", "--seconds=0"], "--seconds must be a finite number > 0 and <= 3600, got 0.0."),
    (["diagnose", "--seconds=nan"], "--seconds must be a finite number > 0 and <= 3600, got nan."),
    (["diagnose", "--seconds=1e9"],
     "--seconds must be a finite number > 0 and <= 3600, got 1000000000.0."),
    (["estimate-memory", "--num_devices=0"],
     "--num_devices must be an integer from 1 to 256 (or None), got 0."),
    (["estimate-memory", "--distribution=mirrored", "--num_devices=100000"],
     "--num_devices must be an integer from 1 to 256 (or None), got 100000."),
    (["estimate-memory", "--distribution=pipeline", "--num_stages=100000"],
     "--num_stages must be an integer from 1 to 256, got 100000."),
    (["estimate-memory", "--model=transformer", "--d_model=1000000"],
     "--d_model must be an integer from 1 to 32768, got 1000000."),
    (["estimate-memory", "--global_batch_size=1000000000000"],
     "--global_batch_size must be an integer from 1 to 2147483647, got 1000000000000."),
])
def test_numeric_flags_state_their_range_before_the_work(argv, message, capsys, no_work):
    assert _error(argv, capsys).startswith(message)


def test_diagnose_output_paths_checked_before_the_work(tmp_path, capsys, no_work):
    (tmp_path / "file").write_text("")
    assert _error(["diagnose", f"--plot={tmp_path}/file/split.png"], capsys).startswith(
        f"--plot {str(tmp_path / 'file')!r} exists and is not a directory")
    assert _error(["diagnose", f"--profile_dir={tmp_path}/file"], capsys).startswith(
        f"--profile_dir {str(tmp_path / 'file')!r} exists and is not a directory")
    assert _error(["diagnose", "--profile_dir="], capsys) == \
        "--profile_dir is empty; pass a directory path."


def test_export_paths_checked_before_tensorflow(tmp_path, capsys, no_work, monkeypatch):
    monkeypatch.chdir(tmp_path)
    (tmp_path / "run").mkdir()
    (tmp_path / "run" / "model.keras").write_text("not a zip archive")
    assert _error(["export", "--model_dir=run", "--output=out"], capsys) == \
        "run/model.keras is not a Keras model file (not a .keras zip archive); pass the " \
        "directory a training run wrote."
    assert _error(["export", "--model_dir=", "--output=out"], capsys).startswith(
        "--model_dir '' has no model.keras")
    (tmp_path / "taken").mkdir()
    (tmp_path / "run" / "model.keras").unlink()
    import zipfile

    with zipfile.ZipFile(tmp_path / "run" / "model.keras", "w") as archive:
        archive.writestr("config.json", "{}")
    assert _error(["export", "--model_dir=run", "--output=taken"], capsys) == \
        f"{tmp_path / 'taken'} exists; pass another output directory, or set --overwrite to " \
        "replace it."
    assert sorted(p.name for p in tmp_path.iterdir()) == ["run", "taken"]  # nothing written
