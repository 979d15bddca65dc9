"""Tests for tfmulti.data: batch arithmetic, exactly-once distribution over the
4 virtual CPUs of conftest.py, offline dataset sources and synthetic data.

Nothing here downloads: `download=True` is never passed.
"""

from __future__ import annotations

import gzip
import math
import tempfile
import time
from pathlib import Path

import numpy as np
import pytest
import tensorflow as tf
import tensorflow_datasets as tfds

from tfmulti import data
from tfmulti.data import catalog
from tfmulti.runtime.strategy import get_strategy
from tests._util import write_idx

NUM_DEVICES = 4  # configured by conftest.py
FAIL_FAST_S = 20  # an offline TFDS download attempt hangs for minutes


@pytest.fixture(scope="module")
def strategy():
    s = get_strategy("mirrored")
    assert s.num_replicas_in_sync == NUM_DEVICES
    return s


def _id_dataset(n: int) -> tf.data.Dataset:
    """Example i is (float(i), i): features and labels both identify it."""
    return tf.data.Dataset.range(n).map(lambda i: (tf.cast(i, tf.float32), i))


def _take_steps(strategy, dist: data.DistributedInput, steps: int | None = None):
    """Runs `steps` global steps (all of them when None) of `dist.dataset`.

    Returns a list of steps, each a list of (features, labels, devices) per
    replica as numpy arrays.
    """
    iterator = iter(dist.dataset)
    out = []
    while steps is None or len(out) < steps:
        try:
            x, y = next(iterator)
        except StopIteration:
            break
        xs = strategy.experimental_local_results(x)
        ys = strategy.experimental_local_results(y)
        assert len(xs) == len(ys) == strategy.num_replicas_in_sync
        out.append([(xi.numpy(), yi.numpy(), yi.device) for xi, yi in zip(xs, ys)])
    return out


def _ids(steps) -> list[int]:
    ids = []
    for step in steps:
        for x, y, _ in step:
            np.testing.assert_array_equal(x, y.astype(np.float32))  # pairs stay together
            ids.extend(int(i) for i in y)
    return ids


# --------------------------------------------------------------------------
# per_replica_batch_size
# --------------------------------------------------------------------------

@pytest.mark.parametrize("global_batch, replicas, expected", [
    (256, 4, 64), (4, 4, 1), (7, 1, 7), (np.int64(32), 2, 16),
])
def test_per_replica_batch_size(global_batch, replicas, expected):
    assert data.per_replica_batch_size(global_batch, replicas) == expected


def test_per_replica_batch_size_not_divisible():
    with pytest.raises(
        ValueError,
        match=r"`global_batch_size` \(10\) must be divisible by the number of replicas \(4\)",
    ) as info:
        data.per_replica_batch_size(10, 4)
    assert "e.g. 8 or 12" in str(info.value)


@pytest.mark.parametrize("global_batch", [0, -4, 2.5, "8", None, True])
def test_per_replica_batch_size_not_positive_int(global_batch):
    with pytest.raises(ValueError, match=r"`global_batch_size` must be a positive integer"):
        data.per_replica_batch_size(global_batch, 4)


# --------------------------------------------------------------------------
# distribute: exactly once, shapes, devices, order
# --------------------------------------------------------------------------

def test_training_divisible_every_id_exactly_once(strategy):
    n, batch = 64, 16
    dist = data.distribute(_id_dataset(n), strategy, batch, seed=0)
    assert dist.steps_per_epoch == 4
    assert dist.repeat is True
    assert dist.per_replica_batch_size == 4 and dist.num_replicas == NUM_DEVICES
    steps = _take_steps(strategy, dist, dist.steps_per_epoch)
    ids = _ids(steps)
    assert sorted(ids) == list(range(n))


