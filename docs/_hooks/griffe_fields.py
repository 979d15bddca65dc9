"""A griffe extension for the API reference: `TrainConfig`'s fields documented by
their help texts.

Each field of `tfmulti.TrainConfig` is declared as `_field(default, help)`: its help
(`dataclasses.Field.metadata["help"]`, also each flag's `--help`) is the field's
documentation, and its default the first argument. Read statically, griffe sees
neither (a field has no docstring and its value is the `_field(...)` call), so the
API page would list no field and a signature of `_field` calls. This extension
gives each field its help as its docstring and its default as its value, read from
the class itself (`tfmulti.config.train_config` imports no TensorFlow).

mkdocs.yml names it in the `mkdocstrings` handler's `extensions` option.
"""

from __future__ import annotations

import dataclasses
import importlib
from typing import Any

import griffe

CLASSES = ("tfmulti.config.train_config.TrainConfig",)
"""The dataclasses whose fields carry `metadata["help"]`."""


def field_docs(path: str) -> dict[str, tuple[str, str]]:
    """`{field: (repr of its default, help)}` of the dataclass at `path`."""
    module, _, name = path.rpartition(".")
    cls = getattr(importlib.import_module(module), name)
    docs = {}
    for field in dataclasses.fields(cls):
        if field.default is not dataclasses.MISSING:
            default = repr(field.default)
        elif field.default_factory is not dataclasses.MISSING:
            default = f"{field.default_factory.__name__}()"
        else:
            default = ""
        docs[field.name] = (default, field.metadata.get("help", ""))
    return docs


class FieldHelp(griffe.Extension):
    """Gives the fields of `CLASSES` their help as docstring and their default as value."""

    def on_class_members(self, *, cls: griffe.Class, **kwargs: Any) -> None:
        if cls.path not in CLASSES:
            return
        for name, (default, help_text) in field_docs(cls.path).items():
            attribute = cls.members.get(name)
            if attribute is None or not attribute.is_attribute:
                continue
            if default:
                attribute.value = default
            if help_text:
                attribute.docstring = griffe.Docstring(help_text, parent=attribute)
