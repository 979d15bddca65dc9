"""The bad-input campaign: malformed input to every entry point of tfmulti,
each of which must be refused in one line, exit code 2, writing nothing.

    python recipes/bad_inputs.py --output=runs/bad_inputs/bad_inputs.json

The entry points: `recipes/train.py` and the `tfmulti` subcommands `launch`,
`diagnose`, `estimate-memory`, `export` and `env`. The inputs (`CASES`, over
100), by category:

    flags      wrong types, out of range, unknown, empty, contradictory
    tf_config  TF_CONFIG: not JSON, not an object, missing keys, an index or
               port out of range, an unknown task type
    hooks      `--model` / `--dataset` / `--loss` strings: malformed, a missing
               module or function, not a function, a function that needs an
               argument tfmulti does not give, raises, or returns the wrong type
    datasets   a user's data function returning data that is empty, cut short
               (fewer labels than examples), NaN or infinite, of the wrong dtype
               or shape, or mislabeled (labels outside the classes)
    files      missing, unreadable (the process runs without the capabilities
               that bypass file permissions), not TFRecord, a TFRecord cut in a
               record or in a header; output folders that are files or read-only
    hosts      `launch --hosts` lists: empty, malformed, ports out of range, a
               rank outside the list
    secrets    a multi-host launch's secret: missing, short, empty, a file
               readable by others, a file that does not exist

Each input runs as a fresh process in a fresh temporary folder (its working
directory; `--model_dir` and `--backup_dir`, where given, point inside it),
2 at a time, each with a timeout (a hang is a failure), and is checked
(`check`):

* the exit code is 2 (`tfmulti.cluster.exit_codes.USAGE`);
* stderr holds exactly one non-empty line once TensorFlow's C++ log lines are
  left out (`NOISE`: the absl line "WARNING: All log messages before
  absl::InitializeLog() is called are written to STDERR", and lines in the
  absl or TensorFlow C++ log formats, `I0000 00:00:... file.cc:12] ...` or
  `2026-12-03 10:00:00.000000: I file.cc:12] ...`, from a `.cc`/`.h` source
  file; every other line counts, Python warnings and logging included);
* neither stdout nor stderr holds "Traceback";
* the folder is unchanged: the same files with the same contents as the
  inputs it was given (`benchmarks.chaos_checks.snapshot`); the process's
  TMPDIR is a folder outside it;
* an input marked `early` (flags, TF_CONFIG, hook strings, paths, host lists,
  secrets: what is checked before TensorFlow starts) runs with a `tensorflow`
  package first on its PYTHONPATH whose import fails (`no_tensorflow`): it
  must be refused without importing TensorFlow.

Two controls, valid inputs built from the same fixtures (a data function and a
TFRecord file), must train and exit 0, so that a bad input is refused for what
is wrong with it, not for the fixture. Prints one line per input and a table
by category; exits 1 when an input failed.

Standard library only in this process (the inputs' TFRecord files are framed
here, with their CRC32C).
"""

from __future__ import annotations

import concurrent.futures
import dataclasses
import os
import re
import shutil
import signal
import struct
import subprocess
import sys
import tempfile
import threading
import time

from benchmarks import _harness, chaos_checks
from tfmulti.cluster import exit_codes
from tfmulti.utils import checks
from tfmulti.utils.atomic import write_json_atomic

__all__ = ["CASES", "CATEGORIES", "EARLY_TIMEOUT", "FIXTURES", "NOISE", "NO_TENSORFLOW", "Case",
           "check", "format_table", "meaningful_lines", "no_tensorflow", "run_campaign",
           "run_case", "select", "tfrecord"]

CATEGORIES = ("flags", "tf_config", "hooks", "datasets", "files", "hosts", "secrets",
              "control")
TRAIN_RECIPE = os.path.join(_harness.REPO_ROOT, "recipes", "train.py")
UNPRIVILEGED = ("setpriv", "--reuid=65534", "--regid=65534", "--clear-groups",
                "--inh-caps=-all", "--bounding-set=-all")
"""Runs a command as `nobody` without any capability (none bypasses file permissions)."""
NOBODY = 65534
EARLY_TIMEOUT = 60.0
"""Seconds an input refused before TensorFlow starts may take (a launch that waits
for other hosts, not refused, is a hang)."""
NOISE = (
    re.compile(r"^WARNING: All log messages before absl::InitializeLog\(\) is called are "
               r"written to STDERR$"),
    re.compile(r"^[IWEF]\d{4} \d\d:\d\d:[\d.]+\s+\d+ [\w./+-]+\.(?:cc|h|cpp):\d+\] "),
    re.compile(r"^\d{4}-\d\d-\d\d \d\d:\d\d:\d\d\.\d+: [IWEF] [\w./+-]+\.(?:cc|h|cpp):\d+\] "),
)
"""TensorFlow's C++ log lines, which stderr may hold besides the one line."""

# The base flags of every recipes/train.py input: a tiny run, should one be accepted.
_TRAIN_BASE = {"dataset": "synthetic", "num_examples": "256", "epochs": "1",
               "global_batch_size": "64", "model_dir": "model", "verbose": "2"}
_DIAGNOSE_BASE = {"dataset": "synthetic", "num_examples": "256", "global_batch_size": "64",
                  "seconds": "0.2", "no_measure": None}
