"""One flag style in every tool (issue 29, Deliver 4): the `tfmulti` commands
(argparse) and the recipes (absl) take the same spellings of the same flag.

- dashes or underscores: `--global_batch_size` and `--global-batch-size`;
- `=` or a space before a value;
- booleans: `--x`, `--no_x`, `--no-x`, absl's `--nox`, and `--x=BOOL`;
- help and the docs show one spelling, the field's name with underscores.

Parsed in-process: `cli.build_parser()` for the commands, a fresh absl
`FlagValues` through `absl_argv` (what recipes/_common.py parses) for the recipe.
"""

from __future__ import annotations

import dataclasses

import pytest
from absl import flags

from tfmulti import cli
from tfmulti.config import flags as config_flags
from tfmulti.config.train_config import TrainConfig, _field
from tests._util import cli_main, stub_diagnose

# The tools that take the training flags, each as a function argv -> TrainConfig.


def _train(argv):
    return config_flags.config_from_args(cli.build_parser().parse_args(["train", *argv]))


def _diagnose(argv):
    return config_flags.config_from_args(cli.build_parser().parse_args(["diagnose", *argv]))


def _estimate_memory(argv):
    args = cli.build_parser().parse_args(["estimate-memory", *argv])
    return TrainConfig(**{k: v for k, v in vars(args).items() if k in cli.ESTIMATE_FIELDS})


def _recipe(argv):
    fv = flags.FlagValues()
    config_flags.define_absl_flags(fv)
    rest = fv(config_flags.absl_argv(["train.py", *argv], fv))
    assert rest == ["train.py"], rest
    return config_flags.config_from_absl(fv)


TOOLS = pytest.mark.parametrize("tool", [_train, _diagnose, _recipe, _estimate_memory],
                                ids=["train", "diagnose", "recipe", "estimate-memory"])


@TOOLS
@pytest.mark.parametrize("argv", [
    ["--global_batch_size=64"], ["--global-batch-size=64"], ["--global_batch_size", "64"],
    ["--global-batch-size", "64"]])
def test_dashes_or_underscores_and_equals_or_space(tool, argv):
    assert tool(argv).global_batch_size == 64


@TOOLS
@pytest.mark.parametrize("argv, value", [
    (["--download"], True), (["--download=true"], True), (["--download=yes"], True),
    (["--download=false"], False), (["--download", "--no_download"], False),
    (["--download", "--no-download"], False), (["--download", "--nodownload"], False)])
def test_booleans_in_every_spelling(tool, argv, value):
    assert tool(argv).download is value


@pytest.mark.parametrize("tool", [_train, _diagnose, _recipe], ids=["train", "diagnose", "recipe"])
@pytest.mark.parametrize("flag", ["--nojit_compile", "--no_jit_compile", "--no-jit_compile",
                                  "--no-jit-compile", "--nojit-compile"])
def test_nojit_compile_is_taken_by_diagnose_as_by_the_recipe(tool, flag):
    # Issue 29: `tfmulti diagnose --nojit_compile` was refused where recipes/train.py took it.
    assert tool(["--jit-compile", flag]).jit_compile is False


@pytest.mark.parametrize("argv", [["--nojit_compile"], ["--num-virtual-devices", "2"],
                                  ["--no-download"], ["--jit-compile=false"]])
def test_diagnose_takes_the_spellings_end_to_end(argv, capsys, monkeypatch):
    # Through cli.main: parsed, validated, then the diagnosis (stubbed) gets the config.
    seen = stub_diagnose(monkeypatch)
    code, err, _ = cli_main(["diagnose", "--dataset=synthetic", *argv, "--json"], capsys)
    assert code == 0, err
    assert len(seen) == 1


