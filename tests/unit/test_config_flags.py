"""tfmulti.config.flags: absl and argparse flags generated from the TrainConfig
fields, the configs made from them, and errors restated in flag names.

The acceptance test of "a new option is one field": a field added to a copy
of tfmulti/config/train_config.py shows up, with its default and help, as a flag of
recipes/train.py and of `tfmulti diagnose` with no other edit.
"""

from __future__ import annotations

import argparse
import dataclasses

import pytest
from absl import flags

from tfmulti.config import flags as config_flags
from tfmulti.config.train_config import TrainConfig, _field

FIELD_NAMES = [f.name for f in dataclasses.fields(TrainConfig)]


@dataclasses.dataclass
class _Frobnicating(TrainConfig):
    """TrainConfig with one more field, as a user (or the next feature) adds it."""

    frobnicate: int = _field(7, "Frobnicate this many times.")


# Every field away from its default (jit_compile=True with hybrid is invalid,
# but a round trip does not validate).
SAMPLE = TrainConfig(
    distribution="hybrid", num_virtual_devices=4, devices=("CPU:0", "CPU:1", "CPU:2", "CPU:3"),
    cross_device_ops="reduce_to_one", dataset="synthetic", data_dir="/data/tfds", download=True,
    num_examples=1024, validation_split=0.25, model="cnn", dropout=0.1, epochs=3, steps_per_epoch=8,
    global_batch_size=64, learning_rate=0.01, lr_scaling="sqrt", base_batch_size=128,
    warmup_epochs=0.5, optimizer="sgd", loss="huber", metrics=("auc", "mae"),
    weighted_metrics={"priority": ("auc",), "department": ("accuracy", "mae")},
    loss_weights={"priority": 1.0, "department": 0.2}, class_weight={0: 1.0, 1: 25.0},
    task="regression", accumulate_steps=2, zero_stage=2, shard_embeddings=True,
    input_sharding="files",
    data_service="grpc://node1:5050", data_service_timeout=60.0, sparse_updates="lazy",
    cluster_resolver="slurm",
    overwrite=True, seed=7, steps_per_execution=4, num_stages=3,
    num_microbatches=2, num_replicas=4, partition="flops", remat=True, tensor_parallel=2,
    seq_len=64, d_model=96, num_heads=6, num_layers=3, device_memory_mb=512.5,
    mixed_precision="bfloat16", jit_compile=True, backup_dir="/tmp/backup",
    backup_every_steps=4, keep_backup=True, discard_unreadable_backup=True, model_dir="/tmp/model",
    verbose=2, tensorboard=False, profile_steps="2,3", callbacks="tests.own_model:callbacks")


def _form_text(value) -> str:
    """A tuple or dict of Keras' per-output forms as flag text (`keras_forms.parse`'s
    inverse): a dict's items NAME=VALUE, several values of one name repeated."""
    if isinstance(value, dict):
        return ",".join(f"{k}={item}" for k, v in value.items()
                        for item in (v if isinstance(v, (list, tuple)) else (v,)))
    return ",".join(map(str, value))


def _flags_for(config, *, absl_bools: bool) -> list[str]:
    """`config`'s non-default fields as `--name=value` flags."""
    out = []
    for f in dataclasses.fields(config):
        value = getattr(config, f.name)
        if value == f.default:
            continue
        if isinstance(value, bool):
            out.append(f"--{'' if value else 'no'}{f.name}" if absl_bools
                       else f"--{f.name}={str(value).lower()}")
        elif isinstance(value, (tuple, dict)):
            out.append(f"--{f.name}={_form_text(value)}")
        else:
            out.append(f"--{f.name}={value}")
    return out


def test_the_sample_sets_every_field():
    defaults = TrainConfig()
    assert [n for n in FIELD_NAMES if getattr(SAMPLE, n) == getattr(defaults, n)] == []


# ------------------------------------------------------------------------- field specs


