"""tfmulti.config.train_config: TrainConfig.validate, the steps-per-execution policy, the
model tasks and validate_for_diagnose (pure Python, no TensorFlow needed)."""

from __future__ import annotations

import dataclasses
import math
import re

import pytest

from tfmulti.config import train_config as config_lib
from tfmulti.config.train_config import (AUTO_STEPS_PER_EXECUTION, MODEL_TASKS, TrainConfig, largest_divisor, parse_steps_per_execution, resolve_steps_per_execution, validate_for_diagnose)

FIELDS = {f.name: f for f in dataclasses.fields(TrainConfig)}
CHOICE_FIELDS = [name for name, f in FIELDS.items() if "choices" in f.metadata]


def _refused(match: str, **fields) -> None:
    with pytest.raises(ValueError, match=match):
        TrainConfig(**fields).validate()


# ---------------------------------------------------------------------------- defaults


def test_defaults_are_valid_and_every_field_has_help():
    config = TrainConfig()
    assert config.validate() is None
    assert config.distribution == "auto" and config.builtin_task == "classification"
    assert not config.model_parallel
    for name, f in FIELDS.items():
        assert f.metadata.get("help", "").strip(), f"{name} has no help text"


def test_replace_copies_without_validating():
    config = TrainConfig(global_batch_size=64)
    changed = config.replace(global_batch_size=0, model="regression")
    assert config.global_batch_size == 64 and changed.global_batch_size == 0
    assert changed.builtin_task == "regression"
    with pytest.raises(ValueError, match=r"`global_batch_size` must be a positive integer"):
        changed.validate()


@pytest.mark.parametrize("distribution, expected", [
    ("auto", False), ("one_device", False), ("mirrored", False), ("multi_worker", False),
    ("pipeline", True), ("hybrid", True),
])
def test_model_parallel(distribution, expected):
    assert TrainConfig(distribution=distribution).model_parallel is expected


# ----------------------------------------------------------------------------- choices


def test_choice_fields():
    assert set(CHOICE_FIELDS) == {"distribution", "cross_device_ops", "lr_scaling", "task",
                                  "input_sharding", "cluster_resolver", "partition",
                                  "mixed_precision", "verbose", "sparse_updates"}


@pytest.mark.parametrize("name", CHOICE_FIELDS)
def test_choices_refuse_other_values(name):
    choices = list(FIELDS[name].metadata["choices"])
    _refused(rf"`{name}` must be one of {re.escape(str(choices))}, got 'bogus'\.",
             **{name: "bogus"})


@pytest.mark.parametrize("name", CHOICE_FIELDS)
def test_choices_accept_each_choice(name):
    for choice in FIELDS[name].metadata["choices"]:
        own = {"model": "my_models:build"} if name == "task" else {}  # mlp classifies
        TrainConfig(**{name: choice}, **own).validate()


def test_mixed_precision_unknown_policy():
    _refused(r"`mixed_precision` must be one of \['none', 'bfloat16', 'float16'\], got 'int8'",
             mixed_precision="int8")


def test_verbose_refuses_bools():
    # True == 1 to Python; never a verbosity to tfmulti.
    _refused(r"`verbose` must be one of \['auto', 0, 1, 2\], got True", verbose=True)
    TrainConfig(verbose=1).validate()


# ----------------------------------------------------------------------------- numbers


@pytest.mark.parametrize("name", ["epochs", "global_batch_size", "base_batch_size"])
@pytest.mark.parametrize("value", [0, -1, 2.5, "8", None, True, False])
def test_positive_ints(name, value):
    _refused(rf"`{name}` must be a positive integer, got {re.escape(repr(value))}\.",
             **{name: value})


@pytest.mark.parametrize("name", ["num_examples", "steps_per_epoch", "backup_every_steps"])
@pytest.mark.parametrize("value", [0, -1, 1.5, True])
def test_positive_ints_or_none(name, value):
    fields = {name: value, "dataset": "synthetic"}
    if name == "backup_every_steps":
        fields["backup_dir"] = "/tmp/tfmulti-test-unused"
    _refused(rf"`{name}` must be a positive integer \(or None\), got {re.escape(repr(value))}",
             **fields)


@pytest.mark.parametrize("value", [0, -1])
def test_num_examples_refused(value):
    # 0 must not mean "the default" (60,000 synthetic examples) silently.
    _refused(rf"`num_examples` must be a positive integer \(or None\), got {value}",
             dataset="synthetic", num_examples=value)


