"""Fault tolerance: backup and restore (tfmulti.training.backup), preemption, restarts,
dead peers.

The end-to-end tests train the same small deterministic run (synthetic data,
SGD, no dropout, 3 epochs x 16 steps, a backup every 4 steps:
tests/workers/resumable.py), kill it in the middle of an epoch after a backup
exists, let it resume, and compare the final weights with an uninterrupted
run's. Every subprocess has a timeout; the launcher reaps its workers.
"""

from __future__ import annotations

import contextlib
import glob
import json
import os
import re
import select
import signal
import socket
import subprocess
import sys
import time

import numpy as np
import pytest

from tests._util import REPO, WORKERS, file_tree, free_port, launch_python, run_python
from tests.workers import resumable, slurm_backup, user_model
from tfmulti.training import backup
from tfmulti.cluster import exit_codes, tf_config

WORKER = str(WORKERS / "resumable.py")
SLURM_WORKER = str(WORKERS / "slurm_backup.py")
TOTAL_STEPS = 3 * 16


def _final(out_dir) -> tuple[int, list[np.ndarray]]:
    with np.load(os.path.join(out_dir, "final.npz")) as f:
        weights = [f[k] for k in sorted((k for k in f.files if k != "iterations"),
                                        key=lambda k: int(k.split("_")[1]))]
        return int(f["iterations"]), weights


def _assert_same_weights(out_dir, reference) -> None:
    iterations, weights = _final(out_dir)
    ref_iterations, ref_weights = reference
    assert iterations == ref_iterations == TOTAL_STEPS
    assert len(weights) == len(ref_weights)
    for a, b in zip(weights, ref_weights):
        np.testing.assert_allclose(a, b, atol=1e-5, rtol=0)


def _private_tmp(monkeypatch, tmp_path) -> str:
    """A TMPDIR for the workers a test starts, to show they leave no scratch dir behind."""
    folder = tmp_path / "tmp"
    folder.mkdir()
    monkeypatch.setenv("TMPDIR", str(folder))
    return str(folder)


def _scratch_dirs(tmp: str) -> list[str]:
    """tfmulti's scratch dirs in `tmp` (TensorFlow's autograph leaves files there too)."""
    return [name for name in os.listdir(tmp) if name.startswith("tfmulti-")]


def _resumed(out_dir, step: int) -> str:
    path = os.path.join(out_dir, "backup", f"tfmulti-ckpt-{step}")
    return f"resuming from {path}: global step {step}"


class _Keep:
    """A callback keeping the final weights and step count."""

    def __new__(cls):
        import keras

        class Keep(keras.callbacks.Callback):
            def on_train_end(self, logs=None):
                self.weights = [np.array(w) for w in self.model.get_weights()]
                self.iterations = int(self.model.optimizer.iterations.numpy())

        return Keep()


@pytest.fixture(scope="module")
def uninterrupted(tmp_path_factory):
    """The reference: MirroredStrategy over 2 devices (equal to 2 workers x 1
    device within 1e-5, tests/test_strategy.py), never interrupted;
    trained in this process (2 of the 4 virtual CPUs)."""
    from tfmulti.config.train_config import TrainConfig
    from tfmulti.training.train import train

    out = tmp_path_factory.mktemp("uninterrupted")
    keep = _Keep()
    train(TrainConfig(**{**resumable.FIELDS, "verbose": 0}, distribution="mirrored",
                      devices=("CPU:0", "CPU:1"), backup_dir=str(out / "backup")),
          callbacks=[keep])
    assert not (out / "backup").exists()  # deleted after a clean end
    return keep.iterations, keep.weights


# ----------------------------------------------------------------------------- end to end


@pytest.mark.cluster
def test_multi_worker_sigkill_restarts_and_matches_uninterrupted(tmp_path, uninterrupted,
                                                                 monkeypatch):
    """Each worker SIGKILLed once in one launch (merges the old [victim=1] and
    [victim=0] cases): worker 1 at step 22 (after the backup at 20), then the
    chief at step 30 (after the backup at 28); each restart resumes from the
    last backup and the result is the uninterrupted run's."""
    scratch = _private_tmp(monkeypatch, tmp_path)
    code, output = launch_python([WORKER, str(tmp_path), "multi_worker", "--kill", "22:1",
                                  "--kill", "30:0"], max_restarts=2, grace_period=5)
    assert code == 0, output[-4000:]
    for victim in (1, 0):
        assert f"worker {victim} failed with exit code 137 (killed by SIGKILL)" in output, \
            output[-4000:]
    assert "restart 1 of 2" in output and "restart 2 of 2" in output
    first, second = _resumed(tmp_path, 20), _resumed(tmp_path, 28)  # the last backups
    assert first in output and second in output, output[-4000:]
    assert output.index(first) < output.index(second)
    _assert_same_weights(tmp_path, uninterrupted)
    metrics = json.loads((tmp_path / "metrics.json").read_text())
    assert metrics["resumed_from_step"] == 28 and metrics["epochs_completed"] == 3
    assert not (tmp_path / "backup").exists()  # deleted when training ended cleanly
    assert _scratch_dirs(scratch) == []  # no worker's temporary dir left


@pytest.mark.cluster
def test_multi_worker_sigterm_saves_at_agreed_step(tmp_path, uninterrupted, monkeypatch):
    scratch = _private_tmp(monkeypatch, tmp_path)
    code, output = launch_python([WORKER, str(tmp_path), "multi_worker", "--kill", "22:1:TERM",
                                  "--config", json.dumps({"keep_backup": True})],
                                 max_restarts=1, grace_period=30)
    assert code == 0, output[-4000:]
    assert "exit code 75 (preempted" in output, output[-4000:]
    # Worker 1 got SIGTERM at step 22; both saved at the next boundary, 23.
    assert "backup at global step 23 (preempted)" in output, output[-4000:]
    assert _resumed(tmp_path, 23) in output
    _assert_same_weights(tmp_path, uninterrupted)
    # keep_backup: only the chief's directory exists, with the newest 2 checkpoints.
    kept = sorted(os.path.basename(p) for p in glob.glob(str(tmp_path / "backup" / "*.index")))
    assert kept == ["tfmulti-ckpt-44.index", "tfmulti-ckpt-48.index"]
    assert _scratch_dirs(scratch) == []


