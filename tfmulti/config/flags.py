"""Command-line flags generated from the fields of `tfmulti.config.train_config.TrainConfig`.

The recipes' absl flags (`define_absl_flags`, `config_from_absl`) and the
`tfmulti` command's argparse options (`add_arguments`, `config_from_args`)
are made from the dataclass fields: name, type, default, help text and
choices come from the field, so an option is declared once. Library errors
name Python arguments (`` `global_batch_size` ``); `flag_message` restates
them in flag names (`--global_batch_size`) for the command-line surfaces.

Every tool takes one flag style: the field's name with underscores
(`--global_batch_size=64`, shown in help and used in the docs) or with dashes
(`--global-batch-size 64`), `=` or a space before the value; a boolean as
`--jit_compile` / `--no_jit_compile` (also `--no-jit-compile`, absl's
`--nojit_compile`, and `--jit_compile=false`). `ArgumentParser` and
`BooleanFlag` give argparse these spellings, `absl_argv` gives them to absl.
`--config FILE` reads the values from a YAML or JSON file
(`tfmulti.config.config_file`); flags on the command line override it.

Pure Python (absl and argparse; no TensorFlow), so flags are checked before
TensorFlow starts.

Example:
    >>> import argparse
    >>> from tfmulti.config import flags as config_flags
    >>> parser = argparse.ArgumentParser()
    >>> config_flags.add_arguments(parser, only=("distribution", "global_batch_size"))
    >>> config = config_flags.config_from_args(parser.parse_args(["--global-batch-size", "64"]))
    >>> config.global_batch_size, config.distribution
    (64, 'auto')
    >>> config_flags.flag_message("`global_batch_size` (10) must be divisible by 4")
    '--global_batch_size (10) must be divisible by 4'
"""

from __future__ import annotations

import argparse
import copy
import dataclasses
import re
import sys
from collections.abc import Iterable

from tfmulti.config.config_file import read_config_file
from tfmulti.config.fields import FieldSpec, field_specs, int_or_text
from tfmulti.config.train_config import TrainConfig

__all__ = ["ArgumentParser", "BooleanFlag", "CONFIG_HELP", "HelpFormatter", "absl_argv",
           "add_arguments", "apply_config_file", "config_from_absl", "config_from_args",
           "define_absl_flags", "field_specs", "flag_message", "negative_spellings",
           "option_spellings"]

CONFIG_HELP = ("a YAML or JSON file of training flags' values (name: value), such as "
               "<model_dir>/.tfmulti-run.json to run a run again; flags given on the "
               "command line override it")


# ------------------------------------------------------------------------------- absl


def define_absl_flags(flag_values=None, config_cls=TrainConfig, *,
                      exclude: Iterable[str] = (), config_file: bool = True) -> None:
    """Defines one absl flag per field of `config_cls` (into `flag_values`,
    default `absl.flags.FLAGS`), and `--config FILE` unless `config_file` is
    False. Values are checked by `TrainConfig.validate`, not by absl (one set
    of rules for Python and flags)."""
    from absl import flags

    fv = flags.FLAGS if flag_values is None else flag_values
    for spec in field_specs(config_cls, exclude=exclude):
        default = spec.default
        if spec.kind == "bool":
            flags.DEFINE_boolean(spec.name, default, spec.help, flag_values=fv)
        elif spec.kind == "int":
            flags.DEFINE_integer(spec.name, default, spec.help, flag_values=fv)
        elif spec.kind == "float":
            flags.DEFINE_float(spec.name, default, spec.help, flag_values=fv)
        elif spec.kind == "list":
            flags.DEFINE_list(spec.name, list(default) if default else None, spec.help,
                              flag_values=fv)
        elif spec.choices and spec.kind == "str":
            flags.DEFINE_enum(spec.name, default, list(spec.choices), spec.help,
                              flag_values=fv)
        else:  # str and "auto"-or-integer fields
            flags.DEFINE_string(spec.name, None if default is None else str(default),
                                spec.help, flag_values=fv)
    if config_file:
        flags.DEFINE_string("config", None, CONFIG_HELP[0].upper() + CONFIG_HELP[1:] + ".",
                            flag_values=fv)


