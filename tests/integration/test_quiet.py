"""A quiet start on real processes (tfmulti.utils.quiet): no TensorFlow C++ start-up line in
the output of a recipe's run or of workers started by `tfmulti launch`, unless
TFMULTI_TF_LOG=1 asks; real errors, tracebacks and a killed process's last words still
come through. Cold processes: the lines come with TensorFlow's import. `tfmulti env`'s
start, quiet and asked: tests/integration/test_cli.py (test_env_in_a_fresh_process);
`tfmulti train` under `tfmulti launch`, `estimate-memory` and `env` from the installed
wheel, in a user's environment: tests/integration/test_wheel.py."""

from __future__ import annotations

import signal

import pytest

from tests._util import RECIPES, launch_python, run_python, tf_log_lines

SHOW_DEVICES = "import tensorflow as tf; print(len(tf.config.list_physical_devices()))"


@pytest.mark.slow
@pytest.mark.parametrize("command", [["-m", "tfmulti.cli", "train"], [str(RECIPES / "train.py")]],
                         ids=["tfmulti train", "recipes/train.py"])
def test_a_training_run_prints_no_start_up_line(tmp_path, command):
    result = run_python([*command, "--dataset=synthetic", "--num_examples=128",
                         "--global_batch_size=64", "--epochs=1",
                         f"--model_dir={tmp_path / 'run'}"], timeout=600)
    assert result.returncode == 0, result.stderr[-3000:]
    assert "tfmulti: test_accuracy=" in result.stdout
    assert "replica(s)" not in result.stdout and ", 1 replica, " in result.stdout
    assert tf_log_lines(result.stdout + result.stderr) == [], result.stderr[-3000:]


@pytest.mark.slow
def test_errors_and_a_killed_process_last_words_come_through():
    script = (
        "import os, signal, sys, warnings\n"
        "from tfmulti.utils import quiet\n"
        "quiet.install()\n"
        "import tensorflow as tf\n"
        "tf.config.list_physical_devices()\n"  # the runtime's start (cuInit)
        "def status(pid):\n"
        "    return dict(line.split(':\\t') for line in open(f'/proc/{pid}/status'))\n"
        "(child,) = open(f'/proc/self/task/{os.getpid()}/children').read().split()\n"
        "print(status(child)['SigIgn'], status(child)['SigBlk'], status('self')['SigBlk'],\n"
        "      flush=True)\n"
        "warnings.warn('a real warning')\n"
        "os.write(2, b'E0000 00:00:1796316352.407030 10 collective_ops.cc:52] peer down\\n')\n"
        "print('no newline', end='', file=sys.stderr, flush=True)\n"
        "os.kill(os.getpid(), signal.SIGKILL)\n")
    result = run_python(["-c", script], timeout=600)
    assert result.returncode == -9
    # The filter ignores the stop signals a process group gets (never blocked, so never
    # ended by one while it starts); this process blocks none of them.
    stops = sum(1 << (s - 1) for s in (signal.SIGHUP, signal.SIGINT, signal.SIGQUIT,
                                        signal.SIGTERM))
    ignored, blocked, main_blocked = (int(m, 16) for m in result.stdout.split())
    assert (ignored & stops, blocked & stops, main_blocked & stops) == (stops, 0, 0)
    assert result.stderr.splitlines()[-3:] == [
        "<string>:11: UserWarning: a real warning",
        "E0000 00:00:1796316352.407030 10 collective_ops.cc:52] peer down",
        "no newline"], result.stderr
    assert len(tf_log_lines(result.stderr)) == 1, result.stderr

    failed = run_python(["-c", "from tfmulti.utils import quiet; quiet.install(); "
                         "import keras; raise RuntimeError('boom')"], timeout=600)
    assert failed.returncode == 1
    assert failed.stderr.startswith("Traceback (most recent call last):"), failed.stderr
    assert failed.stderr.endswith("\nRuntimeError: boom\n"), failed.stderr
    assert tf_log_lines(failed.stderr) == [], failed.stderr


@pytest.mark.slow
def test_a_stop_signal_to_the_group_as_the_filter_starts_leaves_stderr_working():
    """A launcher's SIGTERM to the worker's group right as the filter starts (before it
    could ignore the signal) must not end the filter: this process's stderr would be a
    broken pipe. The process itself handles SIGTERM and writes on."""
    script = (
        "import importlib.util, os, signal, sys, time\n"
        "os.setsid()\n"  # a group of its own: this process and the filter
        "signal.signal(signal.SIGTERM, lambda *args: None)\n"
        "from tfmulti.utils import quiet\n"
        "quiet.install()\n"
        "importlib.util.find_spec('tensorflow')\n"  # starts the filter, as an import does
        "os.killpg(0, signal.SIGTERM)\n"
        "time.sleep(0.5)\n"
        "print('after the signal', file=sys.stderr, flush=True)\n")
    result = run_python(["-c", script], timeout=120)
    assert (result.returncode, result.stderr) == (0, "after the signal\n")


@pytest.mark.cluster
@pytest.mark.timeout(900)
def test_launched_workers_print_the_start_up_lines_when_asked(monkeypatch):
    """The workers run a plain script (no tfmulti in it): with TFMULTI_TF_LOG=1 the
    launcher passes their lines. (Without it, it drops them: the 4-attempt launch of
    tests/integration/test_backup.py, whose workers install no filter of their own.)"""
    monkeypatch.setenv("TFMULTI_TF_LOG", "1")
    code, output = launch_python(["-c", SHOW_DEVICES], num_workers=2)
    assert code == 0, output[-3000:]
    assert "[worker 0] 1" in output and "[worker 1] 1" in output, output[-3000:]
    found = tf_log_lines(output)
    assert {line[:10] for line in found} == {"[worker 0]", "[worker 1]"}, output[-3000:]
