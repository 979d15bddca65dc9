"""The logging hooks of a run: the user's Keras callbacks (`callbacks`), the
TensorBoard logs (`tensorboard`) and a profile of some steps (`profile_steps`).

Their rules (checked by `TrainConfig.validate`, before TensorFlow), their flags,
and `tfmulti.training.train.train` running them in-process on the 4 virtual
CPUs of tests/conftest.py: the tracker of docs/examples/jsonl_logger.py writes
one line per epoch with the run's metrics (data-parallel and pipeline), no
logs folder without TensorBoard, a profile of the steps asked. The recipe's
exit code for a bad hook is in tests/integration/test_logging_hooks.py.
"""

from __future__ import annotations

import argparse
import json
import os

import keras
import pytest
from absl import flags

from tests._util import REPO, file_tree
from tfmulti.config import flags as config_flags
from tfmulti.config.train_config import TrainConfig, parse_profile_steps
from tfmulti.training.train import train

TINY = dict(dataset="synthetic", num_examples=512, global_batch_size=64, seed=0, verbose=0)
EXAMPLES = REPO / "docs" / "examples"


@pytest.fixture
def tracker(monkeypatch):
    """The docs' tracker importable as `jsonl_logger`, as from its folder."""
    monkeypatch.syspath_prepend(str(EXAMPLES))
    return "jsonl_logger:callbacks"


def _lines(path) -> list[dict]:
    return [json.loads(line) for line in path.read_text().splitlines()]


# ------------------------------------------------------------------------------- rules


@pytest.mark.parametrize("fields, match", [
    ({"callbacks": "tracker"}, r"^`callbacks` must be package.module:function, got 'tracker'; "
                               r"write e.g. my_tracker:callbacks"),
    ({"callbacks": "a b:c"}, r"^`callbacks` must be package.module:function"),
    ({"callbacks": 3}, r"^`callbacks` must be package.module:function, got 3"),
    ({"tensorboard": "no"}, r"^`tensorboard` must be True or False, got 'no'"),
    ({"profile_steps": "5"}, r"^`profile_steps` must be two global steps A,B with 1 <= A <= B"),
    ({"profile_steps": "5,2"}, r"^`profile_steps` must be two global steps A,B"),
    ({"profile_steps": "0,2"}, r"^`profile_steps` must be two global steps A,B"),
    ({"profile_steps": "a,b"}, r"^`profile_steps` must be two global steps A,B"),
    ({"profile_steps": "1,2,3"}, r"^`profile_steps` must be two global steps A,B"),
    ({"profile_steps": (1.5, 2)}, r"^`profile_steps` must be two global steps A,B"),
    ({"profile_steps": "2,4"}, r"^`profile_steps` \(2,4\) writes the profile into "
                               r"<model_dir>/logs; set `model_dir` too"),
    ({"profile_steps": "2,4", "model_dir": "/tmp/tfmulti-unused", "tensorboard": False},
     r"^`profile_steps` \(2,4\) writes a TensorBoard profile, and `tensorboard` is off; set "
     r"tensorboard=True"),
])
def test_bad_logging_fields_are_refused_in_one_line(fields, match):
    with pytest.raises(ValueError, match=match) as raised:
        TrainConfig(**fields).validate()
    assert "\n" not in str(raised.value)


def test_good_logging_fields_pass(tmp_path):
    TrainConfig(callbacks="my.tracker:callbacks", tensorboard=False).validate()
    TrainConfig(callbacks=lambda: [], profile_steps=" 3 , 5 ", model_dir=str(tmp_path)).validate()
    TrainConfig(profile_steps=[2, 2], model_dir=str(tmp_path)).validate()  # a config file's list
    assert parse_profile_steps("10,12") == (10, 12)
    assert parse_profile_steps((4, 4)) == (4, 4)
    assert parse_profile_steps(None) is None and parse_profile_steps("") is None


