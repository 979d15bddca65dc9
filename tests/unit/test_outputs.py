"""What a run owns in model_dir (tfmulti.training.outputs): the claim, the run
file, the publish that replaces only a run's own outputs and only after the new
ones are written; the same through `train` (issue 27, findings 2 and 8).

(The full model_dir disk, through recipes/train.py in a private mount namespace,
is in tests/integration/test_outputs.py.)
"""

from __future__ import annotations

import errno
import json
import os

import pytest

from tests._util import CrashAt, file_tree
from tfmulti.training import outputs

CONFIG = {"epochs": 1, "learning_rate": 0.001}
OTHER = {"epochs": 2, "learning_rate": 0.001}
EVENTS = "logs/train/events.out.tfevents.1.host.1.v2"


def _publish(folder, config, content: str, events: str = EVENTS) -> None:
    """A run's outputs, published as `train` does (without training)."""
    pending = os.path.join(outputs.pending_logs(str(folder)), os.path.relpath(events, "logs"))
    os.makedirs(os.path.dirname(pending), exist_ok=True)
    with open(pending, "w") as f:
        f.write(f"events of {content}")

    def write(stage):
        for name in ("metrics.json", "model.keras"):
            with open(os.path.join(stage, name), "w") as f:
                f.write(f"{name} of {content}")

    outputs.publish(str(folder), config, write)


@pytest.fixture
def published(tmp_path):
    """A model_dir holding the outputs of a finished run of CONFIG."""
    folder = tmp_path / "run"
    assert outputs.claim(str(folder), CONFIG, overwrite=False, resumable=False) is False
    _publish(folder, CONFIG, "the old run")
    return folder


def test_a_run_publishes_its_outputs_and_records_them(published):
    assert sorted(os.listdir(published)) == [".tfmulti-run.json", "logs", "metrics.json",
                                             "model.keras"]  # no pending or staging left
    assert (published / EVENTS).read_text() == "events of the old run"
    assert json.loads((published / ".tfmulti-run.json").read_text()) == {
        "config": CONFIG, "finished": True, "publishing": [],
        "published": [EVENTS, "metrics.json", "model.keras"]}


@pytest.mark.parametrize("files", [
    {"README": "mine"},
    {"metrics.json": "my own metrics"},
    {"logs/notes.txt": "my notes", "metrics.json": "{}", "README": "mine"},
    {".tfmulti-run.json": "not JSON", "model.keras": "mine"},  # not a run file tfmulti wrote
])
@pytest.mark.parametrize("overwrite", [False, True])
def test_a_folder_tfmulti_did_not_write_is_refused(tmp_path, files, overwrite):
    """Without a run file nothing there is tfmulti's: refused with or without
    overwrite, in one line naming what is there; nothing changes."""
    for name, text in files.items():
        (tmp_path / name).parent.mkdir(parents=True, exist_ok=True)
        (tmp_path / name).write_text(text)
    before = file_tree(tmp_path)
    shown = ", ".join(sorted({name.split("/")[0] for name in files}))
    with pytest.raises(ValueError, match=rf"holds files tfmulti did not write \({shown}; no "
                                         r"readable .tfmulti-run.json there\), and overwrite=True "
                                         r"replaces only a tfmulti run's outputs: choose "
                                         r"another model_dir, or move") as raised:
        outputs.claim(str(tmp_path), CONFIG, overwrite=overwrite, resumable=False)
    assert "\n" not in str(raised.value) and repr(str(tmp_path)) in str(raised.value)
    assert file_tree(tmp_path) == before and sorted(os.listdir(tmp_path)) == sorted(
        {name.split("/")[0] for name in files})


@pytest.mark.parametrize("name", ["logs/notes.txt", "logs/train/mine.txt"])
def test_overwrite_refuses_a_users_file_inside_the_runs_logs(published, name):
    (published / name).write_text("the user's")
    before = file_tree(published)
    with pytest.raises(ValueError, match=rf"holds {name}, which no tfmulti run wrote \(not in "
                                         r"its .tfmulti-run.json\): overwrite=True replaces "
                                         r"only a run's own outputs; move it out"):
        outputs.claim(str(published), OTHER, overwrite=True, resumable=False)
    assert file_tree(published) == before


