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
import sys

import numpy as np
import pytest

from tests._util import file_tree
from tests.workers import user_model
from tfmulti.training import backup
from tfmulti.cluster import exit_codes
from tests._util import CrashAt, backup_dict_stream, backup_fit, backup_model, backup_stream


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
        result = backup.fit(m, backup_stream, epochs=2, steps_per_epoch=8, save_every_steps=4,
                            backup_dir=str(tmp_path / directory), callbacks=list(callbacks),
                            verbose=0)
        return m, result

    reference, _ = run("a")
    with pytest.raises(RuntimeError, match="simulated crash"):
        run("b", [CrashAt(14)])
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
        backup.fit(m, backup_stream, epochs=4, steps_per_epoch=8, save_every_steps=4,
                   backup_dir=str(tmp_path), callbacks=callbacks, verbose=0)
        return int(m.optimizer.iterations)

    with pytest.raises(RuntimeError, match="simulated crash"):
        run([CrashAt(14)])
    # Resumed at step 12 (the restored iteration count): the rest of epoch 2,
    # 4 steps, then stopped, as the uninterrupted run stops after 16 steps.
    assert run([StopAfterSecondEpoch()]) == 16


def test_fit_refuses_a_steps_per_execution_the_model_does_not_run(tmp_path):
    m = _small_model(0.0)  # compiled with steps_per_execution 1
    with pytest.raises(ValueError, match=r"`steps_per_execution` \(5\) differs from the "
                                         r"model's \(1\)"):
        backup.fit(m, backup_stream, epochs=1, steps_per_epoch=10, steps_per_execution=5,
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
        backup.fit(_small_model(0.0), backup_stream, **args)
    assert os.listdir(tmp_path) == []


def test_fit_needs_whole_calls_of_steps(tmp_path):
    import keras

    m = keras.Sequential([keras.Input((3,)), keras.layers.Dense(2)])
    m.compile("sgd", "mse", steps_per_execution=3)
    with pytest.raises(ValueError, match=r"the model's steps per execution \(3\) must divide "
                                         r"`steps_per_epoch` \(8\) for step-exact resumes"):
        backup.fit(m, backup_stream, epochs=1, steps_per_epoch=8, backup_dir=str(tmp_path))
    _saved_backups(tmp_path)  # at step 12
    m.compile("sgd", "mse", steps_per_execution=8)
    with pytest.raises(ValueError, match=r"global step 12, not a multiple of the steps per "
                                         r"execution \(8\)"):
        backup.fit(m, backup_stream, epochs=2, steps_per_epoch=16, backup_dir=str(tmp_path))


# ------------------------------------------------------------------------ one run, one directory


def test_backup_dir_is_a_path_not_a_pattern(tmp_path):
    """`runs/exp[12]` is that directory: not a glob matching runs/exp1 and runs/exp2,
    whose checkpoints were resumed and then deleted."""
    for name in ("exp1", "exp2"):
        with pytest.raises(RuntimeError, match="simulated crash"):
            backup_fit(tmp_path / name, callbacks=[CrashAt(6)])
    others = {name: file_tree(tmp_path / name) for name in ("exp1", "exp2")}
    assert all(backup.checkpoints(str(tmp_path / name)) for name in others)
    pattern = tmp_path / "exp[12]"
    assert backup.latest_valid(str(pattern)).path is None
    result = backup_fit(pattern)
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
            backup_fit(tmp_path)
        assert sorted(os.listdir(tmp_path)) == ["tfmulti-backup.lock"]  # nothing written
        with pytest.raises(ValueError, match=r"in use by another run \(pid 4242"):
            backup.delete(str(tmp_path))
    finally:
        os.close(fd)  # what the kernel does when the holder dies
    # The dead holder's details do not block the rerun, nor show afterwards.
    result = backup_fit(tmp_path)
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
        result = backup_fit(tmp_path, callbacks=[Probe()])
        assert (tmp_path / "tfmulti-backup.lock").read_text() != ""  # still held
        result.delete_backup()
        assert os.listdir(tmp_path) == ["tfmulti-backup.lock"]
    assert seen and seen[0]["pid"] == os.getpid() and seen[0]["command"] == " ".join(sys.argv)
    assert not tmp_path.exists()


def test_a_resume_with_other_settings_is_refused_naming_them(tmp_path):
    fields = {"global_batch_size": 32, "dataset": "mine", "seed": 0}
    with pytest.raises(RuntimeError, match="simulated crash"):
        backup_fit(tmp_path, fingerprint=fields, callbacks=[CrashAt(10)])
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
        (dict(fingerprint=fields, model=backup_model(3)),
         r"model variables \(2 -> 2\): changed 0.Dense/0.kernel: \[8, 2\] float32 -> "
         r"\[8, 3\] float32, 0.Dense/1.bias: \[2\] float32 -> \[3\] float32"),
    ]
    for kwargs, match in cases:
        with pytest.raises(ValueError, match=match):
            backup_fit(tmp_path, **kwargs)
        assert file_tree(tmp_path) == before  # nothing restored into, nothing written
    assert backup_fit(tmp_path, fingerprint=fields).resumed_step == 8  # the same settings resume


