"""A user's data error through `recipes/train.py --dataset=module:function`
ends in one `train.py: error:` line and exit 2, before training, with
nothing written: no TensorFlow traceback (tfmulti.data.checks; the
in-process cases are in tests/unit/test_data_checks.py)."""

from __future__ import annotations

import pytest

from tests._util import RECIPES, file_tree, run_python_warm

_MODULE = '''
import numpy as np
import tensorflow as tf

_SPEC = {"x": tf.io.FixedLenFeature([4], tf.float32), "y": tf.io.FixedLenFeature([], tf.int64)}


def _arrays(n, seed=0):
    x = np.random.default_rng(seed).random((n, 4), dtype=np.float32)
    return x, (x.sum(axis=1) > 2).astype(np.int64)


def cut_header():
    """256 records in one TFRecord file cut 5 bytes into the header of record 128."""
    x, y = _arrays(256)
    path = "data.tfrecord"
    with tf.io.TFRecordWriter(path) as writer:
        for xi, yi in zip(x, y):
            writer.write(tf.train.Example(features=tf.train.Features(feature={
                "x": tf.train.Feature(float_list=tf.train.FloatList(value=xi)),
                "y": tf.train.Feature(int64_list=tf.train.Int64List(value=[yi]))}))
                .SerializeToString())
    with open(path, "rb") as f:
        content = f.read()
    with open(path, "wb") as f:
        f.write(content[:len(content) // 2 + 5])
    parse = lambda r: tuple(tf.io.parse_single_example(r, _SPEC).values())
    return tf.data.TFRecordDataset([path]).map(parse), _arrays(64, 1)


def label_10():
    """10 classes, and one label 10."""
    x, y = _arrays(256)
    y[7] = 10
    return {"train": (x, y), "test": _arrays(64, 1), "num_classes": 10}
'''


@pytest.mark.slow
@pytest.mark.parametrize("function, message", [
    ("cut_header", "train.py: error: the dataset function's train data reads a damaged "
                   "TFRecord file: data.tfrecord is damaged at byte offset "),
    ("label_10", "train.py: error: the training split holds label 10, outside the model's 10 "
                 "classes (0 to 9; "),
])
def test_a_data_error_is_one_line_and_exit_2_before_training(tmp_path, function, message):
    """Before: a file cut into a record's header trained on half of it, exit 0;
    label 10 for 10 classes ended in a TensorFlow traceback, exit 1."""
    (tmp_path / "mydata.py").write_text(_MODULE)
    model_dir = tmp_path / "run"
    result = run_python_warm([str(RECIPES / "train.py"), f"--dataset=mydata:{function}",
                         "--distribution=one_device", "--epochs=1", "--global_batch_size=32",
                         f"--model_dir={model_dir}", "--verbose=0"], timeout=240, cwd=tmp_path)
    assert result.returncode == 2, result.stderr[-3000:]
    errors = [line for line in result.stderr.splitlines() if line.startswith("train.py:")]
    assert len(errors) == 1 and errors[0].startswith(message), result.stderr[-3000:]
    assert "Traceback" not in result.stderr and "Epoch" not in result.stdout
    assert not model_dir.exists() or file_tree(model_dir) == {}
