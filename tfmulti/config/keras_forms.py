"""Keras' own forms of a loss, metrics, loss weights and class weights, as
`TrainConfig` fields, flags and configuration files take them.

`model.compile` takes a loss, metrics and loss weights for each output of a
model with several outputs, by output name (a dict) or by position (a list),
and `fit` takes `class_weight` as a dict of class id to weight. A
`TrainConfig` takes the same values from Python; a configuration file the
same as YAML or JSON mappings and lists; a flag the same as text, where a
comma separates items and `NAME=VALUE` names an output (or a class):

| flag | Python value |
| --- | --- |
| `--loss=mse` | `"mse"` |
| `--loss=priority=binary_crossentropy,department=my_losses:focal` | `{"priority": "binary_crossentropy", "department": "my_losses:focal"}` |
| `--loss=mse,binary_crossentropy` | `["mse", "binary_crossentropy"]` (by output position) |
| `--metrics=accuracy,auc` | `("accuracy", "auc")` (each output) |
| `--metrics=priority=accuracy,priority=auc,department=accuracy` | `{"priority": ("accuracy", "auc"), "department": ("accuracy",)}` |
| `--loss_weights=priority=1.0,department=0.2` | `{"priority": 1.0, "department": 0.2}` |
| `--loss_weights=1.0,0.2` | `[1.0, 0.2]` |
| `--class_weight=0=1.0,1=25.0` | `{0: 1.0, 1: 25.0}` |
| `--class_weight=balanced` | `"balanced"` (n / (classes x count), from the labels) |

Pure Python, no TensorFlow: the values are checked in form here (names,
numbers); whether each name is an output of the model, a Keras loss or a
metric is checked once the model is built.

Example:
    >>> from tfmulti.config.keras_forms import parse
    >>> parse("loss", "priority=binary_crossentropy,department=mse")
    {'priority': 'binary_crossentropy', 'department': 'mse'}
    >>> parse("metrics", "priority=accuracy,priority=auc")
    {'priority': ('accuracy', 'auc')}
    >>> parse("class_weight", "0=1,1=25.5")
    {0: 1.0, 1: 25.5}
"""

from __future__ import annotations

import math
import numbers
import re

__all__ = ["BALANCED", "FORMS", "check", "parse", "plain"]

FORMS = ("loss", "metrics", "loss_weights", "class_weight")
"""The fields that take Keras' per-output (or per-class) forms; `weighted_metrics`
takes the metrics' form."""
BALANCED = "balanced"
"""`class_weight="balanced"`: each class weighted n / (classes x its count)."""

_NAME = re.compile(r"[A-Za-z_][\w.\-/]*")
_EXAMPLES = {
    "loss": "e.g. mse, or priority=binary_crossentropy,department=mse for two outputs",
    "metrics": "e.g. accuracy,auc, or priority=accuracy,department=mae for two outputs",
    "loss_weights": "e.g. priority=1.0,department=0.2 (by output name) or 1.0,0.2",
    "class_weight": "e.g. 0=1.0,1=25.0 (class id=weight) or balanced",
}


def _form(name: str) -> str:
    return "metrics" if name == "weighted_metrics" else name


def _fail(name: str, value, why: str) -> ValueError:
    return ValueError(f"`{name}` {why}, got {value!r}; {_EXAMPLES[_form(name)]}.")


def _items(name: str, text: str) -> list[str]:
    items = [item.strip() for item in text.split(",")]
    if not text.strip() or any(not item for item in items):
        raise _fail(name, text, "has an empty item")
    return items


def _number(name: str, text: str, whole):
    try:
        value = float(text)
    except ValueError:
        raise _fail(name, whole, f"takes numbers, and {text!r} is not one") from None
    return value


def parse(name: str, text: str):
    """The value of field `name` (one of `FORMS`, or `weighted_metrics`) from
    its flag text.

    Raises:
        ValueError: text that is not the field's form, naming the part.
    """
    form = _form(name)
    if form == "class_weight" and text.strip().lower() == BALANCED:
        return BALANCED
    items = _items(name, text)
    named = ["=" in item for item in items]
    if any(named) and not all(named):
        raise _fail(name, text, "names some items NAME=VALUE and not others; name all of them "
                                "or none")
    if form == "class_weight" and not all(named):
        raise _fail(name, text, "takes CLASS=WEIGHT items")
    if not all(named):
        if form == "loss":
            return items[0] if len(items) == 1 else items
        if form == "metrics":
            return tuple(items)
        return [_number(name, item, text) for item in items]
    out: dict = {}
    for item in items:
        key, _, value = (part.strip() for part in item.partition("="))
        if not key or not value:
            raise _fail(name, text, f"has {item!r} without a name or a value")
        if form == "class_weight":
            if not re.fullmatch(r"[+-]?\d+", key):
                raise _fail(name, text, f"takes whole class ids, and {key!r} is not one")
            key = int(key)
        if form == "metrics":
            out[key] = (*out.get(key, ()), value)
            continue
        if key in out:
            raise _fail(name, text, f"names {key!r} twice")
        out[key] = value if form == "loss" else _number(name, value, text)
    return out


