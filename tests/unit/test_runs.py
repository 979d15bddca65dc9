"""tfmulti.training.run.build_run: a TrainConfig's strategy, inputs and compiled model,
on the 4 virtual CPU devices of tests/conftest.py."""

from __future__ import annotations

import keras
import numpy as np
import pytest
import tensorflow as tf

from tfmulti import data
from tfmulti.config.train_config import TrainConfig
from tfmulti.parallel.pipeline import PipelineModel
from tfmulti.training.run import Run, build_run

NUM_DEVICES = 4  # configured by conftest.py
SYNTHETIC = dict(dataset="synthetic", num_examples=1024, global_batch_size=64, seed=0)


def _first_labels(dataset, strategy) -> np.ndarray:
    _, y = next(iter(dataset))
    return np.concatenate([t.numpy() for t in strategy.experimental_local_results(y)])


def test_mirrored_on_four_devices():
    run = build_run(TrainConfig(distribution="mirrored", **SYNTHETIC))
    assert isinstance(run, Run)
    assert isinstance(run.strategy, tf.distribute.MirroredStrategy)
    assert run.strategy.num_replicas_in_sync == NUM_DEVICES
    assert run.num_replicas == NUM_DEVICES and run.per_replica_batch_size == 16
    assert run.train_input.num_replicas == NUM_DEVICES
    assert run.train_input.per_replica_batch_size == 16
    assert run.steps_per_epoch == 16 and run.train_input.repeat is True
    assert run.test_input.steps_per_epoch == 4 and run.test_input.repeat is False  # 256 / 64
    # auto: the largest divisor of 16 steps up to 32, compiled into the model
    assert run.steps_per_execution == 16 and run.model.steps_per_execution == 16
    assert run.info == data.dataset_info("synthetic")
    assert int(run.train_data.cardinality()) == 1024 and int(run.test_data.cardinality()) == 256
    # The model is built and compiled under the strategy: mirrored variables,
    # the classification loss, the configured optimizer.
    variable = run.model.trainable_variables[0]
    assert len(run.strategy.experimental_local_results(variable.value)) == NUM_DEVICES
    assert isinstance(run.model.loss, keras.losses.SparseCategoricalCrossentropy)
    assert type(run.model.optimizer).__name__ == "Adam"
    assert run.model.name == "mlp"
    line = run.describe()
    assert line.startswith("MirroredStrategy with 4 replicas")
    assert "global batch 64 = 4 x 16; 16 steps/epoch, 16 per call" in line


def test_dataset_from_continues_the_training_stream():
    run = build_run(TrainConfig(distribution="one_device", **SYNTHETIC))
    full = iter(run.dataset_from(0))
    batches = [next(full)[1].numpy() for _ in range(5)]
    np.testing.assert_array_equal(next(iter(run.dataset_from(3)))[1].numpy(), batches[3])
    np.testing.assert_array_equal(next(iter(run.train_input.dataset))[1].numpy(), batches[0])


@pytest.mark.parametrize("changes, steps_per_epoch, steps_per_execution", [
    ({"steps_per_epoch": 8}, 8, 8),
    ({"steps_per_execution": 4}, 16, 4),
    ({"backup_dir": "BACKUP", "backup_every_steps": 4}, 16, 4),  # calls end at each backup
    ({"backup_dir": "BACKUP", "backup_every_steps": 6}, 16, 2),
])
def test_steps(changes, steps_per_epoch, steps_per_execution, tmp_path):
    changes = {k: str(tmp_path / v) if v == "BACKUP" else v for k, v in changes.items()}
    run = build_run(TrainConfig(distribution="one_device", **SYNTHETIC, **changes))
    assert run.steps_per_epoch == steps_per_epoch
    assert run.steps_per_execution == run.model.steps_per_execution == steps_per_execution
    assert not (tmp_path / "BACKUP").exists()  # building writes nothing


def test_pipeline():
    run = build_run(TrainConfig(distribution="pipeline", devices=("CPU:0", "CPU:1"),
                                num_stages=2, num_microbatches=4, **SYNTHETIC))
    model = run.model
    assert isinstance(model, PipelineModel)
    assert run.strategy is tf.distribute.get_strategy()  # stages are placed by hand
    assert (model.num_replicas, model.num_stages, model.num_microbatches) == (1, 2, 4)
    assert model.stage_devices == [["/device:CPU:0", "/device:CPU:1"]]
    assert run.num_replicas == 1 and run.per_replica_batch_size == 64
    assert run.train_input.num_replicas == 1 and run.steps_per_epoch == 16
    assert model.name == "mlp" and model.optimizer is not None
    assert isinstance(model.loss, keras.losses.SparseCategoricalCrossentropy)
    line = run.describe()
    assert line.startswith("pipeline: 1 replica x 2 stages on ")
    assert "global batch 64 = 1 x 4 micro-batches of 16; 16 steps/epoch, 16 per call" in line