@pytest.mark.cluster
def test_sigterm_to_the_launcher_saves_on_all_workers_and_does_not_restart(tmp_path):
    """What a scheduler does (Kubernetes, SLURM): SIGTERM to the launcher. Every
    worker saves at the same step, the launcher exits 128 + 15 without restarting."""
    proc = subprocess.Popen(
        [sys.executable, "-m", "tfmulti.cli", "launch", "--num_workers", "2", "--max_restarts",
         "2", "--grace_period", "30", "--", sys.executable, WORKER, str(tmp_path),
         "multi_worker", "--config", json.dumps({"epochs": 100})],
        stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, cwd=REPO,
        env={**os.environ, "TF_CPP_MIN_LOG_LEVEL": "2"})
    lines = []
    try:
        for line in proc.stdout:
            lines.append(line)
            if "backup at global step 8 " in line:
                proc.send_signal(signal.SIGTERM)
                break
        lines += proc.communicate(timeout=180)[0].splitlines()
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait(timeout=30)
    output = "".join(line if line.endswith("\n") else line + "\n" for line in lines)
    assert proc.returncode == 128 + signal.SIGTERM, output[-4000:]
    saved = {int(m) for m in re.findall(
        r"\[worker \d\] tfmulti: preempted: saved a backup at global step (\d+)", output)}
    assert output.count("preempted: saved a backup") == 2 and len(saved) == 1, output[-4000:]
    assert "restart 1" not in output
    assert backup.latest_valid(str(tmp_path / "backup")).step == saved.pop()


@pytest.mark.cluster
@pytest.mark.timeout(900)
def test_a_faked_slurm_job_has_one_writer_one_resume_point_and_a_coordinated_preemption(
        tmp_path, monkeypatch):
    """2 tasks of a SLURM job step on this host, roles from SLURM's variables only
    (no TF_CONFIG): task 0 alone writes (backups, results, the SavedModel); task 1
    SIGKILLed at step 10, and after the restart both tasks resume from the
    backup at 8; task 0 SIGTERMed at step 18, and both save at 19 and exit 75;
    the last restart resumes both from 19 and ends with the uninterrupted
    2-replica run's weights; its SavedModel predicts like the trained model."""
    import tfmulti

    strategy = tfmulti.get_strategy("mirrored", devices=["CPU:0", "CPU:1"])
    with strategy.scope():
        reference = slurm_backup.build_model()
    slurm_backup.fit(reference, strategy, str(tmp_path / "reference")).delete_backup()
    scratch = _private_tmp(monkeypatch, tmp_path)
    out = tmp_path / "job"
    out.mkdir()
    code, output = launch_python([SLURM_WORKER, str(out), "--kill", "10:1", "--kill",
                                  "18:0:TERM"], max_restarts=2, grace_period=30)
    assert code == 0, output[-4000:]
    assert "[worker 0] slurm_backup: task 0: chief=True rank=0 of 2" in output, output[-4000:]
    assert "[worker 1] slurm_backup: task 1: chief=False rank=1 of 2" in output
    # One writer: only task 0 reports backups, writes its results and the SavedModel.
    writers = set(re.findall(r"\[worker (\d)\] tfmulti: backup at global step", output))
    assert writers == {"0"}, output[-4000:]
    assert sorted(os.listdir(out)) == ["final-0.npz", "killed-10-1", "killed-18-0", "serving"]
    assert "[worker 1] slurm_backup: task 1 exported: None" in output
    # One resume point after the SIGKILL, one agreed save on SIGTERM.
    assert "slurm_backup: worker 1 sends itself SIGKILL at step 10" in output
    assert "worker 1 failed with exit code 137 (killed by SIGKILL)" in output
    for task in (0, 1):
        for step in (8, 19):
            assert f"[worker {task}] tfmulti: {_resumed(out, step)}" in output, output[-4000:]
    assert "slurm_backup: worker 0 sends itself SIGTERM at step 18" in output
    saved = re.findall(r"\[worker (\d)\] tfmulti: preempted: saved a backup at global step "
                       r"(\d+)", output)
    assert sorted(saved) == [("0", "19"), ("1", "19")], output[-4000:]
    assert "exit code 75 (preempted" in output
    assert "restart 2 of 2" in output
    with np.load(out / "final-0.npz") as final:
        assert int(final["iterations"]) == 32 and int(final["resumed_step"]) == 19
        weights = [final[f"w{i}"] for i in range(len(reference.get_weights()))]
        predictions = final["predictions"]
    for a, b in zip(weights, reference.get_weights()):
        np.testing.assert_allclose(a, b, atol=1e-5, rtol=0)
    import tensorflow as tf

    served = tf.saved_model.load(str(out / "serving"))  # kept: it owns the variables
    np.testing.assert_allclose(served.serve(slurm_backup.probe()).numpy(), predictions,
                               atol=1e-6, rtol=0)
    assert not (out / "backup").exists()  # deleted by task 0 after its results
    assert _scratch_dirs(scratch) == []


@pytest.mark.slow
def test_mirrored_killed_then_rerun_resumes(tmp_path, uninterrupted):
    """One process per interruption, each rerun of the run resuming the last,
    all with 4 steps per call (the steps per call are part of the backup's
    fingerprint; 1 step per call is the multi-worker tests'):

    1. SIGKILL past step 22: it comes at 24, the end of a call, before that
       call's backup: the rerun resumes from the backup at 20;
    2. SIGTERM at 24: saves at that boundary, exits 75;
    3. SIGKILL past 26: it comes at 28, before that call's backup, so the run
       resumes from 24;
    4. to the end: the uninterrupted run's weights.
    """
    backup_dir = tmp_path / "backup"

    def run(*kill):
        args = [WORKER, str(tmp_path), "mirrored", *(["--kill", kill[0]] if kill else []),
                "--config", json.dumps({"num_virtual_devices": 2, "steps_per_execution": 4})]
        return run_python(args, timeout=300)

    killed = run("22:0:KILL")
    assert killed.returncode == -signal.SIGKILL, killed.stderr[-3000:]
    assert "sends itself SIGKILL at step 24" in killed.stdout
    assert backup.latest_valid(str(backup_dir)).step == 20

    preempted = run("24:0:TERM")
    assert preempted.returncode == exit_codes.PREEMPTED, preempted.stderr[-3000:]
    assert _resumed(tmp_path, 20) in preempted.stdout
    # One process: it saves at the boundary where it sees the signal.
    assert "preempted: saved a backup at global step 24" in preempted.stderr

    killed_in_a_call = run("26:0:KILL")
    assert killed_in_a_call.returncode == -signal.SIGKILL, killed_in_a_call.stderr[-3000:]
    assert _resumed(tmp_path, 24) in killed_in_a_call.stdout
    assert "sends itself SIGKILL at step 28" in killed_in_a_call.stdout

    finished = run()
    assert finished.returncode == 0, finished.stderr[-3000:]
    assert _resumed(tmp_path, 24) in finished.stdout  # 28's backup never happened
    _assert_same_weights(tmp_path, uninterrupted)
    metrics = json.loads((tmp_path / "metrics.json").read_text())
    assert metrics["resumed_from_step"] == 24 and metrics["epochs_completed"] == 3
    assert not backup_dir.exists()



