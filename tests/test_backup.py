"""Fault tolerance: backup and restore (tfmulti.backup), preemption, restarts,
dead peers.

The end-to-end tests train the same small deterministic run (synthetic data,
SGD, no dropout, 3 epochs x 16 steps, a backup every 4 steps) with
tests/workers/resumable.py, kill it in the middle of an epoch after a backup
exists, let it resume, and compare the final weights with an uninterrupted
run's. Every subprocess has a timeout; the launcher reaps its workers.
"""

from __future__ import annotations

import glob
import io
import json
import os
import re
import signal
import socket
import subprocess
import sys
import time

import numpy as np
import pytest

from tfmulti import backup, launch
from tests._util import REPO, run_python

WORKER = str(REPO / "tests" / "workers" / "resumable.py")
TOTAL_STEPS = 3 * 16
KILL_AT = 22  # epoch 2, step 6: after the backup at step 20, mid-epoch


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


def _scratch_dirs(out_dir) -> list[str]:
    probe = backup.Backup(os.path.join(out_dir, "backup"), model=None, chief=False,
                          task_index=1)
    return glob.glob(probe._scratch_dir())  # pylint: disable=protected-access


def _launch(args: list[str], **kwargs) -> tuple[int, str]:
    out = io.StringIO()
    code = launch.launch([sys.executable, WORKER, *args], num_workers=2, output=out,
                         startup_timeout=120, **kwargs)
    return code, out.getvalue()


@pytest.fixture(scope="module")
def uninterrupted(tmp_path_factory):
    """The reference: MirroredStrategy over 2 devices (equal to 2 workers x 1
    device within 1e-5, tests/test_multi_worker.py), never interrupted."""
    out = tmp_path_factory.mktemp("uninterrupted")
    result = run_python([WORKER, str(out), "mirrored", "--config",
                         json.dumps({"num_virtual_devices": 2})], timeout=240)
    assert result.returncode == 0, result.stderr[-3000:]
    assert not (out / "backup").exists()  # deleted after a clean end
    return _final(out)


# ----------------------------------------------------------------------------- end to end


@pytest.mark.parametrize("victim", [0, 1])
def test_multi_worker_sigkill_restarts_and_matches_uninterrupted(tmp_path, uninterrupted,
                                                                 victim):
    code, output = _launch([str(tmp_path), "multi_worker", "--kill_at_step", str(KILL_AT),
                            "--kill_worker", str(victim)], max_restarts=1, grace_period=5)
    assert code == 0, output[-4000:]
    assert f"worker {victim} failed with exit code 137 (killed by SIGKILL)" in output, \
        output[-4000:]
    assert "restart 1 of 1" in output
    assert "resuming from" in output and "ckpt-20" in output  # the last backup before 22
    _assert_same_weights(tmp_path, uninterrupted)
    metrics = json.loads((tmp_path / "metrics.json").read_text())
    assert metrics["resumed_from_step"] == 20 and metrics["epochs_completed"] == 3
    assert not (tmp_path / "backup").exists()  # deleted when training ended cleanly
    assert _scratch_dirs(tmp_path) == []  # no worker's temporary dir left


def test_multi_worker_sigterm_saves_at_agreed_step(tmp_path, uninterrupted):
    code, output = _launch([str(tmp_path), "multi_worker", "--kill_at_step", str(KILL_AT),
                            "--kill_worker", "1", "--signal", "TERM",
                            "--config", json.dumps({"keep_backup": True})],
                           max_restarts=1, grace_period=30)
    assert code == 0, output[-4000:]
    assert "exit code 75 (preempted" in output, output[-4000:]
    # Worker 1 got SIGTERM at step 22; both saved at the next boundary, 23.
    assert "backup at global step 23 (preempted)" in output, output[-4000:]
    assert "resuming from" in output and "ckpt-23" in output
    _assert_same_weights(tmp_path, uninterrupted)
    # keep_backup: only the chief's directory exists, with the newest 2 checkpoints.
    kept = sorted(os.path.basename(p) for p in glob.glob(str(tmp_path / "backup" / "*.index")))
    assert kept == ["ckpt-44.index", "ckpt-48.index"]
    assert _scratch_dirs(tmp_path) == []


