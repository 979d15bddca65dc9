"""The offline text dataset (tfmulti.data.text): the corpus' files and
splits, byte windows, preparation as a TFDS dataset (deterministic, loaded
through tfmulti.data.load and `tfmulti prepare-data`), and the unigram
baseline checked against a hand computation."""

from __future__ import annotations

import json
import math
import os
from pathlib import Path

import numpy as np
import pytest
import tensorflow as tf

from tfmulti import cli, data
from tfmulti.data import text as text_data

LETTERS = "abcdefghijkl"


@pytest.fixture(scope="module")
def corpus(tmp_path_factory) -> Path:
    """12 modules, each of one letter (so a byte tells its file), and files
    the corpus leaves out: a test folder, a file over 200 KB, an empty file,
    a text file and a symlink."""
    root = tmp_path_factory.mktemp("stdlib")
    (root / "pkg").mkdir()
    for i, letter in enumerate(LETTERS):
        path = root / ("pkg" if i % 3 == 0 else ".") / f"{letter}_module.py"
        path.write_bytes(letter.encode() * (300 + 41 * i))
    (root / "test").mkdir()
    (root / "test" / "test_x.py").write_bytes(b"z" * 400)
    (root / "big.py").write_bytes(b"y" * 200_001)
    (root / "empty.py").write_bytes(b"")
    (root / "notes.txt").write_bytes(b"x" * 400)
    os.symlink(root / "pkg" / "a_module.py", root / "link.py")
    return root


def _examples(dataset) -> list[tuple[np.ndarray, np.ndarray]]:
    return [(x, y) for x, y in dataset.as_numpy_iterator()]


def test_corpus_files_split_by_file(corpus):
    files = text_data.corpus_files(str(corpus))
    expected = sorted(f"{'pkg/' if i % 3 == 0 else ''}{letter}_module.py"
                      for i, letter in enumerate(LETTERS))
    assert sorted(files["train"] + files["validation"]) == expected
    assert not set(files["train"]) & set(files["validation"])
    assert files["train"] == sorted(files["train"]) and files["validation"]
    assert files == text_data.corpus_files(str(corpus))  # deterministic
    # The size cap takes whole files, in the order of their paths' hashes.
    capped = text_data.corpus_files(str(corpus), max_bytes=1500)
    sizes = {f"{'pkg/' if i % 3 == 0 else ''}{letter}_module.py": 300 + 41 * i
             for i, letter in enumerate(LETTERS)}
    assert sum(sizes[f] for f in capped["train"] + capped["validation"]) <= 1500
    assert len(capped["train"] + capped["validation"]) >= 2


def test_the_standard_library_corpus():
    files = text_data.corpus_files()
    everything = files["train"] + files["validation"]
    root = Path(text_data.default_source_dir())
    assert len(files["validation"]) >= 1 and len(files["train"]) > 5 * len(files["validation"])
    assert not {"test", "tests", "idle_test", "site-packages"} & {
        part for f in everything for part in Path(f).parts}
    sizes = [(root / f).stat().st_size for f in everything]
    assert 2**20 < sum(sizes) <= text_data.MAX_CORPUS_BYTES and max(sizes) <= 200_000
    assert files == text_data.corpus_files()


def test_byte_windows():
    inputs, targets = text_data.byte_windows(b"0123456789", 4)
    assert inputs.dtype == np.uint8 and inputs.shape == (2, 4)
    assert [bytes(row) for row in inputs] == [b"0123", b"4567"]
    assert [bytes(row) for row in targets] == [b"1234", b"5678"]
    assert text_data.byte_windows(b"0123", 4)[0].shape == (0, 4)  # no complete window
    texts = tf.data.Dataset.from_tensor_slices({"text": [b"0123456789", b"abcde"]})
    windows = [(bytes(x.astype(np.uint8)), bytes(y.astype(np.uint8)), x.dtype)
               for x, y in text_data.text_windows(texts, 4).as_numpy_iterator()]
    assert windows == [(b"0123", b"1234", np.int32), (b"4567", b"5678", np.int32),
                       (b"abcd", b"bcde", np.int32)]


