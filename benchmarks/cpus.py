"""Which core each thread of a benchmark runs on, and what 2 cores give at most.

Standard library only (no TensorFlow), Linux (`os.sched_setaffinity` and
`/proc/self/task`):

* `one_core`: every thread of this process on one core, for timing one side
  of a step "alone" without its helper threads borrowing the other core;
* `DeviceCore`: the step's threads on one core and the input's on the other,
  as a device and its host;
* `hardware_ceiling`: how much 2 independent single-threaded processes on 2
  cores outrun 1, the most any 2-worker run can gain on this machine.
"""

from __future__ import annotations

import contextlib
import os
import subprocess
import sys
import threading

from tfmulti.utils import checks

__all__ = ["DeviceCore", "hardware_ceiling", "one_core"]


def _threads() -> set[int]:
    """The Linux thread ids of this process."""
    return {int(tid) for tid in os.listdir("/proc/self/task")}


def _pin(threads, cores) -> None:
    for tid in threads:
        try:
            os.sched_setaffinity(tid, cores)
        except OSError:  # the thread ended meanwhile
            pass


@contextlib.contextmanager
def one_core():
    """Confines every thread of this process to one core, then frees them.

    Timing the input or the step "alone" otherwise lets its helper threads
    (tf.data's prefetch and copy, the executor, Python) use the idle second
    core, which they cannot when the other side runs beside it."""
    every = os.sched_getaffinity(0)
    _pin(_threads(), {min(every)})
    try:
        yield
    finally:
        _pin(_threads(), every)


class DeviceCore:
    """One core stands in for the device, the other for its host.

    Built once TensorFlow's runtime has started and before any input pipeline
    runs, it takes the threads that exist then (Python's main thread,
    TensorFlow's inter-op and intra-op pools: the ones that run the step) as
    the step's; every thread started later (tf.data's pools and runners,
    prefetch-to-device's transfers) is the input's. Within `with`, the step's
    threads run on the first core only and the input's on the second only,
    re-checked every 20 ms for new threads (a new thread inherits its
    creator's core, which may be the step's). So each side has exactly the
    core it had when timed alone under `one_core`, as a device and its host
    would, instead of the OS mixing the two sides' threads on both cores.
    On leaving, every thread gets all the cores back.

    Raises:
        ValueError: this process may use fewer than 2 cores.
    """

    def __init__(self):
        every = sorted(os.sched_getaffinity(0))
        if len(every) < 2:
            raise ValueError(f"the streaming suite needs 2 cores, one for the step and one for "
                             f"the input; this process may use {len(every)}.")
        self.every, self.step_core, self.input_core = set(every), {every[0]}, {every[1]}
        self.step_threads = _threads()
        self._stop = threading.Event()
        self._keeper = None

    def __repr__(self) -> str:
        return (f"DeviceCore(step_core={sorted(self.step_core)}, "
                f"input_core={sorted(self.input_core)}, step_threads={len(self.step_threads)})")

    @contextlib.contextmanager
    def step_thread(self):
        """Counts the calling thread as the step's while inside (enter it from
        that thread)."""
        tid = threading.get_native_id()
        self.step_threads.add(tid)
        os.sched_setaffinity(0, self.step_core)
        try:
            yield
        finally:
            self.step_threads.discard(tid)

    def _apply(self) -> None:
        now = _threads()
        _pin(now & self.step_threads, self.step_core)
        _pin(now - self.step_threads, self.input_core)

    def _keep(self) -> None:
        while not self._stop.wait(0.02):
            self._apply()

    def __enter__(self):
        self._apply()
        self._stop.clear()
        self._keeper = threading.Thread(target=self._keep, daemon=True)
        self._keeper.start()
        return self

    def __exit__(self, *exc):
        self._stop.set()
        self._keeper.join()
        _pin(_threads(), self.every)


_SPIN = """
import os, sys, time
os.sched_setaffinity(0, {int(sys.argv[1])})
import numpy as np
a = np.random.default_rng(0).random((384, 384), dtype=np.float32)
end, n = time.perf_counter() + float(sys.argv[2]), 0
while time.perf_counter() < end:
    a @ a
    n += 1
print(n)
"""


def hardware_ceiling(seconds: float = 3.0) -> float:
    """How much 2 independent single-core processes outrun 1 on this machine
    (1 thread each, no communication): the most any 2-worker run can gain.

    Each process multiplies a 384 x 384 matrix for `seconds`, pinned to its
    core; the figure is the matmuls of 2 at once over those of 1 alone.
    """
    checks.positive_number("seconds", seconds)
    env = {**os.environ, "OPENBLAS_NUM_THREADS": "1", "OMP_NUM_THREADS": "1",
           "MKL_NUM_THREADS": "1"}
    cores = sorted(os.sched_getaffinity(0))[:2]
    if len(cores) < 2:
        raise ValueError(f"hardware_ceiling needs 2 cores; this process may use {len(cores)}.")

    def spin(core):
        return subprocess.Popen([sys.executable, "-c", _SPIN, str(core), str(seconds)],
                                stdout=subprocess.PIPE, text=True, env=env)

    spinning = []
    try:
        spinning.append(spin(cores[0]))
        alone = int(spinning[0].communicate(timeout=60)[0])
        spinning[:] = [spin(c) for c in cores]
        together = sum(int(p.communicate(timeout=60)[0]) for p in spinning)
    finally:
        for p in spinning:  # none left behind after a timeout
            if p.poll() is None:
                p.kill()
                p.wait()
    return together / alone