def _is_text(value) -> bool:
    return isinstance(value, str)


def check(name: str, value):
    """`value` of field `name` checked in form and normalized (tuples of
    metrics, float weights, int class ids; objects and functions pass as
    they are); None passes.

    Raises:
        ValueError: naming the field, the part and the form.
    """
    form = _form(name)
    if value is None:
        return None
    if form == "class_weight":
        if _is_text(value):
            if value.strip().lower() != BALANCED:
                raise _fail(name, value, f"must be a dict of class id to weight or "
                                         f"{BALANCED!r}")
            return BALANCED
        if not isinstance(value, dict) or not value:
            raise _fail(name, value, "must be a dict of class id to weight")
        out = {}
        for key, weight in value.items():
            if isinstance(key, str) and re.fullmatch(r"[+-]?\d+", key.strip()):
                key = int(key)  # JSON keys are text
            if isinstance(key, bool) or not isinstance(key, numbers.Integral) or key < 0:
                raise _fail(name, value, f"takes class ids 0, 1, ..., and {key!r} is not one")
            out[int(key)] = _weight(name, weight, value)
        return out
    if form == "loss_weights":
        if isinstance(value, dict):
            return {_key(name, k, value): _weight(name, w, value) for k, w in value.items()}
        if isinstance(value, (list, tuple)) and value:
            return [_weight(name, w, value) for w in value]
        raise _fail(name, value, "must be a dict of output name to weight, or a list")
    if form == "metrics":
        if _is_text(value):
            raise ValueError(f"`{name}` must be a list of metric names, got the string "
                             f"{value!r}; e.g. ({value!r},).")
        if isinstance(value, dict):
            return {_key(name, k, value): _metric_list(name, v, value)
                    for k, v in value.items()}
        if isinstance(value, (list, tuple)):
            if any(isinstance(v, (list, tuple)) for v in value):  # a list per output
                return [_metric_list(name, v, value) for v in value]
            return _metric_list(name, value, value)
        raise _fail(name, value, "must be a list of metrics, or a dict of output name to "
                                 "metrics")
    # loss: a name, a hook, an object or function; or one per output.
    if isinstance(value, dict):
        return {_key(name, k, value): _loss_item(name, v, value) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        if not value:
            raise _fail(name, value, "is an empty list")
        return [_loss_item(name, v, value) for v in value]
    return _loss_item(name, value, value)


def _key(name: str, key, whole) -> str:
    if not isinstance(key, str) or not _NAME.fullmatch(key):
        raise _fail(name, whole, f"names outputs by their names, and {key!r} is not one")
    return key


def _weight(name: str, weight, whole) -> float:
    if isinstance(weight, str):
        weight = _number(name, weight, whole)
    if isinstance(weight, bool) or not isinstance(weight, numbers.Real) \
            or not math.isfinite(weight) or weight < 0:
        raise _fail(name, whole, f"takes finite weights >= 0, and {weight!r} is not one")
    return float(weight)


def _metric_list(name: str, value, whole) -> tuple:
    items = (value,) if _is_text(value) or not isinstance(value, (list, tuple)) else tuple(value)
    if not items:
        raise _fail(name, whole, "gives an output no metric")
    for item in items:
        if not (_is_text(item) and item.strip()) and not callable(item):
            raise _fail(name, whole, f"takes metric names or objects, and {item!r} is "
                                     "neither")
    return items


def _loss_item(name: str, value, whole):
    if _is_text(value) and not value.strip():
        raise _fail(name, whole, "has an empty name")
    if value is None or isinstance(value, (dict, list, tuple, numbers.Number)):
        raise _fail(name, whole, "takes a loss name, package.module:function or a loss "
                                 "object per output")
    return value


def plain(value):
    """`value` as JSON keeps it (a run's record, compared with the record read
    back): objects and functions by `module:name`, tuples as lists, keys as
    text (class ids too, as JSON writes them)."""
    if isinstance(value, dict):
        return {str(k): plain(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [plain(v) for v in value]
    if value is None or isinstance(value, (str, int, float, bool)):
        return value
    module = getattr(value, "__module__", None)
    qualname = getattr(value, "__qualname__", None) or getattr(type(value), "__qualname__", None)
    if module and getattr(value, "__qualname__", None):
        return f"{module}:{qualname}"
    return type(value).__name__
