"""tfmulti.data.sources and the data forms `distribute` takes: NumPy arrays,
dicts, pandas DataFrames, files bigger than memory, data of unknown size."""

from __future__ import annotations

import numpy as np
import pandas as pd
import pytest
import tensorflow as tf

from tests import own_model
from tfmulti import data
from tfmulti.data import sources, streaming
from tfmulti.runtime.strategy import get_strategy


def _ids(dist, steps: int, key="id") -> list[int]:
    """The example ids of `steps` global batches of a distributed input."""
    seen = []
    iterator = iter(dist.dataset)
    for _ in range(steps):
        x, _ = next(iterator)
        values = x[key] if isinstance(x, dict) else x
        for part in dist.dataset._strategy.experimental_local_results(values) \
                if hasattr(dist.dataset, "_strategy") else [values]:
            seen.extend(int(v) for v in np.asarray(part).reshape(-1))
    return seen


# ----------------------------------------------------------------------------- in memory


def test_arrays_and_dicts_become_a_dataset_of_float32():
    x, y = own_model.arrays(10)
    ds = sources.as_dataset(({k: v.astype(np.float64) for k, v in x.items()}, y))
    features, labels = next(iter(ds))
    assert set(features) == {"pixels", "extra"} and features["pixels"].dtype == tf.float32
    assert labels.dtype == tf.int32 and int(ds.cardinality()) == 10
    assert int(sources.as_dataset(x["pixels"]).cardinality()) == 10  # features only


def test_a_dataframe_with_a_label_column():
    frame = pd.DataFrame({"a": np.arange(6.0), "b": np.ones(6), "target": np.arange(6) % 2})
    ds = sources.as_dataset(frame, label="target")
    features, labels = next(iter(ds.skip(3)))
    assert features.numpy().tolist() == [3.0, 1.0] and features.dtype == tf.float32
    assert int(labels) == 1
    dist = data.distribute(frame, get_strategy("one_device"), 2, label="target", seed=0)
    assert dist.steps_per_epoch == 3


@pytest.mark.parametrize("value, kwargs, match", [
    (pd.DataFrame({"a": [1.0]}), {"label": "y"},
     r"`label` 'y' is not a column of the DataFrame; its columns: \['a'\]"),
    ((np.zeros(3), np.zeros(4)), {}, r"different numbers of examples \(\[3, 4\]\)"),
    ("a string", {}, r"cannot read data of type str; pass a tf.data.Dataset, \(features, "
                     r"labels\) arrays"),
    ((np.zeros(3), np.zeros(3)), {"label": "y"}, r"`label` \('y'\) names a DataFrame column"),
    ((1, 2, 3, 4), {}, r"\(features, labels\[, sample_weights\]\), got a tuple of 4"),
])
def test_in_memory_errors(value, kwargs, match):
    with pytest.raises(ValueError, match=match):
        sources.as_dataset(value, **kwargs)


# ----------------------------------------------------------------------------- files


@pytest.fixture(scope="module")
def tfrecords(tmp_path_factory):
    folder = tmp_path_factory.mktemp("records")
    return own_model.write_tfrecords(folder, num_files=4, per_file=24)


def test_from_files_by_pattern_or_list(tfrecords):
    folder = tfrecords[0].rsplit("/", 1)[0]
    by_pattern = data.from_files(f"{folder}/part-*.tfrecord", own_model.parse)
    assert by_pattern.files == tuple(sorted(tfrecords))
    assert by_pattern.shard(1, 2) == (tfrecords[1], tfrecords[3])
    assert by_pattern.count(progress=None) == 96
    features, label = next(iter(by_pattern.dataset()))
    assert features["pixels"].shape == (16,) and label.dtype == tf.int64
    assert data.from_files(list(reversed(tfrecords))).files == tuple(reversed(tfrecords))


def test_from_files_takes_a_list_literally(tmp_path):
    weird = tmp_path / "exp[12]"
    weird.mkdir()
    (path,) = own_model.write_tfrecords(weird, num_files=1, per_file=3)
    assert data.from_files([path]).count(progress=None) == 3  # not read as a pattern


