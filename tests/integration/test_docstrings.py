"""The docstring examples that train for seconds run as written (doctest), on
the 4 virtual CPU devices of tests/conftest.py; the others are
tests/unit/test_docstrings.py."""

from __future__ import annotations

import pytest

from tests._util import run_docstring_examples
from tests.unit.test_docstrings import TRAINING_EXAMPLES, WITH_EXAMPLES


@pytest.mark.slow
@pytest.mark.parametrize("name", [m for m in WITH_EXAMPLES if m in TRAINING_EXAMPLES])
def test_docstring_examples_run(name, tmp_path, monkeypatch):
    run_docstring_examples(name, tmp_path, monkeypatch)