@pytest.mark.cluster
@pytest.mark.parametrize("victim", [0, 1])
def test_dead_peer_fails_the_survivor_within_60s(tmp_path, victim):
    """Without the launcher (as on separate hosts): TensorFlow's coordination
    service notices the missing heartbeats and aborts the survivor's collectives."""
    addresses = [f"localhost:{free_port()}", f"localhost:{free_port()}"]
    procs = []
    try:
        for index in range(2):
            env = {**os.environ, "TF_CPP_MIN_LOG_LEVEL": "2",
                   "TF_CONFIG": json.dumps(tf_config.build_tf_config(addresses, index))}
            procs.append(subprocess.Popen(
                [sys.executable, WORKER, str(tmp_path), "multi_worker", "--config",
                 json.dumps({"epochs": 1000, "num_examples": 4096})],
                env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                start_new_session=True))
        chief_lines = []
        deadline = time.monotonic() + 240
        for line in procs[0].stdout:  # wait until training is under way
            chief_lines.append(line)
            if "backup at global step" in line or time.monotonic() > deadline:
                break
        assert any("backup at global step" in line for line in chief_lines), chief_lines[-20:]
        killed_at = time.monotonic()
        procs[victim].send_signal(signal.SIGKILL)
        survivor = procs[1 - victim]
        code = survivor.wait(timeout=90)
        took = time.monotonic() - killed_at
        assert code != 0
        assert took < 60, f"survivor took {took:.1f} s to fail"
    finally:
        for p in procs:
            if p.poll() is None:
                os.killpg(p.pid, signal.SIGKILL)
            p.wait(timeout=10)


@pytest.mark.slow  # trains for seconds
@pytest.mark.parametrize("strategy", ["pipeline", "one_device"])
def test_resumes_in_process(tmp_path, strategy):
    """A PipelineModel (2 stages on 2 virtual CPUs), or one device, crashed
    mid-epoch by an exception, then rerun in the same process: the same
    weights as without the crash."""
    import keras

    from tfmulti.config.train_config import TrainConfig
    from tfmulti.training.train import train

    class Crash(keras.callbacks.Callback):
        def on_train_batch_end(self, batch, logs=None):
            if int(self.model.optimizer.iterations.numpy()) == 10:
                raise RuntimeError("simulated crash")

    def run(backup_dir, callbacks):
        keep = _Keep()
        devices = ("CPU:0", "CPU:1") if strategy == "pipeline" else None
        train(TrainConfig(distribution=strategy, devices=devices, num_stages=2,
                          num_microbatches=2, dataset="synthetic", num_examples=512,
                          global_batch_size=64, epochs=2, optimizer="sgd",
                          learning_rate=0.05, dropout=0.0, seed=0, backup_dir=backup_dir,
                          backup_every_steps=4, steps_per_execution=1, verbose=0),
              callbacks=[*callbacks, keep])
        return keep

    reference = run(str(tmp_path / "a"), [])
    with pytest.raises(RuntimeError, match="simulated crash"):
        run(str(tmp_path / "b"), [Crash()])
    assert backup.latest_valid(str(tmp_path / "b")).step == 8
    resumed = run(str(tmp_path / "b"), [])
    assert resumed.iterations == reference.iterations == 16
    for a, b in zip(resumed.weights, reference.weights):
        np.testing.assert_allclose(a, b, atol=1e-5, rtol=0)


def _xy():
    x = np.random.default_rng(0).random((256, 8), dtype=np.float32)
    return x, (x.sum(axis=1) > 4).astype(np.int32)


def _stream(step):
    import tensorflow as tf

    return tf.data.Dataset.from_tensor_slices(_xy()).batch(32).repeat().skip(step)


class _CrashAt:
    """A callback raising RuntimeError once the optimizer reaches `iteration`."""

    def __new__(cls, iteration):
        import keras

        class Crash(keras.callbacks.Callback):
            def on_train_batch_end(self, batch, logs=None):
                if int(self.model.optimizer.iterations.numpy()) == iteration:
                    raise RuntimeError("simulated crash")

        return Crash()


@pytest.mark.parametrize("with_input", [True, False])
def test_resumes_a_model_made_outside_any_strategy_scope(tmp_path, with_input):
    """Keras builds such a model (and its optimizer) only when its first step
    is traced, after the restore: Adam's moments and iteration count, or for a
    model without an Input its weights, must still be restored."""
    import keras

    def model():
        keras.utils.set_random_seed(1)
        m = keras.Sequential(([keras.Input((8,))] if with_input else [])
                             + [keras.layers.Dense(2)])
        m.compile(keras.optimizers.Adam(0.05),
                  keras.losses.SparseCategoricalCrossentropy(from_logits=True))
        return m

    def run(directory, callbacks=()):
        m = model()
        result = backup.fit(m, _stream, epochs=2, steps_per_epoch=8, save_every_steps=4,
                            backup_dir=str(tmp_path / directory), callbacks=list(callbacks),
                            verbose=0)
        return m, result

    reference, _ = run("a")
    with pytest.raises(RuntimeError, match="simulated crash"):
        run("b", [_CrashAt(14)])
    resumed, result = run("b")
    assert result.resumed_step == 12
    assert int(resumed.optimizer.iterations) == 16
    for a, b in zip(resumed.get_weights(), reference.get_weights()):
        np.testing.assert_allclose(a, b, atol=1e-6, rtol=0)


def test_a_callback_that_stops_the_resumed_epoch_stops_the_run(tmp_path):
    import keras

    class StopAfterSecondEpoch(keras.callbacks.Callback):  # as EarlyStopping would
        def on_epoch_end(self, epoch, logs=None):
            if epoch == 1:
                self.model.stop_training = True

    def run(callbacks):
        m = keras.Sequential([keras.Input((8,)), keras.layers.Dense(2)])
        m.compile("sgd", keras.losses.SparseCategoricalCrossentropy(from_logits=True))
        backup.fit(m, _stream, epochs=4, steps_per_epoch=8, save_every_steps=4,
                   backup_dir=str(tmp_path), callbacks=callbacks, verbose=0)
        return int(m.optimizer.iterations)

    with pytest.raises(RuntimeError, match="simulated crash"):
        run([_CrashAt(14)])
    # Resumed at step 12 (the restored iteration count): the rest of epoch 2,
    # 4 steps, then stopped, as the uninterrupted run stops after 16 steps.
    assert run([StopAfterSecondEpoch()]) == 16