def test_overwrite_refuses_a_users_metrics_json_that_no_run_published(tmp_path):
    """A failed run's run file (nothing published) does not make the user's
    metrics.json tfmulti's."""
    outputs.claim(str(tmp_path), CONFIG, overwrite=False, resumable=False)  # then it failed
    (tmp_path / "metrics.json").write_text("the user's")
    with pytest.raises(ValueError, match=r"holds metrics.json, which no tfmulti run wrote"):
        outputs.claim(str(tmp_path), OTHER, overwrite=True, resumable=False)
    assert (tmp_path / "metrics.json").read_text() == "the user's"


def test_overwrite_keeps_the_old_outputs_until_the_new_ones_are_published(published):
    """The claim changes nothing the old run published; the publish replaces
    them, removes the old run's recorded files only, and keeps the user's."""
    (published / "notes.txt").write_text("the user's, beside the outputs")
    old = file_tree(published)
    with pytest.raises(ValueError, match=r"holds another run's outputs; pass overwrite=True"):
        outputs.claim(str(published), OTHER, overwrite=False, resumable=False)
    assert outputs.claim(str(published), OTHER, overwrite=True, resumable=False) is False
    claimed = file_tree(published)
    assert {k: v for k, v in claimed.items() if k != ".tfmulti-run.json"} == {
        k: v for k, v in old.items() if k != ".tfmulti-run.json"}
    assert json.loads(claimed[".tfmulti-run.json"]) == {
        "config": OTHER, "finished": False, "publishing": [],
        "published": [EVENTS, "metrics.json", "model.keras"]}
    # A file of the user's dropped into logs/ during the run stays.
    (published / "logs" / "train" / "late.txt").write_text("the user's, added meanwhile")
    new_events = "logs/train/events.out.tfevents.2.host.2.v2"
    _publish(published, OTHER, "the new run", events=new_events)
    assert file_tree(published) == {
        ".tfmulti-run.json": file_tree(published)[".tfmulti-run.json"],
        "notes.txt": b"the user's, beside the outputs",
        "logs/train/late.txt": b"the user's, added meanwhile",
        new_events: b"events of the new run",
        "metrics.json": b"metrics.json of the new run",
        "model.keras": b"model.keras of the new run"}
    assert json.loads((published / ".tfmulti-run.json").read_text()) == {
        "config": OTHER, "finished": True, "publishing": [],
        "published": [new_events, "metrics.json", "model.keras"]}


def test_a_failed_publish_leaves_the_old_outputs(published):
    """A full disk while the new outputs are staged: one line naming model_dir
    and the fix; the old outputs stay, and the new run's logs stay pending."""
    outputs.claim(str(published), OTHER, overwrite=True, resumable=False)
    old = {k: v for k, v in file_tree(published).items() if k != ".tfmulti-run.json"}
    pending = os.path.join(outputs.pending_logs(str(published)), "train", "events.new")
    os.makedirs(os.path.dirname(pending))
    open(pending, "w").close()

    def full_disk(stage):
        with open(os.path.join(stage, "metrics.json"), "w") as f:
            f.write("{}")
        raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC), os.path.join(stage, "model"))

    with pytest.raises(OSError, match=rf"^cannot write the outputs to `model_dir` "
                                      rf"'{published}': No space left on device; free space "
                                      r"there, or choose another model_dir\.$"):
        outputs.publish(str(published), OTHER, full_disk)
    left = file_tree(published)
    assert {k: v for k, v in left.items()
            if k != ".tfmulti-run.json" and not k.startswith(".tfmulti-pending")} == old
    assert os.path.exists(pending)
    assert not [name for name in os.listdir(published) if name.startswith(".staging-")]


