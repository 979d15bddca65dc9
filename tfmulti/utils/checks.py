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


def integer(name: str, value, *, minimum: int | None = None, maximum: int | None = None,
            none_ok: bool = False, hint: str = "") -> int | None:
    """`value` as an int, at least `minimum` and at most `maximum` when given;
    None passes when `none_ok`. With a `maximum`, the message states the range:

        >>> integer("seed", -5, minimum=0, maximum=2**32 - 1)
        Traceback (most recent call last):
            ...
        ValueError: `seed` must be an integer from 0 to 4294967295, got -5.
    """
    if value is None and none_ok:
        return None
    if (not is_int(value) or (minimum is not None and value < minimum)
            or (maximum is not None and value > maximum)):
        if maximum is not None:
            what = (f"an integer <= {maximum}" if minimum is None else
                    f"an integer from {minimum} to {maximum}")
        else:
            what = ("an integer" if minimum is None else
                    "a positive integer" if minimum == 1 else
                    "an integer >= 0" if minimum == 0 else f"an integer >= {minimum}")
        raise _fail(name, what + (" (or None)" if none_ok else ""), value, hint)
    return int(value)


def positive_int(name: str, value, *, maximum: int | None = None, none_ok: bool = False,
                 hint: str = "") -> int | None:
    """An integer >= 1 (never a bool), at most `maximum` when given."""
    return integer(name, value, minimum=1, maximum=maximum, none_ok=none_ok, hint=hint)


def non_negative_int(name: str, value, *, maximum: int | None = None, none_ok: bool = False,
                     hint: str = "") -> int | None:
    """An integer >= 0 (never a bool), at most `maximum` when given."""
    return integer(name, value, minimum=0, maximum=maximum, none_ok=none_ok, hint=hint)


def finite_number(name: str, value, *, minimum: float | None = None, strict: bool = False,
                  maximum: float | None = None, none_ok: bool = False,
                  hint: str = "") -> float | None:
    """A finite real number (nan and inf refused), >= `minimum` (> when `strict`)
    and <= `maximum` when given."""
    if value is None and none_ok:
        return None
    ok = _is_number(value) and math.isfinite(value)
    if ok and minimum is not None:
        ok = value > minimum if strict else value >= minimum
    if ok and maximum is not None:
        ok = value <= maximum
    if not ok:
        bound = ("" if minimum is None else
                 " > 0" if strict and minimum == 0 else f" {'>' if strict else '>='} {minimum:g}")
        if maximum is not None:
            bound += f"{' and' if bound else ''} <= {maximum:g}"
        raise _fail(name, f"a finite number{bound}" + (" (or None)" if none_ok else ""),
                    value, hint)
    return float(value)


def positive_number(name: str, value, *, maximum: float | None = None, none_ok: bool = False,
                    hint: str = "") -> float | None:
    """A finite number > 0, at most `maximum` when given."""
    return finite_number(name, value, minimum=0, strict=True, maximum=maximum,
                         none_ok=none_ok, hint=hint)


def one_of(name: str, value, choices: Collection, *, hint: str = ""):
    """`value` if it is one of `choices`; the error lists them."""
    if isinstance(value, bool) or value not in choices:
        raise ValueError(f"`{name}` must be one of {list(choices)}, got {value!r}"
                         + (f"; {hint}" if hint else "") + ".")
    return value