@pytest.mark.parametrize("repeat", [None, False])
def test_training_with_remainder_uses_full_batches_only(strategy, repeat):
    n, batch = 50, 16
    dist = data.distribute(_id_dataset(n), strategy, batch, seed=3, repeat=repeat)
    assert dist.steps_per_epoch == n // batch == 3
    assert dist.repeat is (repeat is None)
    # Without repeat, the iterator ends by itself after one pass.
    steps = _take_steps(strategy, dist, dist.steps_per_epoch if dist.repeat else None)
    assert len(steps) == 3
    for step in steps:
        for x, y, _ in step:
            assert x.shape == y.shape == (dist.per_replica_batch_size,)
    ids = _ids(steps)
    assert len(ids) == dist.steps_per_epoch * batch == 48
    assert len(set(ids)) == len(ids)  # at most once
    assert set(ids) <= set(range(n))


def test_training_with_remainder_second_epoch_also_distinct(strategy):
    n, batch = 50, 16
    dist = data.distribute(_id_dataset(n), strategy, batch, seed=5)
    steps = _take_steps(strategy, dist, 2 * dist.steps_per_epoch)
    first, second = _ids(steps[:3]), _ids(steps[3:])
    for ids in (first, second):
        assert len(ids) == len(set(ids)) == 48


@pytest.mark.parametrize("n, batch", [(50, 16), (64, 16), (5, 16), (33, 8)])
def test_evaluation_every_id_exactly_once(strategy, n, batch):
    dist = data.distribute(_id_dataset(n), strategy, batch, training=False)
    assert dist.steps_per_epoch == math.ceil(n / batch)
    assert dist.repeat is False
    steps = _take_steps(strategy, dist)
    assert len(steps) == dist.steps_per_epoch
    ids = _ids(steps)
    assert ids == list(range(n))  # no shuffling: natural order, each id once
    for step in steps:
        for x, _, _ in step:
            assert x.shape[0] <= dist.per_replica_batch_size


def test_per_replica_shapes_and_devices(strategy):
    dist = data.distribute(_id_dataset(96), strategy, 32, seed=0)
    assert dist.per_replica_batch_size == 8
    steps = _take_steps(strategy, dist, 2)
    for step in steps:
        for i, (x, y, device) in enumerate(step):
            assert x.shape == (8,) and x.dtype == np.float32
            assert y.shape == (8,) and y.dtype == np.int64
            assert device.endswith(f"CPU:{i}"), (i, device)
    # The features too are placed on the replica's device.
    x, _ = next(iter(dist.dataset))
    for i, xi in enumerate(strategy.experimental_local_results(x)):
        assert xi.device.endswith(f"CPU:{i}")


def test_seeded_order_is_deterministic_and_reshuffled_each_epoch(strategy):
    n, batch = 64, 16

    def two_epochs():
        dist = data.distribute(_id_dataset(n), strategy, batch, seed=1)
        steps = _take_steps(strategy, dist, 2 * dist.steps_per_epoch)
        return _ids(steps[:4]), _ids(steps[4:])

    first_a, second_a = two_epochs()
    first_b, _ = two_epochs()
    assert first_a == first_b  # same seed, same order
    assert first_a != list(range(n))  # shuffled
    assert sorted(second_a) == list(range(n))
    assert second_a != first_a  # reshuffled in the next epoch


def test_evaluation_order_is_natural_even_with_seed(strategy):
    dist = data.distribute(_id_dataset(40), strategy, 8, training=False, seed=1)
    assert _ids(_take_steps(strategy, dist)) == list(range(40))


def test_dataset_function_and_map_fn(strategy):
    dist = data.distribute(
        lambda: _id_dataset(32), strategy, 16, training=False,
        map_fn=lambda x, y: (x * 2.0, y),
    )
    assert dist.steps_per_epoch == 2
    values = []
    for step in _take_steps(strategy, dist):
        for x, y, _ in step:
            np.testing.assert_array_equal(x, 2.0 * y)
            values.extend(y.tolist())
    assert values == list(range(32))