def test_prepared_dataset_is_deterministic_and_split_by_file(corpus, tmp_path):
    first = text_data.prepare(str(tmp_path / "one"), str(corpus), sequence_length=64)
    assert first == str(tmp_path / "one" / "tfmulti_text" / "seq64" / "1.0.0")
    text_data.prepare(str(tmp_path / "two"), str(corpus), sequence_length=64)
    files = text_data.corpus_files(str(corpus))
    letters = {split: {Path(f).name[0] for f in files[split]} for split in files}
    for split in ("train", "validation"):
        one = _examples(data.load("tfmulti_text/seq64", split, data_dir=str(tmp_path / "one")))
        two = _examples(text_data.load("tfmulti_text", split, str(tmp_path / "two"),
                                       sequence_length=64))
        assert len(one) == len(two) > 0
        for (x1, y1), (x2, y2) in zip(one, two):
            np.testing.assert_array_equal(x1, x2)
            np.testing.assert_array_equal(y1, y2)
        for x, y in one:
            assert x.shape == y.shape == (64,) and x.dtype == y.dtype == np.int32
            np.testing.assert_array_equal(x[1:], y[:-1])  # targets: inputs shifted by one
        seen = {chr(b) for x, y in one for b in np.concatenate([x, y])}
        assert seen <= letters[split]  # only bytes of the split's own files
    # Every byte of the split's stream after the first is a target once.
    stream = b"".join((corpus / f).read_bytes() for f in files["train"])
    train = _examples(data.load("tfmulti_text/seq64", "train", data_dir=str(tmp_path / "one")))
    assert len(train) == (len(stream) - 1) // 64


def test_load_prepares_on_first_use_and_cli(corpus, tmp_path, capsys):
    dataset = data.load("tfmulti_text", "validation", data_dir=str(tmp_path / "fresh"),
                        source_dir=str(corpus))
    assert dataset.element_spec == (tf.TensorSpec((256,), tf.int32),
                                    tf.TensorSpec((256,), tf.int32))
    assert (tmp_path / "fresh" / "tfmulti_text" / "seq256" / "1.0.0").is_dir()
    assert cli.main(["prepare-data", "--dataset=tfmulti_text", f"--source_dir={corpus}",
                     f"--data_dir={tmp_path / 'cli'}"]) == 0
    folder = tmp_path / "cli" / "tfmulti_text" / "seq256" / "1.0.0"
    assert f"tfmulti_text is ready in {folder}" in capsys.readouterr().out
    assert (folder / "dataset_info.json").is_file()


def test_unigram_cross_entropy_by_hand():
    # Train bytes a, a, a, b; validation a, b. Without smoothing p = (3/4, 1/4).
    ce = text_data.unigram_cross_entropy([3, 1], [1, 1], smoothing=0)
    assert ce == pytest.approx(-(math.log(0.75) + math.log(0.25)) / 2) == pytest.approx(0.836988)
    # Add-one over the 2 values counted: p = (4/6, 2/6).
    assert text_data.unigram_cross_entropy([3, 1], [1, 1]) == pytest.approx(0.752039, abs=1e-6)
    with pytest.raises(ValueError, match=r"a validation byte never occurs in training"):
        text_data.unigram_cross_entropy([3, 0], [1, 1], smoothing=0)
    with pytest.raises(ValueError, match=r"vectors of one length"):
        text_data.unigram_cross_entropy([1, 2, 3], [1, 1])
    with pytest.raises(ValueError, match=r"validation counts are all 0"):
        text_data.unigram_cross_entropy([1, 2], [0, 0])


def _known_corpus(tmp_path) -> Path:
    """A source folder of two files, one a split: train "a"*96 + "b"*33 (129
    bytes, 2 windows of 64: targets 95 a, 33 b), validation "a"*33 + "b"*32 (65
    bytes, 1 window: targets 32 a, 32 b)."""
    source = tmp_path / "src"
    source.mkdir()
    for name in ("one.py", "two.py"):
        (source / name).write_bytes(b"#")
    files = text_data.corpus_files(str(source))
    (source / files["train"][0]).write_bytes(b"a" * 96 + b"b" * 33)
    (source / files["validation"][0]).write_bytes(b"a" * 33 + b"b" * 32)
    return source