def test_the_flags_set_the_fields():
    """Generated from the fields, as every other training flag: absl (the recipe)
    and argparse (the `tfmulti` command)."""
    fv = flags.FlagValues()
    config_flags.define_absl_flags(fv)
    fv(["train.py", "--callbacks=my_tracker:callbacks", "--notensorboard",
        "--profile_steps=10,12"])
    config = config_flags.config_from_absl(fv)
    assert (config.callbacks, config.tensorboard, config.profile_steps) == (
        "my_tracker:callbacks", False, "10,12")
    parser = argparse.ArgumentParser()
    config_flags.add_arguments(parser, only=("callbacks", "tensorboard", "profile_steps"))
    config = config_flags.config_from_args(parser.parse_args(
        ["--callbacks=my_tracker:callbacks", "--no-tensorboard", "--profile_steps=10,12"]))
    assert (config.callbacks, config.tensorboard, config.profile_steps) == (
        "my_tracker:callbacks", False, "10,12")
    defaults = config_flags.config_from_args(parser.parse_args([]))
    assert (defaults.callbacks, defaults.tensorboard, defaults.profile_steps) == (
        None, True, None)


# ------------------------------------------- bad hooks: one error, nothing written


def _returns_none():
    return None


def _returns_a_string():
    return ["not a callback"]


def _needs_a_wandb_key(api_key):
    return []


@pytest.mark.parametrize("callbacks, match", [
    ("no_such_tracker:callbacks", r"^`callbacks` 'no_such_tracker:callbacks': no module named "
                                  r"'no_such_tracker'"),
    ("json:no_such_function", r"^`callbacks` 'json:no_such_function': module 'json' .* has no "
                              r"'no_such_function'"),
    (_returns_none, r"^`callbacks` '.*_returns_none' returned NoneType, not a list of "
                    r"keras.callbacks.Callback"),
    (_returns_a_string, r"^`callbacks` '.*_returns_a_string' returned str in its list, not "
                        r"keras.callbacks.Callback"),
    (_needs_a_wandb_key, r"^the callbacks function .*_needs_a_wandb_key requires \['api_key'\]"),
])
def test_a_bad_callbacks_function_fails_before_anything_is_written(callbacks, match, tmp_path):
    model_dir = tmp_path / "run"
    model_dir.mkdir()
    (model_dir / "notes.txt").write_text("mine")
    before = file_tree(model_dir)
    with pytest.raises(ValueError, match=match):
        train(TrainConfig(callbacks=callbacks, model_dir=str(model_dir), **TINY))
    assert file_tree(model_dir) == before


def test_a_profile_past_the_last_step_fails_before_anything_is_written(tmp_path):
    with pytest.raises(ValueError, match=r"^`profile_steps` \(6,9\) ends after the run's last "
                                         r"global step, 8 \(1 epochs x 8 steps\)"):
        train(TrainConfig(profile_steps="6,9", epochs=1, model_dir=str(tmp_path / "run"),
                          **TINY))
    assert not (tmp_path / "run").exists()


# ------------------------------------------------------------------ runs (in-process)


@pytest.mark.slow  # trains for seconds: not in make test-fast
def test_the_tracker_writes_a_line_per_epoch_and_no_tensorboard_writes_no_logs(
        tmp_path, tracker, capsys):
    model_dir = tmp_path / "run"
    metrics = train(TrainConfig(distribution="mirrored", devices=("CPU:0", "CPU:1"), epochs=3,
                                validation_split=0.25, callbacks=tracker, tensorboard=False,
                                model_dir=str(model_dir), **TINY))
    lines = _lines(model_dir / "metrics.jsonl")
    assert [line["epoch"] for line in lines] == [1, 2, 3]
    assert {"loss", "accuracy", "val_loss", "val_accuracy"} <= set(lines[-1])
    assert lines[-1]["loss"] == pytest.approx(metrics["train_loss"])
    assert lines[-1]["val_accuracy"] == pytest.approx(metrics["val_accuracy"])
    assert sorted(os.listdir(model_dir)) == [".tfmulti-run.json", "metrics.json",
                                             "metrics.jsonl", "model.keras"]  # no logs/
    assert f"tfmulti: wrote metrics.json and model.keras to {model_dir}" in capsys.readouterr().out
    recorded = json.loads((model_dir / ".tfmulti-run.json").read_text())["config"]
    assert recorded["callbacks"] == tracker  # a hook that may change the training: recorded


