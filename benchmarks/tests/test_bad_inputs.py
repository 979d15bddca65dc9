"""The bad-input campaign (benchmarks.bad_inputs, recipes/bad_inputs.py): its
inputs cover every entry point and category, its checker catches what it must
(in-process), and a few inputs refused before TensorFlow starts run through
the real runner (slow). The whole campaign is not part of the tests;
BENCHMARKS.md records it (Reliability)."""

from __future__ import annotations

import collections
import dataclasses
import json
import os
import stat
import sys

import pytest

from benchmarks import bad_inputs
from tfmulti.cluster import exit_codes

BAD = [c for c in bad_inputs.CASES if c.category != "control"]
_REFUSED = "train.py: error: --seed must be an integer from 0 to 4294967295 (or None), got -5."


def _case(**changes) -> bad_inputs.Case:
    return dataclasses.replace(bad_inputs.CASES[0], **changes)


# ----------------------------------------------------------------------------- inputs

def test_over_100_inputs_over_every_category_and_entry_point():
    assert len(BAD) >= 100
    names = [c.name for c in bad_inputs.CASES]
    assert len(set(names)) == len(names)
    counts = collections.Counter(c.category for c in bad_inputs.CASES)
    assert set(counts) == set(bad_inputs.CATEGORIES)
    assert all(counts[c] >= 5 for c in bad_inputs.CATEGORIES if c != "control"), counts
    entry = collections.Counter(
        "train" if c.argv[0] == bad_inputs.TRAIN_RECIPE else c.argv[2] for c in BAD)
    assert {"train", "launch", "diagnose", "estimate-memory", "export", "env"} <= set(entry)
    assert [c.status for c in bad_inputs.CASES if c.category == "control"] == [0, 0]
    assert all(c.status == exit_codes.USAGE for c in BAD)
    assert {f for c in bad_inputs.CASES for f in c.fixtures} <= set(bad_inputs.FIXTURES)
    assert any(c.unprivileged for c in BAD) and any(not c.early for c in BAD)


def test_the_train_inputs_are_a_tiny_run_but_for_the_flag_they_break():
    seed = next(c for c in BAD if c.name == "train seed negative")
    assert seed.argv == (bad_inputs.TRAIN_RECIPE, "--dataset=synthetic", "--num_examples=256",
                         "--epochs=1", "--global_batch_size=64", "--model_dir=model",
                         "--verbose=2", "--seed=-5")
    assert seed.describe().startswith("recipes/train.py --dataset=synthetic ")
    own = next(c for c in BAD if c.name == "NaN in a feature column")
    assert "--num_examples=256" not in own.argv  # synthetic data only
    assert own.argv[-1] == "--dataset=userdata:nan_features"
    launch = next(c for c in BAD if c.name == "launch num_workers 0")
    assert launch.describe().startswith("tfmulti launch --num_workers=0 -- python -c ")


def test_select():
    early_hosts = bad_inputs.select(categories=("hosts",), early_only=True)
    assert early_hosts and all(c.category == "hosts" and c.early for c in early_hosts)
    assert [c.name for c in bad_inputs.select(names=("no secret",))] == ["no secret"]
    with pytest.raises(ValueError, match=r"`categories` must be one of \["):
        bad_inputs.select(categories=("flag",))
    with pytest.raises(ValueError, match=r"`names` \['nope'\] are not inputs"):
        bad_inputs.select(names=("nope",))


def test_fixtures_make_their_files(tmp_path):
    for name, make in bad_inputs.FIXTURES.items():
        folder = tmp_path / name
        folder.mkdir()
        make(str(folder))
        assert any(folder.iterdir()), name
    records = tmp_path / "records"
    assert stat.S_IMODE((records / "locked.tfrecord").stat().st_mode) == 0
    assert stat.S_IMODE((tmp_path / "secret_world_readable" / "secret.txt").stat().st_mode) \
        == 0o644
    good = (records / "good.tfrecord").stat().st_size
    assert (records / "cut_record.tfrecord").stat().st_size < good
    assert (records / "cut_header.tfrecord").stat().st_size == good + 6


def test_tfrecord_framing_is_tensorflows(tmp_path):
    import tensorflow as tf

    bad_inputs.FIXTURES["records"](str(tmp_path))
    read = [r.numpy() for r in tf.data.TFRecordDataset(str(tmp_path / "good.tfrecord"))]
    assert len(read) == 128 and {len(r) for r in read} == {20}  # 5 float32 each
    # The CRCs are TensorFlow's: its checked reader takes every record.
    from tensorflow.python.lib.io import tf_record

    assert sum(1 for _ in tf_record.tf_record_iterator(str(tmp_path / "good.tfrecord"))) == 128
    with pytest.raises(tf.errors.DataLossError):
        list(tf.data.TFRecordDataset(str(tmp_path / "cut_record.tfrecord")))


def test_the_user_module_is_valid_python():
    compile(bad_inputs.USER_MODULE, "userdata.py", "exec")


# ----------------------------------------------------------------------------- checks