def config_from_absl(flag_values=None, config_cls=TrainConfig, *,
                     exclude: Iterable[str] = (), **overrides):
    """A `config_cls` from parsed absl flags: a flag given on the command line,
    else the `--config` file's value, else the flag's default (fields in
    `exclude` keep their defaults; `overrides` win).

    Raises:
        ValueError: a `--config` file that cannot be read, or with a key that is
            not a field or a value of the wrong type.
    """
    from absl import flags

    fv = flags.FLAGS if flag_values is None else flag_values
    path = fv["config"].value if "config" in fv else None
    from_file = read_config_file(path, config_cls) if path is not None else {}
    values = {}
    for spec in field_specs(config_cls, exclude=exclude):
        value = fv[spec.name].value
        if spec.kind == "list":
            value = tuple(value) if value else None
        elif spec.kind == "int_or_str":
            value = int_or_text(value)
        elif spec.kind == "form" and isinstance(value, str):
            try:
                value = spec.parse(value)
            except argparse.ArgumentTypeError as e:
                raise ValueError(f"--{spec.name}: {e}.") from None
        values[spec.name] = value
        if spec.name in from_file and not fv[spec.name].present:
            values[spec.name] = from_file[spec.name]
    return config_cls(**{**values, **overrides})


def absl_argv(argv: list[str], flag_values=None) -> list[str]:
    """`argv` in the spellings absl parses, so that a recipe takes the flag style
    of every tool: `--num-workers` -> `--num_workers`, `--no_x` or `--no-x`
    -> absl's `--nox` for a boolean `x`, and `--x=yes` (any word `BooleanFlag`
    takes) -> `--x` or `--nox`. Arguments after `--`, and names that
    are not flags of `flag_values` (default `absl.flags.FLAGS`), are left as
    they are (absl reports those).

    Example:
        >>> from absl import flags
        >>> fv = flags.FlagValues()
        >>> define_absl_flags(fv)
        >>> absl_argv(["train.py", "--global-batch-size", "64", "--no-jit-compile",
        ...            "--remat=yes", "--", "--no-remat"], fv)[1:]
        ['--global_batch_size', '64', '--nojit_compile', '--remat', '--', '--no-remat']
    """
    from absl import flags

    fv = flags.FLAGS if flag_values is None else flag_values
    out = list(argv[:1])
    for index, arg in enumerate(argv[1:], start=1):
        if arg == "--":
            return out + list(argv[index:])
        name, eq, value = arg[2:].partition("=")
        name = name.replace("-", "_")
        negated = next((name[len(p):] for p in ("no_", "no") if name.startswith(p)
                        and name[len(p):] in fv and fv[name[len(p):]].boolean), None)
        if not arg.startswith("--") or not name:
            out.append(arg)
        elif name in fv and fv[name].boolean and eq:  # --x=yes as the argparse tools read it
            try:
                out.append(f"--{'' if _parse_bool(value) else 'no'}{name}")
            except argparse.ArgumentTypeError:
                out.append(f"--{name}{eq}{value}")  # absl says what is wrong
        elif name in fv:
            out.append(f"--{name}{eq}{value}")
        else:
            out.append(f"--no{negated}{eq}{value}" if negated else arg)
    return out


# --------------------------------------------------------------------------- argparse


def option_spellings(name: str) -> list[str]:
    """The option strings of `name`: with underscores (shown) and with dashes."""
    name = name.lstrip("-").replace("-", "_")
    return list(dict.fromkeys((f"--{name}", f"--{name.replace('_', '-')}")))


def negative_spellings(name: str) -> list[str]:
    """The option strings that set boolean `name` to False: `--no_name` (shown),
    `--no-name` (also all dashes) and absl's `--noname`."""
    under = name.lstrip("-").replace("-", "_")
    dashed = under.replace("_", "-")
    return list(dict.fromkeys(f"--{form}" for form in (
        f"no_{under}", f"no-{under}", f"no-{dashed}", f"no{under}", f"no{dashed}")))