def test_a_backup_without_its_manifest_is_refused(tmp_path):
    with pytest.raises(RuntimeError, match="simulated crash"):
        backup_fit(tmp_path, callbacks=[CrashAt(10)])
    os.remove(tmp_path / "tfmulti-backup.json")
    with pytest.raises(ValueError, match=r"has no tfmulti-backup.json"):
        backup_fit(tmp_path)


def test_fingerprint_fields_must_be_json(tmp_path):
    with pytest.raises(ValueError, match=r"`fingerprint` field 'data' must be a JSON value"):
        backup_fit(tmp_path, fingerprint={"data": object()})


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
        backup_fit(tmp_path, callbacks=[CrashAt(10)])
    result = backup_fit(tmp_path)
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
    model = backup_model()
    result = backup_fit(tmp_path, model=model)
    assert [os.path.basename(p) for p in backup.checkpoints(str(tmp_path))] == \
        ["tfmulti-ckpt-16", "tfmulti-ckpt-12"]
    # The caller's save failed; the rerun finds the finished run.
    rerun_model = backup_model()
    rerun = backup_fit(tmp_path, model=rerun_model)
    assert rerun.resumed_step == 16 and rerun.history == {}
    for a, b in zip(rerun_model.get_weights(), model.get_weights()):
        np.testing.assert_array_equal(a, b)
    rerun.delete_backup()
    assert not tmp_path.exists()
    assert result.chief and result.backup_dir == str(tmp_path)
    backup_fit(tmp_path, delete_on_success=True)  # the old behaviour, asked for
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
        data = (backup_dict_stream if strategy is None else
                lambda step: strategy.experimental_distribute_dataset(backup_dict_stream(step)))
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

    backup_fit(tmp_path)
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


@pytest.mark.slow  # trains for seconds: not in make test-fast
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


def test_a_scratch_dir_left_by_a_killed_save_goes_at_the_next_one(tmp_path, monkeypatch):
    """What a worker killed mid-save (outside `tfmulti launch`, whose workers
    have a TMPDIR of their own) leaves in TMPDIR is removed by the next save on
    the host: a scratch dir whose lock no process holds. One in use, another
    user's, a link (and what it points to) and a folder without tfmulti's lock
    file stay."""
    import fcntl
    import tempfile

    from tfmulti.training.backup import _files

    tmp = tmp_path / "tmp"
    tmp.mkdir()
    monkeypatch.setattr(tempfile, "tempdir", str(tmp))

    def scratch(name, locked_file=True):
        folder = tmp / f"tfmulti-backup-{name}"
        folder.mkdir()
        (folder / "tfmulti-ckpt_temp").mkdir()  # a half-written save
        if locked_file:
            (folder / ".tfmulti-scratch.lock").touch()
        return folder

    abandoned = scratch("killed")
    in_use = scratch("in-use")
    held = os.open(in_use / ".tfmulti-scratch.lock", os.O_RDWR)
    fcntl.flock(held, fcntl.LOCK_EX)  # another process's save under way
    others = scratch("others")
    os.chown(others, 65534, 65534)
    no_lock = scratch("unknown", locked_file=False)
    victim = tmp_path / "victim"
    victim.mkdir()
    (victim / ".tfmulti-scratch.lock").touch()
    os.symlink(victim, tmp / "tfmulti-backup-link")
    try:
        with _files.private_scratch() as folder:
            assert not abandoned.exists()
            assert os.path.dirname(folder) == str(tmp)
            assert os.stat(folder).st_mode & 0o777 == 0o700
            assert _files.remove_abandoned_scratch() == []  # this save's own is in use
            assert os.listdir(folder) == [".tfmulti-scratch.lock"]
        assert not os.path.exists(folder)
        assert sorted(os.listdir(tmp)) == ["tfmulti-backup-in-use", "tfmulti-backup-link",
                                           "tfmulti-backup-others", "tfmulti-backup-unknown"]
        assert sorted(os.listdir(victim)) == [".tfmulti-scratch.lock"]
        assert (no_lock / "tfmulti-ckpt_temp").is_dir() and (others / "tfmulti-ckpt_temp").is_dir()
    finally:
        os.close(held)
    assert _files.remove_abandoned_scratch() == [str(in_use)]  # its save ended without it


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


