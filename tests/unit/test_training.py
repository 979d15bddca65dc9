"""tfmulti.training.train.train, in-process on the 4 virtual CPUs of tests/conftest.py:
the metrics it returns and writes, what it writes to model_dir, and that a
bad configuration writes nothing.

(TrainConfig's own rules are in tests/unit/test_config.py, the recipe around
train in tests/integration/test_recipes.py, resuming in tests/integration/test_backup.py.)
"""

from __future__ import annotations

import json
import os
import shutil
import stat

import keras
import numpy as np
import pytest

from tfmulti.config.train_config import TrainConfig
from tfmulti.training.train import train

SYNTHETIC = dict(dataset="synthetic", num_examples=512, global_batch_size=64, seed=0)


def _tree(folder) -> dict:
    return {str(p.relative_to(folder)): p.read_bytes() for p in sorted(folder.rglob("*"))
            if p.is_file()}


class _Iterations(keras.callbacks.Callback):
    def on_train_end(self, logs=None):
        self.iterations = int(self.model.optimizer.iterations.numpy())


@pytest.mark.slow  # trains for seconds: not in make test-fast
def test_train_returns_and_writes_metrics_model_and_logs(tmp_path, capsys):
    model_dir, backup_dir = tmp_path / "run", tmp_path / "backup"
    counter = _Iterations()
    metrics = train(TrainConfig(distribution="mirrored", devices=("CPU:0", "CPU:1"), epochs=2,
                                model_dir=str(model_dir), backup_dir=str(backup_dir),
                                verbose=0, **SYNTHETIC), callbacks=[counter])
    assert counter.iterations == 2 * 8  # the extra callback ran: 512 / 64 steps per epoch
    assert {k: metrics[k] for k in (
        "distribution", "num_replicas", "num_workers", "dataset", "model", "global_batch_size",
        "per_replica_batch_size", "epochs_completed", "resumed_from_step", "steps_per_epoch",
        "steps_per_execution", "mixed_precision", "jit_compile")} == {
        "distribution": "MirroredStrategy", "num_replicas": 2, "num_workers": 1,
        "dataset": "synthetic", "model": "mlp", "global_batch_size": 64,
        "per_replica_batch_size": 32, "epochs_completed": 2, "resumed_from_step": 0,
        "steps_per_epoch": 8, "steps_per_execution": 8, "mixed_precision": "none",
        "jit_compile": False}
    assert "strategy" not in metrics  # renamed "distribution"
    assert metrics["learning_rate"] == pytest.approx(1e-3)
    assert len(metrics["epoch_seconds"]) == 2 and metrics["train_seconds"] > 0
    assert metrics["examples_per_second"] > 0
    assert 0 <= metrics["test_accuracy"] <= 1 and 0 <= metrics["train_accuracy"] <= 1
    assert metrics["test_loss"] > 0 and metrics["train_loss"] > 0
    assert "test_mae" not in metrics
    # Written: the same metrics (readable by all), the model, TensorBoard logs; no temporaries.
    written = model_dir / "metrics.json"
    assert json.loads(written.read_text()) == metrics
    assert stat.S_IMODE(written.stat().st_mode) == 0o644
    loaded = keras.saving.load_model(model_dir / "model.keras")
    assert loaded.name == "mlp" and loaded.output_shape == (None, 10)
    assert list((model_dir / "logs").rglob("events.out.tfevents.*"))
    assert sorted(os.listdir(model_dir)) == [".tfmulti-run.json", "logs", "metrics.json",
                                             "model.keras"]  # no staging folder left
    assert not backup_dir.exists()  # deleted after a clean end (keep_backup=False)
    out = capsys.readouterr().out
    assert "tfmulti: MirroredStrategy with 2 replicas" in out
    assert "global batch 64 = 2 x 32; 8 steps/epoch, 8 per call" in out
    assert f"tfmulti: wrote metrics.json, model.keras and logs/ to {model_dir}" in out


