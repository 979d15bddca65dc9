"""Every docstring example in the package runs as written (doctest), on the 4
virtual CPU devices of tests/conftest.py. The examples that train for seconds
run in the slow tier: tests/integration/test_docstrings.py."""

from __future__ import annotations

import pkgutil

import pytest

import tfmulti
from tests._util import docstring_examples, run_docstring_examples

MODULES = sorted(m.name for m in pkgutil.walk_packages(tfmulti.__path__, "tfmulti."))
WITH_EXAMPLES = [m for m in MODULES if docstring_examples(m)]
# Examples that train for seconds run in the slow tier.
TRAINING_EXAMPLES = {"tfmulti.insight.diagnose", "tfmulti.training.train", "tfmulti.insight.timing"}


def test_most_modules_have_examples():
    assert len(WITH_EXAMPLES) >= 15, WITH_EXAMPLES


@pytest.mark.parametrize("name", [m for m in WITH_EXAMPLES if m not in TRAINING_EXAMPLES])
def test_docstring_examples_run(name, tmp_path, monkeypatch):
    run_docstring_examples(name, tmp_path, monkeypatch)


def test_the_examples_temporary_folders_are_made_in_the_tests_folder(tmp_path, monkeypatch):
    """`tempfile.mkdtemp()` in an example makes its folder under the test's
    `tmp_path` (pytest removes it), not in the machine's TMPDIR, where every run
    of the suite left one per such example."""
    run_docstring_examples("tfmulti.utils.atomic", tmp_path, monkeypatch)
    assert [p.name for p in tmp_path.glob("tmp*/*")] == ["out.json"]