@pytest.mark.parametrize("argv, attribute, value", [
    (["launch", "--num-workers", "3", "--", "python"], "num_workers", 3),
    (["launch", "--no-isolate", "--", "python"], "isolate", False),
    (["launch", "--no_isolate", "--", "python"], "isolate", False),
    (["launch", "--noisolate", "--", "python"], "isolate", False),
    (["launch", "--isolate=false", "--", "python"], "isolate", False),
    (["launch", "--pin-cpus", "--", "python"], "pin_cpus", True),
    (["launch", "--max-restarts=2", "--", "python"], "max_restarts", 2),
    (["env", "--num-virtual-devices=3", "--json"], "num_virtual_devices", 3),
    (["env", "--json=false"], "json", False),
    (["diagnose", "--no-measure"], "measure", False),
    (["diagnose", "--no_prefetch", "--no_cache"], "prefetch", False),
    (["diagnose", "--no_prefetch", "--no_cache"], "cache", False),
    (["diagnose"], "cache", None),  # the diagnosis' own default
    (["export", "--model-dir", "a", "--output=b", "--overwrite"], "model_dir", "a"),
    (["prepare-data", "--data-dir", "d"], "data_dir", "d"),
    (["estimate-memory", "--num-devices", "2"], "num_devices", 2),
])
def test_the_commands_own_options_take_the_same_style(argv, attribute, value):
    assert getattr(cli.build_parser().parse_args(argv), attribute) == value


def test_a_worker_command_is_left_as_written():
    # After `--`, or from the first word of the worker's command line, nothing is rewritten.
    args = cli.build_parser().parse_args(
        ["launch", "--isolate=false", "python", "x.py", "--isolate=true", "--num-workers=1"])
    assert args.worker_command == ["python", "x.py", "--isolate=true", "--num-workers=1"]
    assert args.isolate is False and args.num_workers == 2
    fv = flags.FlagValues()
    config_flags.define_absl_flags(fv)
    assert config_flags.absl_argv(["train.py", "--no-remat", "--", "--no-remat"], fv) == \
        ["train.py", "--noremat", "--", "--no-remat"]


@pytest.mark.parametrize("argv, message", [
    (["train", "--jit_compile=maybe"],
     "tfmulti train: error: argument --jit_compile: expected true or false, got 'maybe'"),
    (["train", "--no-jit-compile=true"],
     "tfmulti train: error: argument --no-jit-compile: takes no value; write --no-jit-compile "
     "alone, or --jit_compile=true|false"),
    (["train", "--global-batch-size=many"],
     "tfmulti train: error: argument --global_batch_size: expected an integer, got 'many'"),
    (["launch", "--num-workers=two", "--", "python"],
     "tfmulti launch: error: argument --num_workers: invalid int value: 'two'"),
])
def test_a_bad_value_is_one_line_in_the_shown_spelling(argv, message, capsys):
    code, err, out = cli_main(argv, capsys)
    assert (code, err, out) == (2, [message], "")


def test_help_shows_one_spelling(capsys):
    for command in ("train", "diagnose", "estimate-memory", "launch", "env", "export"):
        code, _, out = cli_main([command, "--help"], capsys)
        assert code == 0
        text = " ".join(out.split())
        for action in cli._subcommands(cli.build_parser())[command]._actions:
            shown = getattr(action, "shown", action.option_strings)
            for hidden in set(action.option_strings) - set(shown):
                assert f"{hidden} " not in text and f"{hidden}," not in text, (command, hidden)
    code, _, out = cli_main(["train", "--help"], capsys)
    text = " ".join(out.split())
    assert "--jit_compile, --no_jit_compile" in text and "--global_batch_size GLOBAL_BATCH_SIZE" \
        in text


@dataclasses.dataclass
class _Logging(TrainConfig):
    """Fields of the kinds helper D's logging fields have, added as any field is."""

    loud: bool = _field(True, "Say so.")
    hooks: str | None = _field(None, "module:function.")
    step_range: str | tuple | None = _field(None, "A,B.")


def test_new_fields_get_every_spelling_without_special_cases():
    parser = config_flags.ArgumentParser(prog="p")
    config_flags.add_arguments(parser, _Logging)

    def parse(*argv):
        return config_flags.config_from_args(parser.parse_args(argv), _Logging)

    assert parse().loud is True
    assert parse("--no-loud").loud is False and parse("--no_loud").loud is False
    assert parse("--loud=false").loud is False and parse("--noloud").loud is False
    assert parse("--hooks", "m:f").hooks == "m:f"
    assert parse("--step-range=10,12").step_range == "10,12"
    assert parse("--step_range", "10,12").step_range == "10,12"

    fv = flags.FlagValues()
    config_flags.define_absl_flags(fv, _Logging)
    fv(config_flags.absl_argv(["r", "--no-loud", "--step-range", "1,2"], fv))
    config = config_flags.config_from_absl(fv, _Logging)
    assert (config.loud, config.step_range) == (False, "1,2")
