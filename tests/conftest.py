"""Test set-up: 4 virtual CPU devices, configured once per pytest process,
before anything starts the TensorFlow runtime; and the test tiers.

Tiers (markers, registered in setup.cfg): `cluster` (starts a multi-process
cluster or the launcher), `notebook` (executes a notebook), `slow` (starts
another process, or trains for long). `make test-fast` runs the rest: no
processes, no notebooks. A test that starts a process without one of these
markers fails, so the fast tier stays process-free.
"""

from __future__ import annotations

import gc
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
# suite starts that runs the user's commands (recipes, `tfmulti train` under the
# launcher, notebooks, the docs' code) runs with it on, as users do, so the
# optimized graphs are still trained end to end; the corpus' cluster workers
# (tests/workers/corpus.py), which trace every program again, turn it off too.
import tensorflow as tf  # noqa: E402

tf.config.optimizer.set_experimental_options({"disable_meta_optimizer": True})

# The objects made so far (TensorFlow's and Keras' modules: millions) live as
# long as the process; frozen, Python's cyclic garbage collector no longer
# scans them in every full collection. In a pytest worker each full collection
# took 0.6-5 s, about 40 of the fast tier's 270 CPU-seconds; frozen, the tier
# runs in 109 s instead of 133-140 s here. Nothing a test checks changes (the
# objects made by the tests are collected as before).
gc.freeze()


# A tf.data iterator that lived a minute or more takes up to a minute to be
# destroyed: its autotuning thread first ends the optimization period it waits
# in (TensorFlow 2.21; here an iterator of 100 s took 42 s, one of 12 s none).
# Keras keeps a fit's iterator in reference cycles, so a test's iterators were
# destroyed by whichever later garbage collection found them, old by then: a
# later test stalled in it, without CPU, for 36-188 s in a process-tier run.
# Each test that made an iterator now has its garbage collected as it ends,
# while its iterators are young; what survives is then frozen like the import's
# objects, so that the next such collection scans only what later tests made
# (unfrozen, each collection took 0.25-0.5 s in a worker, growing with the
# session: 48 of the fast tier's 259 CPU-seconds). A frozen object that later
# becomes cyclic garbage (a module fixture's model) stays, never destroyed: an
# old iterator among them then never stalls a test.
from tensorflow.python.data.ops import iterator_ops  # noqa: E402

_iterators_made = [0]
_owned_iterator_init = iterator_ops.OwnedIterator.__init__


def _counted_iterator_init(self, *args, **kwargs):
    _iterators_made[0] += 1
    _owned_iterator_init(self, *args, **kwargs)


iterator_ops.OwnedIterator.__init__ = _counted_iterator_init


@pytest.fixture(autouse=True)
def _young_iterators_destroyed():
    made = _iterators_made[0]
    yield
    if _iterators_made[0] != made:
        gc.collect()
        gc.freeze()


@pytest.fixture(scope="session")
def fashion_mnist_data_dir() -> str:
    """The TFDS data dir holding real Fashion-MNIST (prepared from the Debian
    package's IDX files if needed; `make test` installs the package)."""
    from tfmulti import data

    return data.prepare_fashion_mnist(data.default_data_dir())


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_setup(item):
    """Fails a test that starts a process but is not marked cluster, notebook
    or slow, from the set-up of its fixtures (a module fixture's process
    counts: it runs in the test's set-up) to its end."""
    if PROCESS_MARKERS & {m.name for m in item.iter_markers()}:
        yield
        return
    real = subprocess.Popen
    nodeid = item.nodeid

    class _Refused(real):
        def __init__(self, args, *rest, **kwargs):
            raise RuntimeError(f"{nodeid} starts a process ({args!r}) but is not marked "
                               f"{' / '.join(sorted(PROCESS_MARKERS))}; mark it so that "
                               "`make test-fast` stays process-free.")

    subprocess.Popen = _Refused
    item._real_popen = real
    yield


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_teardown(item):
    yield
    real = getattr(item, "_real_popen", None)
    if real is not None:
        subprocess.Popen = real