def test_fit_and_evaluate_kwargs(strategy):
    train = data.distribute(_id_dataset(64), strategy, 16, seed=0)
    assert train.fit_kwargs() == {"x": train.dataset, "steps_per_epoch": 4, "shuffle": False}
    test = data.distribute(_id_dataset(50), strategy, 16, training=False)
    assert test.evaluate_kwargs() == {"x": test.dataset, "steps": 4}
    assert test.fit_kwargs()["steps_per_epoch"] is None


def test_global_batch_larger_than_training_data(strategy):
    with pytest.raises(
        ValueError,
        match=r"`global_batch_size` \(64\) exceeds the number of training examples \(40\)",
    ):
        data.distribute(_id_dataset(40), strategy, 64)
    # The suggestion is a batch the replicas can split and the data can fill.
    with pytest.raises(ValueError, match=r"use at most 100 \(a multiple of the 4 replicas\)"):
        data.distribute(_id_dataset(101), strategy, 128)
    with pytest.raises(ValueError, match=r"fewer examples than the 4 replicas"):
        data.distribute(_id_dataset(3), strategy, 4)
    # Evaluation accepts it: one partial batch.
    dist = data.distribute(_id_dataset(40), strategy, 64, training=False)
    assert dist.steps_per_epoch == 1


def test_distribute_refuses_indivisible_batch(strategy):
    with pytest.raises(ValueError, match=r"must be divisible by the number of replicas \(4\)"):
        data.distribute(_id_dataset(64), strategy, 18)


def test_distribute_refuses_bad_prefetch(strategy):
    with pytest.raises(ValueError, match=r"`prefetch_per_replica` must be a positive integer, "
                                         r"got 0"):
        data.distribute(_id_dataset(64), strategy, 16, prefetch_per_replica=0)


@pytest.mark.parametrize("kwargs, match", [
    ({"skip_steps": -1}, r"`skip_steps` must be an integer >= 0, got -1"),
    ({"skip_steps": True}, r"`skip_steps` must be an integer >= 0, got True"),
    ({"skip_steps": 2, "training": False}, r"`skip_steps` applies to training data only"),
    ({"input_threads": 0}, r"`input_threads` must be a positive integer \(or None\), got 0"),
])
def test_distribute_refuses_bad_skip_and_threads(strategy, kwargs, match):
    with pytest.raises(ValueError, match=match):
        data.distribute(_id_dataset(64), strategy, 16, **kwargs)


def test_skip_steps_continues_the_uninterrupted_stream():
    ds = tf.data.Dataset.from_tensor_slices(np.arange(40, dtype=np.int64))
    one = get_strategy("one_device")
    full = data.distribute(ds, one, 8, training=True, seed=3)
    resumed = data.distribute(ds, one, 8, training=True, seed=3, skip_steps=7)
    full_batches = [b.numpy().tolist() for b, _ in zip(full.dataset, range(15))]
    resumed_batches = [b.numpy().tolist() for b, _ in zip(resumed.dataset, range(8))]
    assert resumed_batches == full_batches[7:]
    assert full_batches[:5] != full_batches[5:10]  # epochs are reshuffled


def test_unknown_size_is_counted_for_training_and_read_to_the_end_for_evaluation(strategy):
    ds = _id_dataset(64).filter(lambda x, y: y >= 0)  # cardinality unknown
    dist = data.distribute(ds, strategy, 16, seed=0)
    assert dist.steps_per_epoch == 4 and dist.repeat is True and dist.num_examples is None
    assert sorted(_ids(_take_steps(strategy, dist, 4))) == list(range(64))
    test = data.distribute(ds, strategy, 16, training=False)
    assert test.steps_per_epoch is None and test.repeat is False
    assert sorted(_ids(_take_steps(strategy, test))) == list(range(64))


def _match_examples(loaded_images, loaded_labels, images, labels):
    """Pairs every loaded example with its original (TFDS shuffles on write)."""
    assert len(loaded_images) == len(images)
    matched = []
    for image, label in zip(loaded_images, loaded_labels):
        index = int(np.argmin(np.abs(images[:, 0, 0].astype(float) - image[0, 0, 0] * 255.0)))
        np.testing.assert_array_equal(image[..., 0], images[index].astype(np.float32) / 255.0)
        assert label == labels[index]
        matched.append(index)
    assert sorted(matched) == list(range(len(images)))