def test_every_field_has_a_spec_in_declaration_order():
    specs = config_flags.field_specs()
    assert [s.name for s in specs] == FIELD_NAMES
    for spec, f in zip(specs, dataclasses.fields(TrainConfig)):
        assert spec.default == f.default and spec.help == f.metadata["help"]
        assert spec.kind in ("bool", "int", "float", "str", "list", "int_or_str", "form")
        assert spec.choices == (tuple(f.metadata["choices"]) if "choices" in f.metadata
                                else None)


@pytest.mark.parametrize("name, kind, optional", [
    ("distribution", "str", False), ("num_virtual_devices", "int", False),
    ("devices", "list", True), ("data_dir", "str", True), ("download", "bool", False),
    ("num_examples", "int", True), ("dropout", "float", False), ("seed", "int", True),
    ("steps_per_execution", "int_or_str", False), ("verbose", "int_or_str", False),
    ("backup_every_steps", "int", True), ("learning_rate", "float", True),
    ("loss", "form", True), ("metrics", "form", True), ("class_weight", "form", True),
])
def test_field_kinds(name, kind, optional):
    (spec,) = config_flags.field_specs(only=[name])
    assert (spec.kind, spec.optional) == (kind, optional)


def test_only_and_exclude():
    assert [s.name for s in config_flags.field_specs(only=("epochs", "seed"))] == \
        ["epochs", "seed"]  # declaration order, not the order asked
    names = [s.name for s in config_flags.field_specs(exclude=("epochs", "model_dir"))]
    assert names == [n for n in FIELD_NAMES if n not in ("epochs", "model_dir")]


@pytest.mark.parametrize("name, text, expected", [
    ("download", "true", True), ("download", "Yes", True), ("download", "1", True),
    ("download", "on", True), ("download", "false", False), ("download", "NO", False),
    ("download", "0", False), ("download", "off", False),
    ("epochs", "12", 12), ("learning_rate", "1e-3", 1e-3), ("dataset", "mnist", "mnist"),
    ("devices", "CPU:0, CPU:1,", ("CPU:0", "CPU:1")), ("devices", "none", None),
    ("num_examples", "None", None), ("data_dir", "", None), ("seed", "none", None),
    ("steps_per_execution", "4", 4), ("steps_per_execution", " +8 ", 8),
    ("steps_per_execution", "auto", "auto"), ("verbose", "2", 2), ("verbose", "auto", "auto"),
])
def test_spec_parse(name, text, expected):
    (spec,) = config_flags.field_specs(only=[name])
    value = spec.parse(text)
    assert value == expected and type(value) is type(expected)


@pytest.mark.parametrize("name, text, message", [
    ("download", "maybe", "expected true or false, got 'maybe'"),
    ("epochs", "five", "expected an integer, got 'five'"),
    ("epochs", "none", "expected an integer, got 'none'"),  # epochs cannot be None
    ("learning_rate", "fast", "expected a number, got 'fast'"),
])
def test_spec_parse_errors(name, text, message):
    (spec,) = config_flags.field_specs(only=[name])
    with pytest.raises(argparse.ArgumentTypeError, match=message):
        spec.parse(text)


def test_a_field_without_a_flag_type_is_refused():
    @dataclasses.dataclass
    class WithDict(TrainConfig):
        extra: dict | None = _field(None, "No flag can say this.")

    with pytest.raises(TypeError, match=r"no flag type for"):
        config_flags.field_specs(WithDict)


# -------------------------------------------------------------------------------- absl


def _absl(argv=(), config_cls=TrainConfig, **kwargs) -> flags.FlagValues:
    fv = flags.FlagValues()
    config_flags.define_absl_flags(fv, config_cls, **kwargs)
    fv(["prog", *argv])
    return fv