@pytest.mark.parametrize("value", [-1, True, 1.0])
def test_num_virtual_devices(value):
    _refused(rf"`num_virtual_devices` must be an integer >= 0, got {re.escape(repr(value))}; "
             r"0 leaves the devices as they are\.", num_virtual_devices=value)
    TrainConfig(num_virtual_devices=0).validate()
    TrainConfig(num_virtual_devices=4).validate()


@pytest.mark.parametrize("value", [True, 1.5, "0", -5, -1, 2**32, 10**30])
def test_seed_is_an_integer_from_0_to_2_32_or_none(value):
    # NumPy's range, which keras.utils.set_random_seed needs: -5 used to pass here and fail
    # only once TensorFlow had started.
    _refused(rf"`seed` must be an integer from 0 to 4294967295 \(or None\), got "
             rf"{re.escape(repr(value))}\.$", seed=value)
    TrainConfig(seed=None).validate()
    TrainConfig(seed=0).validate()
    TrainConfig(seed=config_lib.MAX_SEED).validate()


def test_max_seed_is_numpys():
    import numpy as np

    np.random.default_rng(config_lib.MAX_SEED)
    with pytest.raises(ValueError):
        np.random.seed(config_lib.MAX_SEED + 1)


@pytest.mark.parametrize("fields, match", [
    ({"num_virtual_devices": 100000},
     r"`num_virtual_devices` must be an integer from 0 to 256, got 100000; 0 leaves"),
    ({"epochs": 2**31}, r"`epochs` must be an integer from 1 to 2147483647, got 2147483648\.$"),
    ({"global_batch_size": 10**12}, r"`global_batch_size` must be an integer from 1 to "),
    ({"base_batch_size": 2**31}, r"`base_batch_size` must be an integer from 1 to 2147483647"),
    ({"steps_per_epoch": 2**40}, r"`steps_per_epoch` must be an integer from 1 to 2147483647 "
                                 r"\(or None\)"),
    ({"accumulate_steps": 2**31}, r"`accumulate_steps` must be an integer from 1 to "),
    ({"steps_per_execution": 2**31}, r"`steps_per_execution` must be an integer from 1 to "),
    ({"steps_per_execution": str(2**31)}, r"`steps_per_execution` must be an integer from 1 "),
    ({"dataset": "synthetic", "num_examples": 10**9},
     r"`num_examples` must be an integer from 1 to 1000000 \(or None\), got 1000000000; "
     r"synthetic data is made in memory"),
    ({"distribution": "pipeline", "num_stages": 100000},
     r"`num_stages` must be an integer from 1 to 256, got 100000\.$"),
    ({"distribution": "hybrid", "num_replicas": 3000},
     r"`num_replicas` must be an integer from 1 to 256, got 3000\.$"),
    ({"distribution": "pipeline", "num_microbatches": 2**31},
     r"`num_microbatches` must be an integer from 1 to 2147483647"),
    ({"distribution": "hybrid", "num_replicas": 64, "num_stages": 8, "num_microbatches": 1},
     r"^`num_replicas` \(64\) x `num_stages` \(8\) x `tensor_parallel` \(1\) = 512 devices, "
     r"more than the 256 one process trains on"),
    ({"distribution": "pipeline", "tensor_parallel": 1000, "model": "transformer"},
     r"`tensor_parallel` must be an integer from 1 to 256, got 1000\.$"),
    ({"model": "transformer", "d_model": 10**6}, r"`d_model` must be an integer from 1 to 32768"),
    ({"model": "transformer", "seq_len": 10**6}, r"`seq_len` must be an integer from 1 to 65536"),
    ({"model": "transformer", "num_layers": 10**5},
     r"`num_layers` must be an integer from 1 to 1024"),
])
def test_counts_have_upper_bounds_that_state_the_range(fields, match):
    # A huge count used to pass here and then hang (devices traced one by one) or exhaust
    # memory (synthetic data, a transformer's weights) once TensorFlow had started.
    _refused(match, **fields)


def test_counts_at_their_bounds_are_accepted():
    TrainConfig(num_virtual_devices=256, epochs=2**31 - 1, steps_per_execution=2**31 - 1,
                dataset="synthetic", num_examples=10**6).validate()
    TrainConfig(distribution="hybrid", num_replicas=128, num_stages=2,
                global_batch_size=1024).validate()