@pytest.mark.slow  # trains for seconds: not in make test-fast
def test_train_regression_with_fewer_steps_and_a_kept_backup(tmp_path, capsys):
    counter = _Iterations()
    metrics = train(TrainConfig(distribution="one_device", model="regression",
                                dataset="synthetic_regression", num_examples=256,
                                global_batch_size=64, epochs=2, steps_per_epoch=2,
                                backup_dir=str(tmp_path / "backup"), keep_backup=True),
                    callbacks=[counter])
    assert counter.iterations == 4
    assert metrics["steps_per_epoch"] == 2 and metrics["epochs_completed"] == 2
    assert metrics["distribution"] == "OneDeviceStrategy" and metrics["num_replicas"] == 1
    assert metrics["test_mae"] > 0 and metrics["test_loss"] > 0
    assert "test_accuracy" not in metrics and "train_accuracy" not in metrics
    assert sorted(p.name for p in (tmp_path / "backup").glob("tfmulti-ckpt-*.index")) == \
        ["tfmulti-ckpt-2.index", "tfmulti-ckpt-4.index"]  # keep_backup: the newest 2
    out = capsys.readouterr().out
    assert "Epoch 1/2" in out and "Epoch 2/2" in out  # verbose "auto" off a terminal: 2
    assert "wrote metrics.json" not in out  # no model_dir: nothing written


def test_train_pipeline_saves_a_plain_keras_model(tmp_path, capsys):
    model_dir = tmp_path / "run"
    metrics = train(TrainConfig(distribution="pipeline", devices=("CPU:0", "CPU:1"),
                                num_stages=2, num_microbatches=2, epochs=1,
                                model_dir=str(model_dir), verbose=0, **SYNTHETIC))
    assert metrics["distribution"] == "pipeline" and metrics["num_replicas"] == 1
    assert metrics["num_stages"] == 2 and metrics["num_microbatches"] == 2
    assert len(metrics["partition_sizes"]) == 2 and sum(metrics["partition_sizes"]) == 4
    assert metrics["partition_balance"] >= 1.0
    loaded = keras.saving.load_model(model_dir / "model.keras")
    assert type(loaded) is keras.Sequential and loaded.name == "mlp"
    assert [layer.name for layer in loaded.layers] == ["flatten", "fc1", "dropout", "logits"]
    out = capsys.readouterr().out
    assert "pipeline: 1 replica x 2 stages on ['/device:CPU:0', '/device:CPU:1']" in out
    assert "balance (max/mean stage cost, 1.00 is perfect)" in out  # the plan's table
    assert "replica  stage  parameters  gradients" in out  # and its memory per device


@pytest.mark.parametrize("fields, match", [
    ({"global_batch_size": 0}, r"`global_batch_size` must be a positive integer"),
    ({"model": "regression"}, r"`model` 'regression' does regression but `dataset` "
                              r"'synthetic' is a classification dataset"),
    ({"steps_per_execution": 3}, r"`steps_per_execution` \(3\) must divide the steps per "
                                 r"epoch \(8\)"),
    ({"distribution": "mirrored", "devices": ("CPU:0", "CPU:9")}, r"do not exist; available"),
    ({"distribution": "pipeline", "global_batch_size": 30}, r"must split into 1 replica x"),
])
def test_a_bad_configuration_writes_nothing(tmp_path, fields, match):
    existing, new = tmp_path / "existing", tmp_path / "new"
    existing.mkdir()
    (existing / "keep.txt").write_text("previous results")
    before = _tree(existing)
    for model_dir in (existing, new):
        config = TrainConfig(**{**SYNTHETIC, "model_dir": str(model_dir),
                                "backup_dir": str(tmp_path / "backup"), **fields})
        with pytest.raises(ValueError, match=match):
            train(config)
    assert _tree(existing) == before
    assert not new.exists() and not (tmp_path / "backup").exists()


TINY = dict(dataset="synthetic", num_examples=256, global_batch_size=64, epochs=1, seed=0,
            verbose=0, distribution="one_device")


@pytest.fixture(scope="module")
def _tiny_run(tmp_path_factory):
    """The model_dir of one finished TINY run (no backup_dir: its outputs do not
    name their folder), trained once for the tests that start from such a run."""
    model_dir = tmp_path_factory.mktemp("tiny") / "run"
    train(TrainConfig(model_dir=str(model_dir), **TINY))
    return model_dir


@pytest.fixture
def finished_tiny_run(_tiny_run, tmp_path):
    """A copy, in this test's tmp_path/run, of the finished TINY run's model_dir."""
    model_dir = tmp_path / "run"
    shutil.copytree(_tiny_run, model_dir)
    return model_dir