# ------------------------------------------------------------- read failures, a full backup_dir


def _snapshot(folder) -> dict:
    """Name -> bytes, or ("link", target) for a symbolic link (a dangling one
    included), of every entry of `folder`: to prove nothing was touched."""
    out = {}
    for name in sorted(os.listdir(folder)):
        path = os.path.join(folder, name)
        if os.path.islink(path):
            out[name] = ("link", os.readlink(path))
        elif os.path.isdir(path):
            out[name] = ("folder", sorted(os.listdir(path)))
        else:
            with open(path, "rb") as f:
                out[name] = f.read()
    return out


def _lose_data(prefix) -> str:
    """Replaces the data file of the checkpoint at `prefix` with a link into a
    filesystem that is not there (a missing mount): the name is listed, its bytes
    cannot be read. Returns where the real file went."""
    data_file = glob.glob(str(prefix) + ".data-*")[0]
    kept = os.path.join(os.path.dirname(data_file), "lost-" + os.path.basename(data_file))
    os.rename(data_file, kept)
    os.symlink("/nonexistent-mount/tfmulti-test/data", data_file)
    return kept


def _find_data_again(prefix, kept) -> None:
    data_file = glob.glob(str(prefix) + ".data-*")[0]
    os.remove(data_file)
    os.rename(kept, data_file)


@pytest.mark.parametrize("lost", ["newest", "all", "older after a corrupt newest"])
def test_an_unreadable_backup_stops_touching_nothing_and_resumes_once_readable(
        tmp_path, capsys, lost):
    """Issue 27, 1: a read failure is not corruption. A kept backup whose data
    cannot be read stops the run with the file and the error named, and nothing
    in backup_dir changes (no fallback, no fresh start whose first save replaces
    the checkpoints); once readable again, the run resumes from it."""
    backup_dir = tmp_path / "backup"
    with pytest.raises(RuntimeError, match="simulated crash"):
        backup_fit(backup_dir, callbacks=[CrashAt(10)])  # backups at 4 and 8
    newest, older = backup_dir / "tfmulti-ckpt-8", backup_dir / "tfmulti-ckpt-4"
    if lost == "older after a corrupt newest":
        with open(str(newest) + ".index", "r+b") as f:
            f.write(b"\xde\xad\xbe\xef" * 16)
        unreadable = [older]
    else:
        unreadable = [newest, older] if lost == "all" else [newest]
    kept = {prefix: _lose_data(prefix) for prefix in unreadable}
    before = _snapshot(backup_dir)
    capsys.readouterr()
    corrupt_newest = lost == "older after a corrupt newest"

    def falls_back():  # a corrupt newest checkpoint is still skipped, with a warning
        return (pytest.warns(RuntimeWarning, match=r"tfmulti-ckpt-8 .* falling back")
                if corrupt_newest else contextlib.nullcontext())

    for _ in range(2):  # and again: the first refusal changed nothing
        with falls_back(), pytest.raises(
                OSError, match=rf"cannot read the backup file {unreadable[0]}\.data-00000-of-"
                               r"00001 \(No such file or directory\); nothing in it was "
                               r"changed: make it readable .* and rerun to resume, or pass "
                               r"discard_unreadable_backup=True to start from step 0"):
            backup_fit(backup_dir)
        assert _snapshot(backup_dir) == before
    out = capsys.readouterr().out  # a corrupt newest one is still skipped, as before
    assert ("falling back" in out) == corrupt_newest, out
    for prefix, where in kept.items():
        _find_data_again(prefix, where)
    with falls_back():
        result = backup_fit(backup_dir)
    assert result.resumed_step == (4 if corrupt_newest else 8)


