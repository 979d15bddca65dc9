"""Test set-up: 4 virtual CPU devices, configured once per pytest process,
before anything starts the TensorFlow runtime; and the test tiers.

Tiers (markers, registered in setup.cfg): `cluster` (starts a multi-process
cluster or the launcher), `notebook` (executes a notebook), `slow` (starts
another process, or trains for long). `make test-fast` runs the rest: no
processes, no notebooks. A test that starts a process without one of these
markers fails, so the fast tier stays process-free.
"""

from __future__ import annotations

import os
import subprocess

os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")

import pytest  # noqa: E402

import tfmulti  # noqa: E402

# Fixtures that both halves (unit, integration) of a test file use: defined in
# tests/_util.py, offered to every test from here.
from tests._util import big_batch, fake_idx  # noqa: E402, F401

NUM_TEST_DEVICES = 4
PROCESS_MARKERS = frozenset({"cluster", "notebook", "slow"})
tfmulti.configure_virtual_devices(NUM_TEST_DEVICES)

# In the pytest processes, TensorFlow's graph optimizer (grappler) is off: the
# tests build hundreds of small models and trace each one's first step, and
# grappler's passes cost about half of that tracing while changing no result a
# test checks (it rewrites graphs, not what they compute). Every process the
# suite starts (recipes, launched workers, notebooks, the docs' commands) runs
# with it on, as users do, so the optimized graphs are still trained end to end.
import tensorflow as tf  # noqa: E402

tf.config.optimizer.set_experimental_options({"disable_meta_optimizer": True})


@pytest.fixture(scope="session")
def fashion_mnist_data_dir() -> str:
    """The TFDS data dir holding real Fashion-MNIST (prepared from the Debian
    package's IDX files if needed; `make test` installs the package)."""
    from tfmulti import data

    return data.prepare_fashion_mnist(data.default_data_dir())


@pytest.fixture(autouse=True)
def _processes_need_a_marker(request, monkeypatch):
    """Fails a test that starts a process but is not marked cluster, notebook or slow."""
    if PROCESS_MARKERS & {m.name for m in request.node.iter_markers()}:
        return
    real = subprocess.Popen
    nodeid = request.node.nodeid

    class _Refused(real):
        def __init__(self, args, *rest, **kwargs):
            raise RuntimeError(f"{nodeid} starts a process ({args!r}) but is not marked "
                               f"{' / '.join(sorted(PROCESS_MARKERS))}; mark it so that "
                               "`make test-fast` stays process-free.")

    monkeypatch.setattr(subprocess, "Popen", _Refused)
