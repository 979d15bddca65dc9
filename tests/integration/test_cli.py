"""The `tfmulti` command (tfmulti/cli.py): bad input is one line,
`tfmulti COMMAND: error: ...` in flag names, exit code 2, before any work
starts. Checked in-process with `cli.main`; two subprocess cases keep the
contract of the real command (one line, no TensorFlow log, fast).

The commands' work is tested with their modules (diagnose, memory, launcher,
data) and in tests/unit/test_recipes.py.
"""

from __future__ import annotations

import json
import os
import re
import sys
import time

import pytest

from tests._util import cli_main, run_python, tf_log_lines
from tests.unit.test_cli import OWN_FLAGS


# ------------------------------------------------------------------- the real command


@pytest.mark.slow
@pytest.mark.parametrize("argv, line", [
    (["diagnose", "--global_batch_size=0"],
     "tfmulti diagnose: error: --global_batch_size must be a positive integer, got 0."),
    (["launch", "--max_restarts=-1", "--", "python", "x.py"],
     re.compile(r"tfmulti launch: error: --max_restarts .*-1.*")),
    (["train", "--global-batch-size=0"],
     "tfmulti train: error: --global_batch_size must be a positive integer, got 0."),
    (["train", "--config=/nonexistent/run.yaml"],
     "tfmulti train: error: cannot read the config file /nonexistent/run.yaml (No such file or "
     "directory); pass a readable YAML or JSON file."),
    (["estimate-memory", "--model=mlp", "--task=regression", "--num_virtual_devices=2"],
     "tfmulti estimate-memory: error: --task 'regression' does not fit --model 'mlp', which "
     "does classification; leave --task='auto'."),
])
def test_the_command_fails_in_one_line_before_tensorflow(argv, line):
    # TensorFlow's start-up lines come through absl even at TF_CPP_MIN_LOG_LEVEL=2, and
    # unfiltered with TFMULTI_TF_LOG=1: an empty stderr besides the error means it never
    # loaded.
    start = time.monotonic()
    result = run_python(["-m", "tfmulti.cli", *argv], timeout=60, env={"TFMULTI_TF_LOG": "1"})
    took = time.monotonic() - start
    assert result.returncode == 2, result.stderr[-3000:]
    # Nothing else: no TensorFlow log lines.
    assert result.stderr.endswith("\n") and len(result.stderr.splitlines()) == 1, result.stderr
    error = result.stderr.rstrip("\n")
    assert line.fullmatch(error) if isinstance(line, re.Pattern) else error == line
    assert result.stdout == ""
    assert took < 1.5, f"{took:.2f} s: TensorFlow was loaded?"


# ------------------------------------------------------------------------------- env


@pytest.mark.slow
@pytest.mark.parametrize("onednn, tf_log", [("0", ""), ("1", "1")],
                         ids=["oneDNN off, quiet", "oneDNN on, TFMULTI_TF_LOG=1"])
def test_env_in_a_fresh_process(onednn, tf_log):
    """`tfmulti env` splits the CPU first when asked, shows TF_CONFIG, and
    reports oneDNN as TF_ENABLE_ONEDNN_OPTS forces it (both ways: the variable
    acts only before TensorFlow starts, hence a fresh process each). Its start is
    quiet (tfmulti.utils.quiet: no TensorFlow C++ start-up line) unless
    TFMULTI_TF_LOG=1 asks for TensorFlow's log as it writes it."""
    tf_config = {"cluster": {"worker": ["localhost:1234"]}, "task": {"type": "worker", "index": 0}}
    result = run_python(["-m", "tfmulti.cli", "env", "--json", "--num_virtual_devices=3"],
                        env={"TF_ENABLE_ONEDNN_OPTS": onednn, "TF_CONFIG": json.dumps(tf_config),
                             "TFMULTI_TF_LOG": tf_log})
    assert result.returncode == 0, result.stderr[-2000:]
    found = tf_log_lines(result.stdout + result.stderr)
    if tf_log:  # absl's pre-init line, oneDNN's, ...
        assert any("InitializeLog" in line for line in found), result.stderr
    else:
        assert found == [], result.stderr
    report = json.loads(result.stdout)
    for key in ("python", "tensorflow", "keras", "tensorflow_datasets", "absl_py",
                "physical_devices", "logical_devices", "gpus", "nccl_usable", "cpu_count",
                "cpu_model", "onednn", "ram_bytes", "tf_config"):
        assert key in report, key
    assert report["python"] == ".".join(map(str, sys.version_info[:3]))
    assert report["tensorflow"].startswith("2.21") and report["keras"].startswith("3.")
    assert len([d for d in report["logical_devices"] if ":CPU:" in d]) == 3
    assert report["cpu_count"] == os.cpu_count()
    assert report["onednn"] is (onednn == "1")
    assert report["tf_config"] == tf_config


@pytest.mark.slow  # trains for seconds
def test_diagnose_the_users_model(capsys):
    # 2 of the test process' 4 CPUs: MirroredStrategy traces each function once
    # per replica, and 2 replicas are what mirroring the user's model needs.
    code, err, out = cli_main(["diagnose", *OWN_FLAGS, "--loss=tests.own_model:smooth_loss",
                               "--distribution=mirrored", "--devices=CPU:0,CPU:1",
                               "--global_batch_size=64", "--seconds=0.2", "--no_measure",
                               "--json"], capsys)
    assert code == 0, err
    report = json.loads(out)
    assert report["config"]["model"] == "tests.own_model:build"
    assert report["num_replicas"] == 2 and report["bottleneck"] in ("input", "compute",
                                                                     "overhead")
