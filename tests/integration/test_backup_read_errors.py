"""A backup_dir that fails the run, through recipes/train.py (issue 27): checkpoint
data that cannot be read (the recipe run without the capabilities that bypass file
permissions) stops the run in one line and changes nothing, and the run resumes
once the files are readable again; a full backup_dir (a tiny tmpfs in a private
mount namespace, gone with it) ends in one line and keeps the previous backup.

The in-process checks of the same logic (corruption still skipped, the
discard flag, the rotation) are in tests/unit/test_backup.py."""

from __future__ import annotations

import glob
import os
import shutil
import subprocess

import pytest

from tests._util import RECIPES, WORKERS, CrashAt, run_python_warm
from tfmulti.training import backup

# 256 examples in batches of 64: 4 steps an epoch; a backup every 2 steps.
TINY = dict(distribution="one_device", dataset="synthetic", num_examples=256,
            global_batch_size=64, epochs=2, seed=0, backup_every_steps=2,
            steps_per_execution=1, verbose=0)
NO_DAC = ["--drop_dac"]  # root without the capabilities that bypass permissions


def _recipe(backup_dir, *confine: str, timeout: float = 300) -> subprocess.CompletedProcess:
    """recipes/train.py with TINY and `backup_dir`, in a process of its own confined
    first by tests/workers/confined.py's options `confine` (forked from the warm
    server: TensorFlow imported already)."""
    flags = [f"--{k}={v}" for k, v in {**TINY, "backup_dir": backup_dir}.items()]
    return run_python_warm([str(WORKERS / "confined.py"), *confine, "--",
                            str(RECIPES / "train.py"), *flags], timeout=timeout)


def _one_error(result: subprocess.CompletedProcess) -> str:
    """The one `train.py: error:` line of a run that exited 2, with no traceback."""
    assert result.returncode == 2, result.stderr[-3000:]
    errors = [line for line in result.stderr.splitlines() if line.startswith("train.py: error:")]
    assert len(errors) == 1, result.stderr[-3000:]
    assert "Traceback" not in result.stderr, result.stderr[-3000:]
    return errors[0]


def _state(folder) -> dict:
    """Name -> (mode, bytes) of every file in `folder` (read as root)."""
    out = {}
    for name in sorted(os.listdir(folder)):
        path = os.path.join(folder, name)
        with open(path, "rb") as f:
            out[name] = (os.stat(path).st_mode, f.read())
    return out


def _names(folder) -> list[str]:
    return sorted(os.path.basename(p) for p in backup.checkpoints(str(folder)))


@pytest.fixture(scope="module")
def crashed_backup(tmp_path_factory):
    """The backup of TINY crashed at step 6, made in this process: checkpoints at 2, 4."""
    from tfmulti.config.train_config import TrainConfig
    from tfmulti.training.train import train

    folder = tmp_path_factory.mktemp("crashed") / "backup"
    with pytest.raises(RuntimeError, match="simulated crash"):
        train(TrainConfig(**TINY, backup_dir=str(folder)), callbacks=[CrashAt(6)])
    assert _names(folder) == ["tfmulti-ckpt-2", "tfmulti-ckpt-4"]
    return folder


@pytest.mark.slow  # runs the recipe
def test_unreadable_checkpoint_data_stops_the_run_touching_nothing(tmp_path, crashed_backup,
                                                                   capsys):
    """The finding: a kept backup whose data files cannot be read was taken for
    corruption, the run started from step 0 (exit 0) and its first save replaced
    the checkpoints. Now: exit 2, one line naming the file and the error, the
    files unchanged byte for byte; readable again, the run resumes from them."""
    from tfmulti.config.train_config import TrainConfig
    from tfmulti.training.train import train

    backup_dir = tmp_path / "backup"
    shutil.copytree(crashed_backup, backup_dir)
    data_files = sorted(glob.glob(str(backup_dir / "tfmulti-ckpt-*.data-*")))
    assert len(data_files) == 2
    for path in data_files:
        os.chmod(path, 0)
    before = _state(backup_dir)
    error = _one_error(_recipe(backup_dir, *NO_DAC))
    assert error.startswith(
        f"train.py: error: cannot read the backup file {backup_dir}/tfmulti-ckpt-4.data-00000-"
        f"of-00001 (Permission denied); nothing in it was changed: make it readable"), error
    assert error.endswith(f"or pass --discard_unreadable_backup=True to start from step 0, "
                          f"discarding the backup in {backup_dir}."), error
    assert _state(backup_dir) == before
    for path in data_files:
        os.chmod(path, 0o644)
    capsys.readouterr()
    metrics = train(TrainConfig(**TINY, backup_dir=str(backup_dir)))
    assert metrics["resumed_from_step"] == 4 and metrics["epochs_completed"] == 2
    assert (f"resuming from {backup_dir}/tfmulti-ckpt-4: global step 4"
            in capsys.readouterr().out)


