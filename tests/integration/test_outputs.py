"""A full model_dir disk at a run's final writes, through recipes/train.py: one
line naming model_dir, exit code 2, the outputs it was to replace intact
(issue 27, finding 7's model_dir half; the claim and publish themselves are in
tests/unit/test_outputs.py)."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest

from tests._util import REPO, RECIPES

pytestmark = pytest.mark.slow

# Runs in a private mount namespace on a 1 MiB tmpfs (the mount dies with the
# namespace): an earlier run's outputs there, then the recipe with --overwrite;
# prints what the test checks, since the files go with the mount.
_DRIVER = """
import json, os, subprocess, sys
folder, recipe = sys.argv[1], sys.argv[2]
os.makedirs(os.path.join(folder, "logs", "train"))
old = {"metrics.json": '{"test_accuracy": 0.5}', "model.keras": "an earlier model",
       "logs/train/events.out.tfevents.1.host.1.v2": "earlier events",
       ".tfmulti-run.json": '{"epochs": 9}'}
for name, text in old.items():
    with open(os.path.join(folder, name), "w") as f:
        f.write(text)
run = subprocess.run([sys.executable, recipe, "--dataset=synthetic", "--num_examples=256",
                      "--epochs=1", "--model=mlp", "--distribution=one_device",
                      "--global_batch_size=64", "--verbose=0", "--overwrite",
                      "--model_dir=" + folder], capture_output=True, text=True, timeout=300)
left = {}
for root, _, files in os.walk(folder):
    for name in files:
        with open(os.path.join(root, name), "rb") as f:
            left[os.path.relpath(os.path.join(root, name), folder)] = f.read().decode("latin-1")
print(json.dumps({"code": run.returncode, "stderr": run.stderr, "old": old, "left": left}))
"""


def test_a_full_model_dir_disk_names_model_dir_and_keeps_the_old_outputs(tmp_path):
    disk = tmp_path / "disk"
    disk.mkdir()
    result = subprocess.run(
        ["unshare", "-m", "sh", "-c",
         'mount -t tmpfs -o size=1m tmpfs "$1" && exec "$2" -c "$3" "$1" "$4"', "sh",
         str(disk), sys.executable, _DRIVER, str(RECIPES / "train.py")],
        capture_output=True, text=True, timeout=360, cwd=REPO,
        env={**os.environ, "TF_CPP_MIN_LOG_LEVEL": "2"})
    assert result.returncode == 0, result.stderr
    found = json.loads(result.stdout.splitlines()[-1])
    lines = [line for line in found["stderr"].splitlines() if line.strip()]
    assert found["code"] == 2, found["stderr"]
    assert lines[-1] == (f"train.py: error: cannot write the outputs to --model_dir "
                         f"'{disk}': No space left on device; free space there, or choose "
                         "another model_dir."), found["stderr"]
    assert "Traceback" not in found["stderr"]
    # The earlier run's outputs, as they were; the new run's logs wait, unpublished.
    assert {name: text for name, text in found["left"].items()
            if name != ".tfmulti-run.json" and not name.startswith(".tfmulti-pending/")} == {
        name: text for name, text in found["old"].items() if name != ".tfmulti-run.json"}
    assert not [name for name in found["left"] if name.startswith(".staging-")]
    assert not (disk / "metrics.json").exists()  # the mount went with the namespace