@pytest.mark.parametrize("args, kwargs, match", [
    (("/nonexistent/*.tfrecord",), {}, r"`files` '/nonexistent/\*.tfrecord' matches no file"),
    ((["/nonexistent/a.tfrecord"],), {}, r"`files` lists 1 path that is not a file"),
    (([],), {}, r"`files` is empty"),
    (("PATTERN",), {"reader": "parquet"}, r"`reader` must be one of \['tfrecord', 'text'\]"),
    (("PATTERN",), {"reader": len, "compression": "GZIP"}, r"`compression` applies to the "
                                                           r"named readers"),
    (("PATTERN",), {"cycle_length": 0}, r"`cycle_length` must be a positive integer"),
])
def test_from_files_errors(tfrecords, args, kwargs, match):
    args = tuple(tfrecords[0] if a == "PATTERN" else a for a in args)
    with pytest.raises(ValueError, match=match):
        data.from_files(*args, **kwargs)


def test_files_are_counted_once_and_every_example_trains_once_per_epoch(tfrecords, capsys):
    files = data.from_files(tfrecords, own_model.parse_with_id)
    dist = data.distribute(files, get_strategy("one_device"), 16, seed=0)
    assert "counted 96 records in 4 files" in capsys.readouterr().out
    assert dist.steps_per_epoch == 6 and dist.num_examples is None and dist.repeat
    assert dist.sharding == "examples"  # one worker: nothing to split
    first, second = _ids(dist, 6), _ids(dist, 12)[96:]
    assert sorted(first) == list(range(96)) and sorted(second) == list(range(96))
    assert first != second  # reshuffled (files and examples) each epoch


def test_a_given_epoch_length_skips_the_count(tfrecords, capsys):
    files = data.from_files(tfrecords, own_model.parse_with_id)
    dist = data.distribute(files, get_strategy("one_device"), 16, seed=0, steps_per_epoch=4)
    assert "counted" not in capsys.readouterr().out and dist.steps_per_epoch == 4
    resumed = data.distribute(files, get_strategy("one_device"), 16, seed=0, steps_per_epoch=4,
                              skip_steps=5)
    assert _ids(resumed, 3) == _ids(dist, 8)[5 * 16:]


def test_data_of_unknown_size_is_counted(capsys):
    evens = tf.data.Dataset.range(100).filter(lambda i: i % 2 == 0).map(lambda i: (i, i))
    dist = data.distribute(evens, get_strategy("mirrored", devices=["CPU:0", "CPU:1"]), 10,
                           seed=1)
    assert "counted 50 examples" in capsys.readouterr().out
    assert dist.steps_per_epoch == 5


def test_data_that_repeats_forever_is_refused():
    with pytest.raises(ValueError, match=r"the dataset repeats forever, so an epoch has no end"):
        data.distribute(tf.data.Dataset.range(8).repeat(), get_strategy("one_device"), 4)


def test_steps_per_epoch_is_for_data_of_unknown_size():
    with pytest.raises(ValueError, match=r"`steps_per_epoch` is for data of unknown size; this "
                                         r"data has 8 examples \(2 steps per pass\)"):
        data.distribute(tf.data.Dataset.range(8), get_strategy("one_device"), 4,
                        steps_per_epoch=3)


def test_sharding_by_files_needs_a_file_per_worker(tfrecords, capsys):
    files = data.from_files(tfrecords[:1])
    with pytest.raises(ValueError, match=r"`sharding` 'files' gives each of the 2 workers its "
                                         r"own files, but there are 1"):
        streaming._choose_sharding("files", files, 2)
    with pytest.raises(ValueError, match=r"`sharding` 'files' needs data from "
                                         r"tfmulti.data.from_files"):
        streaming._choose_sharding("files", lambda: None, 2)
    assert streaming._choose_sharding("auto", files, 2) == "examples"
    assert "1 file for 2 workers: every worker reads all of them" in capsys.readouterr().out
    assert streaming._choose_sharding("auto", data.from_files(tfrecords), 2) == "files"
    assert streaming._choose_sharding("auto", data.from_files(tfrecords), 1) == "examples"


def test_cache_and_shuffle_buffer_follow_the_size():
    assert streaming.element_bytes(tf.TensorSpec((28, 28, 1), tf.float32)) == 3136
    assert streaming.element_bytes(tf.TensorSpec((None, 3), tf.float32)) is None
    assert streaming.element_bytes((tf.TensorSpec((), tf.string),)) is None
    big = tf.TensorSpec((1024, 1024), tf.float32)  # 4 MiB an example
    assert streaming._shuffle_buffer(big, None) == 1000
    assert streaming._shuffle_buffer(tf.TensorSpec((10,), tf.float32), 500) == 500
    assert streaming._shuffle_buffer(tf.TensorSpec((10,), tf.float32), None) == 60000