@pytest.mark.slow  # runs the recipe
def test_a_full_backup_dir_ends_in_one_line_and_keeps_the_previous_backup(tmp_path,
                                                                          crashed_backup):
    """A tmpfs with room for the 2 kept checkpoints and half of a third: the save
    at step 6 fails with ENOSPC (TensorFlow's ResourceExhaustedError), which used to
    end in a traceback (exit 1). Now: one line naming backup_dir and "no space
    left", exit 2, the checkpoints at 2 and 4 whole and no unfinished save left.
    The namespace's mount dies with it: the backup is copied out before."""
    page = 4096
    sizes = [os.path.getsize(p) for p in glob.glob(str(crashed_backup / "tfmulti-ckpt-4.*"))]
    checkpoint = sum(-(-size // page) * page for size in sizes)
    room = 2 * checkpoint + 2 * page + checkpoint // 2  # + the manifest and the lock file
    disk, after = tmp_path / "disk", tmp_path / "after"
    disk.mkdir()
    result = _recipe(disk / "backup", "--tmpfs", str(disk), f"{room // 1024}k",
                     "--then_copy", str(disk / "backup"), str(after))
    error = _one_error(result)
    assert error.startswith(
        f"train.py: error: no space left on the device of --backup_dir '{disk}/backup' while "
        "saving the backup at global step 6 ("), error
    assert "No space left on device" in error and "the backup at global step 4 is kept" in error
    assert not os.path.ismount(disk) and os.listdir(disk) == []  # nothing left behind
    assert _names(after) == ["tfmulti-ckpt-2", "tfmulti-ckpt-4"]
    assert not [n for n in os.listdir(after) if n.endswith("_temp")]
    assert [backup.verify(str(after / name)) for name in _names(after)] == [2, 4]
    assert backup.latest_valid(str(after)).step == 4


@pytest.mark.slow  # trains (in this process)
def test_discard_unreadable_backup_starts_the_run_from_step_0(tmp_path, crashed_backup, capsys):
    """The flag, through `train`: a backup whose data files are gone (links into a
    mount that is not there) is discarded with one warning line, the run trains
    from step 0 and its saves replace the old checkpoints."""
    from tfmulti.config.train_config import TrainConfig
    from tfmulti.training.train import train

    backup_dir = tmp_path / "backup"
    shutil.copytree(crashed_backup, backup_dir)
    for path in glob.glob(str(backup_dir / "tfmulti-ckpt-*.data-*")):
        os.remove(path)
        os.symlink("/nonexistent-mount/tfmulti-test/data", path)
    capsys.readouterr()
    metrics = train(TrainConfig(**TINY, backup_dir=str(backup_dir), keep_backup=True,
                                discard_unreadable_backup=True))
    assert metrics["resumed_from_step"] == 0 and metrics["epochs_completed"] == 2
    err = capsys.readouterr().err
    assert [line for line in err.splitlines() if "discard" in line] == [
        f"tfmulti: warning: discarding the backup in {backup_dir} (discard_unreadable_backup): "
        f"the file {backup_dir}/tfmulti-ckpt-4.data-00000-of-00001 cannot be read (No such file "
        "or directory); starting from step 0"], err
    assert _names(backup_dir) == ["tfmulti-ckpt-6", "tfmulti-ckpt-8"]
    assert not any(os.path.islink(p) for p in glob.glob(str(backup_dir / "*")))
