"""The `tfmulti` command (tfmulti/cli.py): bad input is one line,
`tfmulti COMMAND: error: ...` in flag names, exit code 2, before any work
starts. Checked in-process with `cli.main`; two subprocess cases keep the
contract of the real command (one line, no TensorFlow log, fast).

The commands' work is tested with their modules (diagnose, memory, launcher,
data) and in tests/integration/test_recipes.py.
"""

from __future__ import annotations

import dataclasses
import json
import importlib
import re
import sys

import pytest

from tfmulti import cli
from tfmulti.config.train_config import TrainConfig
from tests._util import cli_main

FLAG_NAMES = {f.name for f in dataclasses.fields(TrainConfig)}.union(
    *(cli._option_names(p) for p in cli._subcommands(cli.build_parser()).values()))


class _Blocked:
    """Stands in for a module the command must not reach: any use fails the test."""

    def __init__(self, name):
        self._name = name

    def __getattr__(self, attr):
        if attr.startswith("__"):
            raise AttributeError(attr)
        raise AssertionError(f"{self._name}.{attr} was used: the command did work before "
                             "checking its input")


def _block(monkeypatch, name: str) -> None:
    """Makes `import name` and `from parent import leaf` give a `_Blocked`."""
    parent, _, leaf = name.rpartition(".")
    blocked = _Blocked(name)
    monkeypatch.setitem(sys.modules, name, blocked)
    monkeypatch.setattr(importlib.import_module(parent), leaf, blocked, raising=False)


def _one_error(argv, capsys, prefix: str) -> str:
    code, err, out = cli_main(argv, capsys)
    assert code == 2, (code, err)
    assert len(err) == 1, err
    assert err[0].startswith(prefix), err
    assert out == ""
    # In flag names: no `name` of a flag is left in Python's spelling.
    assert not FLAG_NAMES & set(re.findall(r"`(\w+)`", err[0])), err
    return err[0][len(prefix):]


@pytest.fixture
def no_diagnose(monkeypatch):
    """`tfmulti diagnose` must refuse bad input before loading the diagnosis
    (and TensorFlow with it)."""
    _block(monkeypatch, "tfmulti.insight.diagnose")


# ------------------------------------------------------------------------------ diagnose


@pytest.mark.parametrize("flags, message", [
    (["--global_batch_size=0"], "--global_batch_size must be a positive integer, got 0."),
    (["--distribution=pipeline"],
     "--distribution must be one of ['auto', 'one_device', 'mirrored'], got 'pipeline'; "
     "diagnose measures one process (for multi_worker, diagnose one worker with "
     "--distribution='mirrored' on its devices)."),
    (["--distribution=multi_worker"],
     "--distribution must be one of ['auto', 'one_device', 'mirrored'], got 'multi_worker'"),
    (["--plot=split.jpg"], "--plot takes a .png file name, got 'split.jpg'."),
    (["--learning_rate=nan"], "--learning_rate must be a finite number > 0, got nan."),
    (["--learning_rate=inf"], "--learning_rate must be a finite number > 0, got inf."),
    (["--dropout=1"], "--dropout must be in [0, 1), got 1.0."),
    (["--steps_per_execution=many"],
     "--steps_per_execution must be 'auto' or a positive integer, got 'many'."),
    (["--optimizer=rmsprops"], "--optimizer must be one of ['adam', 'adamw', 'sgd', "),
    (["--distribution=bogus"], "--distribution must be one of ['auto', 'one_device', "
                               "'mirrored', 'multi_worker', 'pipeline', 'hybrid'], got 'bogus'."),
    (["--global_batch_size=abc"], "argument --global_batch_size: expected an integer, got 'abc'"),
    (["--download=maybe"], "argument --download: expected true or false, got 'maybe'"),
    (["--seconds=soon"], "argument --seconds: invalid float value: 'soon'"),
])
def test_diagnose_bad_flags(flags, message, capsys, no_diagnose):
    assert _one_error(["diagnose", *flags], capsys, "tfmulti diagnose: error: ").startswith(
        message)


