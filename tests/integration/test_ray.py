"""Training on Ray (`tfmulti.ray`), on a real local Ray: 2 Ray Train workers, one
killed mid-run; Ray starts them again, they resume from the backup, and the run
ends with the weights of the uninterrupted run on a TF_CONFIG cluster; no Ray
process is left behind."""

from __future__ import annotations

import concurrent.futures
import json
import os
import shutil
import signal
import tempfile
import threading
import time
import uuid
from pathlib import Path

import numpy as np
import pytest

from tests._util import RECIPES, WORKERS, cluster_python_warm, run_python_warm
from tests.workers import ray_train

KILL_AT_STEP = 3 * ray_train.BACKUP_EVERY  # the step's backup is not taken: resumes 1 back
MARKER = "TFMULTI_TEST_RAY_RUN"


def _processes_with(marker: str) -> list[str]:
    """The live processes whose environment holds `marker` (Ray's processes
    inherit the driver's), as "PID COMMAND"."""
    found = []
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit() or int(entry.name) == os.getpid():
            continue
        try:
            if marker.encode() in (entry / "environ").read_bytes():
                command = (entry / "cmdline").read_bytes().replace(b"\0", b" ")
                found.append(f"{entry.name} {command.decode(errors='replace')[:120]}")
        except OSError:  # gone meanwhile, or a kernel thread
            continue
    return found


def _left_over(marker: str, wait_s: float = 60.0) -> list[str]:
    """The processes still holding `marker` after up to `wait_s` for them to end
    (ray.shutdown stops them; their exits take a moment); those are killed."""
    deadline = time.monotonic() + wait_s
    while (left := _processes_with(marker)) and time.monotonic() < deadline:
        time.sleep(1.0)
    for line in left:  # cleaned up, then reported by the test
        try:
            os.kill(int(line.split()[0]), signal.SIGKILL)
        except OSError:
            pass
    return left


def _weights(model_dir: Path) -> list[np.ndarray]:
    import keras

    return keras.models.load_model(model_dir / "model.keras").get_weights()


@pytest.mark.cluster
@pytest.mark.timeout(900)
def test_a_killed_worker_restarts_and_the_run_resumes_exactly(tmp_path):
    # Ray's sockets live in its temp dir: a short path (108 bytes at most).
    ray_tmp = tempfile.mkdtemp(prefix="ray-", dir="/tmp")
    marker = f"{MARKER}={uuid.uuid4().hex}"
    seen, done = set(), threading.Event()

    def watch():  # Ray's processes while it runs: the check below looks for the right ones
        while not done.wait(1.0):
            seen.update(line.split()[1] for line in _processes_with(marker))

    watcher = threading.Thread(target=watch, daemon=True)
    watcher.start()
    reference = tmp_path / "reference"
    try:
        with concurrent.futures.ThreadPoolExecutor(max_workers=1) as pool:
            on_ray = pool.submit(
                run_python_warm,
                [str(WORKERS / "ray_train.py"), str(tmp_path), f"--kill_at_step={KILL_AT_STEP}"],
                timeout=840, env={"RAY_TMPDIR": ray_tmp, "HOME": str(tmp_path),
                                  MARKER: marker.split("=")[1]})
            # Meanwhile, the uninterrupted reference: the same run on 2 workers started by
            # TF_CONFIG (the launcher's own tests are in test_launcher.py).
            code, output = cluster_python_warm(
                [str(RECIPES / "train.py"), *ray_train.FLAGS,
                 f"--model_dir={reference / 'model'}", f"--backup_dir={reference / 'backup'}"],
                num_workers=2)
            result = on_ray.result()
    finally:
        done.set()
        watcher.join()
        left = _left_over(marker)
        shutil.rmtree(ray_tmp, ignore_errors=True)
    assert code == 0, output[-3000:]
    log = result.stdout[-4000:] + result.stderr[-6000:]
    assert result.returncode == 0, log
    assert {"raylet", "gcs_server"} <= {os.path.basename(p) for p in seen}, seen
    assert left == [], f"Ray processes left behind: {left}"
    run = json.loads(result.stdout.strip().splitlines()[-1])
    fired = json.loads((tmp_path / "fired").read_text())  # worker 1 killed itself
    assert (fired["worker"], fired["signal"]) == (1, "KILL"), fired
    metrics = run["metrics"]
    # Ray started the workers again; they resumed at the last backup before the kill.
    assert metrics["resumed_from_step"] == KILL_AT_STEP - ray_train.BACKUP_EVERY, log
    assert metrics["epochs_completed"] == ray_train.EPOCHS
    expected = json.loads((reference / "model" / "metrics.json").read_text())
    assert metrics["test_loss"] == expected["test_loss"]
    model_dir = Path(run["model_dir"])
    assert model_dir == tmp_path / "ray" / "run" / "model"
    assert json.loads((model_dir / "metrics.json").read_text())["test_loss"] == metrics["test_loss"]
    for got, want in zip(_weights(model_dir), _weights(reference / "model"), strict=True):
        np.testing.assert_array_equal(got, want)
    assert not os.path.exists(run["backup_dir"])  # removed once the outputs were written
