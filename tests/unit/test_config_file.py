"""Configuration files (issue 29, Deliver 3): `--config FILE`, YAML or JSON, for
`tfmulti train`, `diagnose`, `estimate-memory` and recipes/train.py
(tfmulti.config.config_file); flags on the command line override the file; a
bad key or value is one line naming the key and the file, exit 2; a run's
`.tfmulti-run.json` is read back. In-process (the training itself stubbed);
tests/integration/test_train_command.py reruns a real run from its file."""

from __future__ import annotations

import dataclasses
import json

import pytest
from absl import flags

from tfmulti import cli
from tfmulti.config import config_file
from tfmulti.config import flags as config_flags
from tfmulti.config.train_config import TrainConfig
from tfmulti.training import outputs
from tests._util import REPO, cli_main, stub_diagnose

EXAMPLE = REPO / "docs" / "examples" / "train.yaml"

YAML = """\
# a comment
distribution: mirrored
num-virtual-devices: 2
dataset: synthetic
num_examples: 256
epochs: 2
global_batch_size: 64
metrics: [accuracy, auc]
devices: CPU:0,CPU:1
learning_rate: 1e-2
dropout: 0
seed: null
jit_compile: no
steps_per_execution: 4
"""
EXPECTED = {"distribution": "mirrored", "num_virtual_devices": 2, "dataset": "synthetic",
            "num_examples": 256, "epochs": 2, "global_batch_size": 64,
            "metrics": ("accuracy", "auc"), "devices": ("CPU:0", "CPU:1"),
            "learning_rate": 0.01, "dropout": 0.0, "seed": None, "jit_compile": False,
            "steps_per_execution": 4}


METRICS = {"test_accuracy": 0.5, "num_replicas": 1, "distribution": "OneDeviceStrategy"}


@pytest.fixture
def yaml_file(tmp_path):
    path = tmp_path / "run.yaml"
    path.write_text(YAML)
    return str(path)


@pytest.fixture
def trained(monkeypatch):
    """`tfmulti train` with the training stubbed: the configs it was given."""
    import tfmulti.training.train as train_module

    seen = []
    monkeypatch.setattr(train_module, "train", lambda config: seen.append(config) or METRICS)
    monkeypatch.delenv("TF_CONFIG", raising=False)
    return seen


# ------------------------------------------------------------------------- the reader


def test_yaml_values_are_read_as_their_flags(yaml_file):
    values = config_file.read_config_file(yaml_file)
    assert values == EXPECTED
    assert [type(values[k]) for k in ("learning_rate", "dropout", "metrics")] == \
        [float, float, tuple]
    TrainConfig(**values).validate()


def test_json_is_read_too(tmp_path):
    path = tmp_path / "run.json"
    path.write_text(json.dumps({"epochs": 3, "devices": ["CPU:0"], "download": True,
                                "verbose": "auto", "steps-per-epoch": "12"}))
    assert config_file.read_config_file(str(path)) == {
        "epochs": 3, "devices": ("CPU:0",), "download": True, "verbose": "auto",
        "steps_per_epoch": 12}


def test_an_empty_file_sets_nothing(tmp_path):
    path = tmp_path / "empty.yaml"
    path.write_text("# nothing yet\n")
    assert config_file.read_config_file(str(path)) == {}


@pytest.mark.parametrize("text, message", [
    ("epoch: 3\n", r"unknown key 'epoch' in the config file .*bad.yaml; did you mean 'epochs'\?"),
    ("frobnicate: 3\n", r"unknown key 'frobnicate' in the config file .*bad.yaml; the keys are "
                        r"the fields of TrainConfig"),
    ("epochs: five\n", r"'epochs' in the config file .*bad.yaml: expected an integer, got 'five'"),
    ("epochs: 2.5\n", r"'epochs' in the config file .*bad.yaml must be an integer, got 2.5"),
    ("epochs: true\n", r"'epochs' in the config file .*bad.yaml must be an integer, got True"),
    ("epochs: null\n", r"'epochs' in the config file .*bad.yaml must be an integer, got None"),
    ("jit_compile: 1.0\n", r"'jit_compile' .*bad.yaml must be true or false, got 1.0"),
    ("metrics: {a: 1}\n", r"'metrics' in the config file .*bad.yaml: takes metric names or "
                          r"objects, and 1 is neither, got \{'a': 1\}; e.g. accuracy,auc"),
    ("metrics: true\n", r"'metrics' .*bad.yaml must be text, a list or a mapping \(Keras' "
                        r"per-output form\) or null, got True"),
    ("learning_rate: .nan\n", r"'learning_rate' .*bad.yaml must be a number or null, got nan"),
    ("- epochs\n", r"the config file .*bad.yaml must hold a mapping of flag names to values"),
    ("epochs: [\n", r"the config file .*bad.yaml is not valid YAML \(.* at line 2, column 1\)"),
    ("epochs: 2\nepochs-x: 1\n", r"unknown key 'epochs-x'"),
    ("num_stages: 2\nnum-stages: 3\n", r"'num-stages' is set twice in the config file "),
])
def test_a_bad_file_names_the_key_and_the_file(tmp_path, text, message):
    path = tmp_path / "bad.yaml"
    path.write_text(text)
    with pytest.raises(ValueError, match=message):
        config_file.read_config_file(str(path))


def test_a_file_that_cannot_be_read(tmp_path):
    with pytest.raises(ValueError, match=r"cannot read the config file .*missing.yaml \(No such "
                                         r"file or directory\)"):
        config_file.read_config_file(str(tmp_path / "missing.yaml"))
    (tmp_path / "bad.json").write_text("{'epochs': 1}")
    with pytest.raises(ValueError, match=r"the config file .*bad.json is not valid JSON"):
        config_file.read_config_file(str(tmp_path / "bad.json"))