def test_good_flags_reach_the_diagnosis(capsys, no_diagnose):
    # The guard of the tests above is live: valid flags do get to the work.
    with pytest.raises(AssertionError, match=r"tfmulti.insight.diagnose.diagnose was used"):
        cli.main(["diagnose", "--distribution=one_device", "--global_batch_size=64"])


def test_diagnose_takes_the_training_flags_but_not_the_run_ones():
    parser = cli.build_parser()
    args = parser.parse_args(["diagnose", "--distribution=mirrored", "--global_batch_size=64",
                              "--devices=CPU:0,CPU:1", "--no_measure"])
    assert (args.distribution, args.global_batch_size, args.devices, args.measure) == \
        ("mirrored", 64, ("CPU:0", "CPU:1"), False)
    assert set(cli.DIAGNOSE_EXCLUDES) == {"epochs", "backup_dir", "backup_every_steps",
                                          "keep_backup", "discard_unreadable_backup",
                                          "model_dir", "overwrite", "verbose", "tensorboard",
                                          "profile_steps", "callbacks"}
    for name in cli.DIAGNOSE_EXCLUDES:
        assert not hasattr(args, name), name


@pytest.mark.parametrize("flag", ["--epochs=3", "--model_dir=/tmp/x", "--backup_dir=/tmp/b",
                                  "--verbose=2", "--overwrite", "--bogus"])
def test_diagnose_unknown_options_fail_in_one_line(flag, capsys, no_diagnose):
    code, err, out = cli_main(["diagnose", flag], capsys)
    assert code == 2 and len(err) == 1 and out == "", err
    assert err[0].endswith(f"error: unrecognized arguments: {flag}"), err


def test_diagnose_unknown_option_names_the_command(capsys, no_diagnose):
    _one_error(["diagnose", "--bogus"], capsys, "tfmulti diagnose: error: ")


# ----------------------------------------------------------------------- estimate-memory


@pytest.mark.parametrize("args, message", [
    (["--distribution", "bogus"], "--distribution must be one of ['auto', 'one_device', "
                                  "'mirrored', 'multi_worker', 'pipeline', 'hybrid'], got "
                                  "'bogus'."),
    (["--distribution", "mirrored", "--num_devices", "3"],
     "--global_batch_size (256) must be divisible by the number of replicas (3)"),
    (["--mixed_precision=int8"],
     "--mixed_precision must be one of ['none', 'bfloat16', 'float16'], got 'int8'."),
    (["--distribution=pipeline", "--num_microbatches=3"],
     "--global_batch_size (256) must split into 1 replica x 3 micro-batches"),
    (["--global_batch_size=0"], "--global_batch_size must be a positive integer, got 0"),
    (["--num_devices=abc"], "argument --num_devices: invalid int value: 'abc'"),
    (["--remat=maybe"], "argument --remat: expected true or false, got 'maybe'"),
])
def test_estimate_memory_bad_input(args, message, capsys):
    assert message in _one_error(["estimate-memory", *args], capsys,
                                 "tfmulti estimate-memory: error: ")


def test_estimate_memory_checks_flags_before_loading_tensorflow(capsys, monkeypatch):
    _block(monkeypatch, "tfmulti.memory.estimate")
    _one_error(["estimate-memory", "--distribution=bogus"], capsys,
               "tfmulti estimate-memory: error: ")