# --------------------------------------------------------------------------
# Fashion-MNIST from IDX files
# --------------------------------------------------------------------------


def test_read_idx_roundtrip(tmp_path):
    array = np.arange(2 * 3 * 4, dtype=np.uint8).reshape(2, 3, 4)
    write_idx(tmp_path / "x.gz", array)
    np.testing.assert_array_equal(data.read_idx(tmp_path / "x.gz"), array)
    # Uncompressed too.
    with gzip.open(tmp_path / "x.gz", "rb") as f:
        (tmp_path / "x.idx").write_bytes(f.read())
    np.testing.assert_array_equal(data.read_idx(tmp_path / "x.idx"), array)


def test_read_idx_truncated(tmp_path):
    write_idx(tmp_path / "t.gz", np.zeros((3, 28, 28), np.uint8), truncate=100)
    with pytest.raises(ValueError, match=r"truncated"):
        data.read_idx(tmp_path / "t.gz")


def test_read_idx_not_idx(tmp_path):
    (tmp_path / "bad").write_bytes(b"\x89PNG\r\n\x1a\n")
    with pytest.raises(ValueError, match=r"is not an unsigned-byte IDX file"):
        data.read_idx(tmp_path / "bad")


def test_prepare_fashion_mnist_from_idx(tmp_path, fake_idx):
    src, arrays = fake_idx
    data_dir = str(tmp_path / "tfds")
    assert data.prepare_fashion_mnist(data_dir=data_dir, source_dir=str(src)) == data_dir
    assert (tmp_path / "tfds" / "fashion_mnist" / "3.0.1" / "dataset_info.json").is_file()
    # TFDS's own registered builder reads it: the layout is TFDS-compatible.
    train = tfds.load("fashion_mnist", split="train", data_dir=data_dir, download=False)
    examples = list(train.as_numpy_iterator())
    assert len(examples) == 12
    assert examples[0]["image"].shape == (28, 28, 1) and examples[0]["image"].dtype == np.uint8
    builder = tfds.builder("fashion_mnist", data_dir=data_dir)
    assert builder.info.splits["test"].num_examples == 5
    assert builder.info.features["label"].num_classes == 10
    assert builder.info.features["label"].names == list(catalog.FASHION_MNIST_CLASSES)

    test = data.load("fashion_mnist", "test", data_dir=data_dir, source_dir=str(src))
    assert test.element_spec[0] == tf.TensorSpec((28, 28, 1), tf.float32)
    loaded = list(test.as_numpy_iterator())
    assert len(loaded) == 5
    images = np.stack([x for x, _ in loaded])
    assert images.min() >= 0.0 and images.max() <= 1.0
    _match_examples(images, [y for _, y in loaded], *arrays["test"])

    # Preparing again is a no-op.
    mtime = (tmp_path / "tfds" / "fashion_mnist" / "3.0.1" / "dataset_info.json").stat().st_mtime_ns
    data.prepare_fashion_mnist(data_dir=data_dir, source_dir=str(src))
    assert (tmp_path / "tfds" / "fashion_mnist" / "3.0.1" / "dataset_info.json").stat().st_mtime_ns == mtime


def test_load_prepares_fashion_mnist_on_first_use(tmp_path, fake_idx):
    src, arrays = fake_idx
    data_dir = str(tmp_path / "fresh")
    train = data.load("fashion_mnist", "train", data_dir=data_dir, source_dir=str(src))
    loaded = list(train.as_numpy_iterator())
    _match_examples(np.stack([x for x, _ in loaded]), [y for _, y in loaded], *arrays["train"])
    assert data.dataset_info("fashion_mnist", data_dir=data_dir) == {
        "input_shape": (28, 28, 1), "num_classes": 10, "task": "classification",
    }


