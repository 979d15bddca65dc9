"""What a command line needs to know about each field of a configuration
dataclass (`tfmulti.config.train_config.TrainConfig`): its kind of value,
default, help, choices and whether None is a value; and how flag text becomes
that value. Shared by the flags (`tfmulti.config.flags`) and configuration
files (`tfmulti.config.config_file`).

Pure Python, no TensorFlow.

Example:
    >>> from tfmulti.config.fields import field_specs
    >>> (spec,) = field_specs(only=["steps_per_execution"])
    >>> spec.kind, spec.parse("8"), spec.parse("auto")
    ('int_or_str', 8, 'auto')
"""

from __future__ import annotations

import argparse
import dataclasses
import re
import types
import typing
from collections.abc import Iterable

from tfmulti.config import keras_forms
from tfmulti.config.train_config import TrainConfig

__all__ = ["FALSE_WORDS", "FieldSpec", "TRUE_WORDS", "field_specs", "int_or_text"]

TRUE_WORDS = ("1", "true", "yes", "on")
"""Flag text read as True (any case)."""
FALSE_WORDS = ("0", "false", "no", "off")
"""Flag text read as False (any case)."""


@dataclasses.dataclass(frozen=True)
class FieldSpec:
    """What a command line needs to know about one config field."""

    name: str
    kind: str  # "bool", "int", "float", "str", "list", "int_or_str", "form"
    default: object
    help: str
    choices: tuple | None
    optional: bool  # None is a valid value
    sequence: bool = False  # a "str" field that also takes a tuple (from Python or a file)
    form: str | None = None  # "form" fields: Keras' per-output form (`keras_forms`)

    def parse(self, text: str):
        """The field's value from flag text (argparse gives text)."""
        if self.optional and text in ("", "none", "None"):
            return None
        if self.kind == "bool":
            lowered = str(text).strip().lower()
            if lowered in TRUE_WORDS:
                return True
            if lowered in FALSE_WORDS:
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
            return int_or_text(text)
        if self.kind == "form":
            try:
                return keras_forms.parse(self.name, text)
            except ValueError as e:
                raise argparse.ArgumentTypeError(_without_name(str(e))) from None
        return text


def _without_name(message: str) -> str:
    """A `keras_forms` message without its leading `` `field` `` (argparse names the flag)."""
    return re.sub(r"^`\w+` ", "", message).rstrip(".")


def int_or_text(value):
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
        form = f.metadata.get("form")
        if form:
            kind, optional = "form", True
        else:
            kind, optional = _kind(hints[f.name])
        choices = f.metadata.get("choices")
        sequence = kind == "str" and any(a is tuple or typing.get_origin(a) is tuple
                                         for a in typing.get_args(hints[f.name]))
        specs.append(FieldSpec(f.name, kind, f.default, f.metadata.get("help", ""),
                               tuple(choices) if choices else None, optional, sequence,
                               form))
    return specs