class BooleanFlag(argparse.Action):
    """A boolean option in every spelling the tools take: `--x` (True),
    `--no_x`, `--no-x` or absl's `--nox` (False), dashes for underscores in
    each; and, in an `ArgumentParser`, `--x=BOOL` (true/false, yes/no, on/off,
    1/0). Help shows `--x, --no_x`. A `default` of None leaves the choice to
    the program."""

    def __init__(self, option_strings, dest, default=None, required=False,
                 help=None):  # noqa: A002  (argparse's name)
        positives = list(dict.fromkeys(
            s for o in option_strings
            for s in (option_spellings(o) if o.startswith("--") else [o])))
        long = [o for o in positives if o.startswith("--")]
        negatives = [n for n in negative_spellings(long[0]) if n not in positives] if long else []
        super().__init__(positives + negatives, dest, nargs=0, default=default,
                         required=required, help=help)
        self.negatives = frozenset(negatives)
        self.shown = [positives[0], *negatives[:1]]

    def __call__(self, parser, namespace, values, option_string=None):
        setattr(namespace, self.dest, option_string not in self.negatives)


class HelpFormatter(argparse.HelpFormatter):
    """Help that shows each option's main spellings (an action's `shown`):
    `--num_workers NUM_WORKERS` without `--num-workers`, and a `BooleanFlag` as
    `--x, --no_x`."""

    def _format_action_invocation(self, action):
        shown = getattr(action, "shown", None)
        if not shown:
            return super()._format_action_invocation(action)
        action = copy.copy(action)
        action.option_strings = list(shown)
        return super()._format_action_invocation(action)


class ArgumentParser(argparse.ArgumentParser):
    """`argparse.ArgumentParser` in the tools' flag style: every `--a_b` option
    also takes `--a-b` (help shows the first); a `BooleanFlag` also takes
    `--x=BOOL`; help shows a `BooleanFlag` as `--x, --no_x` (`HelpFormatter`)."""

    def __init__(self, *args, **kwargs):
        kwargs.setdefault("formatter_class", HelpFormatter)
        super().__init__(*args, **kwargs)

    def add_argument(self, *names, **kwargs):
        if not names or not all(n.startswith("--") for n in names):
            return super().add_argument(*names, **kwargs)
        spelled = list(dict.fromkeys(s for n in names for s in option_spellings(n)))
        action = super().add_argument(*spelled, **kwargs)
        if not getattr(action, "shown", None):
            action.shown = [names[0]]
        return action

    def error(self, message: str):
        super().error(self.shown_names(message))

    def shown_names(self, message: str) -> str:
        """argparse's `message` with each option named by its shown spellings
        (argparse names an option by all of them: `--num_workers/--num-workers`)."""
        for action in self._actions:
            shown = getattr(action, "shown", None)
            if shown and len(action.option_strings) > len(shown):
                message = message.replace("/".join(action.option_strings), "/".join(shown))
        return message

    def parse_known_args(self, args=None, namespace=None):
        args = list(sys.argv[1:] if args is None else args)
        return super().parse_known_args(self._boolean_values(args), namespace)

    def _boolean_values(self, args: list[str]) -> list[str]:
        """`--x=BOOL` of a `BooleanFlag` as `--x` or `--no_x`, up to the first
        argument that is not an option's (where a command line of a worker may
        start) or `--`."""
        options = self._option_string_actions  # noqa: SLF001  (argparse has no public map)
        out, takes_value = [], False
        for index, arg in enumerate(args):
            if arg == "--" or (not arg.startswith("-") and not takes_value):
                return out + args[index:]
            name, eq, value = arg.partition("=")
            action = options.get(name) if arg.startswith("--") else None
            if isinstance(action, BooleanFlag) and eq:
                try:
                    on = _parse_bool(value)
                except argparse.ArgumentTypeError as e:
                    self.error(f"argument {name}: {e}")
                if name in action.negatives:
                    self.error(f"argument {name}: takes no value; write {name} alone, or "
                               f"{action.shown[0]}=true|false")
                arg = action.shown[0] if on else action.shown[-1]
            out.append(arg)
            takes_value = action is not None and action.nargs != 0 and not eq
        return out


