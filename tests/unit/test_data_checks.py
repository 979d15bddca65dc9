"""A run's data checked before the first epoch (tfmulti.data.tfrecord,
tfmulti.data.checks, the in-memory checks of tfmulti.data.sources): damaged
TFRecord files named with the byte offset, NaN/inf and text values refused,
labels outside the model's classes and splits of unlike shapes refused in one
line before anything trains."""

from __future__ import annotations

import os

import keras
import numpy as np
import pandas as pd
import pytest
import tensorflow as tf

from tests import own_model
from tfmulti import data
from tfmulti.config.train_config import TrainConfig
from tfmulti.data import checks, sources, tfrecord
from tfmulti.data.from_config import RunData, load_data


def _cut(path: str, keep_records: int, extra: int) -> str:
    """Cuts `path` `extra` bytes after its first `keep_records` records (into
    the next record's header when `extra` < 12); returns the byte offset of
    the cut record."""
    with open(path, "rb") as f:
        content = f.read()
    offset = 0
    for _ in range(keep_records):
        (length,) = np.frombuffer(content[offset:offset + 8], "<u8")
        offset += 12 + int(length) + 4
    with open(path, "wb") as f:
        f.write(content[:offset + extra])
    return offset


@pytest.fixture
def records(tmp_path):
    """2 TFRecord files of 32 examples each."""
    return own_model.write_tfrecords(tmp_path, num_files=2, per_file=32)


# ----------------------------------------------------------------------------- framing


def test_an_intact_file_scans_whole(records):
    found = tfrecord.scan(records[0])
    assert found.ok and found.records == 32 and found.offset is None


@pytest.mark.parametrize("extra, damage", [
    (5, "the file ends inside the header of record 20 (5 of its 12 bytes are there)"),
    (40, "the file ends inside record 20 (a record of "),
])
def test_a_cut_file_is_found_at_its_offset(records, extra, damage):
    offset = _cut(records[1], 20, extra)
    found = tfrecord.scan(records[1])
    assert not found.ok and found.records == 20 and found.offset == offset
    assert found.damage.startswith(damage)
    assert found.describe().startswith(f"{records[1]} is damaged at byte offset {offset}: ")


def test_a_file_that_is_not_tfrecord_fails_the_header_checksum(tmp_path):
    path = tmp_path / "notes.csv"
    path.write_text("a,b,c\n1,2,3\n4,5,6\n")
    found = tfrecord.scan(str(path))
    assert (found.records, found.offset) == (0, 0)
    assert "the header of record 0 fails its checksum" in found.damage


