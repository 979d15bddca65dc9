"""Fault tolerance in processes and clusters: backup and restore
(tfmulti.training.backup), preemption, restarts, kills.

The tests that start processes or clusters; the in-process ones, and the
conventions, are in tests/unit/test_backup.py."""

from __future__ import annotations

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

from tests._util import (REPO, WORKERS, free_port, launch_python, popen_python_warm,
                         run_python_warm, tf_log_lines)
from tests.workers import resumable, slurm_backup, user_model
from tfmulti.training import backup
from tfmulti.cluster import exit_codes, tf_config
from tests._util import CrashAt, backup_dict_stream, backup_fit, backup_stream

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
    device within 1e-5, tests/integration/test_strategy.py), never interrupted;
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
def test_multi_worker_kills_and_a_sigterm_resume_and_match_uninterrupted(tmp_path, uninterrupted,
                                                                       monkeypatch):
    """Each worker SIGKILLed once, then one SIGTERMed, in one launch (merges the
    SIGKILL test, itself the old [victim=1] and [victim=0] cases, and the SIGTERM
    test: one cluster instead of two): worker 1 killed at step 22 (after the
    backup at 20), then the chief at step 30 (after the backup at 28); each
    restart resumes from the last backup. Then worker 1 gets SIGTERM at step 38:
    both workers save at the agreed next boundary, 39, exit 75, and the last
    restart resumes from 39. The result is the uninterrupted run's; with
    keep_backup only the chief's directory is kept, with the newest 2 checkpoints."""
    scratch = _private_tmp(monkeypatch, tmp_path)
    code, output = launch_python([WORKER, str(tmp_path), "multi_worker", "--kill", "22:1",
                                  "--kill", "30:0", "--kill", "38:1:TERM",
                                  "--config", json.dumps({"keep_backup": True})],
                                 max_restarts=3, grace_period=30)
    assert code == 0, output[-4000:]
    for victim in (1, 0):
        assert f"worker {victim} failed with exit code 137 (killed by SIGKILL)" in output, \
            output[-4000:]
    assert "restart 1 of 3" in output and "restart 2 of 3" in output
    assert "restart 3 of 3" in output
    first, second = _resumed(tmp_path, 20), _resumed(tmp_path, 28)  # the last backups
    assert first in output and second in output, output[-4000:]
    assert output.index(first) < output.index(second)
    assert "exit code 75 (preempted" in output, output[-4000:]
    # Worker 1 got SIGTERM at step 38; both saved at the next boundary, 39.
    assert "backup at global step 39 (preempted)" in output, output[-4000:]
    third = _resumed(tmp_path, 39)
    assert third in output and output.index(second) < output.index(third), output[-4000:]
    _assert_same_weights(tmp_path, uninterrupted)
    metrics = json.loads((tmp_path / "metrics.json").read_text())
    assert metrics["resumed_from_step"] == 39 and metrics["epochs_completed"] == 3
    # keep_backup: only the chief's directory exists, with the newest 2 checkpoints.
    kept = sorted(os.path.basename(p) for p in glob.glob(str(tmp_path / "backup" / "*.index")))
    assert kept == ["tfmulti-ckpt-44.index", "tfmulti-ckpt-48.index"]
    assert _scratch_dirs(scratch) == []  # no worker's temporary dir left
    # The workers (4 attempts) wrote TensorFlow's start-up lines (info, absl's pre-init
    # line, cuInit's error); the launcher dropped them (they come through when asked:
    # tests/integration/test_quiet.py) and passed the errors of the collectives a kill broke.
    passed = tf_log_lines(output)
    assert [line for line in passed if not re.match(r"(\[worker \d\] )?E\d{4} ", line)
            or "cuda_platform.cc" in line] == [], passed


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

    1. SIGTERM at 24: saves at that boundary, exits 75;
    2. SIGKILL past 26: it comes at 28, the end of a call, before that call's
       backup: the newest backup is still 24's, and the run resumes from it;
    3. to the end: the uninterrupted run's weights.

    (Three processes: a first one SIGKILLed past 22, at 24 before its backup,
    showed what 2. shows.)
    """
    backup_dir = tmp_path / "backup"

    def run(*kill):
        args = [WORKER, str(tmp_path), "mirrored", *(["--kill", kill[0]] if kill else []),
                "--config", json.dumps({"num_virtual_devices": 2, "steps_per_execution": 4})]
        return run_python_warm(args, timeout=300)

    preempted = run("24:0:TERM")
    assert preempted.returncode == exit_codes.PREEMPTED, preempted.stderr[-3000:]
    assert "sends itself SIGTERM at step 24" in preempted.stdout
    # One process: it saves at the boundary where it sees the signal.
    assert "preempted: saved a backup at global step 24" in preempted.stderr
    assert backup.latest_valid(str(backup_dir)).step == 24

    killed_in_a_call = run("26:0:KILL")
    assert killed_in_a_call.returncode == -signal.SIGKILL, killed_in_a_call.stderr[-3000:]
    assert _resumed(tmp_path, 24) in killed_in_a_call.stdout
    assert "sends itself SIGKILL at step 28" in killed_in_a_call.stdout
    assert backup.latest_valid(str(backup_dir)).step == 24  # 28's backup never happened

    finished = run()
    assert finished.returncode == 0, finished.stderr[-3000:]
    assert _resumed(tmp_path, 24) in finished.stdout
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
            env = {"TF_CONFIG": json.dumps(tf_config.build_tf_config(addresses, index))}
            procs.append(popen_python_warm(
                [WORKER, str(tmp_path), "multi_worker", "--config",
                 json.dumps({"epochs": 1000, "num_examples": 4096})],
                env=env, start_new_session=True))
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


@pytest.mark.slow
def test_a_crash_during_a_save_leaves_a_consistent_backup(tmp_path):
    """SIGKILL a process that saves ~32 MB checkpoints back to back, at 3
    random points in time: each time, the newest valid checkpoint is complete and
    consistent (every value equals its step), and saving resumes after it."""
    worker = str(WORKERS / "save_loop.py")
    rng = np.random.default_rng(0)
    steps = []
    for _ in range(3):
        proc = popen_python_warm([worker, str(tmp_path)], stderr="devnull")
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


@pytest.mark.slow  # starts a process
def test_a_killed_runs_lock_does_not_block_its_rerun(tmp_path):
    """A real holder process: its run is refused with its pid; once it is SIGKILLed,
    the kernel has released its lock and the rerun goes ahead."""
    code = ("import sys, time; from tfmulti.training.backup import _files; "
            "lock = _files.DirLock(sys.argv[1]); lock.acquire(); print('locked', flush=True); "
            "time.sleep(300)")
    proc = popen_python_warm(["-c", code, str(tmp_path)], stderr="devnull")
    try:
        ready, _, _ = select.select([proc.stdout], [], [], 120)
        assert ready and proc.stdout.readline().strip() == "locked"
        with pytest.raises(ValueError, match=rf"in use by another run \(pid {proc.pid} on "
                                             rf"{re.escape(socket.gethostname())}, since .*-c"):
            backup_fit(tmp_path)
    finally:
        proc.kill()
        proc.wait(timeout=30)
    assert backup_fit(tmp_path).resumed_step == 0


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


# ----------------------------------------------------------------------------- portable checkpoints


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
        backup.fit(model, backup_dict_stream, epochs=2, steps_per_epoch=8, save_every_steps=4,
                   backup_dir=str(tmp_path / directory), callbacks=list(callbacks), verbose=0,
                   fingerprint={"global_batch_size": 32})
        return model

    four = ["CPU:0", "CPU:1", "CPU:2", "CPU:3"]
    reference = run(four, "reference")
    weights = lambda m: [np.array(w) for w in m.get_weights()]  # noqa: E731
    saved_4 = _Record(8, weights)
    with pytest.raises(RuntimeError, match="simulated crash"):
        run(four, "b", saved_4, CrashAt(10))
    on_2, saved_2 = _Record(12, weights), None
    with pytest.raises(RuntimeError, match="simulated crash"):
        run(["CPU:0", "CPU:1"], "b", on_2, CrashAt(14))
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
        backup.fit(model, backup_stream, epochs=2, steps_per_epoch=8, save_every_steps=4,
                   backup_dir=str(tmp_path / directory), callbacks=list(callbacks), verbose=0)
        return model

    def weights(model):  # the unpartitioned model's, replica 0's for a pipeline
        unpartitioned = model.to_sequential() if isinstance(model, PipelineModel) else model
        return [np.array(w) for w in unpartitioned.get_weights()]

    reference = run("one_device", "reference")
    slots = 2 * len(reference.trainable_variables)
    one = _Record(4, weights)
    with pytest.raises(RuntimeError, match="simulated crash"):
        run("one_device", "b", one, CrashAt(6))
    hybrid = _Record(8, weights)
    with pytest.raises(RuntimeError, match="simulated crash"):
        run("hybrid", "b", hybrid, CrashAt(10))
    pipeline = _Record(12, weights)
    with pytest.raises(RuntimeError, match="simulated crash"):
        run("pipeline", "b", pipeline, CrashAt(14))
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