def test_hybrid():
    run = build_run(TrainConfig(distribution="hybrid", num_replicas=2, num_stages=2,
                                num_microbatches=2, model="cnn", **SYNTHETIC))
    model = run.model
    assert isinstance(model, PipelineModel)
    assert (model.num_replicas, model.num_stages, model.num_microbatches) == (2, 2, 2)
    # every device by default, one replica's stages after the other's
    assert model.stage_devices == [["/device:CPU:0", "/device:CPU:1"],
                                   ["/device:CPU:2", "/device:CPU:3"]]
    assert run.num_replicas == 2 and run.per_replica_batch_size == 32
    assert model.name == "cnn"
    assert "hybrid: 2 replicas x 2 stages on" in run.describe()
    assert "global batch 64 = 2 x 2 micro-batches of 16" in run.describe()


def test_reuse_keeps_the_strategy_and_data_and_builds_a_new_model():
    config = TrainConfig(distribution="mirrored", **SYNTHETIC)
    first = build_run(config)
    second = build_run(config.replace(global_batch_size=128, optimizer="sgd"), reuse=first)
    assert second.strategy is first.strategy
    assert second.train_data is first.train_data and second.test_data is first.test_data
    assert second.info == first.info and second.train_data is first.train_data
    assert second.model is not first.model
    assert type(second.model.optimizer).__name__ == "SGD"
    assert second.steps_per_epoch == 8 and second.per_replica_batch_size == 32
    assert second.train_input.dataset is not first.train_input.dataset


def test_input_options_reach_the_training_input_only():
    run = build_run(TrainConfig(distribution="mirrored", **SYNTHETIC),
                    input_options={"batch_map_fn": lambda x, y: (x, y * 0 + 7)})
    assert set(_first_labels(run.train_input.dataset, run.strategy)) == {7}
    assert set(_first_labels(run.test_input.dataset, run.strategy)) != {7}
    with pytest.raises(ValueError, match=r"`prefetch_per_replica` must be a positive integer"):
        build_run(TrainConfig(distribution="mirrored", **SYNTHETIC),
                  input_options={"prefetch_per_replica": 0})


def test_regression_run():
    run = build_run(TrainConfig(distribution="one_device", model="regression",
                                dataset="synthetic_regression", num_examples=256,
                                global_batch_size=64))
    assert isinstance(run.model.loss, keras.losses.MeanSquaredError)
    assert run.info["task"] == "regression" and run.model.output_shape == (None, 1)
    assert isinstance(run.strategy, tf.distribute.OneDeviceStrategy)


@pytest.mark.parametrize("model, dataset, message", [
    ("regression", "synthetic", r"`model` 'regression' does regression but `dataset` "
                                r"'synthetic' is a classification dataset; use "
                                r"dataset='synthetic_regression'\."),
    ("mlp", "synthetic_regression", r"`model` 'mlp' does classification but `dataset` "
                                    r"'synthetic_regression' is a regression dataset; use "
                                    r"model='mlp' or 'cnn'\."),
])
def test_model_and_dataset_tasks_must_match(model, dataset, message):
    with pytest.raises(ValueError, match=message):
        build_run(TrainConfig(distribution="one_device", model=model, dataset=dataset,
                              num_examples=256, global_batch_size=64))


def test_the_config_is_validated_first():
    with pytest.raises(ValueError, match=r"`global_batch_size` must be a positive integer"):
        build_run(TrainConfig(distribution="mirrored", dataset="synthetic", global_batch_size=0))


def test_the_precision_policy_applies_to_the_model_and_is_restored():
    before = keras.mixed_precision.global_policy().name
    run = build_run(TrainConfig(distribution="one_device", mixed_precision="bfloat16",
                                **SYNTHETIC))
    assert run.model.dtype_policy.name == "mixed_bfloat16"
    assert run.model.layers[-1].dtype_policy.name == "float32"  # float32 logits
    assert keras.mixed_precision.global_policy().name == before
    if not tf.config.list_physical_devices("GPU"):
        with pytest.raises(ValueError, match=r"`mixed_precision` 'float16' needs a GPU"):
            build_run(TrainConfig(distribution="one_device", mixed_precision="float16",
                                  **SYNTHETIC))
        assert keras.mixed_precision.global_policy().name == before


# ------------------------------------------------------------------- the user's own


def test_own_model_data_and_loss_from_python():
    """The user's functions, as Python callables: a functional model with dict
    inputs and a residual, NumPy data, the user's loss, a Keras optimizer by name."""
    from tests import own_model

    run = build_run(TrainConfig(distribution="mirrored", model=own_model.build,
                                dataset=own_model.data, loss=own_model.smooth_loss,
                                optimizer="rmsprop", learning_rate=0.01, global_batch_size=128,
                                seed=0, epochs=1))
    assert run.model.name == "own" and run.info == {
        "input_shape": {"pixels": (16,), "extra": (4,)}, "num_classes": None,
        "task": "classification"}  # integer labels
    assert run.model.loss is own_model.smooth_loss
    assert type(run.model.optimizer).__name__ == "RMSprop"
    assert run.steps_per_epoch == 16 and run.test_input.steps_per_epoch == 4
    variable = run.model.trainable_variables[0]
    assert len(run.strategy.experimental_local_results(variable.value)) == NUM_DEVICES
    history = run.model.fit(**run.train_input.fit_kwargs(), epochs=1, verbose=0).history
    assert set(history) == {"loss", "accuracy"}


