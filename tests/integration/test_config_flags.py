"""tfmulti.config.flags: absl and argparse flags generated from the TrainConfig
fields, the configs made from them, and errors restated in flag names.

The acceptance test of "a new option is one field": a field added to a copy
of tfmulti/config/train_config.py shows up, with its default and help, as a flag of
recipes/train.py, of `tfmulti train` and of `tfmulti diagnose` with no other edit.
"""

from __future__ import annotations

import shutil

import pytest

from tests._util import REPO, run_python
NEW_FIELD = 'frobnicate: int = _field(7, "Frobnicate this many times.")'


@pytest.mark.slow
def test_a_field_added_to_train_config_is_a_flag_of_train_py_and_diagnose(tmp_path):
    """Issue "Done when": one field added to TrainConfig's source (nothing else
    edited) is a flag of recipes/train.py, `tfmulti train` and `tfmulti diagnose`,
    with its default and help text."""
    for folder in ("tfmulti", "recipes"):
        shutil.copytree(REPO / folder, tmp_path / folder,
                        ignore=shutil.ignore_patterns("__pycache__"))
    source = tmp_path / "tfmulti" / "config" / "train_config.py"
    text = source.read_text()
    anchor = "\n    @property\n    def model_parallel(self)"
    assert text.count(anchor) == 1 and "frobnicate" not in text
    source.write_text(text.replace(anchor, f"\n    {NEW_FIELD}\n{anchor}"))
    env = {"PYTHONPATH": str(tmp_path)}  # the copy shadows the installed package

    train = run_python([str(tmp_path / "recipes" / "train.py"), "--helpfull"], timeout=120,
                       env=env, cwd=tmp_path)
    assert "Traceback" not in train.stderr, train.stderr[-3000:]
    train_help = " ".join(train.stdout.split())
    assert "--frobnicate: Frobnicate this many times. (default: '7') (an integer)" in \
        train_help, train.stdout[-3000:]
    assert "--global_batch_size: Examples per step over all replicas." in train_help

    for command in ("diagnose", "train"):
        result = run_python(["-m", "tfmulti.cli", command, "--help"], timeout=120, env=env,
                            cwd=tmp_path)
        assert result.returncode == 0, result.stderr[-3000:]
        command_help = " ".join(result.stdout.split())
        assert "--frobnicate FROBNICATE Frobnicate this many times. (default: 7)" in \
            command_help, result.stdout[-3000:]
        # diagnose's exclusions still apply
        assert ("--epochs" in command_help) is (command == "train")