class _StopAfterEpoch(keras.callbacks.Callback):
    def __init__(self, epochs: int):
        super().__init__()
        self.epochs = epochs

    def on_epoch_end(self, epoch, logs=None):
        if epoch + 1 == self.epochs:
            self.model.stop_training = True


@pytest.mark.slow  # trains for seconds: not in make test-fast
def test_the_users_callbacks_run_in_a_pipeline(tmp_path, tracker):
    """Pipelines train through `fit` too (a Keras model whose step runs the
    stages), so Keras callbacks work there as under a strategy."""
    model_dir = tmp_path / "run"
    stopper = _StopAfterEpoch(2)
    metrics = train(TrainConfig(distribution="pipeline", devices=("CPU:0", "CPU:1"),
                                num_stages=2, num_microbatches=2, epochs=3, callbacks=tracker,
                                profile_steps="1,1", model_dir=str(model_dir), **TINY),
                    callbacks=[stopper])
    lines = _lines(model_dir / "metrics.jsonl")
    # The callback that stops training (as EarlyStopping does) ends it after epoch 2 of 3.
    assert [line["epoch"] for line in lines] == [1, 2]
    assert metrics["epochs_completed"] == 2
    assert lines[-1]["loss"] == pytest.approx(metrics["train_loss"])
    assert list((model_dir / "logs").rglob("events.out.tfevents.*"))  # TensorBoard, the default
    assert list((model_dir / "logs" / "train" / "plugins" / "profile").glob("*/*.xplane.pb"))


@pytest.mark.slow  # trains for seconds: not in make test-fast
def test_profile_steps_writes_a_profile_of_the_calls_that_hold_them(tmp_path, capsys):
    model_dir = tmp_path / "run"
    train(TrainConfig(distribution="one_device", epochs=2, steps_per_execution=2,
                      profile_steps="2,3", model_dir=str(model_dir), **TINY))
    logs = model_dir / "logs" / "train"
    profiles = list((logs / "plugins" / "profile").glob("*/*.xplane.pb"))
    assert len(profiles) == 1 and profiles[0].stat().st_size > 0, list(logs.rglob("*"))
    out = capsys.readouterr().out
    # Calls of 2 steps: steps 2 and 3 are in the calls of steps 1-2 and 3-4.
    assert f"tfmulti: profiled global steps 1-4 into {logs / 'plugins' / 'profile'}" in out
    assert not (model_dir / ".tfmulti-pending").exists()  # published with the logs


@pytest.mark.slow  # trains for seconds: not in make test-fast
def test_a_finished_run_stays_finished_with_other_logging(tmp_path, capsys):
    """TensorBoard and the profile only watch a run: turning them off or on for
    its rerun (a requeued job, a resumed one) does not make it another run."""
    model_dir, backup_dir = tmp_path / "run", tmp_path / "backup"
    config = TrainConfig(epochs=1, model_dir=str(model_dir), backup_dir=str(backup_dir), **TINY)
    first = train(config)
    recorded = json.loads((model_dir / ".tfmulti-run.json").read_text())["config"]
    # Not recorded, as by a tfmulti before them: such a run file stays this run's.
    assert not {"callbacks", "tensorboard", "profile_steps"} & set(recorded)
    again = train(config.replace(tensorboard=False))
    assert again == first
    assert "this run has finished already" in capsys.readouterr().out