def _record(config: TrainConfig) -> dict:
    """The configuration as a run records it (tfmulti.training.train: JSON values, without
    the fields a rerun may change)."""
    plain = {f.name: list(v) if isinstance(v, tuple) else v
             for f in dataclasses.fields(config) for v in [getattr(config, f.name)]}
    for name in ("verbose", "overwrite", "keep_backup", "discard_unreadable_backup"):
        del plain[name]
    return plain


def test_a_runs_record_is_a_config_file(tmp_path):
    config = TrainConfig(distribution="mirrored", dataset="synthetic", num_examples=128,
                         devices=("CPU:0", "CPU:1"), metrics=("accuracy",), epochs=1,
                         model_dir=str(tmp_path / "run"), verbose=0, overwrite=True)
    outputs.claim(config.model_dir, _record(config), overwrite=False, resumable=False)
    record = tmp_path / "run" / outputs.RUN_FILE
    assert set(json.loads(record.read_text())) == set(config_file.RUN_RECORD_KEYS)
    values = config_file.read_config_file(str(record))
    # Every field but those a rerun may change, which keep their defaults.
    assert TrainConfig(**values) == config.replace(verbose="auto", overwrite=False)
    # An earlier tfmulti's record: the configuration alone.
    record.write_text(json.dumps(_record(config)))
    assert config_file.read_config_file(str(record)) == values


def test_the_documented_example_is_a_valid_configuration():
    values = config_file.read_config_file(str(EXAMPLE))
    TrainConfig(**values).validate()
    assert values["distribution"] == "mirrored" and values["metrics"] == ("accuracy",)
    args = cli.build_parser().parse_args(["train", f"--config={EXAMPLE}"])
    assert args.config == str(EXAMPLE)


# ------------------------------------------------------------------------- the tools


def test_train_takes_the_file_and_the_flags_win(yaml_file, trained, capsys):
    code, err, out = cli_main(["train", "--config", yaml_file, "--epochs=3", "--jit-compile",
                               "--no-download"], capsys)
    assert code == 0, err
    (config,) = trained
    assert config == TrainConfig(**{**EXPECTED, "epochs": 3, "jit_compile": True})
    assert out == outputs.summary_line(METRICS) + "\n"


def test_a_flag_equal_to_its_default_still_wins_over_the_file(yaml_file, trained, capsys):
    assert cli_main(["train", f"--config={yaml_file}", "--epochs=5", "--seed=0"], capsys)[0] == 0
    assert (trained[0].epochs, trained[0].seed) == (5, 0)  # the file: 2 and None


def test_the_recipe_takes_the_file_and_the_flags_win(yaml_file):
    fv = flags.FlagValues()
    config_flags.define_absl_flags(fv)
    fv(config_flags.absl_argv(["train.py", f"--config={yaml_file}", "--epochs=3",
                               "--jit_compile", "--seed=0"], fv))
    assert config_flags.config_from_absl(fv) == TrainConfig(
        **{**EXPECTED, "epochs": 3, "jit_compile": True, "seed": 0})


def test_diagnose_and_estimate_memory_take_what_bears_on_them(yaml_file, monkeypatch, capsys):
    # A whole training configuration (a run's record has every field): diagnose leaves
    # out the fields it does not take (epochs, model_dir, ...), estimate-memory all but its own.
    import tfmulti.memory.estimate as estimate_module

    seen = stub_diagnose(monkeypatch)
    code, err, _ = cli_main(["diagnose", "--config", yaml_file, "--global-batch-size=32",
                             "--json"], capsys)
    assert code == 0, err
    assert seen[0] == TrainConfig(**{**EXPECTED, "epochs": 5, "global_batch_size": 32})

    monkeypatch.setattr(estimate_module, "estimate_for_config",
                        lambda config, **kwargs: seen.append((config, kwargs["given"])) or {})
    code, err, _ = cli_main(["estimate-memory", "--config", yaml_file, "--json"], capsys)
    assert code == 0, err
    config, given = seen[1]
    assert (config.distribution, config.num_virtual_devices, config.global_batch_size) == \
        ("mirrored", 2, 64)
    assert "epochs" not in given and given["dataset"] == "synthetic"


@pytest.mark.parametrize("command", ["train", "diagnose", "estimate-memory"])
@pytest.mark.parametrize("text, message", [
    ("epoch: 3\n", "unknown key 'epoch' in the config file {path}; did you mean 'epochs'?"),
    ("global_batch_size: lots\n", "'global_batch_size' in the config file {path}: expected an "
                                  "integer, got 'lots'."),
])
def test_a_bad_file_is_one_line_and_exit_2(command, text, message, tmp_path, capsys, trained):
    path = tmp_path / "bad.yaml"
    path.write_text(text)
    code, err, out = cli_main([command, f"--config={path}"], capsys)
    assert (code, out, trained) == (2, "", [])
    assert err == [f"tfmulti {command}: error: " + message.format(path=path)]


def test_a_file_value_that_validate_refuses_is_named_as_a_flag(tmp_path, capsys, trained):
    path = tmp_path / "bad.yaml"
    path.write_text("global_batch_size: 0\n")
    code, err, _ = cli_main(["train", f"--config={path}"], capsys)
    assert (code, err) == (2, ["tfmulti train: error: --global_batch_size must be a positive "
                               "integer, got 0."])