_WORKER = ("--", sys.executable, "-c", "open('STARTED', 'w').close()")
_SECRET = "5f2b" * 16  # 64 hex digits: a good secret, for the files that are bad otherwise


@dataclasses.dataclass(frozen=True)
class Case:
    """One bad input.

    Attributes:
        category: one of `CATEGORIES`.
        name: unique within the campaign.
        argv: the program and its arguments after the Python interpreter.
        env: variables set for the process (on top of this one's, without
            TF_CONFIG and TFMULTI_LAUNCH_SECRET).
        fixtures: the names of `FIXTURES` created in its folder first.
        unprivileged: run as `nobody` without capabilities (`UNPRIVILEGED`), the
            folder owned by `nobody`.
        early: expected to be refused before TensorFlow starts, within seconds (it
            gets at most `EARLY_TIMEOUT` seconds).
        status: the exit status it must end with (0 for the controls).
    """

    category: str
    name: str
    argv: tuple[str, ...]
    env: tuple[tuple[str, str], ...] = ()
    fixtures: tuple[str, ...] = ()
    unprivileged: bool = False
    early: bool = True
    status: int = exit_codes.USAGE

    def command(self) -> list[str]:
        prefix = list(UNPRIVILEGED) if self.unprivileged else []
        return [*prefix, sys.executable, *self.argv]

    def describe(self) -> str:
        """The input as a command line (`tfmulti ...`, `recipes/train.py ...`)."""
        argv = list(self.argv)
        if argv[:2] == ["-m", "tfmulti.cli"]:
            argv[:2] = ["tfmulti"]
        shown = " ".join("recipes/train.py" if a == TRAIN_RECIPE else
                         "python" if a == sys.executable else a for a in argv)
        env = " ".join(f"{k}={v!r}" for k, v in self.env)
        return (env + " " if env else "") + shown


def _merge(base: dict, flags: tuple[str, ...]) -> list[str]:
    """`base` flags not given in `flags`, then `flags` (absl and argparse take the last)."""
    given = {f[2:].split("=", 1)[0] for f in flags if f.startswith("--")}
    if any(f.startswith("--dataset=") and f != "--dataset=synthetic" for f in flags):
        given.add("num_examples")  # for synthetic data only
    return [f"--{k}" if v is None else f"--{k}={v}" for k, v in base.items()
            if k not in given] + list(flags)


def _train(category, name, *flags, **kwargs) -> Case:
    return Case(category, name, (TRAIN_RECIPE, *_merge(_TRAIN_BASE, flags)), **kwargs)


def _cli(category, name, command, *args, **kwargs) -> Case:
    if command == "diagnose":
        args = tuple(_merge(_DIAGNOSE_BASE, args))
    elif command == "launch" and "--" not in args:
        args = (*args, *_WORKER)
    return Case(category, name, ("-m", "tfmulti.cli", command, *args), **kwargs)


# ------------------------------------------------------------------------- fixtures

USER_MODULE = '''"""A user's data and model functions, good and bad (the bad-input campaign)."""
import numpy as np


def _xy(n=64, d=4, classes=3, seed=0):
    rng = np.random.default_rng(seed)
    return rng.random((n, d), dtype=np.float32), rng.integers(0, classes, n)


def _splits(x, y, xt=None, yt=None, num_classes=3):
    test = _xy(seed=1) if xt is None else (xt, yt)
    return {"train": (x, y), "test": test, "num_classes": num_classes}


def good():
    return _splits(*_xy())


def empty():
    x, y = _xy()
    return _splits(x[:0], y[:0])


def empty_test():
    x, y = _xy()
    return _splits(x, y, x[:0], y[:0])


def truncated():
    x, y = _xy()
    return _splits(x, y[:40])


def nan_features():
    x, y = _xy()
    x[5, 2] = np.nan
    return _splits(x, y)


def inf_features():
    x, y = _xy()
    x[7, 1] = np.inf
    return _splits(x, y)


def nan_labels():
    x, _ = _xy()
    y = x.sum(axis=1, keepdims=True)
    y[3] = np.nan
    return {"train": (x, y), "test": (x, y), "task": "regression"}


def text_features():
    x, y = _xy()
    return _splits(np.full(x.shape, "a"), y)


def object_features():
    x, y = _xy()
    return _splits(np.array([None] * len(y), dtype=object), y)


def complex_features():
    x, y = _xy()
    return _splits(x.astype(np.complex64), y)


def text_labels():
    x, y = _xy()
    return _splits(x, y.astype(str))


def labels_out_of_range():
    x, y = _xy()
    y[9] = 7
    return _splits(x, y)


def negative_labels():
    x, y = _xy()
    y[2] = -1
    return _splits(x, y)


def fractional_labels():
    x, y = _xy()
    return _splits(x, y + 0.5)


def test_shaped_unlike_train():
    x, y = _xy()
    xt, yt = _xy(d=5, seed=1)
    return _splits(x, y, xt, yt)


def labels_2d():
    x, y = _xy()
    return _splits(x, np.stack([y, y], axis=1))


def returns_none():
    return None


def returns_text():
    return "train.csv"


def returns_no_train():
    return {"test": _xy(), "num_classes": 3}


def returns_unknown_key():
    return {**good(), "validation": _xy()}


def raises_value_error():
    raise ValueError("the data server refused the query")


def raises_os_error():
    with open("no/such/file.csv") as f:
        return f.read()


def needs_path(path):
    return good()


def _parse(record):
    import tensorflow as tf

    values = tf.io.decode_raw(record, tf.float32)
    return tf.reshape(values[:4], [4]), tf.cast(values[4], tf.int64)


def _files(paths):
    from tfmulti.data import from_files

    return {"train": from_files(paths, _parse), "test": from_files(paths, _parse),
            "num_classes": 3}


def files_good():
    return _files(["good.tfrecord"])


def files_missing():
    return _files(["records/missing.tfrecord"])


def files_no_match():
    from tfmulti.data import from_files

    return {"train": from_files("records/train-*.tfrecord", _parse), "num_classes": 3}


def files_not_tfrecord():
    return _files(["notes.txt"])


def files_cut_in_record():
    return _files(["cut_record.tfrecord"])


def files_cut_in_header():
    return _files(["cut_header.tfrecord"])


def files_unreadable():
    return _files(["locked.tfrecord"])


def files_empty():
    return _files(["empty.tfrecord"])


def model_returns_text(input_shape=None):
    return "a model"


def model_returns_none():
    return None


def model_raises(input_shape=None):
    raise ValueError("width 0 is too small")


def loss_needs_three(y_true, y_pred, weights):
    return y_pred


not_a_function = 3
'''

