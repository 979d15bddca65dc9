"""`tfmulti train` as a user runs it (issue 29): a real run, the same run again
from its `.tfmulti-run.json`; `tfmulti --version`
without TensorFlow; `recipes/train.py --help`. The in-process checks are in
tests/unit/test_train_command.py, tests/unit/test_config_file.py and
tests/unit/test_flag_style.py."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

import tfmulti
from tfmulti.training import outputs
from tests._util import REPO, run_python, run_python_warm

# Away from the defaults, so that a rerun that missed the file would differ.
TINY = ["--distribution=one_device", "--dataset=synthetic", "--num_examples=384", "--epochs=1",
        "--global_batch_size=32", "--learning_rate=0.01", "--dropout=0", "--seed=3",
        "--verbose=0", "--no-tensorboard"]
TFMULTI = Path(sys.executable).parent / "tfmulti"  # the console script pip installs


def _train(*argv: str) -> subprocess.CompletedProcess:
    return run_python_warm(["-m", "tfmulti.cli", "train", *argv], timeout=600)


@pytest.mark.slow
def test_a_run_again_from_its_run_file_gives_the_same_metrics(tmp_path):
    first, again = tmp_path / "first", tmp_path / "again"
    result = _train(*TINY, f"--model-dir={first}")
    assert result.returncode == 0, result.stderr[-3000:]
    metrics = json.loads((first / "metrics.json").read_text())
    assert outputs.summary_line(metrics) in result.stdout.splitlines()

    result = _train("--config", str(first / outputs.RUN_FILE), f"--model_dir={again}")
    assert result.returncode == 0, result.stderr[-3000:]
    rerun = json.loads((again / "metrics.json").read_text())
    for key in ("test_accuracy", "test_loss", "num_replicas", "epochs_completed"):
        assert rerun[key] == pytest.approx(metrics[key], rel=1e-6, abs=1e-7), key
    # The same configuration, but for the folder the command line gave.
    recorded = [json.loads((folder / outputs.RUN_FILE).read_text())["config"]
                for folder in (first, again)]
    assert recorded[1] == {**recorded[0], "model_dir": str(again)}


@pytest.mark.slow
def test_version_without_tensorflow():
    result = run_python(["-c", "import sys\nfrom tfmulti import cli\ntry:\n"
                               "    cli.main(['--version'])\nexcept SystemExit as e:\n"
                               "    print(e.code, 'tensorflow' in sys.modules)"], timeout=60)
    assert result.stdout == f"tfmulti {tfmulti.__version__}\n0 False\n", result.stderr
    script = subprocess.run([str(TFMULTI), "--version"], capture_output=True, text=True,
                            timeout=60)
    assert (script.returncode, script.stdout) == (0, f"tfmulti {tfmulti.__version__}\n")


@pytest.mark.slow
def test_the_recipes_help_lists_its_flags_and_keeps_its_examples():
    # Issue 29: --help listed no flags and joined the examples' lines; --helpfull
    # listed about 60 of absl's own flags first.
    result = run_python([str(REPO / "recipes" / "train.py"), "--help"], timeout=60)
    assert result.stderr == ""  # (absl's --help exits with 1)
    text = result.stdout
    assert "    python recipes/train.py --distribution=mirrored --num_virtual_devices=4 \\\n" \
           "        --dataset=fashion_mnist" in text, text[:3000]
    for flag in ("--global_batch_size:", "--[no]jit_compile:", "--config:", "--model_dir:"):
        assert flag in text, flag
    assert "--alsologtostderr" not in text and "--flagfile" not in text
    full = run_python([str(REPO / "recipes" / "train.py"), "--helpfull"], timeout=60)
    assert "--alsologtostderr" in full.stdout and "--global_batch_size:" in full.stdout