def test_fit_refuses_a_steps_per_execution_the_model_does_not_run(tmp_path):
    m = _small_model(0.0)  # compiled with steps_per_execution 1
    with pytest.raises(ValueError, match=r"`steps_per_execution` \(5\) differs from the "
                                         r"model's \(1\)"):
        backup.fit(m, _stream, epochs=1, steps_per_epoch=10, steps_per_execution=5,
                   backup_dir=str(tmp_path))


# ----------------------------------------------------------------------------- checkpoints


def _small_model(value: float):
    import keras

    m = keras.Sequential([keras.Input((3,)), keras.layers.Dense(2)])
    m.compile("sgd", "mse")
    for v in m.variables:
        v.assign(np.full(v.shape, value, dtype=np.float32))
    return m


def _saved_backups(backup_dir) -> None:
    m = _small_model(1.0)
    saver = backup.Backup(str(backup_dir), m, keep=2, chief=True, task_index=0)
    for step in (4, 8, 12):
        for v in m.variables:
            v.assign(np.full(v.shape, float(step), dtype=np.float32))
        saver.save(step)


def test_keeps_the_newest_two(tmp_path):
    _saved_backups(tmp_path)
    assert [os.path.basename(p) for p in backup.checkpoints(str(tmp_path))] == \
        ["tfmulti-ckpt-12", "tfmulti-ckpt-8"]
    point = backup.latest_valid(str(tmp_path))
    assert point.step == 12 and point.path.endswith("tfmulti-ckpt-12")


