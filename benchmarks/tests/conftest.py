"""The set-up of tests/conftest.py, for the tests of `benchmarks`: the 4
virtual CPU devices (configured once per pytest process, before anything
starts the TensorFlow runtime), its fixtures, and the rule that a test
starting a process is marked cluster, notebook or slow."""

from __future__ import annotations

from tests.conftest import *  # noqa: F401,F403  (the devices, the fixtures)
from tests.conftest import pytest_runtest_setup, pytest_runtest_teardown  # noqa: F401  (hooks)
from tests.conftest import _young_iterators_destroyed  # noqa: F401  (autouse)