@pytest.mark.parametrize("compression", ["GZIP", "ZLIB"])
def test_a_cut_compressed_file_is_found(tmp_path, compression):
    path = str(tmp_path / "part.tfrecord")
    with tf.io.TFRecordWriter(path, options=compression) as writer:
        for i in range(400):
            writer.write(np.random.default_rng(i).bytes(100))
    assert tfrecord.scan(path, compression).records == 400
    with open(path, "rb") as f:
        content = f.read()
    with open(path, "wb") as f:
        f.write(content[:len(content) // 2])
    found = tfrecord.scan(path, compression)
    assert not found.ok and f"the {compression} stream ends early" in found.damage


@pytest.mark.parametrize("length", [0, 5, 1000, 70000])
def test_the_checksum_is_tensorflows(tmp_path, length):
    """The header TensorFlow writes: the length and the masked CRC32C of its 8 bytes."""
    path = str(tmp_path / "one.tfrecord")
    with tf.io.TFRecordWriter(path) as writer:
        writer.write(b"x" * length)
    with open(path, "rb") as f:
        header = f.read(12)
    assert tfrecord.masked_crc32c(header[:8]) == int.from_bytes(header[8:], "little")


# ----------------------------------------------------------------------------- from_files


@pytest.mark.parametrize("extra", [5, 40])
def test_from_files_refuses_a_cut_file_naming_it_and_the_offset(records, extra):
    """Before: a cut in a record's header trained on the records before it,
    silently; a cut inside a record ended in a DataLossError mid-epoch."""
    offset = _cut(records[1], 20, extra)
    source = data.from_files(records, own_model.parse)
    with pytest.raises(ValueError, match=rf"^{records[1]} is damaged at byte offset {offset}: "
                                         r".*the 20 records before it are whole; .*"
                                         r"damaged='skip'"):
        source.count(progress=None)
    with pytest.raises(ValueError, match="is damaged at byte offset"):
        source.dataset()


def test_damaged_skip_reads_the_whole_records_and_says_so(records, capsys):
    _cut(records[1], 20, 40)
    source = data.from_files(records, own_model.parse_with_id, damaged="skip")
    assert source.count(progress=None) == 52
    ids = sorted(int(x["id"]) for x, _ in source.dataset())
    assert ids == list(range(52))  # file 0's 32, then file 1's first 20
    out = capsys.readouterr().out
    assert out.count("reading only the whole records of a damaged file") == 1
    assert f"{records[1]} is damaged at byte offset" in out


def test_distribute_refuses_a_damaged_file_before_training(records):
    from tfmulti.runtime.strategy import get_strategy

    _cut(records[0], 3, 5)
    source = data.from_files(records, own_model.parse)
    with pytest.raises(ValueError, match="is damaged at byte offset"):
        data.distribute(source, get_strategy("one_device"), 8, steps_per_epoch=2)


def test_from_files_checks_its_damaged_argument(records):
    with pytest.raises(ValueError, match=r"`damaged` must be one of \['error', 'skip'\], "
                                         r"got 'ignore'"):
        data.from_files(records, damaged="ignore")


def test_text_files_are_not_checked_as_tfrecord(tmp_path):
    path = tmp_path / "lines.txt"
    path.write_text("one\ntwo\n")
    source = data.from_files([str(path)], reader="text")
    assert source.check() == () and source.count(progress=None) == 2


# ----------------------------------------------------------------------------- the user's pipelines


def test_the_tfrecord_files_of_a_users_pipeline_are_found(records, tmp_path):
    gz = str(tmp_path / "part.gz.tfrecord")
    with tf.io.TFRecordWriter(gz, options="GZIP") as writer:
        writer.write(b"x")
    names = tf.data.Dataset.from_tensor_slices(records)
    cases = {
        "direct": tf.data.TFRecordDataset(records).map(own_model.parse).batch(4),
        "interleave": names.interleave(tf.data.TFRecordDataset, num_parallel_calls=2),
        "flat_map": names.flat_map(tf.data.TFRecordDataset),
        "list_files": tf.data.Dataset.list_files(str(tmp_path / "part-*.tfrecord"))
        .interleave(tf.data.TFRecordDataset),
    }
    for name, dataset in cases.items():
        assert sorted(checks.tfrecord_files(dataset)) == [(r, "") for r in records], name
    gzipped = tf.data.Dataset.from_tensor_slices([gz]).interleave(
        lambda f: tf.data.TFRecordDataset(f, "GZIP"))
    assert checks.tfrecord_files(gzipped) == [(gz, "GZIP")]
    assert checks.tfrecord_files(tf.data.TFRecordDataset([gz], "GZIP")) == [(gz, "GZIP")]
    assert checks.tfrecord_files(tf.data.Dataset.range(3)) == []


@pytest.mark.parametrize("extra", [5, 40])
def test_a_dataset_function_reading_a_cut_file_is_refused(records, extra):
    """Before: a DataLossError traceback mid-epoch (a cut inside a record), or
    training on part of the data, silently (a cut inside a header)."""
    offset = _cut(records[1], 20, extra)

    def dataset():
        return tf.data.TFRecordDataset(records).map(own_model.parse), None

    with pytest.raises(ValueError, match=rf"^the dataset function's train data reads a "
                                         rf"damaged TFRecord file: {records[1]} is damaged at "
                                         rf"byte offset {offset}: "):
        load_data(TrainConfig(dataset=dataset))


def test_reading_errors_in_the_first_examples_name_the_split(records):
    def dataset():
        bad = tf.data.TFRecordDataset(records).map(
            lambda r: tf.io.parse_single_example(r, {"nope": tf.io.FixedLenFeature([], tf.int64)}))
        return (bad.map(lambda e: (e["nope"], e["nope"])), None)

    with pytest.raises(ValueError, match=r"^reading the first examples of the training split "
                                         r"failed: .*nope"):
        load_data(TrainConfig(dataset=dataset))


# ----------------------------------------------------------------------------- arrays


def test_non_finite_features_are_refused_naming_the_columns_and_counts():
    """Before: NaN in one column trained into a constant predictor, exit 0."""
    x, y = np.random.default_rng(0).random((100, 6)), np.arange(100) % 2
    x[::10, 2], x[7, 4] = np.nan, np.inf
    with pytest.raises(ValueError, match=r"^features: 11 NaN or infinite values in columns "
                                         r"2 \(10\), 4 \(1\), in 11 of 100 examples; fill or "
                                         r"drop them"):
        sources.as_dataset((x, y))


def test_non_finite_labels_and_dict_features_are_refused():
    x = {"pixels": np.zeros((8, 3), np.float32), "extra": np.zeros((8, 2, 2))}
    x["extra"][5, 1, 0] = np.nan
    with pytest.raises(ValueError, match=r"^features\['extra'\]: 1 NaN or infinite value "
                                         r"in feature index \(1, 0\) \(1\), in 1 of 8 examples"):
        sources.as_dataset((x, np.zeros(8)))
    y = np.linspace(0, 1, 8)
    y[3] = np.nan
    with pytest.raises(ValueError, match=r"^labels: 1 NaN or infinite value at rows \[3\]"):
        sources.as_dataset((np.zeros((8, 2)), y))


def test_a_dataset_function_with_nan_labels_is_refused_before_training():
    """Before: NaN regression labels trained into NaN weights, exit 0."""
    def dataset():
        x = np.random.default_rng(0).random((64, 4))
        y = x.sum(axis=1)
        y[10] = np.nan
        return (x, y), None

    with pytest.raises(ValueError, match=r"^the dataset function's train data: labels: 1 NaN "
                                         r"or infinite value at rows \[10\]"):
        load_data(TrainConfig(dataset=dataset))


def test_text_labels_and_text_columns_are_refused():
    with pytest.raises(ValueError, match=r"^labels are text or objects \(e.g. 'cat'\); Keras "
                                         r"losses need numbers"):
        sources.as_dataset((np.zeros((2, 2)), np.array(["cat", "dog"])))
    frame = pd.DataFrame({"a": [1.0, 2.0], "city": ["Oslo", "Lima"], "y": [0, 1]})
    with pytest.raises(ValueError, match=r"^features has columns of text or mixed types "
                                         r"\['city'\]"):
        sources.as_dataset(frame, label="y")


# ----------------------------------------------------------------------------- splits and model


def _arrays(n, features=4, high=2, seed=0):
    rng = np.random.default_rng(seed)
    return rng.random((n, features), dtype=np.float32), rng.integers(0, high, n)


def test_splits_of_unlike_shapes_are_refused():
    """Before: found only after every epoch had trained, and the model discarded."""
    train, test = (sources.as_dataset(_arrays(32)), sources.as_dataset(_arrays(8, features=5)))
    with pytest.raises(ValueError, match=r"^the test split's features have shape \(5,\) per "
                                         r"example, the training split's \(4,\)"):
        checks.check_splits(train, test)
    dicts = sources.as_dataset(({"a": np.zeros((8, 2))}, np.zeros(8)))
    other = sources.as_dataset(({"b": np.zeros((8, 2))}, np.zeros(8)))
    with pytest.raises(ValueError, match=r"^the test split's examples hold \[\"features\['b'\]\","):
        checks.check_splits(dicts, other)
    assert set(checks.check_splits(train, sources.as_dataset(_arrays(8)))) == {"training", "test"}


def test_splits_of_variable_length_are_not_compared():
    ragged = tf.data.Dataset.range(1, 6).map(lambda n: (tf.zeros([n]), n))
    assert checks.check_splits(ragged, ragged.map(lambda x, n: (tf.zeros([7]), n)))


def test_text_labels_of_a_dataset_are_refused():
    ds = tf.data.Dataset.from_tensor_slices((np.zeros((4, 2)), ["a", "b", "a", "b"]))
    with pytest.raises(ValueError, match=r"^the training split's labels are text \(e.g. 'a'\)"):
        checks.check_splits(ds)


def _compiled(units, loss="sparse_categorical_crossentropy"):
    model = keras.Sequential([keras.Input((4,)), keras.layers.Dense(units)])
    model.compile(loss=loss)
    return model


@pytest.mark.parametrize("split, label, match", [
    ("training", 10, r"^the training split holds label 10, outside the model's 10 classes \(0 to "
                     r"9; its first 32 examples' labels run from 0 to 10\); fix the labels, or "
                     r"give the model 11 outputs"),
    ("test", -1, r"^the test split holds label -1, outside the model's 10 classes \(0 to 9; .*"
                 r"class ids start at 0"),
])
def test_labels_outside_the_models_classes_are_refused(split, label, match):
    """Before: a TensorFlow traceback in the first step, exit 1."""
    (x, y), (tx, ty) = _arrays(32, high=10), _arrays(8, high=10, seed=1)
    (y if split == "training" else ty)[5] = label
    run_data = RunData(sources.as_dataset((x, y)), sources.as_dataset((tx, ty)), (4,),
                       "classification", 10)
    with pytest.raises(ValueError, match=match):
        checks.check_model_fits(run_data, _compiled(10))


def test_labels_are_checked_against_the_models_outputs_not_the_data():
    x, y = _arrays(32, high=3)
    run_data = RunData(sources.as_dataset((x, y)), None, (4,), "classification", 10)
    with pytest.raises(ValueError, match=r"outside the model's 2 classes"):
        checks.check_model_fits(run_data, _compiled(2))
    checks.check_model_fits(run_data, _compiled(3))
    # The user's own loss decides what labels mean: not checked.
    checks.check_model_fits(run_data, _compiled(2, loss=own_model.smooth_loss))
    checks.check_model_fits(RunData(run_data.train, None, (4,), "regression"),
                            _compiled(2, loss="mse"))


def test_text_features_for_a_model_of_numbers_are_refused():
    x, y = _arrays(8)
    ds = tf.data.Dataset.from_tensor_slices((x.astype(str), y))
    run_data = RunData(ds, None, (4,), "classification", 2)
    with pytest.raises(ValueError, match=r"^the training split's features are text \(e.g. "
                                         r"'0\.\d+'\), but the model's inputs take numbers"):
        checks.check_model_fits(run_data, _compiled(2))


def test_build_run_refuses_labels_beyond_the_models_classes_before_training():
    from tfmulti.training.run import build_run

    def dataset():
        x, y = _arrays(64, high=10)
        y[7] = 10
        return {"train": (x, y), "test": _arrays(16, high=10), "num_classes": 10}

    with pytest.raises(ValueError, match=r"^the training split holds label 10, outside the "
                                         r"model's 10 classes"):
        build_run(TrainConfig(dataset=dataset, distribution="one_device", global_batch_size=16,
                              epochs=1))


def _own_model(units):
    inputs = {name: keras.Input((width,), name=name) for name, width in own_model.FEATURES.items()}
    model = keras.Model(inputs, keras.layers.Dense(units)(
        keras.layers.Concatenate()(list(inputs.values()))))
    model.compile(loss="sparse_categorical_crossentropy")
    return model


def test_tfrecord_files_are_sampled_against_the_model(records):
    source = data.from_files(records, own_model.parse)
    run_data = RunData(source, None, None, "classification", None)
    checks.check_model_fits(run_data, _own_model(2))
    with pytest.raises(ValueError, match=r"^the training split holds label 1, outside the "
                                         r"model's 1 classes"):
        checks.check_model_fits(RunData(source, None, None, "classification", None),
                                _own_model(1))


def test_a_users_reader_is_left_alone_by_the_checks(records):
    """A reader of the user's may do anything (the own benchmark counts its
    openings): the checks read no file through it."""
    opened = []

    def log(name):
        opened.append(name.numpy())
        return name

    def reader(name):
        return tf.data.TFRecordDataset(tf.py_function(log, [name], tf.string))

    source = data.from_files(records, own_model.parse, reader=reader)
    run_data = RunData(source, sources.as_dataset(own_model.arrays(8)), None,
                       "classification", None)
    checks.check_model_fits(run_data, _own_model(2))
    assert opened == [] and set(run_data.samples) == {"test"}


def test_a_file_that_cannot_be_read_is_named(records):
    source = data.from_files(records, own_model.parse)
    os.remove(records[1])
    with pytest.raises(OSError, match=rf"^cannot read {records[1]} \(No such file or "
                                      r"directory\); check its permissions"):
        source.count(progress=None)


def test_an_empty_test_split_and_complex_features_are_refused():
    with pytest.raises(ValueError, match=r"^the test split has no examples; give it some, or "
                                         r"return no test split \(None\)"):
        checks.check_splits(sources.as_dataset(_arrays(8)),
                            sources.as_dataset((np.zeros((0, 4)), np.zeros(0))))
    with pytest.raises(ValueError, match=r"^features holds complex numbers"):
        sources.as_dataset((np.zeros((4, 2), np.complex64), np.zeros(4)))


@pytest.mark.parametrize("labels, match", [
    (lambda y: y + 0.5, r"^the training split holds label \d.5, not a class id \(a whole number "
                        r"from 0 to 9\)"),
    (lambda y: np.stack([y, y], axis=1), r"^the training split's labels have shape \(2,\) per "
                                         r"example, but the sparse categorical cross-entropy "
                                         r"takes one class id per output row"),
])
def test_labels_that_are_not_class_ids_are_refused(labels, match):
    x, y = _arrays(32, high=10)
    run_data = RunData(sources.as_dataset((x, labels(y))), None, (4,), "classification", 10)
    with pytest.raises(ValueError, match=match):
        checks.check_model_fits(run_data, _compiled(10))


def test_a_record_changed_inside_is_named_when_tensorflow_finds_it(records):
    """A flipped bit inside a record's payload passes the framing checks;
    TensorFlow's DataLossError names the offset only: data_loss_error names
    the file."""
    offset = _cut(records[1], 5, 10 ** 6)  # cuts nothing: the offset of record 5
    with open(records[1], "r+b") as f:
        f.seek(offset + 20)
        byte = f.read(1)
        f.seek(offset + 20)
        f.write(bytes([byte[0] ^ 1]))
    source = data.from_files(records, own_model.parse)
    assert source.count(progress=None) == 64  # the framing is whole
    with pytest.raises(tf.errors.DataLossError) as raised:
        for _ in tf.data.TFRecordDataset(records[1]):
            pass
    error = checks.data_loss_error(raised.value, source, None)
    assert str(error).startswith(f"{records[1]} is damaged at byte offset {offset + 12}: the "
                                 "record's ") and "fail their checksum" in str(error)
    unknown = checks.data_loss_error(raised.value, sources.as_dataset(_arrays(4)))
    assert str(unknown).startswith("a data file is damaged: ") and "\n" not in str(unknown)


def test_train_names_a_record_changed_inside_in_one_error(tmp_path):
    """A flipped bit past the examples the checks read, through `tfmulti.train`:
    the DataLossError that ends training becomes a ValueError naming the file
    (a recipe's one line)."""
    import tfmulti

    (path,) = own_model.write_tfrecords(tmp_path, num_files=1, per_file=2 * checks.SAMPLE)
    offset = _cut(path, checks.SAMPLE + 10, 10 ** 6)
    with open(path, "r+b") as f:
        f.seek(offset + 20)
        byte = f.read(1)
        f.seek(offset + 20)
        f.write(bytes([byte[0] ^ 1]))

    def dataset():
        return data.from_files([path], own_model.parse), own_model.arrays(16)

    config = TrainConfig(dataset=dataset, model=lambda input_shape: own_model.build(input_shape),
                         distribution="one_device", global_batch_size=64, epochs=1)
    with pytest.raises(ValueError, match=rf"^{path} is damaged at byte offset {offset + 12}: "):
        tfmulti.train(config)


def test_evaluating_a_test_split_of_files_gives_no_false_warning(records):
    """Keras warns that the input "ran out of data" at the end of any
    evaluation of unknown length; for a test split of files that is its end."""
    import warnings

    import tfmulti

    def dataset():
        return {"train": data.from_files(records, own_model.parse),
                "test": data.from_files(records, own_model.parse)}

    config = TrainConfig(dataset=dataset, model=lambda input_shape: own_model.build(input_shape),
                         distribution="one_device", global_batch_size=16, epochs=1)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        metrics = tfmulti.train(config)
    assert "test_loss" in metrics
    assert not [w for w in caught if "ran out of data" in str(w.message)]
