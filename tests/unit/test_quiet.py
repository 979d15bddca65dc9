"""tfmulti.utils.quiet: which lines are TensorFlow's C++ start-up lines, the byte-stream
filter, and when `install` does nothing. (The filter on real processes, `tfmulti` commands,
recipes and launched workers: tests/integration/test_quiet.py.)"""

from __future__ import annotations

import sys

import pytest

from tfmulti.utils import quiet

# What `tfmulti env` printed on stderr here (TensorFlow 2.21, no GPU), twice the first
# three lines (two libraries carry absl), plus cpu_feature_guard's two lines as they come
# without TF_CPP_MIN_LOG_LEVEL and a start-up line in TensorFlow's older format.
STARTUP = """\
WARNING: All log messages before absl::InitializeLog() is called are written to STDERR
I0000 00:00:1796316347.852164   10324 port.cc:153] oneDNN custom operations are on. You may \
see slightly different numerical results due to floating-point round-off errors from \
different computation orders. To turn them off, set the environment variable \
`TF_ENABLE_ONEDNN_OPTS=0`.
I0000 00:00:1796316347.852638   10324 cudart_stub.cc:31] Could not find cuda drivers on your \
machine, GPU will not be used.
I0000 00:00:1796316369.831303   12106 cpu_feature_guard.cc:227] This TensorFlow binary is \
optimized to use available CPU instructions in performance-critical operations.
To enable the following instructions: AVX2 AVX512F FMA, in other operations, rebuild \
TensorFlow with the appropriate compiler flags.
2024-01-05 10:00:00.123456: E external/local_xla/xla/stream_executor/cuda/cuda_dnn.cc:9261] \
Unable to register cuDNN factory: Attempting to register factory for plugin cuDNN when one \
has already been registered
E0000 00:00:1796316352.407030   10324 cuda_platform.cc:52] failed call to cuInit: INTERNAL: \
CUDA error: Failed call to cuInit: UNKNOWN ERROR (303)
"""
CUINIT = STARTUP.splitlines(keepends=True)[-1]
KEPT = """\
tfmulti: MirroredStrategy with 2 replicas; global batch 64 = 2 x 32
/x/train.py:3: UserWarning: careful
  warnings.warn(
W1203 10:00:00.123456 140 train.py:12] a warning from Python's absl logging
E0000 00:00:1796316352.407030   10324 collective_ops.cc:52] a real error from C++
2026-12-03 10:00:00.123456: W tensorflow/core/framework/op_kernel.cc:1828] OP_REQUIRES failed
To enable the following instructions: a line of the user's, not after a start-up line
Traceback (most recent call last):
ValueError: boom

"""


@pytest.mark.parametrize("line", STARTUP.splitlines()[:-1])
def test_the_start_up_lines_are_known(line):
    if line.startswith("To enable"):  # only right after cpu_feature_guard's (below)
        assert not quiet.is_startup_line(line, nvidia_driver=False)
    else:
        assert quiet.is_startup_line(line, nvidia_driver=False)
        assert quiet.is_startup_line(line + "\n", nvidia_driver=True)


@pytest.mark.parametrize("line", KEPT.splitlines())
def test_other_lines_are_kept(line):
    assert not quiet.is_startup_line(line, nvidia_driver=False)


def test_cuinit_failing_is_an_error_where_the_host_has_an_nvidia_driver():
    assert quiet.is_startup_line(CUINIT, nvidia_driver=False)
    assert not quiet.is_startup_line(CUINIT, nvidia_driver=True)
    keep = quiet.startup_filter({}, nvidia_driver=True)
    assert [keep(line) for line in STARTUP.splitlines(keepends=True)] == [False] * 6 + [True]


def test_the_filter_drops_start_up_lines_only_in_any_chunking():
    data = (STARTUP + KEPT + STARTUP + "last line without a newline").encode()
    expected = (KEPT + "last line without a newline").encode()
    whole = quiet.StreamFilter(nvidia_driver=False)
    assert whole.feed(data) + whole.close() == expected
    for size in (1, 7, 100):
        f = quiet.StreamFilter(nvidia_driver=False)
        out = b"".join(f.feed(data[i:i + size]) for i in range(0, len(data), size))
        assert out + f.close() == expected, size


def test_a_partial_line_goes_out_at_once_unless_it_may_be_a_start_up_line():
    f = quiet.StreamFilter(nvidia_driver=False)
    assert f.feed(b"Downloading: 10%\r") == b"Downloading: 10%\r"  # a progress bar
    assert f.feed(b"Downloading: 20%") == b"Downloading: 20%"
    assert f.feed(b"\nI0000 00:00:17.5   7 port.cc:1") == b"\n"  # held: may be one
    assert f.feed(b"53] oneDNN custom operations are on.\n") == b""
    assert f.feed(b"I0000 00:00:17.5   7 port.cc:153] not the start-up text\n") == (
        b"I0000 00:00:17.5   7 port.cc:153] not the start-up text\n")
    assert f.feed(b"x" * 9000) == b"x" * 9000  # no start-up line is that long


def test_tf_log_asks_for_everything(monkeypatch):
    assert quiet.startup_filter({"TFMULTI_TF_LOG": "1"}) is None
    assert quiet.startup_filter({"TFMULTI_TF_LOG": "0"}) is not None
    environ = {"TFMULTI_TF_LOG": "yes"}
    assert quiet.install(environ) is False
    assert environ == {"TFMULTI_TF_LOG": "yes"}  # TF_CPP_MIN_LOG_LEVEL left unset


def test_install_after_tensorflow_sets_the_log_level_only(monkeypatch):
    assert "tensorflow" in sys.modules  # tests/conftest.py imported it
    meta_path = list(sys.meta_path)
    environ = {}
    assert quiet.install(environ) is False
    assert environ == {"TF_CPP_MIN_LOG_LEVEL": "2"}
    assert quiet.install({"TF_CPP_MIN_LOG_LEVEL": "0"}) is False
    assert sys.meta_path == meta_path  # no filter to start