def test_check_limits_bounds_only_the_count_fields_given():
    config_lib.check_limits(num_stages=256, d_model=32768, optimizer="adam", num_devices=10**9)
    with pytest.raises(ValueError, match=r"^`num_microbatches` must be an integer from 1 to "
                                         r"2147483647, got 2147483648\.$"):
        config_lib.check_limits(num_microbatches=2**31)
    assert set(config_lib.COUNT_LIMITS) <= set(FIELDS)


@pytest.mark.parametrize("value", [0.0, -1e-3, math.nan, math.inf, -math.inf, True, "0.1"])
def test_learning_rate_refused(value):
    _refused(rf"`learning_rate` must be a finite number > 0, got {re.escape(repr(value))}\.",
             learning_rate=value)


@pytest.mark.parametrize("value", [-1.0, math.nan, math.inf, True])
def test_warmup_epochs_refused(value):
    _refused(rf"`warmup_epochs` must be a finite number >= 0, got {re.escape(repr(value))}",
             warmup_epochs=value)
    TrainConfig(warmup_epochs=0).validate()


@pytest.mark.parametrize("value", [-0.1, 1.0, 1.5, math.nan, math.inf])
def test_dropout_outside_0_1_refused(value):
    with pytest.raises(ValueError, match=r"`dropout`"):
        TrainConfig(dropout=value).validate()


def test_dropout_range():
    _refused(r"`dropout` must be in \[0, 1\), got 1\.0\.", dropout=1.0)
    _refused(r"`dropout` must be a finite number >= 0, got -0\.1", dropout=-0.1)
    _refused(r"`dropout` must be a finite number >= 0, got False", dropout=False)
    for ok in (0, 0.0, 0.5, 0.999):
        TrainConfig(dropout=ok).validate()


@pytest.mark.parametrize("value", ["CPU:0", (), []])
def test_devices_must_be_a_non_empty_tuple(value):
    _refused(r"`devices` must be a non-empty tuple of device names \(or None\), got "
             + re.escape(repr(value)), devices=value)
    TrainConfig(devices=("CPU:0", "CPU:1")).validate()


# ------------------------------------------------------------ pipeline and hybrid fields


@pytest.mark.parametrize("distribution, batch, microbatches, replicas, multiple", [
    ("pipeline", 30, 4, 2, 4),   # num_replicas applies to hybrid only
    ("hybrid", 36, 4, 2, 8),
    ("hybrid", 12, 1, 8, 8),
])
def test_pipeline_batch_must_split(distribution, batch, microbatches, replicas, multiple):
    shown = f"{replicas} replicas" if distribution == "hybrid" else "1 replica"
    _refused(rf"`global_batch_size` \({batch}\) must split into {shown} x "
             rf"{microbatches} micro-batches; use a multiple of {multiple}\.",
             distribution=distribution, global_batch_size=batch,
             num_microbatches=microbatches, num_replicas=replicas)
    TrainConfig(distribution=distribution, global_batch_size=multiple * 4,
                num_microbatches=microbatches, num_replicas=replicas).validate()


@pytest.mark.parametrize("name", ["num_stages", "num_microbatches", "num_replicas"])
def test_pipeline_counts_checked_only_for_placed_stages(name):
    for distribution in ("pipeline", "hybrid"):
        _refused(rf"`{name}` must be a positive integer, got 0",
                 distribution=distribution, **{name: 0})
    TrainConfig(distribution="mirrored", **{name: 0}).validate()  # not used there
    TrainConfig(distribution="mirrored", global_batch_size=30).validate()


@pytest.mark.parametrize("mixed_precision", ["none", "bfloat16", "float16"])
def test_jit_compile_with_placed_pipelines_refused_elsewhere_valid(mixed_precision):
    # Was test_valid_precision_and_xla_pass (asserted nothing): now every
    # precision with XLA is accepted for mirrored and refused, with its
    # reason, for the distributions that place stages.
    for distribution in ("pipeline", "hybrid"):
        _refused(rf"`jit_compile` cannot be used with distribution '{distribution}': XLA would "
                 r"compile the step as one cluster",
                 distribution=distribution, mixed_precision=mixed_precision, jit_compile=True)
    config = TrainConfig(distribution="mirrored", mixed_precision=mixed_precision,
                         jit_compile=True)
    assert config.validate() is None
    assert (config.jit_compile, config.mixed_precision) == (True, mixed_precision)


