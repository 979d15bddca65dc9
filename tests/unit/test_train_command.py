"""`tfmulti train` (issue 29, Deliver 1) and `tfmulti --version`, in-process: the
options are TrainConfig's, bad input is one line before training starts, the
chief prints the results line and the other workers the line that says they
are done (the chief rule of `tfmulti.cluster.tf_config.process_is_chief`, shared
with recipes/train.py). The training itself is stubbed here; real runs are in
tests/integration/test_train_command.py."""

from __future__ import annotations

import ast
import dataclasses
import json

import pytest

import tfmulti
from tfmulti import cli
from tfmulti.cluster import tf_config
from tfmulti.config.train_config import TrainConfig
from tfmulti.training import outputs
from tests._util import REPO, cli_main

METRICS = {"test_accuracy": 0.8125, "test_loss": 0.5, "examples_per_second": 25655.8623,
           "num_replicas": 4, "distribution": "MirroredStrategy", "epochs_completed": 1,
           "loss": [0.9]}
TINY = ["--dataset=synthetic", "--num_examples=256", "--epochs=1", "--global_batch_size=64"]


@pytest.fixture
def trained(monkeypatch):
    """The configs `tfmulti train` trained (the training stubbed)."""
    import tfmulti.training.train as train_module

    seen = []
    monkeypatch.setattr(train_module, "train", lambda config: seen.append(config) or METRICS)
    for name in ("TF_CONFIG", "SLURM_PROCID"):
        monkeypatch.delenv(name, raising=False)
    return seen


def test_version(capsys):
    code, err, out = cli_main(["--version"], capsys)
    assert (code, err, out) == (0, [], f"tfmulti {tfmulti.__version__}\n")


def test_train_takes_every_field_of_train_config():
    parser = cli._subcommands(cli.build_parser())["train"]
    dests = {a.dest for a in parser._actions if a.option_strings} - {"help", "config"}
    assert dests == {f.name for f in dataclasses.fields(TrainConfig)}


def test_train_trains_the_flags_configuration_and_the_chief_reports(trained, capsys):
    code, err, out = cli_main(["train", *TINY, "--distribution=mirrored",
                               "--num-virtual-devices=2", "--no-tensorboard"], capsys)
    assert code == 0, err
    assert trained == [TrainConfig(dataset="synthetic", num_examples=256, epochs=1,
                                   global_batch_size=64, distribution="mirrored",
                                   num_virtual_devices=2, tensorboard=False)]
    assert out == outputs.summary_line(METRICS) + "\n"


@pytest.mark.parametrize("env, chief", [
    ({"TF_CONFIG": json.dumps({"cluster": {"worker": ["a:1", "b:1"]},
                               "task": {"type": "worker", "index": 1}})}, False),
    ({"TF_CONFIG": json.dumps({"cluster": {"worker": ["a:1", "b:1"]},
                               "task": {"type": "worker", "index": 0}})}, True),
    ({"SLURM_PROCID": "1"}, False),
    ({"SLURM_PROCID": "0"}, True),
])
def test_only_the_chief_prints_the_results(env, chief, trained, monkeypatch, capsys):
    for name, value in env.items():
        monkeypatch.setenv(name, value)
    code, err, out = cli_main(["train", *TINY, "--distribution=multi_worker"], capsys)
    assert code == 0, err
    assert out == (outputs.summary_line(METRICS) if chief else outputs.OTHER_WORKER_LINE) + "\n"
    # benchmarks/chaos.py times the chief's writes by the other workers' line.
    assert outputs.OTHER_WORKER_LINE == \
        "tfmulti: done; the chief reports the results and writes the outputs"


@pytest.mark.parametrize("argv, message", [
    (["--global_batch_size=0"], "--global_batch_size must be a positive integer, got 0."),
    (["--epochs=two"], "argument --epochs: expected an integer, got 'two'"),
    (["--distribution=multi_worker"], None),  # a malformed TF_CONFIG (set below)
    (["--epochs"], "argument --epochs: expected one argument"),
    (["extra"], "unrecognized arguments: extra"),
])
def test_bad_input_is_one_line_before_training(argv, message, trained, monkeypatch, capsys):
    monkeypatch.setenv("TF_CONFIG", '{"cluster": {}}')
    code, err, out = cli_main(["train", *argv], capsys)
    assert (code, out, trained) == (2, "", [])
    assert len(err) == 1 and err[0].startswith("tfmulti train: error: "), err
    if message:
        assert err[0] == f"tfmulti train: error: {message}"


def test_the_chief_rule():
    worker = {"TF_CONFIG": json.dumps({"cluster": {"chief": ["a:1"], "worker": ["b:1"]},
                                       "task": {"type": "worker", "index": 0}})}
    assert not tf_config.process_is_chief("multi_worker", environ=worker)
    assert not tf_config.process_is_chief("auto", environ=worker)
    assert tf_config.process_is_chief("mirrored", environ=worker)  # one process
    # SLURM's task 0 where its resolver is used (asked for, or no TF_CONFIG).
    assert not tf_config.process_is_chief("multi_worker", "slurm", {"SLURM_PROCID": "3"})
    assert tf_config.process_is_chief("auto", "auto", {"SLURM_PROCID": "3"})
    with pytest.raises(ValueError, match="TF_CONFIG"):
        tf_config.process_is_chief("multi_worker", environ={"TF_CONFIG": "{"})


def test_summary_line_keeps_its_keys_order():
    line = outputs.summary_line(METRICS)
    assert line.startswith("tfmulti: ") and "loss" not in line.replace("test_loss", "")
    positions = [line.find(word) for word in ("accuracy", "loss", "MirroredStrategy")]
    assert -1 not in positions and positions == sorted(positions), line


def test_the_recipes_docstring_keeps_its_line_breaks():
    # Issue 29: `recipes/train.py --help` showed its examples with the `\` line breaks
    # collapsed into runs of spaces (a backslash-newline in a plain string joins the lines).
    doc = ast.get_docstring(ast.parse((REPO / "recipes" / "train.py").read_text()))
    lines = doc.splitlines()
    continued = [i for i, line in enumerate(lines) if line.endswith(" \\")]
    assert len(continued) >= 5
    assert all(lines[i + 1].startswith("        --") for i in continued), doc
