"""The recipes as a user runs them: recipes/train.py end to end (a fresh
process each), its flags and errors, and recipes/seed_examples.py.

Configuration errors are checked in-process (`main` of the recipe on fresh
absl flags); a few subprocess cases hold the command-line contract: exit 2,
one line, nothing written, and for flag errors no TensorFlow start-up at all.
"""

from __future__ import annotations


import pytest
from absl import flags

from tests._util import file_tree
from tfmulti.config import flags as config_flags
from tfmulti.config.train_config import TrainConfig
from tfmulti.data import DataNotFoundError
from tfmulti.training.train import train


# ------------------------------------------------------------------- flags and errors


def _run_main(argv: list[str]):
    """recipes/train.py's flags and main, in-process, on fresh flag values:
    (the config, or the one-line error the recipe prints)."""
    fv = flags.FlagValues()
    config_flags.define_absl_flags(fv)
    try:
        fv(["train.py", *argv])
        config = config_flags.config_from_absl(fv)
        config.validate()
        train(config)
    except flags.Error as e:
        return f"{e} (see --helpfull)"
    except (ValueError, FileNotFoundError) as e:
        return config_flags.flag_message(str(e), extra_names=fv)
    return config


# Each bad configuration and the message the recipe prints (in flag names).
BAD_FLAGS = [
    (["--global_batch_size=10", "--num_virtual_devices=4", "--distribution=mirrored"],
     "--global_batch_size (10) must be divisible by the number of replicas (4)"),
    (["--distribution=bogus"], "flag --distribution=bogus"),
    (["--epochs=0"], "--epochs must be a positive integer, got 0"),
    (["--lr_scaling=cubic"], "flag --lr_scaling=cubic"),
    (["--devices=CPU:9"], "do not exist; available"),
    (["--cross_device_ops=nccl", "--distribution=mirrored"], "needs GPU devices"),
    (["--model=regression"], "--model 'regression' does regression but --dataset 'synthetic' "
                             "is a classification dataset; use --dataset='synthetic_regression'"),
    (["--warmup_epochs=-1"], "--warmup_epochs must be a finite number >= 0, got -1.0"),
    (["--learning_rate=nan"], "--learning_rate must be a finite number > 0, got nan"),
    (["--learning_rate=inf"], "--learning_rate must be a finite number > 0, got inf"),
    (["--steps_per_execution=3", "--global_batch_size=32"],  # 256 / 32 = 8 steps
     "--steps_per_execution (3) must divide the steps per epoch (8)"),
    (["--steps_per_execution=many"],
     "--steps_per_execution must be 'auto' or a positive integer, got 'many'"),
    (["--distribution=pipeline", "--global_batch_size=30", "--num_microbatches=4"],
     "--global_batch_size (30) must split into 1 replica x 4 micro-batches"),
    (["--distribution=pipeline", "--devices=CPU:0,CPU:1", "--num_stages=3"],
     "--devices lists 2 devices but num_stages (3) x num_replicas (1) = 3"),
    (["--mixed_precision=float16"],  # the test machine has no GPU
     "--mixed_precision 'float16' needs a GPU and none was found; use "
     "--mixed_precision='bfloat16' on CPUs"),
    (["--distribution=pipeline", "--jit_compile"],
     "--jit_compile cannot be used with distribution 'pipeline': XLA would compile"),
    (["--backup_every_steps=5"], "--backup_every_steps needs --backup_dir; set --backup_dir too"),
    (["--model=transformer"], "--model 'transformer' and --dataset 'synthetic' do not fit: the "
                              "transformer reads byte sequences (--dataset='tfmulti_text')"),
    (["--model=no_such_module:build"], "--model 'no_such_module:build': no module named "
                                       "'no_such_module' in the current directory"),
    (["--dataset=own_model:missing"], "--dataset 'own_model:missing': no module named"),
    (["--accumulate_steps=0"], "--accumulate_steps must be a positive integer, got 0"),
    (["--backup_dir=/dev/null"], "--backup_dir '/dev/null' exists and is not a directory"),
    (["--dataset=cifar10", "--data_dir=/nonexistent/tfmulti"],
     "dataset 'cifar10' not found; tried: prepared TFDS data in /nonexistent/tfmulti/cifar10"),
]


@pytest.mark.parametrize("argv,message", BAD_FLAGS, ids=[a[0] for a, _ in BAD_FLAGS])
def test_train_recipe_bad_flags_in_process(tmp_path, argv, message):
    model_dir = tmp_path / "existing_run"
    model_dir.mkdir()
    (model_dir / "keep.txt").write_text("previous results")
    before = file_tree(model_dir)
    extra = [] if any(a.startswith("--dataset") for a in argv) else [
        "--dataset=synthetic", "--num_examples=256"]
    error = _run_main([*extra, f"--model_dir={model_dir}", *argv])
    assert isinstance(error, str), f"no error for {argv}"
    assert message in error, error
    assert "\n" not in error
    assert file_tree(model_dir) == before


def test_missing_dataset_names_the_download_flag(tmp_path):
    error = _run_main(["--dataset=cifar10", f"--data_dir={tmp_path / 'empty'}",
                       f"--model_dir={tmp_path / 'new_run'}"])
    assert "--download=True" in error and "--data_dir" in error
    assert not (tmp_path / "new_run").exists()
    with pytest.raises(DataNotFoundError):  # the library's own error type
        train(TrainConfig(dataset="cifar10", data_dir=str(tmp_path / "empty")))


def test_every_flag_is_a_config_field():
    fv = flags.FlagValues()
    config_flags.define_absl_flags(fv)
    fv(["train.py", "--distribution=hybrid", "--devices=CPU:0,CPU:1", "--steps_per_execution=8",
        "--verbose=2", "--nojit_compile"])
    config = config_flags.config_from_absl(fv)
    assert config.distribution == "hybrid" and config.devices == ("CPU:0", "CPU:1")
    assert config.steps_per_execution == 8 and config.verbose == 2
    assert config.jit_compile is False
