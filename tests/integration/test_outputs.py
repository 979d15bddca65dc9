"""A full model_dir disk at a run's final writes, through recipes/train.py: one
line naming model_dir, exit code 2, the outputs it was to replace intact
(issue 27, finding 7's model_dir half; the claim and publish themselves are in
tests/unit/test_outputs.py)."""

from __future__ import annotations

import os

import pytest

from tests._util import RECIPES, WORKERS, file_tree, run_python_warm

pytestmark = pytest.mark.slow

# An earlier run's outputs on the disk before the recipe runs with --overwrite.
_OLD = {"metrics.json": '{"test_accuracy": 0.5}', "model.keras": "an earlier model",
        "logs/train/events.out.tfevents.1.host.1.v2": "earlier events",
        ".tfmulti-run.json": '{"epochs": 9}'}


def test_a_full_model_dir_disk_names_model_dir_and_keeps_the_old_outputs(tmp_path):
    # The recipe in a private mount namespace, on a 1 MiB tmpfs (the mount dies with
    # the namespace; tests/workers/confined.py), the earlier outputs copied onto it
    # first; what it left there copied out after.
    disk, old, left = tmp_path / "disk", tmp_path / "old", tmp_path / "left"
    for folder in (disk, old, left):
        folder.mkdir()
    for name, text in _OLD.items():
        os.makedirs((old / name).parent, exist_ok=True)
        (old / name).write_text(text)
    result = run_python_warm(
        [str(WORKERS / "confined.py"), "--tmpfs", str(disk), "1m", "--first_copy", str(old),
         str(disk), "--then_copy", str(disk), str(left), "--", str(RECIPES / "train.py"),
         "--dataset=synthetic", "--num_examples=256", "--epochs=1", "--model=mlp",
         "--distribution=one_device", "--global_batch_size=64", "--verbose=0", "--overwrite",
         f"--model_dir={disk}"], timeout=360)
    lines = [line for line in result.stderr.splitlines() if line.strip()]
    assert result.returncode == 2, result.stderr
    assert lines[-1] == (f"train.py: error: cannot write the outputs to --model_dir "
                         f"'{disk}': No space left on device; free space there, or choose "
                         "another model_dir."), result.stderr
    assert "Traceback" not in result.stderr
    # The earlier run's outputs, as they were; the new run's logs wait, unpublished.
    found = {name: data.decode("latin-1") for name, data in file_tree(left).items()}
    assert {name: text for name, text in found.items()
            if name != ".tfmulti-run.json" and not name.startswith(".tfmulti-pending/")} == {
        name: text for name, text in _OLD.items() if name != ".tfmulti-run.json"}
    assert not [name for name in found if name.startswith(".staging-")]
    assert not os.path.ismount(disk) and os.listdir(disk) == []  # gone with the namespace