# ------------------------------------------------------------ tensor parallelism and sizes


def test_tensor_parallel_needs_placed_stages_and_the_transformer():
    _refused(r"`tensor_parallel` \(2\) needs distribution 'pipeline' or 'hybrid' \(stages of 2 "
             r"devices; num_stages=1 for tensor parallelism alone\), got 'mirrored'\.",
             distribution="mirrored", tensor_parallel=2)
    _refused(r"`tensor_parallel` \(2\) splits model 'transformer', got model 'mlp'; set "
             r"model='transformer' or tensor_parallel=1\.",
             distribution="pipeline", tensor_parallel=2)
    _refused(r"`tensor_parallel` must be a positive integer, got 0", tensor_parallel=0)
    _refused(r"`device_memory_mb` must be a finite number > 0 \(or None\), got -1",
             device_memory_mb=-1)
    TrainConfig(device_memory_mb=64.5).validate()


def test_transformer_sizes_split_evenly_over_tensor_parallel_devices():
    sizes = dict(seq_len=64, d_model=96, num_heads=6, num_layers=2)
    config_lib.check_transformer_sizes(**sizes, tensor_parallel=2)
    with pytest.raises(ValueError, match=r"`tensor_parallel` \(4\) must divide num_heads \(6\) "
                                         r"to split it evenly; use tensor_parallel=2 or change "
                                         r"num_heads\."):
        config_lib.check_transformer_sizes(**sizes, tensor_parallel=4)
    with pytest.raises(ValueError, match=r"`tensor_parallel` \(3\) must divide vocab_size "
                                         r"\(256\)"):
        config_lib.check_transformer_sizes(**sizes, tensor_parallel=3)
    with pytest.raises(ValueError, match=r"`num_heads` \(5\) must divide `d_model` \(96\); "
                                         r"use e.g. num_heads=4\."):
        config_lib.check_transformer_sizes(**{**sizes, "num_heads": 5})
    with pytest.raises(ValueError, match="`seq_len` must be a positive integer, got 0"):
        config_lib.check_transformer_sizes(**{**sizes, "seq_len": 0})


# --------------------------------------------------------------------- backup and output


@pytest.mark.parametrize("fields, match", [
    ({"backup_dir": "{tmp}/backup", "seed": None}, r"`backup_dir` needs a fixed `seed`"),
    ({"backup_every_steps": 5}, r"`backup_every_steps` needs `backup_dir`; set `backup_dir` too"),
    ({"backup_dir": "{tmp}/backup", "backup_every_steps": 0}, r"must be a positive integer"),
    ({"backup_dir": ""}, r"`backup_dir` is empty; pass a directory path"),
    ({"backup_dir": "/dev/null"}, r"`backup_dir` '/dev/null' exists and is not a directory"),
])
def test_train_config_backup_checks(fields, match, tmp_path):
    # A folder not made yet under the test's own: a fixed path such as /tmp/x may be
    # anything on the machine (a file there made the first case fail on the wrong check).
    fields = {k: v.format(tmp=tmp_path) if isinstance(v, str) else v
              for k, v in fields.items()}
    _refused(match, **fields)


def test_backup_dir_accepted(tmp_path):
    TrainConfig(backup_dir=str(tmp_path), backup_every_steps=4).validate()
    TrainConfig(backup_dir=str(tmp_path / "not_yet")).validate()  # created on the first save
    assert not (tmp_path / "not_yet").exists()  # validate writes nothing


def test_model_dir_that_is_a_file(tmp_path):
    path = tmp_path / "file"
    path.write_text("x")
    _refused(rf"`model_dir` {re.escape(repr(str(path)))} exists and is not a directory; pass a "
             r"directory path\.", model_dir=str(path))
    TrainConfig(model_dir=str(tmp_path)).validate()
    TrainConfig(model_dir=str(tmp_path / "new")).validate()
    assert not (tmp_path / "new").exists()


# ------------------------------------------------------------------ steps per execution


def test_steps_per_execution_defaults_to_auto():
    assert TrainConfig().steps_per_execution == "auto"
    assert AUTO_STEPS_PER_EXECUTION == 32


@pytest.mark.parametrize("value, expected", [
    ("auto", "auto"), ("AUTO", "auto"), (" Auto ", "auto"), (4, 4), ("4", 4), (1, 1),
])
def test_parse_steps_per_execution(value, expected):
    assert parse_steps_per_execution(value) == expected
    TrainConfig(steps_per_execution=value).validate()