def test_a_publish_killed_part_way_keeps_every_file_recorded(published, monkeypatch):
    """Stopped after the first new event file moved into logs/: the run file
    still records the old and the new files; the resumed run's publish keeps
    what it had moved and removes the old run's."""
    outputs.claim(str(published), OTHER, overwrite=True, resumable=True)
    pending = outputs.pending_logs(str(published))
    os.makedirs(os.path.join(pending, "train"))
    for name in ("events.a", "events.b"):
        (published / ".tfmulti-pending" / "logs" / "train" / name).write_text(name)
    sync = outputs.fsync_path

    def stop_at_b(path):
        if path.endswith("events.b"):
            raise OSError(errno.EIO, "simulated stop")
        sync(path)

    monkeypatch.setattr(outputs, "fsync_path", stop_at_b)
    with pytest.raises(OSError, match="simulated stop"):
        _publish(published, OTHER, "the new run", events="logs/train/events.a")
    moved = ["logs/train/events.a", EVENTS, "metrics.json", "model.keras"]
    assert sorted(n for n in file_tree(published) if n.startswith(("logs", "m"))) == moved
    assert set(moved) <= set(outputs.read_record(str(published)).published)
    monkeypatch.setattr(outputs, "fsync_path", sync)
    assert outputs.claim(str(published), OTHER, overwrite=True, resumable=True) is False
    _publish(published, OTHER, "the new run", events="logs/train/events.b")
    assert outputs.read_record(str(published)).published == [
        "logs/train/events.a", "logs/train/events.b", "metrics.json", "model.keras"]
    assert sorted(n for n in file_tree(published) if n != ".tfmulti-run.json") == [
        "logs/train/events.a", "logs/train/events.b", "metrics.json", "model.keras"]


def test_a_failed_run_does_not_block_its_rerun(tmp_path):
    """A run that published nothing leaves only tfmulti's bookkeeping: the same
    run, or another, claims the folder again; its unpublished logs go."""
    folder = str(tmp_path / "run")
    outputs.claim(folder, CONFIG, overwrite=False, resumable=False)
    os.makedirs(outputs.pending_logs(folder))  # then it failed
    assert outputs.claim(folder, CONFIG, overwrite=False, resumable=False) is False
    assert os.listdir(folder) == [".tfmulti-run.json"]
    os.makedirs(outputs.pending_logs(folder))
    assert outputs.claim(folder, OTHER, overwrite=False, resumable=False) is False
    assert outputs.read_record(folder).config == OTHER


def test_a_resumed_run_keeps_its_pending_logs_and_knows_when_it_has_finished(tmp_path):
    folder = str(tmp_path / "run")
    assert outputs.claim(folder, CONFIG, overwrite=False, resumable=True) is False
    os.makedirs(outputs.pending_logs(folder))  # killed while training
    assert outputs.claim(folder, CONFIG, overwrite=False, resumable=True) is False
    assert os.path.isdir(outputs.pending_logs(folder))  # resumed: its logs so far stay
    _publish(folder, CONFIG, "the run")
    assert outputs.claim(folder, CONFIG, overwrite=False, resumable=True) is True
    # overwrite trains a finished run again (its outputs stay until it publishes).
    assert outputs.claim(folder, CONFIG, overwrite=True, resumable=True) is False
    assert outputs.read_record(folder).finished is False
    assert os.path.isfile(os.path.join(folder, "model.keras"))


def test_the_runs_own_backup_dir_inside_model_dir_is_not_another_runs(tmp_path):
    """`--backup_dir=DIR/backup --model_dir=DIR` (docs/how-to/many_hosts.md): the
    backup, made before the claim, does not make the folder "not empty"."""
    (tmp_path / "backup").mkdir()
    assert outputs.claim(str(tmp_path), CONFIG, overwrite=False, resumable=True,
                         own=("backup",)) is False
    with pytest.raises(ValueError, match=r"is not empty \(backup\): it holds other files"):
        outputs.claim(str(tmp_path), OTHER, overwrite=False, resumable=True)
    assert (tmp_path / "backup").is_dir()


