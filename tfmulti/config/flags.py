"""Command-line flags generated from the fields of `tfmulti.config.train_config.TrainConfig`.

The recipes' absl flags (`define_absl_flags`, `config_from_absl`) and the
`tfmulti` command's argparse options (`add_arguments`, `config_from_args`)
are made from the dataclass fields: name, type, default, help text and
choices come from the field, so an option is declared once. Library errors
name Python arguments (`` `global_batch_size` ``); `flag_message` restates
them in flag names (`--global_batch_size`) for the command-line surfaces.

Pure Python (absl and argparse; no TensorFlow), so flags are checked before
TensorFlow starts.

Example:
    >>> import argparse
    >>> from tfmulti.config import flags as config_flags
    >>> parser = argparse.ArgumentParser()
    >>> config_flags.add_arguments(parser, only=("distribution", "global_batch_size"))
    >>> config = config_flags.config_from_args(parser.parse_args(["--global_batch_size=64"]))
    >>> config.global_batch_size, config.distribution
    (64, 'auto')
    >>> config_flags.flag_message("`global_batch_size` (10) must be divisible by 4")
    '--global_batch_size (10) must be divisible by 4'
"""

from __future__ import annotations

import argparse
import dataclasses
import re
import types
import typing
from collections.abc import Iterable

from tfmulti.config.train_config import TrainConfig

__all__ = ["add_arguments", "config_from_absl", "config_from_args", "define_absl_flags",
           "field_specs", "flag_message"]


@dataclasses.dataclass(frozen=True)
class FieldSpec:
    """What a command line needs to know about one config field."""

    name: str
    kind: str  # "bool", "int", "float", "str", "list", "int_or_str"
    default: object
    help: str
    choices: tuple | None
    optional: bool  # None is a valid value

    def parse(self, text: str):
        """The field's value from flag text (argparse gives text)."""
        if self.optional and text in ("", "none", "None"):
            return None
        if self.kind == "bool":
            lowered = str(text).strip().lower()
            if lowered in ("1", "true", "yes", "on"):
                return True
            if lowered in ("0", "false", "no", "off"):
                return False
            raise argparse.ArgumentTypeError(f"expected true or false, got {text!r}")
        if self.kind == "int":
            try:
                return int(text)
            except ValueError:
                raise argparse.ArgumentTypeError(f"expected an integer, got {text!r}") from None
        if self.kind == "float":
            try:
                return float(text)
            except ValueError:
                raise argparse.ArgumentTypeError(f"expected a number, got {text!r}") from None
        if self.kind == "list":
            return tuple(part.strip() for part in text.split(",") if part.strip())
        if self.kind == "int_or_str":
            return _int_or_text(text)
        return text


def _int_or_text(value):
    """An integer given as text becomes an int ("4" -> 4); other text stays."""
    if isinstance(value, str) and re.fullmatch(r"[+-]?\d+", value.strip()):
        return int(value)
    return value


def _kind(annotation) -> tuple[str, bool]:
    args = typing.get_args(annotation)
    origin = typing.get_origin(annotation)
    if origin in (typing.Union, types.UnionType):
        optional = type(None) in args
        rest = tuple(a for a in args if a is not type(None))
        if set(rest) == {int, str}:
            return "int_or_str", optional
        if str in rest:  # text on the command line; Python may also pass an object
            return "str", optional
        if len(rest) == 1:
            return _kind(rest[0])[0], optional
        raise TypeError(f"no flag type for {annotation!r}")
    if origin is tuple:
        return "list", False
    names = {bool: "bool", int: "int", float: "float", str: "str"}
    if annotation in names:
        return names[annotation], False
    raise TypeError(f"no flag type for {annotation!r}")


def field_specs(config_cls=TrainConfig, *, exclude: Iterable[str] = (),
                only: Iterable[str] | None = None) -> list[FieldSpec]:
    """The `FieldSpec` of each field of `config_cls`, in declaration order."""
    hints = typing.get_type_hints(config_cls)
    exclude, only = set(exclude), None if only is None else set(only)
    specs = []
    for f in dataclasses.fields(config_cls):
        if f.name in exclude or (only is not None and f.name not in only):
            continue
        kind, optional = _kind(hints[f.name])
        choices = f.metadata.get("choices")
        specs.append(FieldSpec(f.name, kind, f.default, f.metadata.get("help", ""),
                               tuple(choices) if choices else None, optional))
    return specs


# ------------------------------------------------------------------------------- absl


def define_absl_flags(flag_values=None, config_cls=TrainConfig, *,
                      exclude: Iterable[str] = ()) -> None:
    """Defines one absl flag per field of `config_cls` (into `flag_values`,
    default `absl.flags.FLAGS`). Values are checked by `TrainConfig.validate`,
    not by absl (one set of rules for Python and flags)."""
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


def config_from_absl(flag_values=None, config_cls=TrainConfig, *,
                     exclude: Iterable[str] = (), **overrides):
    """A `config_cls` from parsed absl flags (fields in `exclude` keep their
    defaults; `overrides` win)."""
    from absl import flags

    fv = flags.FLAGS if flag_values is None else flag_values
    values = {}
    for spec in field_specs(config_cls, exclude=exclude):
        value = fv[spec.name].value
        if spec.kind == "list":
            value = tuple(value) if value else None
        elif spec.kind == "int_or_str":
            value = _int_or_text(value)
        values[spec.name] = value
    return config_cls(**{**values, **overrides})


# --------------------------------------------------------------------------- argparse


def add_arguments(parser: argparse.ArgumentParser, config_cls=TrainConfig, *,
                  exclude: Iterable[str] = (), only: Iterable[str] | None = None,
                  defaults: dict | None = None, suppress_defaults: bool = False) -> None:
    """Adds `--name` for each field of `config_cls` to an argparse parser.

    `defaults` replaces field defaults for this parser. With
    `suppress_defaults`, an option left out is absent from the parsed
    namespace (the caller's own defaults apply); the help still shows the
    default.
    """
    defaults = defaults or {}
    for spec in field_specs(config_cls, exclude=exclude, only=only):
        default = defaults.get(spec.name, spec.default)
        shown = ",".join(default) if spec.kind == "list" and default else default
        help_text = spec.help.replace("%", "%%") + f" (default: {shown})"
        kwargs = dict(type=spec.parse, help=help_text, metavar=spec.name.upper(),
                      default=argparse.SUPPRESS if suppress_defaults else default)
        if spec.kind == "bool":  # --flag, --flag=false
            kwargs.update(nargs="?", const=True, metavar="BOOL")
        parser.add_argument(f"--{spec.name}", **kwargs)


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