def test_absl_flag_types_defaults_and_help():
    fv = _absl()
    assert {n: fv[n].flag_type() for n in ("epochs", "learning_rate", "jit_compile", "devices",
                                           "distribution", "steps_per_execution", "verbose",
                                           "data_dir", "seed", "num_examples")} == {
        "epochs": "int", "learning_rate": "float", "jit_compile": "bool",
        "devices": "comma separated list of strings", "distribution": "string enum",
        "steps_per_execution": "string", "verbose": "string", "data_dir": "string",
        "seed": "int", "num_examples": "int"}
    specs = {s.name: s for s in config_flags.field_specs()}
    for name in FIELD_NAMES:
        spec, flag = specs[name], fv[name]
        assert flag.help.endswith(spec.help), name  # enums prefix "<a|b|...>: "
        if spec.kind == "int_or_str":
            assert flag.default == str(spec.default), name  # "auto" or an integer
        else:
            assert flag.default == spec.default, name
    assert fv["distribution"].help.startswith(
        "<auto|one_device|mirrored|multi_worker|pipeline|hybrid>: ")


def test_absl_defaults_are_the_config_defaults():
    assert config_flags.config_from_absl(_absl()) == TrainConfig()


def test_absl_round_trip_of_every_field():
    argv = _flags_for(SAMPLE, absl_bools=True)
    assert len(argv) == len(FIELD_NAMES)
    config = config_flags.config_from_absl(_absl(argv))
    assert config == SAMPLE
    assert isinstance(config.devices, tuple) and config.steps_per_execution == 4
    assert config.verbose == 2  # an "auto"-or-integer flag gives an int


@pytest.mark.parametrize("argv, field, expected", [
    (["--jit_compile"], "jit_compile", True),
    (["--jit_compile=false"], "jit_compile", False),
    (["--nojit_compile"], "jit_compile", False),
    (["--steps_per_execution=auto"], "steps_per_execution", "auto"),
    (["--steps_per_execution=16"], "steps_per_execution", 16),
    (["--verbose=0"], "verbose", 0),
    (["--devices=CPU:1"], "devices", ("CPU:1",)),
    (["--num_examples=64"], "num_examples", 64),
])
def test_absl_values(argv, field, expected):
    value = getattr(config_flags.config_from_absl(_absl(argv)), field)
    assert value == expected and type(value) is type(expected)


@pytest.mark.parametrize("argv", [["--distribution=bogus"], ["--epochs=five"],
                                  ["--learning_rate=fast"], ["--jit_compile=maybe"]])
def test_absl_refuses_what_its_parsers_can_tell(argv):
    fv = flags.FlagValues()
    config_flags.define_absl_flags(fv)
    with pytest.raises(flags.IllegalFlagValueError):
        fv(["prog", *argv])


def test_absl_leaves_the_rules_to_validate():
    # Values absl takes as text are checked by TrainConfig.validate, like in Python.
    config = config_flags.config_from_absl(_absl(["--verbose=loud", "--epochs=0",
                                                  "--steps_per_execution=many"]))
    assert (config.verbose, config.epochs, config.steps_per_execution) == ("loud", 0, "many")
    for field, message in [("verbose", r"`verbose` must be one of \['auto', 0, 1, 2\], got 'loud'"),
                           ("epochs", r"`epochs` must be a positive integer, got 0"),
                           ("steps_per_execution", r"`steps_per_execution` must be 'auto' or a "
                                                   r"positive integer, got 'many'")]:
        with pytest.raises(ValueError, match=message):
            TrainConfig(**{field: getattr(config, field)}).validate()


# Settings under which each count field is used (and so checked).
_COUNT_CONTEXT = {
    **dict.fromkeys(("num_stages", "num_microbatches", "num_replicas"),
                    ("--distribution=hybrid",)),
    "tensor_parallel": ("--distribution=pipeline", "--model=transformer"),
    **dict.fromkeys(("seq_len", "d_model", "num_heads", "num_layers"), ("--model=transformer",)),
    "num_examples": ("--dataset=synthetic",),
    "backup_every_steps": ("--backup_dir=/tmp/tfmulti-test-unused",),
}
_INT_FLAGS = [spec.name for spec in config_flags.field_specs() if spec.kind == "int"]


def _flag_error(argv) -> str:
    """The one line recipes/train.py prints for `argv` (its flags, then validate)."""
    with pytest.raises(ValueError) as raised:
        config_flags.config_from_absl(_absl(argv)).validate()
    return config_flags.flag_message(str(raised.value))