def test_data_not_prepared_yet_leaves_no_folder_in_tmpdir(tmp_path, fake_idx, monkeypatch):
    """TFDS makes an empty `tmpXXXXtfds` folder in TMPDIR for each builder of a
    dataset not prepared in its data dir, and leaves it (tfmulti.data._tfds):
    not through tfmulti's preparing, loading and missing-data paths."""
    src, _ = fake_idx
    scratch = tmp_path / "tmpdir"
    scratch.mkdir()
    monkeypatch.setattr(tempfile, "tempdir", str(scratch))
    data.load("fashion_mnist", "train", data_dir=str(tmp_path / "fresh"), source_dir=str(src))
    with pytest.raises(data.DataNotFoundError):
        data.load("cifar10", data_dir=str(tmp_path / "none"))
    assert list(scratch.iterdir()) == []
    # The bug, still upstream: TFDS's own method leaves the folder.
    info = tfds.builder("cifar10", data_dir=str(tmp_path / "none")).info
    tfds.core.dataset_info.DatasetInfo.initialize_from_bucket.__wrapped__(info)
    assert [p.name[-4:] for p in scratch.iterdir()] == ["tfds"]


def test_find_fashion_mnist_idx_explicit_folder_only(tmp_path, fake_idx):
    src, _ = fake_idx
    assert data.find_fashion_mnist_idx(str(src)) == (Path(src), [str(src)])
    assert data.find_fashion_mnist_idx(str(tmp_path)) == (None, [str(tmp_path)])


def test_prepare_fashion_mnist_without_idx_files(tmp_path):
    empty = tmp_path / "empty"
    empty.mkdir()
    with pytest.raises(data.DataNotFoundError, match=r"Fashion-MNIST IDX files not found in") as info:
        data.prepare_fashion_mnist(data_dir=str(tmp_path / "tfds"), source_dir=str(empty))
    assert str(empty) in str(info.value)
    assert "dataset-fashion-mnist" in str(info.value)


# --------------------------------------------------------------------------
# Missing data fails fast
# --------------------------------------------------------------------------

def test_missing_fashion_mnist_fails_fast(tmp_path):
    data_dir, source_dir = tmp_path / "tfds", tmp_path / "no_idx"
    source_dir.mkdir()
    start = time.monotonic()
    with pytest.raises(data.DataNotFoundError, match=r"dataset 'fashion_mnist' not found; tried: ") as info:
        data.load("fashion_mnist", data_dir=str(data_dir), source_dir=str(source_dir))
    assert time.monotonic() - start < FAIL_FAST_S
    message = str(info.value)
    assert str(data_dir / "fashion_mnist") in message
    assert str(source_dir) in message
    assert "dataset-fashion-mnist" in message
    assert "download=True" in message
    assert isinstance(info.value, FileNotFoundError)


def test_missing_cifar10_fails_fast(tmp_path):
    start = time.monotonic()
    with pytest.raises(data.DataNotFoundError, match=r"dataset 'cifar10' not found; tried: ") as info:
        data.load("cifar10", data_dir=str(tmp_path))
    assert time.monotonic() - start < FAIL_FAST_S
    message = str(info.value)
    assert "download=True" in message
    assert str(tmp_path / "cifar10") in message
    assert "dataset-fashion-mnist" not in message  # that hint is for fashion_mnist only


def test_missing_prepared_data_is_one_error_without_tfds_warnings(tmp_path, caplog):
    """TFDS warns "Variant folder ... has no dataset_info.json" through absl
    logging when a version folder lacks its metadata: a recipe's one error
    line would come second."""
    (tmp_path / "mnist" / "3.0.1").mkdir(parents=True)
    with caplog.at_level("WARNING"), pytest.raises(data.DataNotFoundError):
        data.load("mnist", data_dir=str(tmp_path))
    assert [r.getMessage() for r in caplog.records if r.levelname == "WARNING"] == []