def _parse_bool(text: str) -> bool:
    return FieldSpec("flag", "bool", False, "", None, False).parse(text)  # the fields' reading


def add_arguments(parser: argparse.ArgumentParser, config_cls=TrainConfig, *,
                  exclude: Iterable[str] = (), only: Iterable[str] | None = None,
                  defaults: dict | None = None, suppress_defaults: bool = False,
                  config_file: bool = True) -> None:
    """Adds `--name` (also `--na-me`) for each field of `config_cls` to an
    argparse parser, a boolean field as a `BooleanFlag`, and `--config FILE`
    (`apply_config_file`) unless `config_file` is False.

    `defaults` replaces field defaults for this parser. With
    `suppress_defaults`, an option left out is absent from the parsed
    namespace (the caller's own defaults apply); the help still shows the
    default.
    """
    defaults = defaults or {}
    if config_file:
        action = parser.add_argument(
            "--config", default=argparse.SUPPRESS if suppress_defaults else None,
            metavar="FILE", help=CONFIG_HELP)
        action.shown = ["--config"]
    for spec in field_specs(config_cls, exclude=exclude, only=only):
        default = defaults.get(spec.name, spec.default)
        shown = ",".join(default) if spec.kind == "list" and default else default
        help_text = spec.help.replace("%", "%%") + f" (default: {shown})"
        kwargs = dict(help=help_text, default=argparse.SUPPRESS if suppress_defaults else default)
        if spec.kind == "bool":  # --flag, --no_flag, --flag=false
            kwargs.update(action=BooleanFlag)
        else:
            kwargs.update(type=spec.parse, metavar=spec.name.upper())
        names = option_spellings(spec.name)
        action = parser.add_argument(*names, **kwargs)
        if not getattr(action, "shown", None):
            action.shown = names[:1]


def apply_config_file(parser: argparse.ArgumentParser, path: str,
                      config_cls=TrainConfig) -> dict:
    """Makes the values of the configuration file at `path` the defaults of
    `parser`'s options of the same names (`read_config_file`), so that the
    options on the command line override them; fields `parser` does not
    take are left out. Parse again afterwards. Returns the values used.

    Raises:
        ValueError: naming the file (and the key), as `read_config_file`.
    """
    values = read_config_file(path, config_cls)
    dests = {action.dest for action in parser._actions}  # noqa: SLF001  (no public way)
    used = {name: value for name, value in values.items() if name in dests}
    parser.set_defaults(**used)
    return used


def config_from_args(namespace: argparse.Namespace, config_cls=TrainConfig, **overrides):
    """A `config_cls` from the fields present in an argparse namespace."""
    names = {f.name for f in dataclasses.fields(config_cls)}
    values = {k: v for k, v in vars(namespace).items() if k in names}
    return config_cls(**{**values, **overrides})


# ---------------------------------------------------------------------------- errors


def flag_message(message: str, config_cls=TrainConfig, extra_names: Iterable[str] = ()) -> str:
    """A library error restated in flag names: `` `name` `` -> `--name` and
    `name=value` -> `--name=value` for the fields of `config_cls` (and
    `extra_names`)."""
    names = {f.name for f in dataclasses.fields(config_cls)} | set(extra_names)
    message = re.sub(r"`(\w+)(=[^`]*)?`", lambda m: f"--{m.group(1)}{m.group(2) or ''}"
                     if m.group(1) in names else m.group(0), message)
    return re.sub(r"(?<![\w.-])(\w+)=", lambda m: f"--{m.group(1)}=" if m.group(1) in names
                  else m.group(0), message)