@pytest.mark.parametrize("value", [0, -3, "0", "many", 2.5, True, None])
def test_steps_per_execution_refused(value):
    message = (r"`steps_per_execution` must be 'auto' or a positive integer, got "
               rf"{re.escape(repr(value))}")
    with pytest.raises(ValueError, match=message):
        parse_steps_per_execution(value)
    _refused(message, steps_per_execution=value)


@pytest.mark.parametrize("value, steps_per_epoch, expected", [
    ("auto", 234, 26),      # Fashion-MNIST at batch 256: largest divisor of 234 up to 32
    ("auto", 1875, 25),     # ... at batch 32
    ("auto", 24, 24),       # a short epoch: one call
    ("auto", 31 * 37, 31),  # a prime factor under the cap
    ("auto", 37, 1),        # a prime epoch length over the cap: one step per call
    ("auto", None, 1),      # unknown epoch length
    ("AUTO", 8, 8),
    (4, 8, 4),
    ("4", 8, 4),            # as given by a flag
    (3, None, 3),           # nothing to divide
])
def test_resolve_steps_per_execution(value, steps_per_epoch, expected):
    assert resolve_steps_per_execution(value, steps_per_epoch) == expected


@pytest.mark.parametrize("steps_per_epoch, backup_every_steps, expected", [
    (64, 4, 4),     # a backup every 4 steps: calls of 4
    (64, 100, 4),   # gcd(64, 100) = 4
    (64, 96, 32),
    (64, None, 32),
    (1875, 10, 5),
])
def test_auto_steps_per_execution_keeps_the_backup_cadence(steps_per_epoch, backup_every_steps,
                                                           expected):
    assert resolve_steps_per_execution("auto", steps_per_epoch, backup_every_steps) == expected
    assert resolve_steps_per_execution(8, 64, backup_every_steps) == 8  # explicit wins


def test_steps_per_execution_must_tile_the_epoch():
    # Keras would run whole blocks: 10 steps per epoch in calls of 4 train 12.
    # (compile_model's own refusal: tests/unit/test_models.py.)
    with pytest.raises(ValueError, match=r"`steps_per_execution` \(4\) must divide the steps "
                                         r"per epoch \(10\): .* would train 12 steps; use a "
                                         r"divisor of 10, 'auto'"):
        resolve_steps_per_execution(4, 10)
    with pytest.raises(ValueError, match=r"must be 'auto' or a positive integer"):
        resolve_steps_per_execution("many", 10)


@pytest.mark.parametrize("n, limit, expected", [
    (234, 32, 26), (1875, 32, 25), (37, 32, 1), (24, 32, 24), (12, 5, 4), (1, 32, 1),
    (7, 1, 1), (64, 64, 64), (100, 1000, 100),
])
def test_largest_divisor(n, limit, expected):
    assert largest_divisor(n, limit) == expected
    assert n % expected == 0 and expected <= limit


# --------------------------------------------------------------------------- models


def test_model_tasks_agree_with_the_builders():
    from tfmulti.models import builders as models

    assert set(MODEL_TASKS) == set(models.INPUT_SHAPES)
    assert set(MODEL_TASKS.values()) == set(config_lib.TASKS)
    for name, task in MODEL_TASKS.items():
        assert models.model_task(name) == task
        assert TrainConfig(model=name).builtin_task == task
        assert TrainConfig(model=name).builtin_model
        built = models.build_model(name)
        assert built.input_shape == (None, *models.INPUT_SHAPES[name])
        assert built.output_shape[-1] == (1 if task == "regression" else 10)
    with pytest.raises(ValueError, match=r"`model` must be one of \['mlp', 'regression', 'cnn'\]"):
        models.model_task("resnet")


def test_optimizer_names_are_the_ones_keras_builds():
    import keras
    from keras.src import optimizers as keras_optimizers

    wrappers = {"optimizer", "multioptimizer", "optimizermap", "lossscaleoptimizer"}
    assert set(config_lib.OPTIMIZERS) == set(keras_optimizers.ALL_OBJECTS_DICT) - wrappers
    for name in config_lib.OPTIMIZERS:
        assert isinstance(keras.optimizers.get(name), keras.optimizers.Optimizer)


# --------------------------------------------------------------------- the user's own