@pytest.mark.parametrize("name", _INT_FLAGS)
def test_every_integer_flag_of_train_has_a_range(name):
    # Issue 27: a huge count passed validate and then hung or exhausted memory once
    # TensorFlow had started (num_virtual_devices, num_stages, num_examples, d_model...).
    message = _flag_error([*_COUNT_CONTEXT.get(name, ()), f"--{name}={10**12}"])
    assert message.startswith(f"--{name} must be an integer from "), message
    assert f"got {10**12}" in message


def test_seed_flag_range():
    # Issue 27: --seed=-5 failed only after TensorFlow started (in NumPy's seeding).
    assert _flag_error(["--seed=-5"]) == \
        "--seed must be an integer from 0 to 4294967295 (or None), got -5."
    assert _flag_error([f"--seed={2**32}"]).startswith("--seed must be an integer from 0 to ")
    assert config_flags.config_from_absl(_absl([f"--seed={2**32 - 1}"])).seed == 2**32 - 1


def test_absl_exclude_and_overrides():
    fv = _absl(["--global_batch_size=32"], exclude=("epochs", "model_dir"))
    assert "epochs" not in fv and "model_dir" not in fv and "global_batch_size" in fv
    config = config_flags.config_from_absl(fv, exclude=("epochs", "model_dir"), seed=5)
    assert (config.epochs, config.model_dir) == (5, None)  # the field defaults
    assert (config.global_batch_size, config.seed) == (32, 5)
    assert config_flags.config_from_absl(fv, exclude=("epochs", "model_dir"),
                                         global_batch_size=8).global_batch_size == 8


# ---------------------------------------------------------------------------- argparse


def _parser(config_cls=TrainConfig, **kwargs) -> argparse.ArgumentParser:
    parser = config_flags.ArgumentParser(prog="prog")
    config_flags.add_arguments(parser, config_cls, **kwargs)
    return parser


def _help(parser) -> str:
    return " ".join(parser.format_help().split())


def test_argparse_defaults_are_the_config_defaults():
    assert config_flags.config_from_args(_parser().parse_args([])) == TrainConfig()


def test_argparse_round_trip_of_every_field():
    argv = _flags_for(SAMPLE, absl_bools=False)
    assert len(argv) == len(FIELD_NAMES)
    assert config_flags.config_from_args(_parser().parse_args(argv)) == SAMPLE


@pytest.mark.parametrize("argv, field, expected", [
    (["--download"], "download", True),
    (["--download=false"], "download", False),
    (["--download", "--epochs=2"], "download", True),
    (["--devices=CPU:0,CPU:1"], "devices", ("CPU:0", "CPU:1")),
    (["--devices=none"], "devices", None),
    (["--seed=none"], "seed", None),
    (["--steps_per_execution=8"], "steps_per_execution", 8),
    (["--steps_per_execution=AUTO"], "steps_per_execution", "AUTO"),  # validate reads it
    (["--verbose=1"], "verbose", 1),
])
def test_argparse_values(argv, field, expected):
    value = getattr(config_flags.config_from_args(_parser().parse_args(argv)), field)
    assert value == expected and type(value) is type(expected)


@pytest.mark.parametrize("argv, message", [
    (["--epochs=abc"], "argument --epochs: expected an integer, got 'abc'"),
    (["--download=maybe"], "argument --download: expected true or false, got 'maybe'"),
    (["--learning_rate=fast"], "argument --learning_rate: expected a number, got 'fast'"),
])
def test_argparse_type_errors(argv, message, capsys):
    with pytest.raises(SystemExit) as info:
        _parser().parse_args(argv)
    assert info.value.code == 2
    assert message in capsys.readouterr().err


def test_argparse_help_shows_each_fields_help_and_default():
    text = _help(_parser())
    squashed = "".join(text.split())  # argparse may wrap a line at a hyphen
    for spec in config_flags.field_specs():
        shown = ",".join(spec.default) if spec.kind == "list" and spec.default else spec.default
        assert f"--{spec.name}" in text
        assert "".join(f"{spec.help} (default: {shown})".split()) in squashed, spec.name
    assert "--download, --no_download" in text and "--epochs EPOCHS" in text
    assert "--no-download" not in text and "--global-batch-size" not in text  # not shown


