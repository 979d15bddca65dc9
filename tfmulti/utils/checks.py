"""Argument validators shared by every module: one rule per kind of value.

Pure Python (no TensorFlow). Each check names the argument, the value it got
and what would be accepted, and returns the value normalized:

    >>> from tfmulti.utils import checks
    >>> checks.positive_int("epochs", 5)
    5
    >>> checks.positive_int("epochs", True)
    Traceback (most recent call last):
        ...
    ValueError: `epochs` must be a positive integer, got True.

One rule for `bool`: a bool is never accepted where a number is expected
(`True` is an `int` to Python, never to tfmulti).
"""

from __future__ import annotations

import math
import numbers
from collections.abc import Collection

__all__ = ["finite_number", "integer", "is_int", "non_negative_int", "one_of", "positive_int",
           "positive_number"]


def is_int(value) -> bool:
    """An integer and not a bool (the one rule for bool)."""
    return isinstance(value, numbers.Integral) and not isinstance(value, bool)


def _is_number(value) -> bool:
    return isinstance(value, numbers.Real) and not isinstance(value, bool)


def _fail(name: str, what: str, value, hint: str) -> ValueError:
    return ValueError(f"`{name}` must be {what}, got {value!r}" + (f"; {hint}" if hint else "")
                      + ".")


def integer(name: str, value, *, minimum: int | None = None, none_ok: bool = False,
            hint: str = "") -> int | None:
    """`value` as an int, at least `minimum` when given; None passes when `none_ok`."""
    if value is None and none_ok:
        return None
    if not is_int(value) or (minimum is not None and value < minimum):
        what = ("an integer" if minimum is None else
                "a positive integer" if minimum == 1 else
                "an integer >= 0" if minimum == 0 else f"an integer >= {minimum}")
        raise _fail(name, what + (" (or None)" if none_ok else ""), value, hint)
    return int(value)


def positive_int(name: str, value, *, none_ok: bool = False, hint: str = "") -> int | None:
    """An integer >= 1 (never a bool)."""
    return integer(name, value, minimum=1, none_ok=none_ok, hint=hint)


def non_negative_int(name: str, value, *, none_ok: bool = False, hint: str = "") -> int | None:
    """An integer >= 0 (never a bool)."""
    return integer(name, value, minimum=0, none_ok=none_ok, hint=hint)


def finite_number(name: str, value, *, minimum: float | None = None, strict: bool = False,
                  none_ok: bool = False, hint: str = "") -> float | None:
    """A finite real number (nan and inf refused), >= `minimum` (> when `strict`)."""
    if value is None and none_ok:
        return None
    ok = _is_number(value) and math.isfinite(value)
    if ok and minimum is not None:
        ok = value > minimum if strict else value >= minimum
    if not ok:
        bound = ("" if minimum is None else
                 " > 0" if strict and minimum == 0 else f" {'>' if strict else '>='} {minimum:g}")
        raise _fail(name, f"a finite number{bound}" + (" (or None)" if none_ok else ""),
                    value, hint)
    return float(value)


def positive_number(name: str, value, *, none_ok: bool = False, hint: str = "") -> float | None:
    """A finite number > 0."""
    return finite_number(name, value, minimum=0, strict=True, none_ok=none_ok, hint=hint)


def one_of(name: str, value, choices: Collection, *, hint: str = ""):
    """`value` if it is one of `choices`; the error lists them."""
    if isinstance(value, bool) or value not in choices:
        raise ValueError(f"`{name}` must be one of {list(choices)}, got {value!r}"
                         + (f"; {hint}" if hint else "") + ".")
    return value