def test_unigram_baseline_on_a_known_corpus(tmp_path):
    # Add-one over 256 byte values: p(a) = 96 / 384, p(b) = 34 / 384; the
    # validation bytes are half a, half b.
    source = _known_corpus(tmp_path)
    baseline = text_data.unigram_baseline(str(tmp_path / "tfds"), sequence_length=64,
                                          source_dir=str(source))
    assert baseline == pytest.approx(-(math.log(96 / 384) + math.log(34 / 384)) / 2)
    assert baseline == pytest.approx(1.905288, abs=1e-6)
    # The counts are kept in the prepared folder and read from there next time:
    # other counts stored there (train all "a", validation half "a") give their figure.
    folder = text_data.prepare(str(tmp_path / "tfds"), str(source), 64)
    kept = os.path.join(folder, text_data.BYTE_COUNTS_FILE)
    with open(kept) as f:
        stored = json.load(f)
    assert (stored["train"][ord("a")], stored["train"][ord("b")], sum(stored["train"])) == (
        95, 33, 128)
    assert (stored["validation"][ord("a")], stored["validation"][ord("b")]) == (32, 32)
    stored["train"] = [0] * 256
    stored["train"][ord("a")] = 128
    with open(kept, "w") as f:
        json.dump(stored, f)
    again = text_data.unigram_baseline(str(tmp_path / "tfds"), sequence_length=64,
                                       source_dir=str(source))
    assert again == pytest.approx(-(math.log(129 / 384) + math.log(1 / 384)) / 2)
    # Counts that are not 256 per split are counted anew (and kept again).
    with open(kept, "w") as f:
        f.write('{"train": [1, 2]}')
    assert text_data.unigram_baseline(str(tmp_path / "tfds"), sequence_length=64,
                                      source_dir=str(source)) == pytest.approx(baseline)
    with open(kept) as f:
        assert json.load(f)["train"][ord("a")] == 95


def test_unigram_baseline_counts_anew_where_the_data_dir_is_read_only(tmp_path, monkeypatch):
    source = _known_corpus(tmp_path)

    def refused(path, payload, **kwargs):
        raise PermissionError(13, "Permission denied", path)

    monkeypatch.setattr(text_data.atomic, "write_json_atomic", refused)
    baseline = text_data.unigram_baseline(str(tmp_path / "tfds"), sequence_length=64,
                                          source_dir=str(source))
    assert baseline == pytest.approx(1.905288, abs=1e-6)
    folder = text_data.prepare(str(tmp_path / "tfds"), str(source), 64)
    assert not os.path.exists(os.path.join(folder, text_data.BYTE_COUNTS_FILE))


def test_unigram_baseline_keeps_no_counts_for_a_bucket(tmp_path, monkeypatch):
    """A data dir that is a URL (gs://...) is counted each time: tfmulti writes
    no file there, and never a local folder named after it (`./gs:/...`)."""
    source = _known_corpus(tmp_path)
    local = str(tmp_path / "tfds")
    text_data.prepare(local, str(source), 64)  # the data, read locally below
    read = text_data.load
    monkeypatch.setattr(text_data, "prepare",
                        lambda *args, **kwargs: "gs://bucket/tfmulti_text/seq64/1.0.0")
    monkeypatch.setattr(text_data, "load",
                        lambda name, split, data_dir, **kwargs: read(name, split, local, **kwargs))
    cwd = tmp_path / "cwd"
    cwd.mkdir()
    monkeypatch.chdir(cwd)
    baseline = text_data.unigram_baseline("gs://bucket", sequence_length=64,
                                          source_dir=str(source))
    assert baseline == pytest.approx(1.905288, abs=1e-6)
    assert os.listdir(cwd) == []


def test_bad_arguments(corpus, tmp_path):
    with pytest.raises(ValueError, match=r"`sequence_length` \(100\) must be one of \[64, 128"):
        text_data.load("tfmulti_text/seq100", data_dir=str(tmp_path))
    with pytest.raises(ValueError, match=r"unknown configuration 'tfmulti_text/long'"):
        data.load("tfmulti_text/long", data_dir=str(tmp_path))
    with pytest.raises(FileNotFoundError, match=r"source folder '.*nowhere' does not exist"):
        text_data.corpus_files(str(tmp_path / "nowhere"))
    (tmp_path / "one").mkdir()
    (tmp_path / "one" / "only.py").write_bytes(b"x = 1\n")
    with pytest.raises(ValueError, match=r"holds 1 usable .py file \(.*need at least 2"):
        text_data.prepare(str(tmp_path / "tfds"), str(tmp_path / "one"))
    assert not (tmp_path / "tfds" / "tfmulti_text" / "seq256" / "1.0.0").exists()