@pytest.mark.parametrize("fields", [
    {"model": "my_models:build"}, {"dataset": "pkg.data:load"}, {"loss": "my.losses:focal"},
    {"model": print, "dataset": lambda: None}, {"optimizer": "RMSprop"},
    {"loss": "huber", "metrics": ("auc", "accuracy")}, {"task": "regression", "model": "m:f"},
    {"accumulate_steps": 4}, {"input_sharding": "files"}, {"cluster_resolver": "slurm"},
])
def test_own_model_data_loss_and_keras_names_are_accepted(fields):
    assert TrainConfig(**fields).validate() is None


@pytest.mark.parametrize("fields, match", [
    ({"model": "resnet"}, r"`model` must be one of \['mlp', 'regression', 'cnn', 'transformer'\] "
                          r"or your own "
                          r"package.module:function, got 'resnet'"),
    ({"model": "my models:build"}, r"`model` 'my models:build' is not package.module:function"),
    ({"dataset": "a:b:c"}, r"`dataset` 'a:b:c' is not package.module:function"),
    # Module paths with an empty part passed and failed only once TensorFlow had started.
    ({"dataset": "userdata.:load"}, r"`dataset` 'userdata.:load' is not package.module:function"),
    ({"model": "my..models:build"}, r"`model` 'my..models:build' is not package.module:function"),
    ({"loss": "losses.:mine"}, r"`loss` 'losses.:mine' is not package.module:function"),
    ({"dataset": ""}, r"`dataset` must be a name or package.module:function, got ''"),
    ({"optimizer": "adamm"}, r"`optimizer` must be one of \['adam', 'adamw', 'sgd'"),
    ({"metrics": "accuracy"}, r"`metrics` must be a list of metric names, got the string"),
    ({"accumulate_steps": 0}, r"`accumulate_steps` must be a positive integer, got 0"),
    ({"model": "cnn", "task": "regression"}, r"`task` 'regression' does not fit `model` 'cnn'"),
])
def test_own_model_errors_name_the_value(fields, match):
    _refused(match, **fields)


def test_names_of_the_users_functions():
    config = TrainConfig(model="pkg.models:build", dataset=test_names_of_the_users_functions)
    assert config.model_name == "pkg.models:build" and not config.builtin_model
    assert config.dataset_name == f"{__name__}:test_names_of_the_users_functions"
    assert config.builtin_task is None
    assert TrainConfig(model="pkg.models:build", task="regression").builtin_task == "regression"


def test_directories_must_be_writable_or_creatable(tmp_path):
    afile = tmp_path / "afile"
    afile.write_text("x")
    _refused(r"`model_dir` '.*afile/run' cannot be created: '.*afile' is a file",
             model_dir=str(afile / "run"))
    locked = tmp_path / "locked"
    locked.mkdir()
    locked.chmod(0o500)
    try:
        import os
        if os.access(locked, os.W_OK):  # root writes anywhere: nothing to check there
            return
        _refused(r"`backup_dir` '.*locked/b' cannot be created: '.*locked' is not writable",
                 backup_dir=str(locked / "b"))
    finally:
        locked.chmod(0o700)
    assert TrainConfig(model_dir=str(tmp_path / "new" / "deeper")).validate() is None


# -------------------------------------------------------------------------- diagnose


@pytest.mark.parametrize("distribution", ["auto", "one_device", "mirrored"])
def test_validate_for_diagnose_accepts_one_process(distribution):
    assert validate_for_diagnose(TrainConfig(distribution=distribution)) is None


@pytest.mark.parametrize("distribution", ["multi_worker", "pipeline", "hybrid"])
def test_validate_for_diagnose_refuses_other_distributions(distribution):
    with pytest.raises(ValueError, match=rf"`distribution` must be one of \['auto', "
                                         rf"'one_device', 'mirrored'\], got '{distribution}'; "
                                         r"diagnose measures one process \(for multi_worker, "
                                         r"diagnose one worker with distribution='mirrored'"):
        validate_for_diagnose(TrainConfig(distribution=distribution))


def test_validate_for_diagnose_validates_the_config_first():
    with pytest.raises(ValueError, match=r"`global_batch_size` must be a positive integer"):
        validate_for_diagnose(TrainConfig(distribution="mirrored", global_batch_size=0))
    with pytest.raises(ValueError, match=r"`distribution` must be one of \['auto', "
                                         r"'one_device', 'mirrored', 'multi_worker'"):
        validate_for_diagnose(TrainConfig(distribution="bogus"))