def test_estimate_memory_flags_are_the_config_fields(capsys):
    args = cli.build_parser().parse_args(["estimate-memory"])
    assert vars(args).keys() & set(cli.ESTIMATE_FIELDS) == set()  # unset: memory's defaults
    # ... which the pre-TensorFlow check shares, name for name.
    import inspect

    from tfmulti.memory import arguments as estimate_args
    from tfmulti.memory import estimate as memory

    def defaults(fn):
        return {k: p.default for k, p in inspect.signature(fn).parameters.items()}
    assert defaults(memory.estimate_memory) == defaults(estimate_args.check_estimate_arguments)
    code, _, out = cli_main(["estimate-memory", "--help"], capsys)
    help_text = " ".join(out.split())
    assert code == 0
    assert "--distribution DISTRIBUTION" in help_text and "(default: one_device)" in help_text
    for name in cli.ESTIMATE_FIELDS:
        assert f"--{name}" in help_text, name


# -------------------------------------------------------------------------- prepare-data


def test_prepare_data_refuses_another_dataset(capsys, monkeypatch, tmp_path):
    _block(monkeypatch, "tfmulti.data")
    message = _one_error(["prepare-data", "--dataset=cifar10", f"--data_dir={tmp_path / 'd'}"],
                         capsys, "tfmulti prepare-data: error: ")
    assert message == ("only fashion_mnist and tfmulti_text are prepared from local files; for "
                       "'cifar10' run `tfds build cifar10` with internet access.")
    assert not (tmp_path / "d").exists()


def test_prepare_data_without_the_idx_files(capsys, tmp_path):
    message = _one_error(["prepare-data", f"--source_dir={tmp_path}",
                          f"--data_dir={tmp_path / 'tfds'}"], capsys,
                         "tfmulti prepare-data: error: ")
    assert message.startswith(f"Fashion-MNIST IDX files not found in ['{tmp_path}']")
    assert not (tmp_path / "tfds").exists()


# ---------------------------------------------------------------------- launch, env, top


@pytest.mark.parametrize("args, message", [
    (["--max_restarts=-1", "--", "python", "x.py"], "--max_restarts"),
    (["--num_workers=0", "--", "python", "x.py"], "--num_workers"),
    (["--", "no-such-program-tfmulti"],
     "command 'no-such-program-tfmulti' is not found or not executable"),
    (["--num_workers=two", "--", "python"], "argument --num_workers: invalid int value: 'two'"),
    # Issue 27: every number in its range, the range in the message.
    (["--num_workers=100000", "--", "python"],
     "--num_workers (100000) must be an integer from 1 to 1024; e.g. 2."),
    (["--hosts=127.0.0.1:99999999999", "--host_rank=0", "--", "python"],
     "host 0 of --hosts ('127.0.0.1:99999999999'): N must be a number of workers from 1 to "
     "1024"),
    (["--port=99999999999", "--", "python"],
     "--port (99999999999) must be an integer from 1 to 65535; e.g. 2222."),
    (["--startup_timeout=1e9", "--", "python"],
     "--startup_timeout (1000000000.0) must be a number from above 0 to 86400; seconds"),
    (["--startup_timeout=nan", "--", "python"], "--startup_timeout (nan) must be a number"),
    (["--grace_period=-1", "--", "python"],
     "--grace_period (-1.0) must be a number from 0 to 86400; seconds"),
    (["--max_restarts=1000000", "--", "python"],
     "--max_restarts (1000000) must be an integer from 0 to 1000"),
    (["--gpus_per_worker=-1", "--", "python"],
     "--gpus_per_worker (-1) must be an integer from 0 to 256"),
])
def test_launch_bad_input_starts_nothing(args, message, capsys):
    # An unmarked test: a started process would fail it (tests/conftest.py). (The
    # messages themselves are the launcher's: tests/integration/test_launcher.py.)
    assert message in _one_error(["launch", *args], capsys, "tfmulti launch: error: ")


def test_launch_more_than_four_workers_per_core_needs_oversubscribe(monkeypatch, capsys):
    # Issue 27: --num_workers 3000 started 3,000 processes on 2 cores.
    import os

    monkeypatch.setattr(os, "sched_getaffinity", lambda pid: {0, 1})
    assert _one_error(["launch", "--num_workers=9", "--", "python"], capsys,
                      "tfmulti launch: error: ") == (
        "--num_workers (9) is more than 4 workers per core for the 2 cores of this host: "
        "use 1 to 8, or pass --oversubscribe to start them anyway.")
    # With it, the launch goes on to its next check (and starts nothing here).
    assert _one_error(["launch", "--num_workers=9", "--oversubscribe", "--",
                       "no-such-program-tfmulti"], capsys, "tfmulti launch: error: ") \
        .startswith("command 'no-such-program-tfmulti' is not found")