_IMPORT_FAILS = "raise RuntimeError('this module cannot be imported here')\n"


def _crc32c(data: bytes) -> int:
    crc = 0xFFFFFFFF
    for byte in data:
        crc = _CRC_TABLE[(crc ^ byte) & 0xFF] ^ (crc >> 8)
    return crc ^ 0xFFFFFFFF


_CRC_TABLE = []
for _n in range(256):
    _c = _n
    for _ in range(8):
        _c = (_c >> 1) ^ 0x82F63B78 if _c & 1 else _c >> 1
    _CRC_TABLE.append(_c)


def _masked(data: bytes) -> bytes:
    crc = _crc32c(data)
    return struct.pack("<I", ((((crc >> 15) | (crc << 17)) & 0xFFFFFFFF) + 0xA282EAD8)
                       & 0xFFFFFFFF)


def tfrecord(records: list[bytes]) -> bytes:
    """The bytes of a TFRecord file holding `records` (length, its masked CRC32C,
    the data, its masked CRC32C).

    Example:
        >>> tfrecord([b"abc"]).hex()
        '0300000000000000b099490e6162636e57f121'
    """
    out = b""
    for data in records:
        length = struct.pack("<Q", len(data))
        out += length + _masked(length) + data + _masked(data)
    return out


def _records(n: int = 128) -> list[bytes]:
    """n records of 5 float32 each: 4 features and a label in 0..2."""
    return [struct.pack("<5f", *(((i * 7 + j) % 10) / 10 for j in range(4)), float(i % 3))
            for i in range(n)]


def _write(folder: str, rel: str, content: bytes | str, mode: int | None = None) -> None:
    path = os.path.join(folder, rel)
    os.makedirs(os.path.dirname(path) or folder, exist_ok=True)
    with open(path, "wb") as f:
        f.write(content.encode() if isinstance(content, str) else content)
    if mode is not None:
        os.chmod(path, mode)


def _zip_keras(folder: str, rel: str, mode: int | None = None) -> None:
    import io
    import zipfile

    buffer = io.BytesIO()
    with zipfile.ZipFile(buffer, "w") as archive:
        archive.writestr("config.json", '{"class_name": "Sequential"}')
    _write(folder, rel, buffer.getvalue(), mode)