def test_argparse_only_exclude_defaults_and_suppress():
    parser = _parser(only=("distribution", "global_batch_size"),
                     defaults={"distribution": "one_device"})
    assert "(default: one_device)" in _help(parser)
    args = parser.parse_args([])
    assert vars(args) == {"config": None, "distribution": "one_device", "global_batch_size": 256}
    assert config_flags.config_from_args(args).distribution == "one_device"
    with pytest.raises(SystemExit):
        parser.parse_args(["--epochs=2"])  # not added

    quiet = _parser(exclude=("epochs",), suppress_defaults=True)
    assert vars(quiet.parse_args([])) == {}  # left out: absent, the caller's defaults apply
    assert vars(quiet.parse_args(["--seed=3"])) == {"seed": 3}
    assert "(default: 256)" in _help(quiet)
    assert "--epochs" not in _help(quiet)


def test_config_from_args_takes_only_fields_and_overrides():
    namespace = argparse.Namespace(global_batch_size=32, json=True, func=print)
    config = config_flags.config_from_args(namespace, epochs=1)
    assert (config.global_batch_size, config.epochs) == (32, 1)


def test_argparse_help_with_percent_and_list_defaults():
    @dataclasses.dataclass
    class Custom(TrainConfig):
        devices: tuple[str, ...] | None = _field(("CPU:0", "CPU:1"), "Devices, 100% of them.")

    text = _help(_parser(Custom))
    assert "Devices, 100% of them. (default: CPU:0,CPU:1)" in text
    assert config_flags.config_from_args(_parser(Custom).parse_args([])).devices == \
        ("CPU:0", "CPU:1")
    assert _absl(config_cls=Custom)["devices"].value == ["CPU:0", "CPU:1"]


# ---------------------------------------------------------------------------- messages


@pytest.mark.parametrize("message, expected", [
    ("`global_batch_size` (10) must be divisible by 4",
     "--global_batch_size (10) must be divisible by 4"),
    ("`backup_every_steps` needs `backup_dir`; set `backup_dir` too.",
     "--backup_every_steps needs --backup_dir; set --backup_dir too."),
    ("use mixed_precision='bfloat16' on CPUs", "use --mixed_precision='bfloat16' on CPUs"),
    ("`foo` and foo=1 are not fields", "`foo` and foo=1 are not fields"),
    ("tf.model=1, a-model=2 and model=3", "tf.model=1, a-model=2 and --model=3"),
    ("`plot` takes a .png file name", "`plot` takes a .png file name"),
    ("", ""),
])
def test_flag_message(message, expected):
    assert config_flags.flag_message(message) == expected


def test_flag_message_extra_names_and_config_class():
    assert config_flags.flag_message("`plot` takes a .png, plot=x", extra_names=("plot",)) == \
        "--plot takes a .png, --plot=x"
    assert config_flags.flag_message("`frobnicate` must be 7") == "`frobnicate` must be 7"
    assert config_flags.flag_message("`frobnicate` must be 7", _Frobnicating) == \
        "--frobnicate must be 7"


# ---------------------------------------------------- a new field is a flag everywhere


def test_a_new_field_parses_in_process():
    fv = _absl(["--frobnicate=3"], _Frobnicating)
    assert fv["frobnicate"].default == 7 and fv["frobnicate"].help == "Frobnicate this many times."
    config = config_flags.config_from_absl(fv, _Frobnicating)
    assert isinstance(config, _Frobnicating) and config.frobnicate == 3
    config.validate()  # the inherited rules still apply
    assert config_flags.config_from_absl(_absl([], _Frobnicating), _Frobnicating).frobnicate == 7

    parser = _parser(_Frobnicating)
    assert "--frobnicate FROBNICATE Frobnicate this many times. (default: 7)" in _help(parser)
    config = config_flags.config_from_args(parser.parse_args(["--frobnicate=3"]), _Frobnicating)
    assert isinstance(config, _Frobnicating) and config.frobnicate == 3