@pytest.mark.parametrize("value", [0, -5, 2.5, True])
def test_num_examples_must_be_positive(value):
    with pytest.raises(ValueError, match=rf"`num_examples` must be a positive integer \(or "
                                         rf"None\), got {value}"):
        data.load("synthetic", num_examples=value)


@pytest.mark.parametrize("value", [0, -3])
def test_shuffle_buffer_must_be_positive(strategy, value):
    with pytest.raises(ValueError, match=rf"`shuffle_buffer` must be a positive integer \(or "
                                         rf"None\), got "
                                         rf"{value}; a number of examples"):
        data.distribute(_id_dataset(64), strategy, 16, shuffle_buffer=value)


def test_num_examples_only_for_synthetic():
    with pytest.raises(ValueError, match=r"`num_examples` applies to synthetic data only"):
        data.load("mnist", num_examples=10)


# --------------------------------------------------------------------------
# tfds.testing.mock_data
# --------------------------------------------------------------------------

def test_load_under_tfds_mock_data(tmp_path):
    with tfds.testing.mock_data(num_examples=16):
        ds = data.load("mnist", "train", data_dir=str(tmp_path))
        assert ds.element_spec == (
            tf.TensorSpec((28, 28, 1), tf.float32), tf.TensorSpec((), tf.int64),
        )
        examples = list(ds.as_numpy_iterator())
        info = data.dataset_info("mnist", data_dir=str(tmp_path))
    assert len(examples) == 16
    for image, label in examples:
        assert image.dtype == np.float32 and image.shape == (28, 28, 1)
        assert 0.0 <= image.min() and image.max() <= 1.0
        assert label.dtype == np.int64 and 0 <= label < 10
    assert max(image.max() for image, _ in examples) > 0.5  # normalized, not all zeros
    assert info == {"input_shape": (28, 28, 1), "num_classes": 10, "task": "classification"}


# --------------------------------------------------------------------------
# Real Fashion-MNIST
# --------------------------------------------------------------------------

def test_real_fashion_mnist(fashion_mnist_data_dir):
    train = data.load("fashion_mnist", "train", data_dir=fashion_mnist_data_dir)
    test = data.load("fashion_mnist", "test", data_dir=fashion_mnist_data_dir)
    assert int(train.cardinality()) == 60000
    assert int(test.cardinality()) == 10000
    spec = (tf.TensorSpec((28, 28, 1), tf.float32), tf.TensorSpec((), tf.int64))
    assert train.element_spec == spec and test.element_spec == spec
    # The whole test split (train: a sample, decoding 60000 PNGs is slow).
    labels, lo, hi = [], 1.0, 0.0
    for x, y in test.batch(2500).as_numpy_iterator():
        labels.append(y)
        lo, hi = min(lo, x.min()), max(hi, x.max())
    labels = np.concatenate(labels)
    assert labels.shape == (10000,)
    assert labels.min() == 0 and labels.max() == 9
    np.testing.assert_array_equal(np.bincount(labels), [1000] * 10)
    assert lo == 0.0 and hi == 1.0
    x, y = next(train.batch(1000).as_numpy_iterator())
    assert x.shape == (1000, 28, 28, 1) and x.dtype == np.float32
    assert 0.0 <= x.min() and x.max() <= 1.0
    assert set(np.unique(y)) <= set(range(10)) and len(np.unique(y)) == 10


# --------------------------------------------------------------------------
# Synthetic data
# --------------------------------------------------------------------------

def _arrays(ds: tf.data.Dataset):
    x, y = next(ds.batch(100000).as_numpy_iterator())
    return x, y