def _fixture_records(folder: str) -> None:
    good = tfrecord(_records())
    record = len(tfrecord(_records(1)))
    _write(folder, "good.tfrecord", good)
    _write(folder, "cut_record.tfrecord", good[:len(good) - record // 2])
    _write(folder, "cut_header.tfrecord", good + tfrecord(_records(1))[:6])
    _write(folder, "notes.txt", "label,x\n1,0.5\n2,0.25\n")
    _write(folder, "empty.tfrecord", b"")
    _write(folder, "locked.tfrecord", good, mode=0o000)


FIXTURES = {
    "userdata": lambda d: _write(d, "userdata.py", USER_MODULE),
    "broken_module": lambda d: _write(d, "broken.py", _IMPORT_FAILS),
    "records": _fixture_records,
    "model_is_file": lambda d: _write(d, "model", "my notes, not a folder\n"),
    "backup_is_file": lambda d: _write(d, "backup", "my notes, not a folder\n"),
    "read_only_folder": lambda d: (os.makedirs(os.path.join(d, "ro")),
                                   os.chmod(os.path.join(d, "ro"), 0o555)),
    "keras_not_zip": lambda d: _write(d, "run/model.keras", "not a zip archive\n"),
    "keras_zip": lambda d: _zip_keras(d, "run/model.keras"),
    "keras_locked": lambda d: _zip_keras(d, "run/model.keras", mode=0o000),
    "serving_exists": lambda d: _write(d, "serving/saved_model.pb", b"mine"),
    "secret_world_readable": lambda d: _write(d, "secret.txt", _SECRET, mode=0o644),
    "secret_short": lambda d: _write(d, "secret.txt", "abc123", mode=0o600),
    "secret_empty": lambda d: _write(d, "secret.txt", "", mode=0o600),
    "secret_locked": lambda d: _write(d, "secret.txt", _SECRET, mode=0o000),
}
"""Input files an input's folder starts with: name -> function(folder)."""


# ---------------------------------------------------------------------------- inputs

def _flag_cases() -> list[Case]:
    t = lambda name, *flags, **kw: _train("flags", name, *flags, **kw)  # noqa: E731
    c = lambda name, *args, **kw: _cli("flags", name, *args, **kw)  # noqa: E731
    return [
        t("train unknown flag", "--epoch=3"),
        t("train positional argument", "extra"),
        t("train epochs not a number", "--epochs=three"),
        t("train epochs empty", "--epochs="),
        t("train epochs 0", "--epochs=0"),
        t("train epochs negative", "--epochs=-2"),
        t("train epochs fractional", "--epochs=1.5"),
        t("train epochs huge", "--epochs=99999999999999"),
        t("train global_batch_size 0", "--global_batch_size=0"),
        t("train global_batch_size huge", "--global_batch_size=1000000000000"),
        t("train learning_rate nan", "--learning_rate=nan"),
        t("train learning_rate inf", "--learning_rate=inf"),
        t("train learning_rate negative", "--learning_rate=-0.1"),
        t("train learning_rate text", "--learning_rate=fast"),
        t("train dropout 1", "--dropout=1"),
        t("train dropout negative", "--dropout=-0.5"),
        t("train seed negative", "--seed=-5"),
        t("train seed 2**32", "--seed=4294967296"),
        t("train seed text", "--seed=abc"),
        t("train num_virtual_devices huge", "--num_virtual_devices=100000"),
        t("train num_virtual_devices negative", "--num_virtual_devices=-1"),
        t("train num_examples huge", "--num_examples=1000000000"),
        t("train num_examples 0", "--num_examples=0"),
        t("train distribution unknown", "--distribution=tpu"),
        t("train distribution empty", "--distribution="),
        t("train model empty", "--model="),
        t("train model unknown", "--model=resnet"),
        t("train dataset empty", "--dataset="),
        t("train optimizer unknown", "--optimizer=adamm"),
        t("train steps_per_execution 0", "--steps_per_execution=0"),
        t("train steps_per_execution text", "--steps_per_execution=many"),
        t("train steps_per_execution not dividing", "--steps_per_execution=3", early=False),
        t("train verbose 5", "--verbose=5"),
        t("train warmup_epochs negative", "--warmup_epochs=-1"),
        t("train device_memory_mb 0", "--device_memory_mb=0"),
        t("train backup_every_steps without backup_dir", "--backup_every_steps=2"),
        t("train backup_dir empty", "--backup_dir="),
        t("train seed empty", "--seed="),
        t("train num_stages huge", "--distribution=pipeline", "--num_stages=100000"),
        t("train micro-batches not splitting", "--distribution=pipeline",
          "--num_microbatches=3"),
        t("train jit_compile with pipeline", "--distribution=pipeline", "--jit_compile"),
        t("train tensor_parallel with mlp", "--distribution=pipeline", "--tensor_parallel=2"),
        t("train transformer d_model huge", "--model=transformer", "--d_model=1000000"),
        t("train transformer heads not dividing", "--model=transformer", "--num_heads=3"),
        t("train task unlike the model", "--task=regression"),
        t("train metrics unknown", "--metrics=acuracy", early=False),
        t("train mixed_precision float16 without GPU", "--mixed_precision=float16",
          early=False),
        t("train devices unknown", "--devices=CPU:7", early=False),
        c("env unknown flag", "env", "--bogus"),
        c("env num_virtual_devices huge", "env", "--num_virtual_devices=100000"),
        c("env gpus_per_worker negative", "env", "--gpus_per_worker=-1"),
        c("env num_workers 0", "env", "--num_workers=0"),
        c("diagnose unknown flag", "diagnose", "--epochs=3"),
        c("diagnose seconds 0", "diagnose", "--seconds=0"),
        c("diagnose seconds nan", "diagnose", "--seconds=nan"),
        c("diagnose seconds huge", "diagnose", "--seconds=1e12"),
        c("diagnose distribution pipeline", "diagnose", "--distribution=pipeline"),
        c("diagnose plot not png", "diagnose", "--plot=split.jpg"),
        c("diagnose seed negative", "diagnose", "--seed=-5"),
        c("diagnose global_batch_size text", "diagnose", "--global_batch_size=many"),
        c("estimate-memory num_devices 0", "estimate-memory", "--num_devices=0"),
        c("estimate-memory num_devices huge", "estimate-memory", "--distribution=mirrored",
          "--num_devices=100000"),
        c("estimate-memory num_stages huge", "estimate-memory", "--distribution=pipeline",
          "--num_stages=100000"),
        c("estimate-memory model unknown", "estimate-memory", "--model=resnet"),
        c("estimate-memory d_model huge", "estimate-memory", "--model=transformer",
          "--d_model=1000000"),
        c("estimate-memory one_device on 2", "estimate-memory", "--num_devices=2"),
        c("export missing --output", "export", "--model_dir=run"),
        c("export output empty", "export", "--model_dir=run", "--output=",
          fixtures=("keras_zip",)),
        c("launch num_workers 0", "launch", "--num_workers=0"),
        c("launch num_workers 100000", "launch", "--num_workers=100000"),
        c("launch num_workers 3000", "launch", "--num_workers=3000"),
        c("launch port out of range", "launch", "--port=99999999"),
        c("launch port negative", "launch", "--port=-1"),
        c("launch grace_period negative", "launch", "--grace_period=-1"),
        c("launch startup_timeout nan", "launch", "--startup_timeout=nan"),
        c("launch max_restarts negative", "launch", "--max_restarts=-1"),
        c("launch gpus_per_worker negative", "launch", "--gpus_per_worker=-1"),
        c("launch no command", "launch", "--num_workers=2", "--"),
        c("unknown subcommand", "trian"),
    ]


def _tf_config_cases() -> list[Case]:
    def t(name, value, *flags):
        return _train("tf_config", name, "--distribution=multi_worker", *flags,
                      env=(("TF_CONFIG", value),))

    two = '{"cluster": {"worker": ["localhost:2222", "localhost:2223"]}, '
    return [
        t("not JSON", "{cluster: worker}"),
        t("cut short", two),
        t("a list", '["localhost:2222"]'),
        t("no cluster", '{"task": {"type": "worker", "index": 0}}'),
        t("no task", '{"cluster": {"worker": ["localhost:2222", "localhost:2223"]}}'),
        t("index out of range", two + '"task": {"type": "worker", "index": 2}}'),
        t("index negative", two + '"task": {"type": "worker", "index": -1}}'),
        t("index text", two + '"task": {"type": "worker", "index": "one"}}'),
        t("unknown task type", two + '"task": {"type": "wroker", "index": 0}}'),
        t("address without port", '{"cluster": {"worker": ["localhost", "localhost:2223"]}, '
                                   '"task": {"type": "worker", "index": 0}}'),
        t("port out of range", '{"cluster": {"worker": ["localhost:70000", "localhost:2"]}, '
                               '"task": {"type": "worker", "index": 0}}'),
        t("duplicate addresses", '{"cluster": {"worker": ["localhost:2222", "localhost:2222"]}, '
                                 '"task": {"type": "worker", "index": 0}}'),
        t("unknown top-level key", two + '"task": {"type": "worker", "index": 0}, "tsak": 1}'),
        _train("tf_config", "auto with a cluster not launched", "--distribution=auto",
               env=(("TF_CONFIG", two + '"task": {"type": "worker", "index": 0}}'),),
               early=False),
    ]


def _hook_cases() -> list[Case]:
    def t(name, *flags, early=True, fixtures=("userdata",)):
        return _train("hooks", name, *flags, early=early, fixtures=fixtures)

    return [
        t("model missing function name", "--model=userdata:"),
        t("model missing module", "--model=:build"),
        t("model two colons", "--model=userdata:build:x"),
        t("model with call parentheses", "--model=userdata:build()"),
        t("model module starts with a digit", "--model=1userdata:build"),
        t("model with a space", "--model=user data:build"),
        t("dataset module ends in a dot", "--dataset=userdata.:good"),
        t("model module with an empty part", "--model=user..data:build"),
        t("loss malformed", "--loss=userdata:"),
        t("model module not found", "--model=no_such_module:build", early=False),
        t("dataset module not found", "--dataset=no_such_module:load", early=False),
        t("dataset function not found", "--dataset=userdata:no_such_function", early=False),
        t("model not a function", "--model=userdata:not_a_function", early=False),
        t("dataset needs an argument", "--dataset=userdata:needs_path", early=False),
        t("dataset module import raises", "--dataset=broken:load", early=False,
          fixtures=("broken_module",)),
        t("dataset raises ValueError", "--dataset=userdata:raises_value_error", early=False),
        t("dataset raises OSError", "--dataset=userdata:raises_os_error", early=False),
        t("dataset returns None", "--dataset=userdata:returns_none", early=False),
        t("dataset returns text", "--dataset=userdata:returns_text", early=False),
        t("dataset returns no train split", "--dataset=userdata:returns_no_train", early=False),
        t("dataset returns an unknown key", "--dataset=userdata:returns_unknown_key",
          early=False),
        t("model returns text", "--dataset=userdata:good", "--model=userdata:model_returns_text",
          early=False),
        t("model returns None", "--dataset=userdata:good", "--model=userdata:model_returns_none",
          early=False),
        t("model raises ValueError", "--dataset=userdata:good", "--model=userdata:model_raises",
          early=False),
        t("loss function not found", "--loss=userdata:no_such_loss", early=False),
        t("loss needs three arguments", "--dataset=userdata:good",
          "--loss=userdata:loss_needs_three", early=False),
    ]


def _dataset_cases() -> list[Case]:
    def t(name, function, *flags):
        return _train("datasets", name, f"--dataset=userdata:{function}", *flags,
                      fixtures=("userdata",), early=False)

    return [
        t("empty", "empty"),
        t("empty test split", "empty_test"),
        t("truncated: fewer labels than examples", "truncated"),
        t("NaN in a feature column", "nan_features"),
        t("infinity in a feature column", "inf_features"),
        t("NaN regression labels", "nan_labels", "--model=regression"),
        t("text features", "text_features"),
        t("object features", "object_features"),
        t("complex features", "complex_features"),
        t("text labels", "text_labels"),
        t("labels outside the classes", "labels_out_of_range"),
        t("negative labels", "negative_labels"),
        t("fractional labels for classification", "fractional_labels", "--task=classification"),
        t("test split shaped unlike train", "test_shaped_unlike_train"),
        t("labels of two columns", "labels_2d"),
    ]


def _file_cases() -> list[Case]:
    def t(name, *flags, fixtures=("userdata", "records"), early=False, **kwargs):
        return _train("files", name, *flags, fixtures=fixtures, early=early, **kwargs)

    def e(name, *args, fixtures=(), **kwargs):
        return _cli("files", name, "export", *args, fixtures=fixtures, **kwargs)

    return [
        t("TFRecord file missing", "--dataset=userdata:files_missing"),
        t("no file matches the pattern", "--dataset=userdata:files_no_match"),
        t("not a TFRecord file", "--dataset=userdata:files_not_tfrecord"),
        t("TFRecord cut in a record", "--dataset=userdata:files_cut_in_record"),
        t("TFRecord cut in a header", "--dataset=userdata:files_cut_in_header"),
        t("TFRecord file empty", "--dataset=userdata:files_empty"),
        t("TFRecord file unreadable", "--dataset=userdata:files_unreadable", unprivileged=True),
        t("TFDS dataset not prepared, no download", "--dataset=mnist", "--data_dir=no_such_dir",
          fixtures=()),
        t("model_dir is a file", "--model_dir=model", fixtures=("model_is_file",), early=True),
        t("backup_dir is a file", "--backup_dir=backup", fixtures=("backup_is_file",),
          early=True),
        t("model_dir in a read-only folder", "--model_dir=ro/model",
          fixtures=("read_only_folder",), early=True, unprivileged=True),
        t("backup_dir in a read-only folder", "--backup_dir=ro/backup",
          fixtures=("read_only_folder",), early=True, unprivileged=True),
        e("export model_dir missing", "--model_dir=no_run", "--output=serving"),
        e("export model.keras not a zip", "--model_dir=run", "--output=serving",
          fixtures=("keras_not_zip",)),
        e("export model.keras unreadable", "--model_dir=run", "--output=serving",
          fixtures=("keras_locked",), unprivileged=True),
        e("export output exists", "--model_dir=run", "--output=serving",
          fixtures=("keras_zip", "serving_exists")),
        e("export output in a read-only folder", "--model_dir=run", "--output=ro/serving",
          fixtures=("keras_zip", "read_only_folder"), unprivileged=True),
        _cli("files", "diagnose profile_dir is a file", "diagnose", "--profile_dir=model",
             fixtures=("model_is_file",)),
    ]


def _host_cases() -> list[Case]:
    secret = (("TFMULTI_LAUNCH_SECRET", _SECRET),)

    def t(name, *args):
        return _cli("hosts", name, "launch", *args, env=secret)

    return [
        t("hosts empty", "--hosts=", "--host_rank=0"),
        t("hosts N huge", "--hosts=127.0.0.1:99999999999", "--host_rank=0"),
        t("hosts workers not a number", "--hosts=127.0.0.1:x,127.0.0.2:1", "--host_rank=0"),
        t("hosts workers 0", "--hosts=127.0.0.1:0,127.0.0.2:1", "--host_rank=0"),
        t("hosts empty entry", "--hosts=127.0.0.1:1,,127.0.0.2:1", "--host_rank=0"),
        t("hosts duplicate", "--hosts=127.0.0.1:1,127.0.0.1:1", "--host_rank=0"),
        t("host_rank out of range", "--hosts=127.0.0.1:1,127.0.0.2:1", "--host_rank=2"),
        t("host_rank negative", "--hosts=127.0.0.1:1,127.0.0.2:1", "--host_rank=-1"),
        t("host_rank missing", "--hosts=127.0.0.1:1,127.0.0.2:1"),
        t("host_rank without hosts", "--host_rank=1"),
        t("hosts slurm outside SLURM", "--hosts=slurm"),
        t("hosts too many workers", "--hosts=127.0.0.1:100000,127.0.0.2:1", "--host_rank=0"),
    ]


def _secret_cases() -> list[Case]:
    hosts = ("--hosts=127.0.0.1:1,127.0.0.2:1", "--host_rank=0", "--port=29500")

    def t(name, *args, env=(), fixtures=(), unprivileged=False):
        return _cli("secrets", name, "launch", *hosts, *args, env=env, fixtures=fixtures,
                    unprivileged=unprivileged)

    return [
        t("no secret"),
        t("secret variable empty", env=(("TFMULTI_LAUNCH_SECRET", ""),)),
        t("secret variable short", env=(("TFMULTI_LAUNCH_SECRET", "abc123"),)),
        t("secret file missing", "--secret_file=no_such_secret.txt"),
        t("secret file readable by others", "--secret_file=secret.txt",
          fixtures=("secret_world_readable",)),
        t("secret file short", "--secret_file=secret.txt", fixtures=("secret_short",)),
        t("secret file empty", "--secret_file=secret.txt", fixtures=("secret_empty",)),
        t("secret file unreadable", "--secret_file=secret.txt", fixtures=("secret_locked",),
          unprivileged=True),
        t("secret file is a folder", "--secret_file=.", fixtures=()),
    ]


def _controls() -> list[Case]:
    return [
        _train("control", "a user's arrays train", "--dataset=userdata:good",
               fixtures=("userdata",), early=False, status=0),
        _train("control", "a user's TFRecord file trains", "--dataset=userdata:files_good",
               fixtures=("userdata", "records"), early=False, status=0),
    ]


CASES: tuple[Case, ...] = tuple(_flag_cases() + _tf_config_cases() + _hook_cases()
                                + _dataset_cases() + _file_cases() + _host_cases()
                                + _secret_cases() + _controls())
"""Every input of the campaign, the controls last."""


# ---------------------------------------------------------------------------- checks

def meaningful_lines(stderr: str) -> list[str]:
    """The lines of `stderr` that count: not empty, not TensorFlow's C++ log (`NOISE`).

    Example:
        >>> meaningful_lines("I0000 00:00:1796294243.440659    1824 port.cc:153] oneDNN on\\n"
        ...                  "\\ntrain.py: error: --seed must be ...\\n")
        ['train.py: error: --seed must be ...']
    """
    return [line for line in stderr.splitlines()
            if line.strip() and not any(p.match(line) for p in NOISE)]


def check(case: Case, status: int | None, stdout: str, stderr: str,
          changes: list[str]) -> list[str]:
    """What is wrong with how an input ended (empty: refused as it must be).

    Args:
        case: the input.
        status: its exit status (None: it timed out).
        stdout, stderr: its output.
        changes: `chaos_checks.snapshot_changes` of its folder.
    """
    if status is None:
        return ["timed out (a hang)"]
    problems = []
    if status != case.status:
        problems.append(f"exit status {status}, not {case.status}")
    if NO_TENSORFLOW in stderr:
        problems.append("TensorFlow was imported before the refusal")
    if "Traceback" in stdout or "Traceback" in stderr:
        problems.append("a traceback")
    if case.status == 0:
        return problems
    lines = meaningful_lines(stderr)
    if len(lines) != 1:
        problems.append(f"{len(lines)} lines on stderr, not 1")
    if changes:
        problems.append("wrote: " + ", ".join(changes[:5])
                        + (f" and {len(changes) - 5} more" if len(changes) > 5 else ""))
    return problems


# ----------------------------------------------------------------------------- running

NO_TENSORFLOW = "bad_inputs: TensorFlow was imported before the input was refused"
"""What importing TensorFlow raises in an `early` input's process: such an input
must be refused before TensorFlow starts, and this proves it was."""


def no_tensorflow(folder: str) -> str:
    """Makes `folder`/tensorflow, a package whose import fails with
    `NO_TENSORFLOW`, and returns `folder` (first on an early input's PYTHONPATH)."""
    _write(folder, "tensorflow/__init__.py", f"raise ImportError({NO_TENSORFLOW!r})\n")
    return folder


def _environ(case: Case, tmp: str, poisoned: str | None = None) -> dict:
    env = {k: v for k, v in os.environ.items()
           if k not in ("TF_CONFIG", "TFMULTI_LAUNCH_SECRET", "TFMULTI_FAULTS")}
    env.update(TF_CPP_MIN_LOG_LEVEL="2", TMPDIR=tmp, PYTHONDONTWRITEBYTECODE="1")
    if case.early and poisoned:
        env["PYTHONPATH"] = poisoned + (os.pathsep + env["PYTHONPATH"]
                                        if env.get("PYTHONPATH") else "")
    if case.unprivileged:
        env["HOME"] = tmp
    env.update(dict(case.env))
    return env


def _chown_tree(root: str) -> None:
    for folder, dirs, files in os.walk(root):
        for name in (folder, *(os.path.join(folder, n) for n in dirs + files)):
            os.lchown(name, NOBODY, NOBODY)


def run_case(case: Case, folder: str, timeout: float, poisoned: str | None = None) -> dict:
    """Runs one input in `folder` (created; its TMPDIR is `folder` + ".tmp") and checks it.
    An `early` input runs with `poisoned` (a `no_tensorflow` folder) first on
    its PYTHONPATH, when given.

    Returns:
        Its record: the input, exit status, seconds, the stderr lines that
        count, the folder's changes, the problems found and `ok`.
    """
    tmp = folder + ".tmp"
    if case.early:
        timeout = min(timeout, EARLY_TIMEOUT)
    os.makedirs(folder)
    os.makedirs(tmp)
    for name in case.fixtures:
        FIXTURES[name](folder)
    if case.unprivileged:
        _chown_tree(folder)
        _chown_tree(tmp)
    before = chaos_checks.snapshot(folder)
    start = time.monotonic()
    proc = subprocess.Popen(case.command(), cwd=folder, env=_environ(case, tmp, poisoned),
                            stdin=subprocess.DEVNULL, stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, text=True, errors="backslashreplace",
                            start_new_session=True)
    try:
        stdout, stderr = proc.communicate(timeout=timeout)
        status = exit_codes.exit_status(proc.returncode)
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)
        stdout, stderr = proc.communicate()
        status = None
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()
    seconds = time.monotonic() - start
    _kill_leftovers(proc.pid)
    changes = chaos_checks.snapshot_changes(before, chaos_checks.snapshot(folder))
    problems = check(case, status, stdout, stderr, changes)
    lines = meaningful_lines(stderr)
    return {"category": case.category, "name": case.name, "input": case.describe(),
            "early": case.early, "unprivileged": case.unprivileged, "exit_status": status,
            "seconds": round(seconds, 1), "stderr": lines[-20:],
            "stdout": stdout.splitlines()[-5:], "changes": changes, "problems": problems,
            "ok": not problems}


def _kill_leftovers(pgid: int) -> None:
    """Kills what is left of an input's process group (a launch's workers)."""
    try:
        os.killpg(pgid, signal.SIGKILL)
    except (ProcessLookupError, PermissionError):
        pass


def _counts(records: list[dict]) -> dict:
    rows: dict[str, dict] = {}
    for r in records:
        row = rows.setdefault(r["category"], {"inputs": 0, "ok": 0, "failed": 0})
        row["inputs"] += 1
        row["ok" if r["ok"] else "failed"] += 1
    return rows


def format_table(records: list[dict]) -> str:
    """The campaign's table: inputs by category, refused as they must be, failed.

    Example:
        >>> print(format_table([{"category": "flags", "ok": True},
        ...                     {"category": "hosts", "ok": False}]))
        category   inputs  refused in one line  failed
        flags           1                    1       0
        hosts           1                    0       1
        total           2                    1       1
    """
    rows = _counts(records)
    order = [c for c in CATEGORIES if c in rows] + sorted(set(rows) - set(CATEGORIES))
    lines = [f"{'category':<10} {'inputs':>6}  {'refused in one line':>19}  {'failed':>6}"]
    total = {"inputs": 0, "ok": 0, "failed": 0}
    for category in order:
        row = rows[category]
        for key in total:
            total[key] += row[key]
        lines.append(f"{category:<10} {row['inputs']:>6}  {row['ok']:>19}  {row['failed']:>6}")
    lines.append(f"{'total':<10} {total['inputs']:>6}  {total['ok']:>19}  {total['failed']:>6}")
    return "\n".join(lines)


def select(cases=CASES, *, categories: tuple[str, ...] = (), early_only: bool = False,
           names: tuple[str, ...] = ()) -> list[Case]:
    """The inputs of `cases` in `categories` (all when empty), refused before
    TensorFlow starts when `early_only`, named in `names` (all when empty).

    Raises:
        ValueError: an unknown category or name.
    """
    for category in categories:
        checks.one_of("categories", category, CATEGORIES)
    unknown = set(names) - {c.name for c in cases}
    if unknown:
        raise ValueError(f"`names` {sorted(unknown)} are not inputs of the campaign.")
    return [c for c in cases if (not categories or c.category in categories)
            and (not early_only or c.early) and (not names or c.name in names)]


def run_campaign(output: str, *, cases=CASES, jobs: int = 2, timeout: float = 300.0,
                 workdir: str | None = None, keep: bool = False,
                 command: str | None = None) -> dict:
    """Runs `cases`, `jobs` at a time; prints one line per input and the table;
    writes `output` (JSON: every input's record) after every input.

    Args:
        output: the JSON file.
        cases: the inputs (default: all of `CASES`).
        jobs: inputs run at once.
        timeout: seconds an input may take (a hang is a failure).
        workdir: where the inputs' folders go (default: a new temporary folder,
            removed at the end unless `keep` or an input failed: the failed
            inputs' folders stay).
        keep: keep every input's folder.
        command: the command line, recorded in the JSON.

    Returns:
        The record written to `output`: `inputs`, `failed`, the table.

    Raises:
        ValueError: bad arguments.
    """
    checks.positive_int("jobs", jobs)
    checks.positive_number("timeout", timeout)
    names = [c.name for c in cases]
    if len(set(names)) != len(names):
        raise ValueError("the inputs' names must be unique.")
    own_workdir = workdir is None
    workdir = workdir or tempfile.mkdtemp(prefix="tfmulti-bad-inputs-")
    os.makedirs(workdir, exist_ok=True)
    os.chmod(workdir, 0o755)  # the unprivileged inputs reach their folders
    poisoned = no_tensorflow(os.path.join(workdir, "no-tensorflow"))
    started = time.monotonic()
    result = {"command": command, "inputs": len(cases), "jobs": jobs, "timeout": timeout,
              "workdir": workdir, "complete": False, "records": []}
    records: list[dict] = []
    lock = threading.Lock()

    def one(index_case):
        index, case = index_case
        folder = os.path.join(workdir, f"{index + 1:03d}")
        record = run_case(case, folder, timeout, poisoned)
        with lock:
            records.append(record)
            status = "ok" if record["ok"] else "FAIL: " + "; ".join(record["problems"])
            said = record["stderr"][-1] if record["stderr"] else ""
            print(f"bad_inputs: {len(records):3d}/{len(cases)} {case.category}/{case.name}: "
                  f"{status} [{record['seconds']:.1f} s] {said[:200]}", flush=True)
            result.update(records=sorted(records, key=lambda r: names.index(r["name"])),
                          failed=sum(1 for r in records if not r["ok"]),
                          seconds=round(time.monotonic() - started, 1))
            write_json_atomic(output, result)
        if record["ok"] and not keep:
            shutil.rmtree(folder, ignore_errors=True)
            shutil.rmtree(folder + ".tmp", ignore_errors=True)

    with concurrent.futures.ThreadPoolExecutor(max_workers=jobs) as pool:
        list(pool.map(one, enumerate(cases)))
    result.update(complete=True, table=format_table(records),
                  failures=[{"category": r["category"], "name": r["name"],
                             "problems": r["problems"], "stderr": r["stderr"][-3:]}
                            for r in result["records"] if not r["ok"]])
    write_json_atomic(output, result)
    print(result["table"], flush=True)
    print(f"bad_inputs: {len(cases) - result['failed']} of {len(cases)} inputs ended as they "
          f"must, {result['failed']} failed; {result['seconds'] / 60:.1f} min; {output}",
          flush=True)
    shutil.rmtree(poisoned, ignore_errors=True)
    if own_workdir and not keep and not result["failed"]:
        shutil.rmtree(workdir, ignore_errors=True)
    return result