@pytest.mark.slow  # trains for seconds: not in make test-fast
def test_model_dir_belongs_to_one_run(tmp_path, finished_tiny_run):
    """Another run's outputs are refused, replaced with overwrite, kept on resume."""
    model_dir = finished_tiny_run  # train(TrainConfig(model_dir=str(model_dir), **TINY))
    (model_dir / "notes.txt").write_text("the user's own file")
    before = _tree(model_dir)
    with pytest.raises(ValueError, match=r"`model_dir` '.*run' is not empty \(logs, "
                                         r"metrics.json, model.keras, notes.txt\): it "
                                         r"holds another run's outputs; pass overwrite=True"):
        train(TrainConfig(model_dir=str(model_dir), **{**TINY, "learning_rate": 0.01}))
    assert _tree(model_dir) == before
    # overwrite: tfmulti's outputs (old TensorBoard runs too) are replaced, the user's kept.
    old_events = sorted(str(p) for p in (model_dir / "logs").rglob("events.out.tfevents.*"))
    train(TrainConfig(model_dir=str(model_dir), overwrite=True, **{**TINY, "learning_rate": 0.01}))
    new_events = sorted(str(p) for p in (model_dir / "logs").rglob("events.out.tfevents.*"))
    assert not set(old_events) & set(new_events) and len(new_events) == len(old_events)
    assert (model_dir / "notes.txt").read_text() == "the user's own file"
    record = json.loads((model_dir / ".tfmulti-run.json").read_text())
    assert record["config"]["learning_rate"] == 0.01 and record["finished"] is True
    # The same configuration with a backup resumes into its own model_dir (killed before
    # its outputs were published: here, removed).
    resumable = dict(TINY, model_dir=str(tmp_path / "resumable"), backup_dir=str(tmp_path / "b"),
                     keep_backup=True)
    train(TrainConfig(**resumable))
    for name in ("metrics.json", "model.keras"):
        os.remove(tmp_path / "resumable" / name)
    metrics = train(TrainConfig(**{**resumable, "verbose": 2}))  # a rerun: resumes, at the end
    assert metrics["resumed_from_step"] == 4


@pytest.mark.slow  # trains for seconds: not in make test-fast
def test_a_finished_run_is_not_trained_again(tmp_path, capsys):
    """A resumable run restarted after it published its outputs (a kill at its exit,
    a requeued job) returns its metrics, trains nothing and leaves model_dir as it
    was; it finishes the backup's removal a kill interrupted; overwrite trains again."""
    run = dict(TINY, model_dir=str(tmp_path / "run"), backup_dir=str(tmp_path / "backup"))
    first = train(TrainConfig(**run))
    assert not (tmp_path / "backup").exists()
    before = _tree(tmp_path / "run")
    capsys.readouterr()
    counter = _Iterations()
    again = train(TrainConfig(**{**run, "verbose": 2}), callbacks=[counter])
    assert again == first and not hasattr(counter, "iterations")  # no fit at all
    assert _tree(tmp_path / "run") == before
    out = capsys.readouterr().out
    assert (f"tfmulti: this run has finished already: its outputs are in {tmp_path / 'run'} "
            "(metrics.json, model.keras); nothing left to train (overwrite=True, --overwrite, "
            "trains it again)") in out
    assert "Epoch 1/" not in out
    # Killed while its backup was being removed: the restart removes the rest.
    kept = dict(run, model_dir=str(tmp_path / "kept"), keep_backup=True)
    train(TrainConfig(**kept))
    assert (tmp_path / "backup").is_dir()
    train(TrainConfig(**{**kept, "keep_backup": False}))
    assert not (tmp_path / "backup").exists()
    # Another configuration is still refused; overwrite trains it anew.
    with pytest.raises(ValueError, match="holds another run's outputs"):
        train(TrainConfig(**{**run, "learning_rate": 0.01}))
    counter = _Iterations()
    train(TrainConfig(**run, overwrite=True), callbacks=[counter])
    assert counter.iterations == 4


@pytest.mark.slow  # trains for seconds: not in make test-fast
def test_a_resumed_run_removes_the_half_written_outputs_of_a_killed_one(tmp_path):
    """A worker killed while publishing leaves its staging folder (the next
    publish uses a new one); the run's next attempt removes it. Another
    run's staging folder is not touched without overwrite."""
    run = dict(TINY, model_dir=str(tmp_path / "run"), backup_dir=str(tmp_path / "b"),
               keep_backup=True)
    train(TrainConfig(**run))
    killed = tmp_path / "run" / ".staging-k1ll3d"
    killed.mkdir()
    (killed / "model.keras").write_bytes(b"half a model")
    train(TrainConfig(**run))
    assert sorted(os.listdir(tmp_path / "run")) == [".tfmulti-run.json", "logs", "metrics.json",
                                                     "model.keras"]
    other = tmp_path / "other"
    (other / ".staging-0th3r").mkdir(parents=True)
    train(TrainConfig(**{**run, "model_dir": str(other), "backup_dir": str(tmp_path / "c")}))
    assert (other / ".staging-0th3r").is_dir()