def test_sigterm_to_the_launcher_saves_on_all_workers_and_does_not_restart(tmp_path):
    """What a scheduler does (Kubernetes, SLURM): SIGTERM to the launcher. Every
    worker saves at the same step, the launcher exits 128 + 15 without restarting."""
    proc = subprocess.Popen(
        [sys.executable, "-m", "tfmulti.cli", "launch", "--num_workers", "2", "--max_restarts",
         "2", "--grace_period", "30", "--", sys.executable, WORKER, str(tmp_path),
         "multi_worker", "--config", json.dumps({"epochs": 100})],
        stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
        env={**os.environ, "TF_CPP_MIN_LOG_LEVEL": "2"})
    lines = []
    try:
        for line in proc.stdout:
            lines.append(line)
            if "backup at global step 8 " in line:
                proc.send_signal(signal.SIGTERM)
                break
        lines += proc.communicate(timeout=120)[0].splitlines()
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


@pytest.mark.parametrize("sig, steps_per_execution", [("KILL", 1), ("TERM", 1), ("KILL", 4)])
def test_mirrored_killed_then_rerun_resumes(tmp_path, uninterrupted, sig, steps_per_execution):
    args = [WORKER, str(tmp_path), "mirrored", "--kill_at_step", str(KILL_AT), "--signal", sig,
            "--config", json.dumps({"num_virtual_devices": 2,
                                    "steps_per_execution": steps_per_execution})]
    first = run_python(args, timeout=240)
    if sig == "KILL":  # with 4 steps per call the kill comes at 24, before its backup
        assert first.returncode == -signal.SIGKILL, first.stderr[-3000:]
        resumed_at = 20
    else:  # one process: saves at the boundary where it sees the signal
        assert first.returncode == backup.PREEMPTED_EXIT_CODE, first.stderr[-3000:]
        assert "preempted: saved a backup at global step 22" in first.stderr
        resumed_at = 22
    second = run_python(args, timeout=240)  # the same command again
    assert second.returncode == 0, second.stderr[-3000:]
    assert f"resuming from {tmp_path / 'backup' / f'ckpt-{resumed_at}'}" in second.stdout
    _assert_same_weights(tmp_path, uninterrupted)


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("localhost", 0))
        return s.getsockname()[1]


@pytest.mark.parametrize("victim", [0, 1])
def test_dead_peer_fails_the_survivor_within_60s(tmp_path, victim):
    """Without the launcher (as on separate hosts): TensorFlow's coordination
    service notices the missing heartbeats and aborts the survivor's collectives."""
    ports = [_free_port(), _free_port()]
    procs = []
    try:
        for index in range(2):
            env = {**os.environ, "TF_CPP_MIN_LOG_LEVEL": "2", "TF_CONFIG": json.dumps({
                "cluster": {"worker": [f"localhost:{p}" for p in ports]},
                "task": {"type": "worker", "index": index}})}
            procs.append(subprocess.Popen(
                [sys.executable, WORKER, str(tmp_path), "multi_worker", "--config",
                 json.dumps({"epochs": 1000, "num_examples": 4096})],
                env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                start_new_session=True))
        chief_lines = []
        deadline = time.monotonic() + 180
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


