"""Training configurations read from a file: `--config FILE` of `tfmulti train`,
`diagnose`, `estimate-memory` and recipes/train.py.

A file is a mapping of `tfmulti.config.train_config.TrainConfig` fields to
values, in YAML or JSON (YAML 1.1 through PyYAML's safe loader; a `.json`
file through the standard `json`), keys spelt as the flags are (`num_stages`
or `num-stages`). Each value is checked as its flag would be: a list field
takes a list or comma-separated text, an optional field takes null, text is
read as on the command line ("4" for an integer). An unknown key or a value
of the wrong type is a `ValueError` naming the key and the file.

A run's record, `<model_dir>/.tfmulti-run.json` (`tfmulti.training.outputs`),
is a configuration file too: its `config` is read, and its other keys
(`finished`, `published`, `publishing`: what the run wrote) are not
configuration and are left out. The record holds every field except those a
rerun may change (`verbose`, `overwrite`, `keep_backup`,
`discard_unreadable_backup`), which keep their defaults unless given.

Pure Python, no TensorFlow.

Example:
    >>> import os, tempfile
    >>> from tfmulti.config import config_file
    >>> path = os.path.join(tempfile.mkdtemp(), "run.yaml")
    >>> with open(path, "w") as f:
    ...     _ = f.write("global-batch-size: 64\\ndevices: CPU:0,CPU:1\\njit_compile: yes\\n")
    >>> config_file.read_config_file(path)
    {'global_batch_size': 64, 'devices': ('CPU:0', 'CPU:1'), 'jit_compile': True}
"""

from __future__ import annotations

import argparse
import difflib
import json
import math

from tfmulti.config import keras_forms
from tfmulti.config.fields import field_specs
from tfmulti.config.train_config import TrainConfig

__all__ = ["RUN_RECORD_KEYS", "read_config_file"]

RUN_RECORD_KEYS = ("config", "finished", "published", "publishing")
"""The keys of a run's record (`.tfmulti-run.json`): its configuration under
`config`, and what the run published."""

_KIND_WORDS = {"bool": "true or false", "int": "an integer", "float": "a number",
               "str": "text", "list": "a list of text (or comma-separated text)",
               "int_or_str": "an integer or text",
               "form": "text, a list or a mapping (Keras' per-output form)"}


def _load(path: str):
    try:
        with open(path, encoding="utf-8") as f:
            text = f.read()
    except OSError as e:
        raise ValueError(f"cannot read the config file {path} ({e.strerror}); pass a "
                         "readable YAML or JSON file.") from None
    except UnicodeDecodeError:
        raise ValueError(f"the config file {path} is not UTF-8 text; pass a YAML or JSON "
                         "file.") from None
    if path.lower().endswith(".json"):
        try:
            return json.loads(text)
        except ValueError as e:
            raise ValueError(f"the config file {path} is not valid JSON ({e}).") from None
    import yaml  # PyYAML; only where a file is read

    try:
        return yaml.safe_load(text)
    except yaml.YAMLError as e:
        where = getattr(e, "problem_mark", None)
        at = f" at line {where.line + 1}, column {where.column + 1}" if where else ""
        problem = getattr(e, "problem", None) or type(e).__name__
        raise ValueError(f"the config file {path} is not valid YAML ({problem}{at}).") from None


def _value(spec, value, key: str, path: str):
    """`value` as the field of `spec` takes it, or a ValueError naming `key` and `path`."""
    if value is None:
        if spec.optional:
            return None
    elif isinstance(value, str):
        try:
            return spec.parse(value)
        except argparse.ArgumentTypeError as e:
            raise ValueError(f"{key!r} in the config file {path}: {e}.") from None
    elif spec.kind == "bool" and isinstance(value, bool):
        return value
    elif spec.kind in ("int", "int_or_str") and isinstance(value, int) \
            and not isinstance(value, bool):
        return value
    elif spec.kind == "float" and isinstance(value, (int, float)) \
            and not isinstance(value, bool) and math.isfinite(value):
        return float(value)
    elif spec.kind == "list" and isinstance(value, (list, tuple)) \
            and all(isinstance(v, str) for v in value):
        return tuple(value)
    elif spec.sequence and isinstance(value, (list, tuple)):  # the field's own rules apply
        return tuple(value)
    elif spec.kind == "form" and isinstance(value, (dict, list, int, float)) \
            and not isinstance(value, bool):
        try:
            return keras_forms.check(spec.name, value)
        except ValueError as e:
            raise ValueError(f"{key!r} in the config file {path}: "
                             f"{str(e).split(' ', 1)[1]}") from None
    words = _KIND_WORDS[spec.kind] + (" or null" if spec.optional else "")
    raise ValueError(f"{key!r} in the config file {path} must be {words}, got {value!r}.")


def read_config_file(path: str, config_cls=TrainConfig) -> dict:
    """The field values a YAML or JSON configuration file sets, by field name.

    Args:
        path: the file; a name ending in `.json` is read as JSON, any other as
            YAML (which also reads JSON).
        config_cls: the configuration class whose fields the keys name.

    Returns:
        A dict of field name to value, in the file's order, each value of the
        field's type (a tuple for a list field); not validated together
        (`TrainConfig.validate` does that).

    Raises:
        ValueError: the file cannot be read or parsed, is not a mapping, or has a
            key that is not a field or a value of the wrong type (naming the key
            and the file).
    """
    content = _load(path)
    if isinstance(content, dict) and isinstance(content.get("config"), dict) \
            and set(content) <= set(RUN_RECORD_KEYS):
        content = content["config"]  # a run's record: its configuration
    if content is None:
        return {}
    if not isinstance(content, dict):
        raise ValueError(f"the config file {path} must hold a mapping of flag names to "
                         f"values (name: value), got a {type(content).__name__}.")
    specs = {spec.name: spec for spec in field_specs(config_cls)}
    values = {}
    for key, value in content.items():
        name = key.replace("-", "_") if isinstance(key, str) else key
        if name not in specs:
            close = difflib.get_close_matches(str(name), specs, n=1)
            hint = f"; did you mean {close[0]!r}?" if close else \
                f"; the keys are the fields of {config_cls.__name__} (its flags' names)."
            raise ValueError(f"unknown key {key!r} in the config file {path}{hint}")
        if name in values:
            raise ValueError(f"{key!r} is set twice in the config file {path} (as "
                             f"{name.replace('_', '-')!r} and {name!r}); keep one.")
        values[name] = _value(specs[name], value, key, path)
    return values

