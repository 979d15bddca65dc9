"""The benchmark's core placement (recipes/_bench_utilization.py): `one_core`
confines every thread to one core, `DeviceCore` puts the step's threads on one
core and every later thread on the other; both give all cores back."""

from __future__ import annotations

import importlib.util
import os
import threading
import time

import pytest

from tests._util import REPO

two_cores = pytest.mark.skipif(len(os.sched_getaffinity(0)) < 2,
                               reason="needs 2 cores: the step and the input get one each")


def _bench():
    spec = importlib.util.spec_from_file_location(
        "_bench_utilization", REPO / "recipes" / "_bench_utilization.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)  # standard library imports only
    return module


class _Sleeper:
    """A thread that waits until told to stop; `tid` is its Linux thread id."""

    def __init__(self):
        self._ready, self._stop = threading.Event(), threading.Event()
        self._thread = threading.Thread(target=self._run)
        self._thread.start()
        assert self._ready.wait(10)

    def _run(self):
        self.tid = threading.get_native_id()
        self._ready.set()
        self._stop.wait(30)

    def stop(self):
        self._stop.set()
        self._thread.join(10)


@two_cores
def test_device_core_pins_later_threads_to_the_input_core_and_restores():
    bench, every = _bench(), os.sched_getaffinity(0)
    device = bench.DeviceCore()  # this thread (and pytest's) are the step's
    assert device.step_core != device.input_core
    before = _Sleeper()  # started after DeviceCore: an input thread
    try:
        with device:
            assert os.sched_getaffinity(0) == device.step_core
            assert os.sched_getaffinity(before.tid) == device.input_core
            during = _Sleeper()  # started inside: inherits the step's core ...
            try:
                for _ in range(100):  # ... until the keeper moves it (every 20 ms)
                    if os.sched_getaffinity(during.tid) == device.input_core:
                        break
                    time.sleep(0.02)
                assert os.sched_getaffinity(during.tid) == device.input_core
            finally:
                during.stop()
        assert os.sched_getaffinity(0) == every
        assert os.sched_getaffinity(before.tid) == every
    finally:
        before.stop()
        os.sched_setaffinity(0, every)


def test_device_core_refuses_a_single_core(monkeypatch):
    bench = _bench()
    monkeypatch.setattr(bench.os, "sched_getaffinity", lambda pid: {3})
    with pytest.raises(ValueError, match=r"needs 2 cores.*may use 1"):
        bench.DeviceCore()


@two_cores
def test_one_core_confines_every_thread_then_frees_them():
    bench, every = _bench(), os.sched_getaffinity(0)
    other = _Sleeper()
    try:
        with bench.one_core():
            assert os.sched_getaffinity(0) == {min(every)}
            assert os.sched_getaffinity(other.tid) == {min(every)}
        assert os.sched_getaffinity(0) == every
        assert os.sched_getaffinity(other.tid) == every
    finally:
        other.stop()
        os.sched_setaffinity(0, every)
