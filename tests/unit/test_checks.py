"""tfmulti.utils.checks: the shared argument validators (pure Python)."""

from __future__ import annotations

import math
import re

import numpy as np
import pytest

from tfmulti.utils import checks


def _fails(message: str, check, *args, **kwargs) -> None:
    with pytest.raises(ValueError, match=f"^{re.escape(message)}$"):
        check(*args, **kwargs)


# ------------------------------------------------------------------------------ integers


@pytest.mark.parametrize("value", [0, 1, -7, 10**12, np.int64(3), np.int32(-2), np.uint8(9)])
def test_integer_accepts_integers_and_returns_an_int(value):
    result = checks.integer("n", value)
    assert result == value and type(result) is int


@pytest.mark.parametrize("value", [True, False, 1.0, 2.5, "3", None, np.float64(2.0),
                                   np.bool_(True), [1]])
def test_integer_refuses_everything_else(value):
    _fails(f"`n` must be an integer, got {value!r}.", checks.integer, "n", value)


@pytest.mark.parametrize("minimum, what", [
    (1, "a positive integer"), (0, "an integer >= 0"), (5, "an integer >= 5"),
    (-2, "an integer >= -2"),
])
def test_integer_minimum(minimum, what):
    assert checks.integer("n", minimum, minimum=minimum) == minimum
    _fails(f"`n` must be {what}, got {minimum - 1}.", checks.integer, "n", minimum - 1,
           minimum=minimum)


def test_none_ok_and_hint():
    assert checks.integer("n", None, none_ok=True) is None
    _fails("`n` must be an integer, got None.", checks.integer, "n", None)
    _fails("`n` must be a positive integer (or None), got 0; try 4.", checks.positive_int,
           "n", 0, none_ok=True, hint="try 4")


@pytest.mark.parametrize("value", [0, -1, True, 1.5, "2"])
def test_positive_int(value):
    _fails(f"`epochs` must be a positive integer, got {value!r}.", checks.positive_int,
           "epochs", value)


def test_positive_and_non_negative_int_pass_values_through():
    assert checks.positive_int("epochs", 5) == 5
    assert checks.positive_int("epochs", np.int64(2)) == 2
    assert checks.positive_int("n", None, none_ok=True) is None
    assert checks.non_negative_int("skip", 0) == 0
    _fails("`skip` must be an integer >= 0, got -1; 0 skips nothing.",
           checks.non_negative_int, "skip", -1, hint="0 skips nothing")
    _fails("`skip` must be an integer >= 0, got False.", checks.non_negative_int, "skip", False)


@pytest.mark.parametrize("minimum, maximum, bad, what", [
    (0, 2**32 - 1, -5, "an integer from 0 to 4294967295"),
    (0, 2**32 - 1, 2**32, "an integer from 0 to 4294967295"),
    (1, 1024, 1025, "an integer from 1 to 1024"),
    (1, 1024, 0, "an integer from 1 to 1024"),
    (1, 1024, 2.0, "an integer from 1 to 1024"),
    (None, 10, 11, "an integer <= 10"),
])
def test_integer_maximum_states_the_range(minimum, maximum, bad, what):
    assert checks.integer("n", maximum, minimum=minimum, maximum=maximum) == maximum
    _fails(f"`n` must be {what}, got {bad!r}.", checks.integer, "n", bad, minimum=minimum,
           maximum=maximum)


def test_positive_and_non_negative_int_maximum():
    assert checks.positive_int("n", 8, maximum=8) == 8
    assert checks.non_negative_int("n", 0, maximum=8) == 0
    _fails("`n` must be an integer from 1 to 8 (or None), got 9; fewer.", checks.positive_int,
           "n", 9, maximum=8, none_ok=True, hint="fewer")
    _fails("`n` must be an integer from 0 to 8, got -1.", checks.non_negative_int, "n", -1,
           maximum=8)


# ------------------------------------------------------------------------------- numbers


@pytest.mark.parametrize("value", [0, 0.5, -3, 1e300, np.float32(0.25), np.int64(4)])
def test_finite_number_returns_a_float(value):
    result = checks.finite_number("x", value)
    assert result == pytest.approx(float(value)) and type(result) is float


@pytest.mark.parametrize("value", [math.nan, math.inf, -math.inf, np.float64("nan"), True,
                                   "1.0", None, 1j])
def test_finite_number_refuses_nan_inf_bools_and_text(value):
    _fails(f"`x` must be a finite number, got {value!r}.", checks.finite_number, "x", value)


@pytest.mark.parametrize("kwargs, good, bad, bound", [
    ({"minimum": 0}, 0.0, -0.5, " >= 0"),
    ({"minimum": 0, "strict": True}, 1e-9, 0.0, " > 0"),
    ({"minimum": 1.5}, 1.5, 1.25, " >= 1.5"),
    ({"minimum": 1.5, "strict": True}, 1.75, 1.5, " > 1.5"),
    ({"minimum": 0, "strict": True, "maximum": 3600}, 3600, 3601, " > 0 and <= 3600"),
    ({"maximum": 2.5}, -7.0, 2.75, " <= 2.5"),
])
def test_finite_number_bounds(kwargs, good, bad, bound):
    assert checks.finite_number("x", good, **kwargs) == good
    _fails(f"`x` must be a finite number{bound}, got {bad!r}.", checks.finite_number, "x",
           bad, **kwargs)


def test_positive_number():
    assert checks.positive_number("learning_rate", 1e-3) == 1e-3
    assert checks.positive_number("timeout", None, none_ok=True) is None
    for bad in (0, -1.0, math.nan, math.inf, False):
        _fails(f"`learning_rate` must be a finite number > 0, got {bad!r}.",
               checks.positive_number, "learning_rate", bad)
    _fails("`timeout` must be a finite number > 0 (or None), got 0; in seconds.",
           checks.positive_number, "timeout", 0, none_ok=True, hint="in seconds")


# ------------------------------------------------------------------------------- choices


def test_one_of():
    assert checks.one_of("optimizer", "sgd", ("adam", "sgd")) == "sgd"
    assert checks.one_of("verbose", 2, ("auto", 0, 1, 2)) == 2
    _fails("`optimizer` must be one of ['adam', 'sgd'], got 'rmsprop'.", checks.one_of,
           "optimizer", "rmsprop", ("adam", "sgd"))
    _fails("`optimizer` must be one of ['adam', 'sgd'], got 'Adam'; names are lower case.",
           checks.one_of, "optimizer", "Adam", ("adam", "sgd"), hint="names are lower case")
    # A dict's keys are its choices; a bool is never one of (0, 1, ...).
    assert checks.one_of("model", "mlp", {"mlp": 1, "cnn": 2}) == "mlp"
    _fails("`verbose` must be one of ['auto', 0, 1, 2], got True.", checks.one_of,
           "verbose", True, ("auto", 0, 1, 2))
    _fails("`verbose` must be one of [0, 1], got False.", checks.one_of, "verbose", False,
           (0, 1))