def test_synthetic_is_deterministic_and_splits_differ():
    x1, y1 = _arrays(data.synthetic("train", num_examples=256, seed=7))
    x2, y2 = _arrays(data.synthetic("train", num_examples=256, seed=7))
    xt, _ = _arrays(data.synthetic("test", num_examples=256, seed=7))
    xo, _ = _arrays(data.synthetic("train", num_examples=256, seed=8))
    np.testing.assert_array_equal(x1, x2)
    np.testing.assert_array_equal(y1, y2)
    assert not np.array_equal(x1, xt)
    assert not np.array_equal(x1, xo)
    assert x1.shape == (256, 28, 28, 1) and x1.dtype == np.float32
    assert 0.0 <= x1.min() and x1.max() < 1.0
    assert y1.dtype == np.int64 and y1.min() >= 0 and y1.max() < 10
    assert len(np.unique(y1)) > 1


def test_synthetic_custom_shape_and_classes():
    x, y = _arrays(data.synthetic("test", num_examples=64, shape=(5,), num_classes=3))
    assert x.shape == (64, 5)
    assert set(np.unique(y)) <= {0, 1, 2}


def test_synthetic_regression():
    ds = data.synthetic_regression("train", num_examples=32)
    assert ds.element_spec == (
        tf.TensorSpec((1024,), tf.float32), tf.TensorSpec((1,), tf.float32),
    )
    x, y = _arrays(ds)
    assert x.shape == (32, 1024) and y.shape == (32, 1)
    x2, y2 = _arrays(data.synthetic_regression("train", num_examples=32))
    np.testing.assert_array_equal(y, y2)
    xt, _ = _arrays(data.synthetic_regression("test", num_examples=32))
    assert not np.array_equal(x, xt)


@pytest.mark.parametrize("name, x_shape, y_shape", [
    ("synthetic", (28, 28, 1), ()),
    ("synthetic_regression", (1024,), (1,)),
])
def test_load_synthetic(name, x_shape, y_shape):
    ds = data.load(name, "test", num_examples=10)
    assert int(ds.cardinality()) == 10
    assert ds.element_spec[0].shape == x_shape
    assert ds.element_spec[1].shape == y_shape


def test_synthetic_bad_split():
    with pytest.raises(ValueError, match=r"synthetic data has splits 'train' and 'test'"):
        data.synthetic("validation", num_examples=4)


@pytest.mark.parametrize("name, expected", [
    ("synthetic", {"input_shape": (28, 28, 1), "num_classes": 10, "task": "classification"}),
    ("synthetic_regression", {"input_shape": (1024,), "num_classes": None, "task": "regression"}),
])
def test_dataset_info_synthetic(name, expected):
    assert data.dataset_info(name) == expected


def test_batch_map_runs_after_the_cache_every_epoch():
    calls = []

    def count(x, y):
        return tf.py_function(lambda t: calls.append(1) or t, [x], x.dtype), y

    strategy = get_strategy("one_device")
    dist = data.distribute(data.load("synthetic", num_examples=64), strategy, 16, seed=0,
                           batch_map_fn=count)
    iterator = iter(dist.dataset)
    for _ in range(2 * dist.steps_per_epoch):  # two epochs
        next(iterator)
    assert len(calls) >= 2 * dist.steps_per_epoch


def test_a_truncated_prepared_file_fails_at_load_naming_it(tmp_path, fake_idx):
    """A cut-off TFRecord file (a full disk, a killed copy) fails at once with
    the fix, not mid-epoch with a DataLossError."""
    src, _ = fake_idx
    data_dir = str(tmp_path / "tfds")
    data.prepare_fashion_mnist(data_dir=data_dir, source_dir=str(src))
    (train_file,) = (tmp_path / "tfds" / "fashion_mnist" / "3.0.1").glob("*-train.tfrecord-*")
    train_file.write_bytes(train_file.read_bytes()[:-10])
    assert len(list(data.load("fashion_mnist", "test", data_dir=data_dir))) == 5  # intact
    with pytest.raises(data.DataNotFoundError,
                       match=r"the prepared 'fashion_mnist' data in .*3.0.1 is damaged \(train "
                             r"split: .* bytes where its metadata records .*\); delete that "
                             r"folder and prepare it again \(`tfmulti prepare-data`\)"):
        data.load("fashion_mnist", "train[:50%]", data_dir=data_dir)
