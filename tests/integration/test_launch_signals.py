"""SIGTERM to `tfmulti launch` stops real MultiWorkerMirroredStrategy workers
(recipes/train.py, TensorFlow) that keep no backup, long before the grace
period: TensorFlow's coordination service catches SIGTERM in every worker, so
SIGTERM alone never ended them. (With a backup the workers save first:
tests/integration/test_backup.py; the stop's rules on fake workers:
tests/unit/test_supervisor.py. SIGINT takes the same stop, the workers getting
SIGTERM then SIGKILL as here: its line and status on workers that sleep,
tests/integration/test_launcher.py::test_sigint_to_the_launcher_stops_all_workers.)

The workers read a slow input (tests/workers/slow_input.py: each example waits
5 ms): in the seconds between the launcher's SIGTERM and its SIGKILL
(`save_notice.STOP_WITHOUT_SAVE_S`) they mostly wait for data inside `fit`
instead of training flat out on both cores (~6 CPU-s a launch, ~1 with the wait);
where in `fit` they are when the signal comes is not what is tested.
"""

from __future__ import annotations

import contextlib
import os
import re
import signal
import subprocess
import sys
import threading

import pytest

from tests._util import RECIPES, REPO
from tests.integration.test_launcher import _processes_with, _wait_for

pytestmark = pytest.mark.cluster

GRACE_PERIOD = 600  # what the launcher would wait for workers that save on SIGTERM
STARTED_WITHIN = 240  # TensorFlow's import, the cluster's start, two epochs
STOPPED_WITHIN = 120  # generous: the workers get SIGKILL a few seconds after SIGTERM


@pytest.mark.timeout(600)
def test_sigterm_to_the_launcher_stops_workers_without_a_backup(tmp_path):
    sig = signal.SIGTERM
    marker = str(tmp_path / "run")
    proc = subprocess.Popen(
        [sys.executable, "-m", "tfmulti.cli", "launch", "--num_workers", "2",
         "--grace_period", str(GRACE_PERIOD), "--", sys.executable,
         str(RECIPES / "train.py"), "--distribution=multi_worker",
         "--dataset=tests.workers.slow_input:data", "--num_examples=256",
         "--global_batch_size=64", "--epochs=100000",
         f"--model_dir={marker}"],
        cwd=REPO, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
        start_new_session=True, env={**os.environ, "TF_CPP_MIN_LOG_LEVEL": "2"})
    lines, training = [], threading.Event()

    def read():
        for line in proc.stdout:
            lines.append(line)
            if line.startswith("[worker 0] Epoch 3/"):  # both workers are inside `fit`
                training.set()

    reader = threading.Thread(target=read, daemon=True)
    reader.start()
    try:
        assert training.wait(STARTED_WITHIN), "".join(lines[-50:])
        workers = [pid for pid in _processes_with(marker)
                   if _argv(pid)[1:2] == [str(RECIPES / "train.py")]]
        assert len(workers) == 2, "".join(lines[-50:])
        proc.send_signal(sig)
        proc.wait(timeout=STOPPED_WITHIN)
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait(timeout=30)
        reader.join(timeout=30)
        for pid in _processes_with(marker):
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, signal.SIGKILL)
    output = "".join(lines)
    assert proc.returncode == 128 + sig, output[-4000:]
    name = signal.Signals(sig).name
    assert f"tfmulti launch: got {name}; stopping the workers" in output
    summary = [line for line in output.splitlines()
               if line.startswith(f"tfmulti launch: stopped by {name} to the launcher: ")]
    assert len(summary) == 1, output[-4000:]
    assert summary[0].endswith(f"; exit status {128 + sig}"), summary
    for rank in (0, 1):  # TensorFlow catches SIGTERM: the launcher's SIGKILL ends them
        assert re.search(rf"worker {rank} was killed by SIG(KILL|TERM)\b", summary[0]), summary
    _wait_for(lambda: not _processes_with(marker), 30,
              f"every process of the launch (the workers: {workers}) to exit")


def _argv(pid: int) -> list[str]:
    with contextlib.suppress(OSError):
        with open(f"/proc/{pid}/cmdline", "rb") as f:
            return f.read().decode(errors="replace").split("\0")
    return []