@pytest.mark.parametrize("stderr, expected", [
    (_REFUSED + "\n", [_REFUSED]),
    ("WARNING: All log messages before absl::InitializeLog() is called are written to "
     "STDERR\nI0000 00:00:1796294243.440659    1824 port.cc:153] oneDNN custom operations "
     "are on.\nE0000 00:00:1796294249.827134    1824 cuda_platform.cc:52] failed call to "
     "cuInit\n2026-12-03 10:00:00.123456: W tensorflow/core/framework/op.cc:12] old\n\n"
     + _REFUSED + "\n", [_REFUSED]),
    # Python's own warnings and logging count, even in absl's format.
    ("W1203 10:00:00.123456 140 train.py:12] a warning\n" + _REFUSED,
     ["W1203 10:00:00.123456 140 train.py:12] a warning", _REFUSED]),
    ("/x/keras.py:3: UserWarning: careful\n  warnings.warn(\n" + _REFUSED,
     ["/x/keras.py:3: UserWarning: careful", "  warnings.warn(", _REFUSED]),
    ("", []),
])
def test_meaningful_lines_leave_out_only_tensorflows_cpp_log(stderr, expected):
    assert bad_inputs.meaningful_lines(stderr) == expected


@pytest.mark.parametrize("status, stdout, stderr, changes, problems", [
    (2, "", _REFUSED, [], []),
    (None, "", "", [], ["timed out (a hang)"]),
    (1, "", _REFUSED, [], ["exit status 1, not 2"]),
    (0, "trained\n", "", ["added model"],
     ["exit status 0, not 2", "0 lines on stderr, not 1", "wrote: added model"]),
    (2, "", "Traceback (most recent call last):\nValueError: x\n", [],
     ["a traceback", "2 lines on stderr, not 1"]),
    (2, "", "one\nand another\n", [], ["2 lines on stderr, not 1"]),
    (2, "", _REFUSED, [f"added f{i}" for i in range(7)],
     ["wrote: added f0, added f1, added f2, added f3, added f4 and 2 more"]),
    (1, "", f"ImportError: {bad_inputs.NO_TENSORFLOW}", [],
     ["exit status 1, not 2", "TensorFlow was imported before the refusal"]),
])
def test_check(status, stdout, stderr, changes, problems):
    assert bad_inputs.check(_case(), status, stdout, stderr, changes) == problems


def test_check_of_a_control():
    control = _case(status=0)
    assert bad_inputs.check(control, 0, "tfmulti: test_accuracy=0.5\n",
                            "Epoch 1/1\nmany lines\n", ["added model"]) == []
    assert bad_inputs.check(control, 2, "", _REFUSED, []) == ["exit status 2, not 0"]


def test_format_table_counts_by_category():
    records = [{"category": c, "ok": ok} for c, ok in
               [("hosts", True), ("flags", True), ("flags", False), ("control", True)]]
    assert bad_inputs.format_table(records).splitlines() == [
        "category   inputs  refused in one line  failed",
        "flags           2                    1       1",
        "hosts           1                    1       0",
        "control         1                    1       0",
        "total           4                    3       1"]


# ----------------------------------------------------------------------------- running

_SUBSET = ("train seed negative", "index out of range", "model module with an empty part",
           "estimate-memory num_stages huge", "hosts N huge", "secret file readable by others")


@pytest.mark.slow
def test_a_few_inputs_refused_before_tensorflow_through_the_runner(tmp_path, capsys):
    cases = bad_inputs.select(names=_SUBSET)
    assert len(cases) == len(_SUBSET) and all(c.early for c in cases)
    output = tmp_path / "bad_inputs.json"
    result = bad_inputs.run_campaign(str(output), cases=cases, workdir=str(tmp_path / "work"),
                                     command="test")
    printed = capsys.readouterr().out
    assert result["failed"] == 0, result["failures"]
    assert json.loads(output.read_text())["complete"] is True
    assert "total           6                    6       0" in printed
    assert os.listdir(tmp_path / "work") == []  # passed inputs' folders removed


@pytest.mark.slow
def test_the_runner_catches_writes_lines_and_hangs(tmp_path):
    work = tmp_path / "work"
    work.mkdir()
    writes = bad_inputs.Case("flags", "writes and says nothing", (
        "-c", "open('notes.txt', 'w').write('mine'); import sys; sys.exit(2)"), early=False)
    record = bad_inputs.run_case(writes, str(work / "1"), timeout=60)
    assert record["problems"] == ["0 lines on stderr, not 1", "wrote: added notes.txt"]
    hangs = bad_inputs.Case("flags", "hangs", ("-c", "import time; time.sleep(60)"),
                            early=False)
    assert bad_inputs.run_case(hangs, str(work / "2"), timeout=1)["problems"] == \
        ["timed out (a hang)"]
    imports = bad_inputs.Case("flags", "imports tensorflow", (
        "-c", "import tensorflow"), early=True)
    poisoned = bad_inputs.no_tensorflow(str(tmp_path / "no-tensorflow"))
    problems = bad_inputs.run_case(imports, str(work / "3"), 60, poisoned)["problems"]
    assert "TensorFlow was imported before the refusal" in problems
    assert sys.executable in bad_inputs.Case("x", "y", ("-c", "")).command()
