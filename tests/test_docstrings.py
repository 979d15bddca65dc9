"""Every docstring example in the package runs as written (doctest), on the 4
virtual CPU devices of tests/conftest.py."""

from __future__ import annotations

import doctest
import importlib
import pkgutil

import keras
import pytest

import tfmulti

FLAGS = doctest.ELLIPSIS | doctest.NORMALIZE_WHITESPACE


def _examples(name: str) -> list[doctest.DocTest]:
    module = importlib.import_module(name)
    tests = doctest.DocTestFinder(exclude_empty=True).find(module, name)
    return [t for t in tests if t.examples]


MODULES = sorted(m.name for m in pkgutil.walk_packages(tfmulti.__path__, "tfmulti."))
WITH_EXAMPLES = [m for m in MODULES if _examples(m)]
# Examples that train for seconds run in the slow tier.
TRAINING_EXAMPLES = {"tfmulti.insight.diagnose", "tfmulti.training.train", "tfmulti.insight.timing"}


def test_most_modules_have_examples():
    assert len(WITH_EXAMPLES) >= 15, WITH_EXAMPLES


@pytest.mark.parametrize("name", [
    pytest.param(m, marks=pytest.mark.slow) if m in TRAINING_EXAMPLES else m
    for m in WITH_EXAMPLES])
def test_docstring_examples_run(name, tmp_path, monkeypatch):
    tests = _examples(name)
    monkeypatch.chdir(tmp_path)  # examples that write files write them here
    monkeypatch.setenv("TMPDIR", str(tmp_path))
    policy = keras.mixed_precision.global_policy()
    report: list[str] = []
    runner = doctest.DocTestRunner(optionflags=FLAGS)
    try:
        for test in tests:
            runner.run(test, out=report.append)
    finally:
        keras.mixed_precision.set_global_policy(policy)
    assert runner.failures == 0, "".join(report)