def test_builtin_model_on_the_users_images_counts_the_classes(capsys):
    images = np.random.default_rng(0).random((256, 28, 28, 1), dtype=np.float32)
    labels = np.arange(256) % 7

    def seven_classes():
        return (images, labels), None  # no test split

    run = build_run(TrainConfig(distribution="one_device", model="mlp", dataset=seven_classes,
                                global_batch_size=64))
    assert "7 classes" in capsys.readouterr().out
    assert run.model.output_shape == (None, 7) and run.test_input is None


def test_subclassed_model_and_a_dataset_dict_with_files(tmp_path):
    from tests import own_model

    paths = own_model.write_tfrecords(tmp_path, num_files=2, per_file=40)

    def files():
        return {"train": data.from_files(paths, own_model.parse),
                "test": own_model.arrays(32), "num_classes": 2}

    run = build_run(TrainConfig(distribution="one_device", model=own_model.build_subclassed,
                                dataset=files, global_batch_size=16, steps_per_epoch=4))
    assert run.train_input.num_examples is None and run.steps_per_epoch == 4
    assert run.info["num_classes"] == 2 and run.model.name == "own_subclassed"
    assert isinstance(run.model.loss, keras.losses.SparseCategoricalCrossentropy)


@pytest.mark.parametrize("dataset, match", [
    (lambda: [1, 2, 3], r"returned list; expected \(train, test\)"),
    (lambda: {"training": 1}, r"returned a dict with keys \['training'\]; expected 'train'"),
    (lambda: (object(), None), r"the dataset function's train data: cannot read data of type "
                               r"object"),
])
def test_dataset_function_errors(dataset, match):
    with pytest.raises(ValueError, match=match):
        build_run(TrainConfig(distribution="one_device", model="mlp", dataset=dataset))


def test_an_optimizer_object_brings_its_own_rate():
    from tests import own_model

    fields = dict(distribution="one_device", model=own_model.build, dataset=own_model.data,
                  global_batch_size=128)
    with pytest.raises(ValueError, match=r"`learning_rate` \(0.5\) applies to an optimizer "
                                         r"given by name; set the rate on your SGD instead"):
        build_run(TrainConfig(optimizer=keras.optimizers.SGD(0.1), learning_rate=0.5, **fields))
    run = build_run(TrainConfig(optimizer=keras.optimizers.SGD(0.1, momentum=0.9),
                                lr_scaling="linear", base_batch_size=64, **fields))
    assert run.model.optimizer.momentum == 0.9
    assert float(keras.ops.convert_to_numpy(run.model.optimizer.learning_rate)) == \
        pytest.approx(0.2)


def test_accumulate_steps_batches_k_micro_batches_per_update():
    """--accumulate_steps=k: each step's batch holds k x global_batch_size
    examples, trained as k micro-steps and one update (tfmulti.models.accumulation)."""
    run = build_run(TrainConfig(distribution="mirrored", accumulate_steps=4, epochs=1,
                                **SYNTHETIC))  # 1024 examples, micro-batches of 64 on 4
    assert run.examples_per_step == 256 and run.train_input.global_batch_size == 256
    assert run.steps_per_epoch == 4 and run.model._tfmulti_accumulate_steps == 4
    assert "each step 4 accumulated micro-steps of 64" in run.describe()
    run.model.fit(**run.train_input.fit_kwargs(), epochs=1, verbose=0)
    assert int(keras.ops.convert_to_numpy(run.model.optimizer.iterations)) == 4


def test_the_users_functional_model_as_a_pipeline_with_accumulation():
    from tests import own_model

    run = build_run(TrainConfig(distribution="pipeline", devices=("CPU:0", "CPU:1"),
                                num_stages=2, num_microbatches=2, accumulate_steps=2,
                                model=own_model.build, dataset=own_model.data,
                                global_batch_size=128, seed=0))
    assert isinstance(run.model, PipelineModel) and run.model.accumulate_steps == 2
    assert run.train_input.global_batch_size == 256 and run.steps_per_epoch == 8
    run.model.fit(**run.train_input.fit_kwargs(), epochs=1, verbose=0)
    assert int(run.model.optimizer.iterations.numpy()) == 8
    assert run.model.to_model() is run.model.given  # the user's model, trained
    assert run.model.to_model().name == "own"


def test_input_sharding_by_files_reads_test_arrays_by_examples(tmp_path):
    from tests import own_model

    paths = own_model.write_tfrecords(tmp_path, num_files=2, per_file=32)
    run = build_run(TrainConfig(
        distribution="one_device", model=own_model.build, input_sharding="files",
        dataset=lambda: (data.from_files(paths, own_model.parse), own_model.arrays(32)),
        global_batch_size=16))
    assert run.train_input.sharding == "files"  # as asked (one worker reads all of them)
    assert run.test_input.sharding == "examples" and run.test_input.steps_per_epoch == 2