def test_an_earlier_tfmultis_run_file_records_its_outputs_by_name(tmp_path):
    """A run file of the configuration alone (tfmulti before the record): its
    metrics.json, model.keras and TensorBoard event files are its outputs."""
    (tmp_path / "logs" / "train").mkdir(parents=True)
    (tmp_path / EVENTS).write_text("events")
    for name in ("metrics.json", "model.keras"):
        (tmp_path / name).write_text(name)
    (tmp_path / ".tfmulti-run.json").write_text(json.dumps(CONFIG))
    assert outputs.read_record(str(tmp_path)) == outputs.Record(
        CONFIG, True, [EVENTS, "metrics.json", "model.keras"])
    (tmp_path / "logs" / "notes.txt").write_text("the user's")
    with pytest.raises(ValueError, match=r"holds logs/notes.txt, which no tfmulti run wrote"):
        outputs.claim(str(tmp_path), OTHER, overwrite=True, resumable=False)


def test_one_run_at_a_time_holds_a_model_dir(tmp_path):
    with outputs.lock(str(tmp_path / "run")):
        with pytest.raises(ValueError, match=r"`model_dir` '.*run' is in use by another run "
                                             r"now; wait for it to end, or choose another"):
            with outputs.lock(str(tmp_path / "run")):
                pass
    with outputs.lock(str(tmp_path / "run")):  # released at the end of the block
        pass


# ---------------------------------------------------------------- through train


TINY = dict(dataset="synthetic", num_examples=256, global_batch_size=64, epochs=1, seed=0,
            verbose=0, distribution="one_device")


def test_train_with_overwrite_refuses_the_users_folder(tmp_path):
    """The issue's folder: the user's logs/notes.txt, metrics.json and README,
    never a tfmulti run's: refused with overwrite, nothing deleted."""
    from tfmulti.config.train_config import TrainConfig
    from tfmulti.training.train import train

    (tmp_path / "logs").mkdir()
    for name in ("logs/notes.txt", "metrics.json", "README"):
        (tmp_path / name).write_text(f"the user's {name}")
    before = file_tree(tmp_path)
    with pytest.raises(ValueError, match=r"holds files tfmulti did not write \(README, logs, "
                                         r"metrics.json; no readable .tfmulti-run.json there\)"):
        train(TrainConfig(model_dir=str(tmp_path), overwrite=True, **TINY))
    assert file_tree(tmp_path) == before


def test_train_keeps_the_old_outputs_when_the_new_run_fails_and_reruns(tmp_path):
    """A run that fails while training: the outputs it was to replace are
    untouched (an earlier tfmulti's run, here), and the same command runs again."""
    from tfmulti.config.train_config import TrainConfig
    from tfmulti.training.train import train

    (tmp_path / "logs" / "train").mkdir(parents=True)
    (tmp_path / EVENTS).write_text("old events")
    for name in ("metrics.json", "model.keras"):
        (tmp_path / name).write_text(f"the old run's {name}")
    (tmp_path / ".tfmulti-run.json").write_text(json.dumps(CONFIG))
    before = {k: v for k, v in file_tree(tmp_path).items() if k != ".tfmulti-run.json"}
    config = TrainConfig(model_dir=str(tmp_path), overwrite=True, **TINY)
    with pytest.raises(RuntimeError, match="simulated crash"):
        train(config, callbacks=[CrashAt(4)])  # at its last step
    assert {k: v for k, v in file_tree(tmp_path).items()
            if k != ".tfmulti-run.json" and not k.startswith(".tfmulti-pending")} == before
    train(config)  # the rerun replaces them
    assert (tmp_path / "metrics.json").read_text() != "the old run's metrics.json"
    assert not (tmp_path / EVENTS).exists()
    assert sorted(os.listdir(tmp_path)) == [".tfmulti-run.json", "logs", "metrics.json",
                                            "model.keras"]


def test_a_failed_train_does_not_block_its_identical_rerun(tmp_path):
    """Finding 8: the run file of a run that failed made the same command refused
    as "another run's outputs"."""
    from tfmulti.config.train_config import TrainConfig
    from tfmulti.training.train import train

    config = TrainConfig(model_dir=str(tmp_path / "run"), **TINY)
    with pytest.raises(RuntimeError, match="simulated crash"):
        train(config, callbacks=[CrashAt(4)])
    metrics = train(config)
    assert metrics["epochs_completed"] == 1
    assert json.loads((tmp_path / "run" / "metrics.json").read_text()) == metrics