@pytest.mark.parametrize("strategy", ["pipeline", "one_device"])
def test_resumes_in_process(tmp_path, strategy):
    """A PipelineModel (2 stages on 2 virtual CPUs), or one device, crashed
    mid-epoch by an exception, then rerun in the same process: the same
    weights as without the crash."""
    import keras

    from tfmulti.training import TrainConfig, train

    class Crash(keras.callbacks.Callback):
        def on_train_batch_end(self, batch, logs=None):
            if int(self.model.optimizer.iterations.numpy()) == 10:
                raise RuntimeError("simulated crash")

    class Keep(keras.callbacks.Callback):
        def on_train_end(self, logs=None):
            self.weights = [np.array(w) for w in self.model.get_weights()]
            self.iterations = int(self.model.optimizer.iterations.numpy())

    def run(backup_dir, callbacks):
        keep = Keep()
        devices = ("CPU:0", "CPU:1") if strategy == "pipeline" else None
        train(TrainConfig(strategy=strategy, devices=devices, num_stages=2,
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
                if int(self.model.optimizer.iterations) == iteration:
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
        ["ckpt-12", "ckpt-8"]
    point = backup.latest_valid(str(tmp_path))
    assert point.step == 12 and point.path.endswith("ckpt-12")


@pytest.mark.parametrize("damage", ["truncate data", "garble index", "delete data"])
def test_damaged_latest_falls_back_with_a_warning(tmp_path, damage):
    _saved_backups(tmp_path)
    latest = str(tmp_path / "ckpt-12")
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
    with pytest.warns(RuntimeWarning, match=r"ckpt-12 .* cannot be restored.*falling back"):
        point = backup.latest_valid(str(tmp_path))
    assert point.step == 8 and point.path.endswith("ckpt-8")
    m = _small_model(0.0)
    saver = backup.Backup(str(tmp_path), m, chief=True, task_index=0)
    saver.restore_weights(point)
    assert all(np.all(np.asarray(v) == 8.0) for v in m.variables)


def test_a_crash_during_a_save_leaves_a_consistent_backup(tmp_path):
    """SIGKILL a process that saves ~32 MB checkpoints back to back, at 3
    random points in time: each time, the newest valid checkpoint is complete and
    consistent (every value equals its step), and saving resumes after it."""
    worker = str(REPO / "tests" / "workers" / "save_loop.py")
    rng = np.random.default_rng(0)
    steps = []
    for _ in range(3):
        proc = subprocess.Popen([sys.executable, worker, str(tmp_path)], stdout=subprocess.PIPE,
                                stderr=subprocess.DEVNULL, text=True,
                                env={**os.environ, "TF_CPP_MIN_LOG_LEVEL": "2"})
        try:
            assert proc.stdout.readline().strip() == "ready"
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


def test_data_skip_continues_the_uninterrupted_stream():
    import tensorflow as tf

    from tfmulti import data, strategy as strategy_lib

    ds = tf.data.Dataset.from_tensor_slices(np.arange(40, dtype=np.int64))
    one = strategy_lib.get_strategy("one_device")
    full = data.distribute(ds, one, 8, training=True, seed=3)
    resumed = data.distribute(ds, one, 8, training=True, seed=3, skip_steps=7)
    full_batches = [b.numpy().tolist() for b, _ in zip(full.dataset, range(15))]
    resumed_batches = [b.numpy().tolist() for b, _ in zip(resumed.dataset, range(8))]
    assert resumed_batches == full_batches[7:]
    assert full_batches[:5] != full_batches[5:10]  # epochs are reshuffled


# ----------------------------------------------------------------------------- bad input


@pytest.mark.parametrize("kwargs, match", [
    ({"keep": 0}, r"`keep` must be an integer >= 1"),
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


@pytest.mark.parametrize("fields, match", [
    ({"backup_dir": "/tmp/x", "seed": None}, r"`backup_dir` needs a fixed `seed`"),
    ({"backup_every_steps": 5}, r"`backup_every_steps` needs `backup_dir`"),
    ({"backup_dir": "/tmp/x", "backup_every_steps": 0}, r"must be a positive integer"),
])
def test_train_config_backup_checks(fields, match):
    from tfmulti.training import TrainConfig

    with pytest.raises(ValueError, match=match):
        TrainConfig(**fields).validate()


def test_fit_refuses_a_backup_beyond_the_run(tmp_path):
    _saved_backups(tmp_path)  # at step 12
    m = _small_model(0.0)
    with pytest.raises(ValueError, match=r"global step 12, beyond this run's 1 epochs x 8"):
        backup.fit(m, lambda step: None, epochs=1, steps_per_epoch=8, backup_dir=str(tmp_path))


def test_launcher_reports_each_restart_and_gives_up():
    out = io.StringIO()
    code = launch.launch([sys.executable, "-c", "import sys; sys.exit(3)"], num_workers=2,
                         output=out, max_restarts=2, grace_period=1)
    text = out.getvalue()
    assert code == 3, text
    assert "restart 1 of 2" in text and "restart 2 of 2" in text, text
    assert "giving up after 2 restart(s); exit status 3" in text
    assert text.count("failed with exit code 3") == 3


def test_launcher_max_restarts_must_be_non_negative():
    with pytest.raises(ValueError, match=r"`max_restarts` \(-1\) must be an integer >= 0"):
        launch.make_plan(["python"], max_restarts=-1)


def test_module_examples():
    import doctest

    result = doctest.testmod(backup, verbose=False)
    assert result.attempted > 0 and result.failed == 0
