"""tests/_util.py's `run_python_warm`: a forked child runs a script, `-c` code or
`-m` module as a fresh `python` would (argv, working directory, environment,
exit status, signals, timeout), so the tests that use it prove what
`run_python` proved."""

from __future__ import annotations

import signal
import subprocess

import pytest

from tests._util import REPO, WORKERS, run_python_warm

SHOW = ("import sys; warm = 'tensorflow' in sys.modules\n"
        "import json, os, tempfile, tensorflow as tf\n"
        "def f(): pass\n"
        "import pickle\n"
        "print(json.dumps({'argv': sys.argv, 'cwd': os.getcwd(), 'var': os.environ.get('V'),"
        " 'tmp': tempfile.gettempdir(), 'warm': warm,"
        " 'main_pickles': pickle.loads(pickle.dumps(f)) is f,"
        " 'cpus': len(tf.config.list_physical_devices('CPU'))}))\n"
        "sys.stderr.write('to stderr\\n')\n"
        "sys.exit(3)\n")


@pytest.mark.slow  # starts processes
def test_run_python_warm_runs_as_a_fresh_python(tmp_path):
    import json

    result = run_python_warm(["-c", SHOW, "a", "b"], env={"V": "1", "TMPDIR": str(tmp_path)},
                             cwd=tmp_path)
    assert result.returncode == 3, result.stderr[-2000:]
    assert json.loads(result.stdout) == {"argv": ["-c", "a", "b"], "cwd": str(tmp_path),
                                         "var": "1", "tmp": str(tmp_path), "warm": True,
                                         "main_pickles": True, "cpus": 1}
    assert result.stderr.endswith("to stderr\n")  # after TensorFlow's own lines

    # A script: its folder first on sys.path (the test workers import their
    # neighbours), its signals as exit status.
    killed = run_python_warm([str(WORKERS / "resumable.py"), str(tmp_path), "mirrored",
                              "--kill", "1:0:KILL", "--config", '{"num_examples": 128}'])
    assert killed.returncode == -signal.SIGKILL, killed.stderr[-2000:]
    assert "sends itself SIGKILL at step 1" in killed.stdout

    module = run_python_warm(["-m", "tfmulti.cli", "diagnose", "--global_batch_size=0"])
    assert module.returncode == 2 and module.stderr.startswith("tfmulti diagnose: error:")

    raised = run_python_warm(["-c", "raise ValueError('boom')"])
    assert raised.returncode == 1 and raised.stderr.endswith("ValueError: boom\n")

    with pytest.raises(subprocess.TimeoutExpired):
        run_python_warm(["-c", "import time; time.sleep(60)"], timeout=2)

    # A variable read at TensorFlow's import: a cold process, which reads it.
    onednn = run_python_warm(["-c", "import sys; print('tensorflow' in sys.modules)"],
                             env={"TF_ENABLE_ONEDNN_OPTS": "1"}, cwd=REPO)
    assert onednn.returncode == 0 and onednn.stdout == "False\n"


@pytest.mark.slow  # starts processes
def test_popen_python_warm_runs_children_at_once_as_popen_would():
    """`popen_python_warm`: forked children that run at the same time, each with
    its stdout a pipe read line by line (stderr merged, or discarded), its own
    session where asked, its exit status or the signal that ended it; TF_CONFIG
    (read when a cluster starts, not at import) keeps it warm."""
    import os

    from tests._util import WarmProcess, popen_python_warm

    sleeper = popen_python_warm(
        ["-c", "import os, sys, time; print('up', os.getsid(0) == os.getpid(), flush=True); "
               "print('to stderr', file=sys.stderr, flush=True); time.sleep(300)"],
        start_new_session=True)
    quick = popen_python_warm(
        ["-c", "import os, sys; print(os.environ['TF_CONFIG'], 'tensorflow' in sys.modules); "
               "print('hidden', file=sys.stderr); sys.exit(4)"],
        env={"TF_CONFIG": "{}"}, stderr="devnull")
    try:
        assert isinstance(sleeper, WarmProcess) and isinstance(quick, WarmProcess)
        assert [sleeper.stdout.readline(), sleeper.stdout.readline()] == ["up True\n",
                                                                          "to stderr\n"]
        assert quick.communicate(timeout=120) == ("{} True\n", None)
        assert quick.returncode == 4
        assert sleeper.poll() is None  # still running while the other one ended
        with pytest.raises(subprocess.TimeoutExpired):
            sleeper.wait(timeout=0.5)
        os.killpg(sleeper.pid, signal.SIGKILL)
        assert sleeper.wait(timeout=60) == -signal.SIGKILL
        assert sleeper.stdout.read() == ""  # the pipe's end
    finally:
        sleeper.kill()
        quick.kill()


@pytest.mark.slow  # starts processes
def test_warm_children_waited_on_from_two_threads_each_end_once():
    """A test may wait on warm children from two threads at once (test_ray.py: the Ray
    run in a thread, the reference cluster beside it). Both read the one server pipe:
    an end that one thread reads must still reach the other (before the lock, one
    thread took the other's reply and the other waited for its timeout)."""
    import threading

    from tests._util import popen_python_warm

    results = {}

    def short_runs():
        results["short"] = [run_python_warm(["-c", f"import time; time.sleep({s})"],
                                            timeout=60).returncode for s in (0.3, 0.6, 0.9)]

    long_child = popen_python_warm(["-c", "import time; time.sleep(2)"])
    try:
        thread = threading.Thread(target=short_runs)
        thread.start()
        assert long_child.wait(timeout=60) == 0
        thread.join(timeout=60)
        assert not thread.is_alive() and results == {"short": [0, 0, 0]}
    finally:
        long_child.kill()


@pytest.mark.slow  # starts processes
def test_cluster_python_warm_gives_each_worker_its_tf_config_and_reports_the_first_failure():
    """`cluster_python_warm`: each warm child gets the launcher's worker environment
    (its TF_CONFIG index), the output comes prefixed by worker, and a failed
    worker's exit status is the cluster's, the other killed after the grace period."""
    from tests._util import cluster_python_warm

    show = ("import json, os, sys; index = json.loads(os.environ['TF_CONFIG'])['task']['index']; "
            "print(index, os.environ['TFMULTI_LAUNCHED'], 'tensorflow' in sys.modules)")
    assert cluster_python_warm(["-c", show]) == (0, "[worker 0] 0 1 True\n[worker 1] 1 1 True\n")

    hang_or_fail = ("import json, os, sys, time\n"
                    "if json.loads(os.environ['TF_CONFIG'])['task']['index'] == 1:\n"
                    "    print('failing', flush=True); sys.exit(3)\n"
                    "time.sleep(300)\n")
    code, output = cluster_python_warm(["-c", hang_or_fail], grace_period=1)
    assert (code, output) == (3, "[worker 1] failing\n")