def test_env_bad_input(capsys):
    assert _one_error(["env", "--num_virtual_devices=abc"], capsys, "tfmulti env: error: ") == \
        "argument --num_virtual_devices: invalid int value: 'abc'"


@pytest.mark.parametrize("argv, message", [
    ([], "the following arguments are required: command"),
    (["bogus"], "argument command: invalid choice: 'bogus'"),
])
def test_no_or_unknown_command(argv, message, capsys):
    assert message in _one_error(argv, capsys, "tfmulti: error: ")


def test_help_lists_every_command(capsys):
    code, _, out = cli_main(["--help"], capsys)
    assert code == 0
    for command in ("env", "prepare-data", "estimate-memory", "launch", "diagnose"):
        assert command in out


# ------------------------------------------------------------------- the user's own model


OWN_FLAGS = ["--model=tests.own_model:build", "--dataset=tests.own_model:data"]


def test_estimate_memory_of_the_users_model(capsys):
    code, err, out = cli_main(["estimate-memory", *OWN_FLAGS, "--distribution=mirrored",
                            "--num_devices=2", "--global_batch_size=64", "--json"], capsys)
    assert code == 0, err
    estimate = json.loads(out)
    assert estimate["model"] == "tests.own_model:build" and len(estimate["devices"]) == 2
    row = estimate["devices"][0]
    # 20*32+32 + 32*32+32 + 32*2+2 weights; activations: concat 20, mix 32, block 32,
    # residual 32, out 2 floats for each of the 32 examples of a replica.
    assert row["parameters"] == 4 * (672 + 1056 + 66) and row["optimizer_slots"] == \
        2 * row["parameters"]
    assert row["activations"] == 4 * 32 * (20 + 32 + 32 + 32 + 2)
    message = _one_error(["estimate-memory", "--model=tests.own_model:build"], capsys,
                         "tfmulti estimate-memory: error: ")
    assert message.startswith("your model function tests.own_model:build takes `input_shape`; "
                              "pass --dataset")


def test_diagnose_and_estimate_memory_take_the_training_flags_that_bear_on_them():
    """Issue 28: the tools disagreed on flags. Both take the training flags, spelled as
    recipes/train.py spells them: diagnose all but those of a run's length and outputs
    (steps_per_epoch included: auto steps per call divide it), estimate-memory those
    that decide a device's bytes (--num_devices stays as an alias)."""
    commands = cli._subcommands(cli.build_parser())
    fields = {f.name for f in dataclasses.fields(TrainConfig)}
    assert fields - cli._option_names(commands["diagnose"]) == set(cli.DIAGNOSE_EXCLUDES)
    args = cli.build_parser().parse_args(["diagnose", "--steps_per_epoch=10", "--task=regression",
                                          "--num_virtual_devices=2"])
    assert (args.steps_per_epoch, args.task, args.num_virtual_devices) == (10, "regression", 2)
    memory_flags = {"model", "dataset", "data_dir", "download", "task", "distribution",
                    "num_virtual_devices", "devices", "num_stages", "num_microbatches",
                    "num_replicas", "remat", "tensor_parallel", "partition",
                    "global_batch_size", "optimizer", "mixed_precision", "dropout", "seq_len",
                    "d_model", "num_heads", "num_layers", "device_memory_mb", "zero_stage",
                    "shard_embeddings"}
    assert cli._option_names(commands["estimate-memory"]) & fields == memory_flags
    assert {"num_devices", "json"} <= cli._option_names(commands["estimate-memory"])