@pytest.mark.slow  # trains for seconds: not in make test-fast
def test_a_run_resumed_at_its_end_writes_the_trained_optimizer_and_train_metrics(tmp_path):
    """Killed after training (during the evaluation or the writes), the rerun
    resumes at the finished backup and writes what the uninterrupted run wrote:
    model.keras with the trained optimizer (Adam's step count and moments) and
    metrics.json with the last epoch's train metrics (found by recipes/chaos.py:
    a fresh optimizer and train_loss None before)."""
    run = dict(TINY, optimizer="adam", model_dir=str(tmp_path / "run"),
               backup_dir=str(tmp_path / "backup"), keep_backup=True)  # as if killed
    first = train(TrainConfig(**run))
    saved = keras.models.load_model(tmp_path / "run" / "model.keras")
    for name in ("metrics.json", "model.keras"):  # killed before they were published
        os.remove(tmp_path / "run" / name)
    again = train(TrainConfig(**run))
    assert (first["resumed_from_step"], again["resumed_from_step"]) == (0, 4)
    assert again["epochs_completed"] == first["epochs_completed"] == 1
    for name in ("train_loss", "train_accuracy", "test_loss", "test_accuracy"):
        assert again[name] == pytest.approx(first[name], abs=1e-6), name
    rewritten = keras.models.load_model(tmp_path / "run" / "model.keras")
    assert int(rewritten.optimizer.iterations) == int(saved.optimizer.iterations) == 4
    for a, b in zip(rewritten.optimizer.variables, saved.optimizer.variables):
        np.testing.assert_allclose(np.asarray(a), np.asarray(b), atol=1e-6, rtol=0)


def test_outputs_are_published_together(finished_tiny_run, monkeypatch):
    """A failure while writing the model leaves no metrics.json that belongs to
    another model, no staging folder, and the old run's outputs as they were."""
    model_dir = finished_tiny_run  # train(TrainConfig(model_dir=str(model_dir), **TINY))
    before = {k: v for k, v in _tree(model_dir).items() if k != ".tfmulti-run.json"}

    def full_disk(self, *args, **kwargs):
        raise OSError(28, "No space left on device")

    monkeypatch.setattr(keras.Model, "save", full_disk)
    with pytest.raises(OSError, match=r"cannot write the outputs to `model_dir` '.*run': No "
                                      r"space left on device; free space there"):
        train(TrainConfig(model_dir=str(model_dir), overwrite=True, **TINY))
    left = sorted(os.listdir(model_dir))
    assert not [name for name in left if name.startswith(".staging-")]
    assert {k: v for k, v in _tree(model_dir).items()
            if k != ".tfmulti-run.json" and not k.startswith(".tfmulti-pending")} == before


def test_a_model_is_saved_through_a_file_not_held_twice_in_memory(tmp_path):
    """Keras writes a `.keras` file's weights into memory and copies them where
    it deems the memory enough; tfmulti's save takes its way through a file
    (Keras' own, for machines short of memory): the model loads back the same,
    and Keras' choice is its own again after."""
    from keras.src.saving import saving_lib

    from tfmulti.training import train as train_lib

    model = keras.Sequential([keras.Input((3,)), keras.layers.Dense(2)])
    assert saving_lib.is_memory_sufficient(model)
    taken = []
    original = saving_lib.H5IOStore.__init__

    def init(self, path_or_io, *args, archive=None, **kwargs):
        taken.append("memory" if archive is not None else "file")
        original(self, path_or_io, *args, archive=archive, **kwargs)

    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(saving_lib.H5IOStore, "__init__", init)
        with train_lib._weights_through_a_file():
            model.save(tmp_path / "model.keras")
    assert taken == ["file"]
    assert saving_lib.is_memory_sufficient(model)
    for a, b in zip(keras.models.load_model(tmp_path / "model.keras").get_weights(),
                    model.get_weights(), strict=True):
        np.testing.assert_array_equal(a, b)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["model.keras"]  # no file left
