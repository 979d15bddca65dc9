"""Training on Ray (`tfmulti.ray`), on a real local Ray: the example of
docs/how-to/ray.md, run as written (2 Ray Train workers on a local Ray it starts
and stops), with one worker killed mid-run; Ray starts them again, they resume
from the backup, and the run ends with the weights of the same run uninterrupted
on a TF_CONFIG cluster; no Ray process is left behind. (The docs tests leave
this block to this test: one local Ray for both checks.)"""

from __future__ import annotations

import ast
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

from benchmarks import failpoints
from tests._util import RECIPES, REPO, cluster_python_warm, run_python
from tests.integration.test_docs import RAY_EXAMPLE
from tfmulti.config.train_config import resolve_steps_per_execution

MARKER = "TFMULTI_TEST_RAY_RUN"


def _example_config() -> dict:
    """The keyword arguments of the example's `TrainConfig(...)` (literals)."""
    (call,) = [node for node in ast.walk(ast.parse(RAY_EXAMPLE.code))
               if isinstance(node, ast.Call) and getattr(node.func, "id", "") == "TrainConfig"]
    return {k.arg: ast.literal_eval(k.value) for k in call.keywords}


CONFIG = _example_config()
STEPS_PER_EPOCH = CONFIG["num_examples"] // CONFIG["global_batch_size"]
BACKUP_EVERY = CONFIG["backup_every_steps"]
# Worker 1 dies at the first epoch's end, where a backup is due (not taken): the
# run resumes from the backup before it, in the middle of the first epoch, and
# crosses an epoch end again. The failpoint (`backup.step`, at a call's end) counts
# calls of `steps_per_execution` steps ("auto": a divisor of BACKUP_EVERY).
KILL_AT_STEP = STEPS_PER_EPOCH
STEPS_PER_CALL = resolve_steps_per_execution(CONFIG.get("steps_per_execution", "auto"),
                                             STEPS_PER_EPOCH, BACKUP_EVERY)


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
            # The example as written. Ray's processes inherit the driver's environment:
            # the failpoint (benchmarks.failpoints, from this checkout) kills worker 1
            # once; on a busy machine the first worker waits up to 300 s for the other.
            on_ray = pool.submit(
                run_python, ["-c", RAY_EXAMPLE.code], timeout=840,
                env={"RAY_TMPDIR": ray_tmp, "HOME": str(tmp_path), "TMPDIR": str(tmp_path),
                     MARKER: marker.split("=")[1], "PYTHONPATH": str(REPO),
                     "TFMULTI_STARTUP_TIMEOUT": "300",
                     "TFMULTI_FAULTS": failpoints.environ_value([failpoints.Fault(
                         "backup.step", worker=1, hit=KILL_AT_STEP // STEPS_PER_CALL,
                         signal="KILL", once=str(tmp_path / "fired"))])})
            # Meanwhile, the uninterrupted reference: the same run on 2 workers started by
            # TF_CONFIG (the launcher's own tests are in test_launcher.py).
            code, output = cluster_python_warm(
                [str(RECIPES / "train.py"), "--distribution=multi_worker",
                 *(f"--{name}={value}" for name, value in CONFIG.items()),
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
    fired = json.loads((tmp_path / "fired").read_text())  # worker 1 killed itself
    assert (fired["worker"], fired["signal"]) == (1, "KILL"), fired
    # What the example prints: the chief's num_workers, test_loss and resumed_from_step,
    # then the run's model_dir (Ray's storage under the example's mkdtemp).
    lines = result.stdout.strip().splitlines()
    model_dir = Path(lines[-1])
    assert model_dir.is_relative_to(tmp_path) and model_dir.name == "model", log
    num_workers, test_loss, resumed_from_step = lines[-2].split()
    # Ray started the workers again; they resumed at the last backup before the kill.
    assert (num_workers, resumed_from_step) == ("2", str(KILL_AT_STEP - BACKUP_EVERY)), log
    metrics = json.loads((model_dir / "metrics.json").read_text())
    assert metrics["epochs_completed"] == CONFIG["epochs"]
    expected = json.loads((reference / "model" / "metrics.json").read_text())
    assert float(test_loss) == metrics["test_loss"] == expected["test_loss"]
    for got, want in zip(_weights(model_dir), _weights(reference / "model"), strict=True):
        np.testing.assert_array_equal(got, want)
    # The backup (next to the outputs: storage_path/name/backup) is removed once they
    # were written.
    assert not (model_dir.parent / "backup").exists()