def test_discard_unreadable_backup_starts_from_step_0_saying_what_it_discards(tmp_path, capsys):
    backup_dir = tmp_path / "backup"
    with pytest.raises(RuntimeError, match="simulated crash"):
        backup_fit(backup_dir, callbacks=[CrashAt(10)])  # backups at 4 and 8
    _lose_data(backup_dir / "tfmulti-ckpt-8")
    capsys.readouterr()
    result = backup_fit(backup_dir, discard_unreadable_backup=True)
    assert result.resumed_step == 0 and len(result.history["loss"]) == 2
    err = capsys.readouterr().err
    lines = [line for line in err.splitlines() if "discard" in line]
    assert lines == [
        f"tfmulti: warning: discarding the backup in {backup_dir} (discard_unreadable_backup): "
        f"the file {backup_dir}/tfmulti-ckpt-8.data-00000-of-00001 cannot be read (No such file "
        f"or directory); starting from step 0"], err
    # Its saves replaced the discarded checkpoints.
    assert [os.path.basename(p) for p in backup.checkpoints(str(backup_dir))] == \
        ["tfmulti-ckpt-16", "tfmulti-ckpt-12"]
    assert not glob.glob(str(backup_dir / "tfmulti-ckpt-8*"))


def test_an_unreadable_manifest_stops_too(tmp_path):
    backup_dir = tmp_path / "backup"
    with pytest.raises(RuntimeError, match="simulated crash"):
        backup_fit(backup_dir, callbacks=[CrashAt(10)])
    manifest = backup_dir / "tfmulti-backup.json"
    os.rename(manifest, backup_dir / "manifest.kept")
    os.mkdir(manifest)  # in its place, something that cannot be read as a file
    before = _snapshot(backup_dir)
    with pytest.raises(OSError, match=rf"cannot read the backup file {manifest} "
                                      r"\(Is a directory\)"):
        backup_fit(backup_dir)
    assert _snapshot(backup_dir) == before


def test_a_checkpoint_is_deleted_only_after_a_newer_one_reads_back(tmp_path, monkeypatch):
    """A save whose checkpoint does not read back (a disk that lost the write)
    deletes nothing: the rotation removes the oldest only after the new one has
    been read back whole."""
    import tensorflow as tf

    m = _small_model(1.0)
    saver = backup.Backup(str(tmp_path), m, keep=2, chief=True, task_index=0)
    saver.save(4)
    saver.save(8)
    before = _snapshot(tmp_path)
    real_write = tf.train.Checkpoint.write

    def lossy_write(self, prefix, *args, **kwargs):
        path = real_write(self, prefix, *args, **kwargs)
        data_file = glob.glob(path + ".data-*")[0]
        with open(data_file, "r+b") as f:
            f.seek(os.path.getsize(data_file) // 2)
            f.write(b"\x00\xff" * 8)
        return path

    monkeypatch.setattr(tf.train.Checkpoint, "write", lossy_write)
    with pytest.raises(ValueError, match=r"the backup just saved, .*tfmulti-ckpt-12, does not "
                                         r"read back \(.*\); the previous backups in .* are "
                                         r"kept"):
        saver.save(12)
    assert _snapshot(tmp_path) == before  # the corrupt new one removed, nothing else
    monkeypatch.setattr(tf.train.Checkpoint, "write", real_write)
    saver.save(16)  # reads back: now the rotation goes on
    assert [os.path.basename(p) for p in backup.checkpoints(str(tmp_path))] == \
        ["tfmulti-ckpt-16", "tfmulti-ckpt-8"]


@pytest.mark.parametrize("error", ["tensorflow", "python"])
def test_a_full_backup_dir_names_it_and_keeps_the_previous_backup(tmp_path, monkeypatch, error):
    """ENOSPC while saving (TensorFlow raises ResourceExhaustedError, Python an
    OSError): one message naming backup_dir and "no space left", the previous
    backup intact, the unfinished save's temporary directory removed. (The real
    thing, a full tmpfs: tests/integration/test_backup_read_errors.py.)"""
    import errno

    import tensorflow as tf

    m = _small_model(1.0)
    saver = backup.Backup(str(tmp_path), m, keep=2, chief=True, task_index=0)
    saver.save(4)
    saver.save(8)
    before = _snapshot(tmp_path)

    def full_disk(self, prefix, *args, **kwargs):
        os.makedirs(prefix + "_temp")
        if error == "tensorflow":
            raise tf.errors.ResourceExhaustedError(
                None, None, f"{prefix}_temp/part-00000-of-00001.data-00000-of-00001.tempstate1; "
                "No space left on device [Op:SaveV2]")
        raise OSError(errno.ENOSPC, "No space left on device")

    monkeypatch.setattr(tf.train.Checkpoint, "write", full_disk)
    with pytest.raises(OSError, match=rf"no space left on the device of `backup_dir` "
                                      rf"'{tmp_path}' while saving the backup at global step 12 "
                                      r"\(.*No space left on device.*\); the backup at global "
                                      r"step 8 is kept: free space there"):
        saver.save(12)
    assert _snapshot(tmp_path) == before