@pytest.mark.parametrize("damage", ["truncate data", "garble index", "delete data"])
def test_damaged_latest_falls_back_with_a_warning(tmp_path, damage):
    _saved_backups(tmp_path)
    latest = str(tmp_path / "tfmulti-ckpt-12")
    data_file = glob.glob(latest + ".data-*")[0]
    if damage == "truncate data":
        size = os.path.getsize(data_file)
        with open(data_file, "r+b") as f:
            f.truncate(size // 2)
    elif damage == "garble index":
        with open(latest + ".index", "r+b") as f:
            f.seek(0)
            f.write(b"\xde\xad\xbe\xef" * 16)
    else:
        os.remove(data_file)
    with pytest.warns(RuntimeWarning, match=r"tfmulti-ckpt-12 .* cannot be restored.*falling "
                                            r"back"):
        point = backup.latest_valid(str(tmp_path))
    assert point.step == 8 and point.path.endswith("tfmulti-ckpt-8")
    m = _small_model(0.0)
    saver = backup.Backup(str(tmp_path), m, chief=True, task_index=0)
    saver.restore_weights(point)
    assert all(np.all(np.asarray(v) == 8.0) for v in m.variables)


@pytest.mark.slow
def test_a_crash_during_a_save_leaves_a_consistent_backup(tmp_path):
    """SIGKILL a process that saves ~32 MB checkpoints back to back, at 3
    random points in time: each time, the newest valid checkpoint is complete and
    consistent (every value equals its step), and saving resumes after it."""
    worker = str(WORKERS / "save_loop.py")
    rng = np.random.default_rng(0)
    steps = []
    for _ in range(3):
        proc = subprocess.Popen([sys.executable, worker, str(tmp_path)], stdout=subprocess.PIPE,
                                stderr=subprocess.DEVNULL, text=True,
                                env={**os.environ, "TF_CPP_MIN_LOG_LEVEL": "2"})
        try:
            ready, _, _ = select.select([proc.stdout], [], [], 180)  # after its first save
            assert ready and proc.stdout.readline().strip() == "ready"
            time.sleep(float(rng.uniform(0.3, 1.5)))
        finally:
            proc.kill()
            proc.wait(timeout=30)
        point = backup.latest_valid(str(tmp_path))
        assert point.path is not None
        import tensorflow as tf

        reader = tf.train.load_checkpoint(point.path)
        for name in reader.get_variable_to_shape_map():
            if name.startswith("model/"):
                assert np.all(reader.get_tensor(name) == point.step), name
        steps.append(point.step)
    assert steps == sorted(steps) and steps[-1] > steps[0]  # each run went on from the last


# ----------------------------------------------------------------------------- bad input


@pytest.mark.parametrize("kwargs, match", [
    ({"keep": 0}, r"`keep` must be a positive integer, got 0; use 2 so a damaged newest "
                  r"checkpoint has a fallback"),
    ({"keep": True}, r"`keep` must be a positive integer, got True"),
    ({"backup_dir": ""}, r"`backup_dir` must be a directory path"),
])
def test_backup_bad_arguments(tmp_path, kwargs, match):
    args = {"backup_dir": str(tmp_path), **kwargs}
    with pytest.raises(ValueError, match=match):
        backup.Backup(args.pop("backup_dir"), None, **args)


def test_backup_dir_that_is_a_file(tmp_path):
    path = tmp_path / "file"
    path.write_text("x")
    with pytest.raises(ValueError, match=r"exists and is not a directory"):
        backup.Backup(str(path), None)


def test_fit_refuses_a_backup_beyond_the_run(tmp_path):
    _saved_backups(tmp_path)  # at step 12
    m = _small_model(0.0)
    with pytest.raises(ValueError, match=r"global step 12, beyond this run's 1 epochs x 8"):
        backup.fit(m, lambda step: None, epochs=1, steps_per_epoch=8, backup_dir=str(tmp_path))


@pytest.mark.parametrize("kwargs, match", [
    ({"epochs": 0}, r"`epochs` must be a positive integer, got 0"),
    ({"steps_per_epoch": True}, r"`steps_per_epoch` must be a positive integer, got True"),
    ({"save_every_steps": 0}, r"`save_every_steps` must be a positive integer \(or None\)"),
])
def test_fit_bad_arguments(tmp_path, kwargs, match):
    args = {"epochs": 1, "steps_per_epoch": 8, "backup_dir": str(tmp_path), **kwargs}
    with pytest.raises(ValueError, match=match):
        backup.fit(_small_model(0.0), _stream, **args)
    assert os.listdir(tmp_path) == []


def test_fit_needs_whole_calls_of_steps(tmp_path):
    import keras

    m = keras.Sequential([keras.Input((3,)), keras.layers.Dense(2)])
    m.compile("sgd", "mse", steps_per_execution=3)
    with pytest.raises(ValueError, match=r"the model's steps per execution \(3\) must divide "
                                         r"`steps_per_epoch` \(8\) for step-exact resumes"):
        backup.fit(m, _stream, epochs=1, steps_per_epoch=8, backup_dir=str(tmp_path))
    _saved_backups(tmp_path)  # at step 12
    m.compile("sgd", "mse", steps_per_execution=8)
    with pytest.raises(ValueError, match=r"global step 12, not a multiple of the steps per "
                                         r"execution \(8\)"):
        backup.fit(m, _stream, epochs=2, steps_per_epoch=16, backup_dir=str(tmp_path))



# ------------------------------------------------------------------------ one run, one directory


def _dense_model(units: int = 2):
    import keras

    keras.utils.set_random_seed(1)
    m = keras.Sequential([keras.Input((8,)), keras.layers.Dense(units)])
    m.compile(keras.optimizers.Adam(0.05),
              keras.losses.SparseCategoricalCrossentropy(from_logits=True))
    return m


def _fit(backup_dir, model=None, **kwargs):
    args = dict(epochs=2, steps_per_epoch=8, save_every_steps=4, verbose=0)
    return backup.fit(model or _dense_model(), _stream, backup_dir=str(backup_dir),
                      **{**args, **kwargs})


def test_backup_dir_is_a_path_not_a_pattern(tmp_path):
    """`runs/exp[12]` is that directory: not a glob matching runs/exp1 and runs/exp2,
    whose checkpoints were resumed and then deleted."""
    for name in ("exp1", "exp2"):
        with pytest.raises(RuntimeError, match="simulated crash"):
            _fit(tmp_path / name, callbacks=[_CrashAt(6)])
    others = {name: file_tree(tmp_path / name) for name in ("exp1", "exp2")}
    assert all(backup.checkpoints(str(tmp_path / name)) for name in others)
    pattern = tmp_path / "exp[12]"
    assert backup.latest_valid(str(pattern)).path is None
    result = _fit(pattern)
    assert result.resumed_step == 0
    result.delete_backup()
    backup.delete(str(pattern))
    assert not pattern.exists()
    assert {name: file_tree(tmp_path / name) for name in others} == others


def _hold_lock(backup_dir, holder: dict):
    """Locks `backup_dir` as another process would (its own open file), with `holder`
    details in the file; returns the file descriptor (closing it releases the lock)."""
    import fcntl

    os.makedirs(backup_dir, exist_ok=True)
    fd = os.open(os.path.join(backup_dir, "tfmulti-backup.lock"), os.O_RDWR | os.O_CREAT)
    fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    os.ftruncate(fd, 0)
    os.write(fd, json.dumps(holder).encode())
    return fd


def test_a_second_run_on_a_locked_backup_dir_is_refused_naming_the_holder(tmp_path):
    holder = {"host": "node7", "pid": 4242, "since": "2031-01-02 03:04:05 +0000",
              "command": "python recipes/train.py --backup_dir=runs/b"}
    fd = _hold_lock(tmp_path, holder)
    try:
        with pytest.raises(ValueError, match=r"is in use by another run \(pid 4242 on node7, "
                                             r"since 2031-01-02 03:04:05 \+0000: python "
                                             r"recipes/train.py --backup_dir=runs/b\); .*pass "
                                             r"another `backup_dir`"):
            _fit(tmp_path)
        assert sorted(os.listdir(tmp_path)) == ["tfmulti-backup.lock"]  # nothing written
        with pytest.raises(ValueError, match=r"in use by another run \(pid 4242"):
            backup.delete(str(tmp_path))
    finally:
        os.close(fd)  # what the kernel does when the holder dies
    # The dead holder's details do not block the rerun, nor show afterwards.
    result = _fit(tmp_path)
    assert result.resumed_step == 0
    assert (tmp_path / "tfmulti-backup.lock").read_text() == ""  # released: no holder
    result.delete_backup()
    assert not tmp_path.exists()


def test_the_lock_is_held_while_fit_runs_and_nests_in_the_callers(tmp_path):
    import keras

    seen = []

    class Probe(keras.callbacks.Callback):
        def on_train_batch_end(self, batch, logs=None):
            if not seen:
                holder = json.loads((tmp_path / "tfmulti-backup.lock").read_text())
                seen.append(holder)

    with backup.lock(str(tmp_path)):  # the caller's, around fit, evaluation and delete
        result = _fit(tmp_path, callbacks=[Probe()])
        assert (tmp_path / "tfmulti-backup.lock").read_text() != ""  # still held
        result.delete_backup()
        assert os.listdir(tmp_path) == ["tfmulti-backup.lock"]
    assert seen and seen[0]["pid"] == os.getpid() and seen[0]["command"] == " ".join(sys.argv)
    assert not tmp_path.exists()


@pytest.mark.slow  # starts a process
def test_a_killed_runs_lock_does_not_block_its_rerun(tmp_path):
    """A real holder process: its run is refused with its pid; once it is SIGKILLed,
    the kernel has released its lock and the rerun goes ahead."""
    code = ("import sys, time; from tfmulti.training.backup import _files; "
            "lock = _files.DirLock(sys.argv[1]); lock.acquire(); print('locked', flush=True); "
            "time.sleep(300)")
    proc = subprocess.Popen([sys.executable, "-c", code, str(tmp_path)], stdout=subprocess.PIPE,
                            text=True, cwd=REPO, env={**os.environ, "TF_CPP_MIN_LOG_LEVEL": "2"})
    try:
        ready, _, _ = select.select([proc.stdout], [], [], 120)
        assert ready and proc.stdout.readline().strip() == "locked"
        with pytest.raises(ValueError, match=rf"in use by another run \(pid {proc.pid} on "
                                             rf"{re.escape(socket.gethostname())}, since .*-c"):
            _fit(tmp_path)
    finally:
        proc.kill()
        proc.wait(timeout=30)
    assert _fit(tmp_path).resumed_step == 0


def test_a_resume_with_other_settings_is_refused_naming_them(tmp_path):
    fields = {"global_batch_size": 32, "dataset": "mine", "seed": 0}
    with pytest.raises(RuntimeError, match="simulated crash"):
        _fit(tmp_path, fingerprint=fields, callbacks=[_CrashAt(10)])
    before = file_tree(tmp_path)
    manifest = json.loads((tmp_path / "tfmulti-backup.json").read_text())
    assert manifest["fingerprint"]["global_batch_size"] == 32
    assert manifest["fingerprint"]["steps_per_epoch"] == 8
    cases = [
        (dict(fingerprint={**fields, "global_batch_size": 64, "seed": 1}),
         r"global_batch_size: 32 -> 64; seed: 0 -> 1\); rerun with the original settings to "
         r"resume it, or pass a new `backup_dir` to start afresh"),
        (dict(fingerprint=fields, epochs=1, steps_per_epoch=16), r"steps_per_epoch: 8 -> 16"),
        (dict(fingerprint={k: v for k, v in fields.items() if k != "dataset"}),
         r'dataset: "mine" -> \(not recorded\)'),
        (dict(fingerprint=fields, model=_dense_model(3)),
         r"model variables \(2 -> 2\): changed 0.Dense/0.kernel: \[8, 2\] float32 -> "
         r"\[8, 3\] float32, 0.Dense/1.bias: \[2\] float32 -> \[3\] float32"),
    ]
    for kwargs, match in cases:
        with pytest.raises(ValueError, match=match):
            _fit(tmp_path, **kwargs)
        assert file_tree(tmp_path) == before  # nothing restored into, nothing written
    assert _fit(tmp_path, fingerprint=fields).resumed_step == 8  # the same settings resume


def test_a_backup_without_its_manifest_is_refused(tmp_path):
    with pytest.raises(RuntimeError, match="simulated crash"):
        _fit(tmp_path, callbacks=[_CrashAt(10)])
    os.remove(tmp_path / "tfmulti-backup.json")
    with pytest.raises(ValueError, match=r"has no tfmulti-backup.json"):
        _fit(tmp_path)


def test_fingerprint_fields_must_be_json(tmp_path):
    with pytest.raises(ValueError, match=r"`fingerprint` field 'data' must be a JSON value"):
        _fit(tmp_path, fingerprint={"data": object()})


def test_checkpoints_that_tfmulti_did_not_write_are_left_alone(tmp_path, capsys):
    """A directory holding the user's own TensorFlow checkpoints (prefix `ckpt`,
    TensorFlow's default, and its `checkpoint` state file): never resumed from,
    pruned or deleted; said once."""
    import tensorflow as tf

    manager = tf.train.CheckpointManager(tf.train.Checkpoint(v=tf.Variable(1.0)), str(tmp_path),
                                         max_to_keep=5)
    for step in (100, 200, 300):
        manager.save(checkpoint_number=step)
    theirs = file_tree(tmp_path)
    with pytest.raises(RuntimeError, match="simulated crash"):
        _fit(tmp_path, callbacks=[_CrashAt(10)])
    result = _fit(tmp_path)
    assert result.resumed_step == 8  # tfmulti's own, not ckpt-300
    out = capsys.readouterr().out
    assert out.count("also holds checkpoints tfmulti did not write (ckpt-100, ckpt-200, "
                     "ckpt-300, checkpoint); they are left alone") == 1
    assert {k: v for k, v in file_tree(tmp_path).items() if k in theirs} == theirs
    result.delete_backup()
    assert file_tree(tmp_path) == theirs


def test_the_backup_survives_fit_until_the_caller_deletes_it(tmp_path):
    """The default keeps it: a crash (or a full disk) while the caller saves the
    model still resumes from the finished backup instead of losing the run."""
    model = _dense_model()
    result = _fit(tmp_path, model=model)
    assert [os.path.basename(p) for p in backup.checkpoints(str(tmp_path))] == \
        ["tfmulti-ckpt-16", "tfmulti-ckpt-12"]
    # The caller's save failed; the rerun finds the finished run.
    rerun_model = _dense_model()
    rerun = _fit(tmp_path, model=rerun_model)
    assert rerun.resumed_step == 16 and rerun.history == {}
    for a, b in zip(rerun_model.get_weights(), model.get_weights()):
        np.testing.assert_array_equal(a, b)
    rerun.delete_backup()
    assert not tmp_path.exists()
    assert result.chief and result.backup_dir == str(tmp_path)
    _fit(tmp_path, delete_on_success=True)  # the old behaviour, asked for
    assert not tmp_path.exists()


@pytest.mark.parametrize("where", ["no strategy", "mirrored, distributed data"])
def test_a_run_resumed_at_its_end_gets_its_optimizer_and_last_epochs_metrics(tmp_path, where):
    """A crash after training (in the caller's evaluation, or while it saves the
    model) resumes at the finished backup: the model must be as `fit` left it,
    Adam's iteration count and moments and the last epoch's metric totals
    included, since the caller saves it next (found by recipes/chaos.py: a
    model.keras with a fresh optimizer, iteration count 0, and no train
    metrics, after every kill during evaluation or the final writes)."""
    import keras

    import tfmulti

    def run():
        strategy = (None if where == "no strategy"
                    else tfmulti.get_strategy("mirrored", devices=["CPU:0", "CPU:1"]))
        with strategy.scope() if strategy else contextlib.nullcontext():
            model = user_model.functional_model()
            model.compile(keras.optimizers.Adam(0.02), user_model.loss, metrics=["accuracy"])
        data = (_dict_stream if strategy is None else
                lambda step: strategy.experimental_distribute_dataset(_dict_stream(step)))
        result = backup.fit(model, data, epochs=2, steps_per_epoch=8, save_every_steps=4,
                            backup_dir=str(tmp_path), verbose=0)
        return model, result

    finished, first = run()
    resumed, again = run()  # as after a crash past `fit`: the backup is the finished run
    assert (first.resumed_step, again.resumed_step, again.history) == (0, 16, {})
    assert int(np.asarray(resumed.optimizer.iterations)) == 16
    assert len(resumed.optimizer.variables) == len(finished.optimizer.variables)
    for a, b in zip(resumed.optimizer.variables, finished.optimizer.variables):
        np.testing.assert_allclose(np.asarray(a), np.asarray(b), atol=1e-6, rtol=0)
    for a, b in zip(resumed.get_weights(), finished.get_weights()):
        np.testing.assert_array_equal(a, b)
    metrics = {k: float(v) for k, v in resumed.get_metrics_result().items()}
    assert sorted(metrics) == ["accuracy", "loss"]
    for name, value in metrics.items():  # the last epoch's, as in the first run's history
        assert value == pytest.approx(first.history[name][-1], abs=1e-6)


def test_an_interrupted_delete_leaves_the_newest_checkpoint_whole(tmp_path, monkeypatch):
    """The backup is removed oldest checkpoint first: a run killed while its
    finished backup is removed (its results already written) restarts at the
    end, not from an older checkpoint (found by recipes/chaos.py: the restarted
    run trained the last steps again). The interruption: the failpoint before
    the second checkpoint's removal, with the directory listing newest first."""
    from tfmulti.utils import failpoints
    from tfmulti.training.backup import _files

    class Killed(Exception):
        pass

    deletes = []

    def fire(name):  # the second pass of backup.delete stops the removal
        if name == "backup.delete":
            deletes.append(name)
            if len(deletes) == 2:
                raise Killed

    _fit(tmp_path)
    assert [os.path.basename(p) for p in backup.checkpoints(str(tmp_path))] == \
        ["tfmulti-ckpt-16", "tfmulti-ckpt-12"]
    entries = _files._entries
    monkeypatch.setattr(_files, "_entries", lambda d: sorted(entries(d), reverse=True))
    previous = failpoints.install(fire)
    try:
        with pytest.raises(Killed):
            backup.delete(str(tmp_path))
    finally:
        failpoints.install(previous)
    assert [os.path.basename(p) for p in backup.checkpoints(str(tmp_path))] == \
        ["tfmulti-ckpt-16"]
    assert backup.latest_valid(str(tmp_path)).step == 16


def test_other_workers_save_into_private_scratch_dirs(tmp_path, monkeypatch):
    """A non-chief save goes to a fresh `mkdtemp` directory (mode 0700), removed
    afterwards, also when the save fails; the predictable name of before
    (/tmp/tfmulti-backup-<hash>-worker<i>), planted as a symlink by another user,
    is not followed."""
    import tempfile

    import tensorflow as tf

    tmp = tmp_path / "tmp"
    tmp.mkdir()
    monkeypatch.setattr(tempfile, "tempdir", str(tmp))
    victim = tmp_path / "victim"
    victim.mkdir()
    (victim / "keep.txt").write_text("theirs")
    import hashlib

    backup_dir = str(tmp_path / "backup")
    digest = hashlib.sha256(os.path.abspath(backup_dir).encode()).hexdigest()[:12]
    os.symlink(victim, tmp / f"tfmulti-backup-{digest}-worker1")
    worker = backup.Backup(backup_dir, _small_model(1.0), chief=False, task_index=1)
    modes = []
    real_write = tf.train.Checkpoint.write

    def write(self, prefix, *args, **kwargs):
        modes.append(os.stat(os.path.dirname(prefix)).st_mode & 0o777)
        return real_write(self, prefix, *args, **kwargs)

    monkeypatch.setattr(tf.train.Checkpoint, "write", write)
    assert worker.save(4) is None
    assert file_tree(victim) == {"keep.txt": b"theirs"}
    assert sorted(os.listdir(tmp)) == [f"tfmulti-backup-{digest}-worker1"]  # the planted link
    assert modes == [0o700]
    assert not os.path.exists(backup_dir)  # the chief's directory is not this worker's

    def failing_write(self, prefix, *args, **kwargs):
        open(prefix + ".partial", "w").close()
        raise OSError("No space left on device")

    monkeypatch.setattr(tf.train.Checkpoint, "write", failing_write)
    with pytest.raises(OSError, match="No space left"):
        worker.save(8)
    assert sorted(os.listdir(tmp)) == [f"tfmulti-backup-{digest}-worker1"]


class _FakeCoordination:
    """The coordination service's key-value store, where worker 1 never acknowledges."""

    def __init__(self):
        self.values, self.waits = {}, []

    def set_config_key_value(self, key, value):
        if key in self.values:
            raise RuntimeError(f"{key} is already set")
        self.values[key] = value

    def get_config_key_value(self, key, timeout_ms=None):
        self.waits.append((key, timeout_ms))
        if key in self.values:
            return self.values[key]
        raise RuntimeError(f"DEADLINE_EXCEEDED: {key} was not set in time")


def test_a_preemption_without_agreement_exits_76_saying_nothing_was_saved(monkeypatch, capsys):
    from tfmulti.training.backup import _preemption
    from tfmulti.cluster.plan import PREEMPTION_AGREEMENT_S

    fake = _FakeCoordination()
    monkeypatch.setattr(_preemption, "_kv", lambda: fake)
    monkeypatch.setattr(_preemption, "_coordination_available", lambda: True)
    watcher = _preemption.PreemptionWatcher(task_index=0, num_workers=2, steps_per_execution=4,
                                      run=7)
    watcher.own_signal = True  # what the SIGTERM handler sets
    fake.values["tfmulti/training/backup/7/ack/0"] = "12"  # worker 0's own watcher thread acks
    with pytest.raises(SystemExit) as raised:
        watcher.should_save(8)
    assert raised.value.code == exit_codes.PREEMPTED_UNSAVED == 76
    assert isinstance(raised.value, backup.PreemptedUnsaved)
    assert fake.values["tfmulti/training/backup/7/preempt"] == "12"
    (_, first_wait), (_, second_wait) = fake.waits
    assert 0 < second_wait <= first_wait <= PREEMPTION_AGREEMENT_S * 1000
    assert first_wait > (PREEMPTION_AGREEMENT_S - 5) * 1000
    message = ("worker 0 got SIGTERM but worker 1 did not acknowledge the save step within 20 s "
               "(DEADLINE_EXCEEDED")
    assert message in str(raised.value) and message in capsys.readouterr().err
    assert "nothing was saved: exiting with code 76" in str(raised.value)


# ----------------------------------------------------------------------------- portable checkpoints


def _dict_stream(step):
    import tensorflow as tf

    x, y = user_model.examples(256, seed=5)
    dataset = tf.data.Dataset.from_tensor_slices((user_model.as_inputs(x), y))
    return dataset.batch(32).repeat().skip(step)


class _Record:
    """A callback keeping the model's weights and its optimizer's variables (the
    iteration count and the slots, in the order Keras made them) before the first
    step of `fit` (after the restore) and after step `at`."""

    def __new__(cls, at, weights):
        import keras

        class Record(keras.callbacks.Callback):
            first, last = None, None

            def _state(self):
                opt = self.model.optimizer
                return weights(self.model), [np.array(v) for v in opt.variables]

            def on_train_batch_begin(self, batch, logs=None):
                if self.first is None:
                    self.first = self._state()

            def on_train_batch_end(self, batch, logs=None):
                if int(self.model.optimizer.iterations.numpy()) == at:
                    self.last = self._state()

        return Record()


def _assert_same_state(restored, saved, slots: int) -> None:
    """Weights equal; the iteration count and the first `slots` slots equal (a
    hybrid pipeline holds a copy of each for every replica after them)."""
    (weights, opt), (saved_weights, saved_opt) = restored, saved
    assert len(weights) == len(saved_weights)
    for a, b in zip(weights, saved_weights):
        np.testing.assert_array_equal(a, b)
    assert int(opt[0]) == int(saved_opt[0])  # iteration
    assert len(opt) >= slots + 2 and len(saved_opt) >= slots + 2
    for a, b in zip(opt[2:slots + 2], saved_opt[2:slots + 2]):  # after iteration, rate
        np.testing.assert_array_equal(a, b)


@pytest.mark.slow  # trains 4 runs
def test_a_backup_resumes_with_another_replica_count_and_on_one_device(tmp_path):
    """Mirrored over 4 replicas, crashed at step 10 (backup at 8); resumed with 2
    replicas, crashed at 14 (backup at 12); resumed on one device to the end. Each
    restore puts back exactly the weights and Adam's moments and step count of
    the run that saved; the result is the uninterrupted 4-replica run's."""
    import keras

    import tfmulti

    def run(devices, directory, *callbacks):
        strategy = tfmulti.get_strategy("one_device" if len(devices) == 1 else "mirrored",
                                        devices=devices)
        with strategy.scope():
            model = user_model.functional_model()
            model.compile(keras.optimizers.Adam(0.02), user_model.loss)
        backup.fit(model, _dict_stream, epochs=2, steps_per_epoch=8, save_every_steps=4,
                   backup_dir=str(tmp_path / directory), callbacks=list(callbacks), verbose=0,
                   fingerprint={"global_batch_size": 32})
        return model

    four = ["CPU:0", "CPU:1", "CPU:2", "CPU:3"]
    reference = run(four, "reference")
    weights = lambda m: [np.array(w) for w in m.get_weights()]  # noqa: E731
    saved_4 = _Record(8, weights)
    with pytest.raises(RuntimeError, match="simulated crash"):
        run(four, "b", saved_4, _CrashAt(10))
    on_2, saved_2 = _Record(12, weights), None
    with pytest.raises(RuntimeError, match="simulated crash"):
        run(["CPU:0", "CPU:1"], "b", on_2, _CrashAt(14))
    saved_2 = on_2
    on_1 = _Record(16, weights)
    model = run(["CPU:0"], "b", on_1)
    slots = 2 * len(model.trainable_variables)  # Adam: momentum and velocity each
    _assert_same_state(on_2.first, saved_4.last, slots)
    _assert_same_state(on_1.first, saved_2.last, slots)
    assert int(on_1.first[1][0]) == 12 and int(model.optimizer.iterations) == 16
    for a, b in zip(model.get_weights(), reference.get_weights()):
        np.testing.assert_allclose(a, b, atol=1e-5, rtol=0)


def _stack(seed=4):
    import keras

    keras.utils.set_random_seed(seed)
    return [keras.layers.Dense(16, activation="relu"), keras.layers.Dense(16, activation="relu"),
            keras.layers.Dense(3)]


@pytest.mark.slow  # trains 5 runs
def test_a_backup_moves_between_a_pipeline_and_the_unpartitioned_model(tmp_path):
    """One device (crash at 6, backup at 4) -> a hybrid pipeline, 2 replicas x 2
    stages (crash at 10, backup at 8) -> a pipeline of 2 stages (crash at 14,
    backup at 12) -> the unpartitioned model on one device, to the end. Each
    restore puts back the weights (into every replica) and Adam's state; the
    result is the uninterrupted one-device run's."""
    import keras

    from tfmulti.parallel import PipelineModel

    def run(kind, directory, *callbacks):
        if kind == "one_device":
            model = keras.Sequential([keras.Input((8,)), *_stack()])
        else:
            replicas = 2 if kind == "hybrid" else 1
            model = PipelineModel(_stack(), input_shape=(8,), num_replicas=replicas,
                                  devices=[f"CPU:{i}" for i in range(2 * replicas)],
                                  num_microbatches=2)
        model.compile(keras.optimizers.Adam(0.02),
                      keras.losses.SparseCategoricalCrossentropy(from_logits=True))
        backup.fit(model, _stream, epochs=2, steps_per_epoch=8, save_every_steps=4,
                   backup_dir=str(tmp_path / directory), callbacks=list(callbacks), verbose=0)
        return model

    def weights(model):  # the unpartitioned model's, replica 0's for a pipeline
        unpartitioned = model.to_sequential() if isinstance(model, PipelineModel) else model
        return [np.array(w) for w in unpartitioned.get_weights()]

    reference = run("one_device", "reference")
    slots = 2 * len(reference.trainable_variables)
    one = _Record(4, weights)
    with pytest.raises(RuntimeError, match="simulated crash"):
        run("one_device", "b", one, _CrashAt(6))
    hybrid = _Record(8, weights)
    with pytest.raises(RuntimeError, match="simulated crash"):
        run("hybrid", "b", hybrid, _CrashAt(10))
    pipeline = _Record(12, weights)
    with pytest.raises(RuntimeError, match="simulated crash"):
        run("pipeline", "b", pipeline, _CrashAt(14))
    last = _Record(16, weights)
    model = run("one_device", "b", last)
    _assert_same_state(hybrid.first, one.last, slots)
    # The second replica's slots (after the first's) were restored too.
    np.testing.assert_array_equal(np.concatenate([s.ravel() for s in hybrid.first[1][2:]]),
                                  np.tile(np.concatenate([s.ravel() for s in one.last[1][2:]]),
                                          2))
    _assert_same_state(pipeline.first, hybrid.last, slots)
    _assert_same_state(last.first, pipeline.last, slots)
    assert int(model.optimizer.iterations) == 16
    for a, b in zip(model.get_weights(), reference.get_weights()):
        np.testing.assert_allclose(a, b, atol=1e-5, rtol=0)


def test_the_other_workers_take_the_chiefs_resume_point_or_its_error(tmp_path, monkeypatch):
    """Through the coordination service (faked): a worker resumes where the chief
    chose, after reading that checkpoint itself, or fails with the chief's error
    (a locked or mismatched backup) at once instead of waiting for the chief."""
    from tfmulti.training.backup import _checkpoint

    _saved_backups(tmp_path)  # at steps 8 and 12
    fake = _FakeCoordination()
    monkeypatch.setattr(_checkpoint, "_kv", lambda: fake)
    monkeypatch.setattr(_checkpoint, "_coordination_available", lambda: True)
    chief = backup.Backup(str(tmp_path), _small_model(0.0), chief=True, task_index=0, run=3)
    worker = backup.Backup(str(tmp_path), _small_model(0.0), chief=False, task_index=1, run=3)
    chief.num_workers = worker.num_workers = 2
    with chief:
        assert chief.resume_point().step == 12
    point = worker.resume_point()
    assert point == backup.ResumePoint(12, str(tmp_path / "tfmulti-ckpt-12"))
    assert fake.waits[-1][1] == 300_000  # the chief may read a large checkpoint first
    fd = _hold_lock(tmp_path, {"host": "node7", "pid": 4242})
    try:
        chief = backup.Backup(str(tmp_path), _small_model(0.0), chief=True, run=4)
        chief.num_workers = 2
        with pytest.raises(ValueError, match=r"in use by another run \(pid 4242 on node7"):
            chief.resume_point()
    finally:
        os.close(fd)
    worker = backup.Backup(str(tmp_path), _small_model(0.0), chief=False, task_index=1, run=4)
    worker.num_workers = 2
    with pytest.raises(ValueError, match=r"the chief cannot resume: `backup_dir` .* is in use "
                                         r"by another run \(pid 4242 on node7"):
        worker.resume_point()
