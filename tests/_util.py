"""Helpers shared by the tests: fresh Python processes, recipe runs and local
clusters, each with a timeout."""

from __future__ import annotations

import contextlib
import doctest
import gzip
import importlib
import io
import os
import re
import socket
import subprocess
import sys
import tempfile
import threading
from pathlib import Path

import numpy as np
import pytest

REPO = Path(__file__).resolve().parent.parent
RECIPES = REPO / "recipes"
WORKERS = REPO / "tests" / "workers"


# Any line in absl's or TensorFlow's C++ log format, or absl's pre-init line (what
# tfmulti.utils.quiet drops at a process's start): counted independently of the filter's
# own list, so a start-up line it does not know counts too.
_TF_LOG_LINE = re.compile(
    r"^(?:\[worker \d+\] )?(?:WARNING: All log messages before absl::InitializeLog\(\)"
    r"|[IWEF]\d{4} \d\d:\d\d:[\d.]+\s+\d+ \S+:\d+\]"
    r"|\d{4}-\d\d-\d\d \d\d:\d\d:\d\d\.\d+: [IWEF] \S+:\d+\])", re.M)


def tf_log_lines(text: str) -> list[str]:
    """The lines of `text` in TensorFlow's (or absl's) C++ log format."""
    return [m.group(0) for m in _TF_LOG_LINE.finditer(text)]


def file_tree(path) -> dict[str, bytes]:
    """Relative path -> bytes of every file under `path` (to prove nothing changed)."""
    out = {}
    for root, _, files in os.walk(path):
        for name in files:
            full = os.path.join(root, name)
            with open(full, "rb") as f:
                out[os.path.relpath(full, path)] = f.read()
    return out


def run_python(args: list[str], timeout: float = 240, env: dict | None = None,
               cwd: str | os.PathLike | None = None) -> subprocess.CompletedProcess:
    """Runs `python ARGS` in a fresh process (own TF runtime) with a timeout."""
    full_env = {**os.environ, "TF_CPP_MIN_LOG_LEVEL": "2", **(env or {})}
    return subprocess.run(
        [sys.executable, *args], capture_output=True, text=True, timeout=timeout,
        env=full_env, cwd=cwd or REPO,
    )


# A fresh process without TensorFlow's import each time (~5 CPU-s here): one
# process per pytest process imports tensorflow and keras once, then forks a child
# per call, which runs the script or `-c` code as `python` would, with its own
# argv, environment, working directory and a TensorFlow runtime not yet started.
# Several children may run at once (`popen_python_warm`): the server reaps each
# in a thread of its own and reports {"pid", "returncode"} when it ends.
_WARM_ENV_PREFIXES = ("TF_", "KERAS", "XLA", "OMP", "MKL", "CUDA", "LD_", "PYTHON",
                      "TFMULTI_DEFER_IMPORTS")
_WARM_ENV_READ_LATER = frozenset({"TF_CONFIG"})  # read when a cluster starts, not at import
_WARM_SERVER = r"""
import atexit, json, os, runpy, sys, tempfile, threading, traceback, types
# Keras as it ships (no deferred imports, tfmulti.utils.deferred_imports): the children run
# users' programs too (the docs' blocks, the corpus), and the import is paid once here.
import tfmulti, tensorflow, keras  # noqa: F401  (the point: imported once, as a program does)
REPLIES = os.dup(1)

def reply(message):  # one write of a short line: whole, whichever thread writes
    os.write(REPLIES, (json.dumps(message) + "\n").encode())

def reap(pid):
    _, status = os.waitpid(pid, 0)
    reply({"pid": pid, "returncode": os.waitstatus_to_exitcode(status)})

reply("ready")
for line in sys.stdin:
    request = json.loads(line)
    sys.stdout.flush(); sys.stderr.flush()
    out = os.open(request["stdout"], os.O_WRONLY)  # a file, or a FIFO its reader holds open
    err = out if request["stderr"] is None else os.open(request["stderr"], os.O_WRONLY)
    pid = os.fork()
    if pid == 0:
        code = 1
        try:
            os.close(REPLIES)
            if request.get("session"):
                os.setsid()
            os.dup2(os.open(os.devnull, os.O_RDONLY), 0)
            os.dup2(out, 1)
            os.dup2(err, 2)
            for fd in {out, err}:
                os.close(fd)
            os.chdir(request["cwd"])
            os.environ.clear()
            os.environ.update(request["env"])
            tempfile.tempdir = None  # TMPDIR as the caller set it
            args = request["args"]
            if args[0] == "-c":
                sys.argv, sys.path[0] = ["-c", *args[2:]], ""
                main = sys.modules["__main__"] = types.ModuleType("__main__")
                exec(compile(args[1], "<string>", "exec"), main.__dict__)
            elif args[0] == "-m":
                sys.argv, sys.path[0] = ["-m", *args[2:]], os.getcwd()
                runpy.run_module(args[1], run_name="__main__", alter_sys=True)
            else:
                sys.argv = list(args)
                sys.path[0] = os.path.dirname(os.path.abspath(args[0]))
                runpy.run_path(args[0], run_name="__main__")
            code = 0
        except SystemExit as e:
            if e.code is None or isinstance(e.code, int):
                code = e.code or 0
            else:
                print(e.code, file=sys.stderr)
        except BaseException:
            traceback.print_exc()
        finally:
            try:
                threading._shutdown()
                atexit._run_exitfuncs()
                sys.stdout.flush(); sys.stderr.flush()
            finally:
                os._exit(code)
    for fd in {out, err}:
        os.close(fd)
    reply({"pid": pid})
    threading.Thread(target=reap, args=(pid,), daemon=True).start()
"""
_warm: dict = {}
# The server's pipe is one conversation: threads of a test may start and wait on warm
# children at once (a run in a thread beside a cluster), so each exchange holds this
# lock, and a wait reads in short slices (a reply may reach whichever thread reads it:
# all go to _warm["ended"]).
_warm_lock = threading.RLock()
_WARM_SLICE_S = 0.2


def _warm_read(timeout: float | None) -> dict | str | None:
    """The server's next reply, None after `timeout` s without one. Replies are
    read from the pipe's descriptor (no buffered reader: `select` must see every
    line not yet taken)."""
    import json
    import select

    server, pending = _warm["server"], _warm["pending"]
    while b"\n" not in pending:
        ready, _, _ = select.select([server.stdout], [], [], timeout)
        if not ready:
            return None
        chunk = os.read(server.stdout.fileno(), 65536)
        if not chunk:
            raise RuntimeError("the warm Python server ended")
        pending += chunk
    line, _, _warm["pending"] = pending.partition(b"\n")
    return json.loads(line)


def _warm_server(env: dict) -> subprocess.Popen | None:
    """The forking process for this pytest process (started on first use), or None
    where `env` differs from its environment in a variable read at import."""
    server = _warm.get("server")
    if server is None or server.poll() is not None:
        base = {**os.environ, "TF_CPP_MIN_LOG_LEVEL": "2"}
        server = subprocess.Popen([sys.executable, "-c", _WARM_SERVER], stdin=subprocess.PIPE,
                                  stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, text=True,
                                  env=base, cwd=REPO)
        _warm.clear()
        _warm.update(server=server, env=base, pending=b"", ended={})
        if _warm_read(300) != "ready":
            server.kill()
            server.wait(timeout=30)
            _warm.clear()
            return None
        import atexit

        atexit.register(lambda: (server.stdin.close(), server.wait(timeout=60)))
    base = _warm["env"]
    if any(env.get(k) != base.get(k) for k in {*env, *base}
           if k.startswith(_WARM_ENV_PREFIXES) and k not in _WARM_ENV_READ_LATER):
        return None
    return server


def _warm_start(args: list[str], env: dict, cwd, stdout: str, stderr: str | None,
                session: bool = False) -> int | None:
    """Forks a warm child running `python ARGS` (its stdout and stderr written to
    those paths; stderr None: to stdout): its pid, or None where no warm server
    serves `env`."""
    import json

    if args[0].startswith("-") and args[0] not in ("-c", "-m"):
        return None
    with _warm_lock:
        server = _warm_server(env)
        if server is None:
            return None
        server.stdin.write(json.dumps({"args": [str(a) for a in args], "env": env,
                                       "cwd": str(cwd or REPO), "stdout": stdout,
                                       "stderr": stderr, "session": session}) + "\n")
        server.stdin.flush()
        while True:  # the children that end meanwhile are kept for `_warm_wait`
            reply = _warm_read(None)
            if "returncode" not in reply:
                return reply["pid"]
            _warm["ended"][reply["pid"]] = reply["returncode"]


def _warm_wait(pid: int, timeout: float | None) -> int | None:
    """The exit status of warm child `pid` (negative: the signal that ended it),
    None if it is still running after `timeout` s."""
    import time

    deadline = None if timeout is None else time.monotonic() + timeout
    while True:
        with _warm_lock:
            ended = _warm.get("ended")
            if ended is None:  # another thread abandoned the server (an interruption)
                raise RuntimeError(f"the warm Python server ended before child {pid}")
            if pid in ended:
                return ended.pop(pid)
            left = _WARM_SLICE_S if deadline is None else \
                min(_WARM_SLICE_S, max(0.0, deadline - time.monotonic()))
            reply = _warm_read(left)
            if reply is not None:
                ended[reply["pid"]] = reply["returncode"]
                continue
        if deadline is not None and time.monotonic() >= deadline:
            return None


def _warm_abandon(pid: int) -> None:
    """After an interruption (pytest-timeout, Ctrl-C): child `pid` killed, and a new
    server next time (this one may owe replies no one reads)."""
    import signal

    with contextlib.suppress(ProcessLookupError):
        os.kill(pid, signal.SIGKILL)
    with _warm_lock:
        server = _warm.get("server")
        if server is not None:
            server.kill()
            server.wait(timeout=30)
        _warm.clear()


def run_python_warm(args: list[str], timeout: float = 240, env: dict | None = None,
                    cwd: str | os.PathLike | None = None) -> subprocess.CompletedProcess:
    """`run_python`, in a process forked from one that imported TensorFlow and
    Keras already (started once per pytest process): for scripts and `-c` code
    whose own start is not what is tested. Falls back to `run_python` where the
    environment changes a variable read at import (TF_*, KERAS*, ...)."""
    import signal
    import tempfile

    full_env = {**os.environ, "TF_CPP_MIN_LOG_LEVEL": "2", **(env or {})}
    with tempfile.TemporaryDirectory(prefix="tfmulti-warm-") as folder:
        out, err = os.path.join(folder, "stdout"), os.path.join(folder, "stderr")
        for path in (out, err):
            open(path, "w").close()
        pid = _warm_start(args, full_env, cwd, out, err)
        if pid is None:
            return run_python(args, timeout=timeout, env=env, cwd=cwd)
        try:
            returncode = _warm_wait(pid, timeout)
            if returncode is None:
                os.kill(pid, signal.SIGKILL)
                _warm_wait(pid, None)
        except BaseException:
            _warm_abandon(pid)
            raise
        with open(out) as f_out, open(err) as f_err:
            stdout, stderr = f_out.read(), f_err.read()
        if returncode is None:
            raise subprocess.TimeoutExpired([sys.executable, *args], timeout, stdout, stderr)
    return subprocess.CompletedProcess([sys.executable, *args], returncode, stdout, stderr)


class WarmProcess:
    """What `subprocess.Popen` gives with stdout=PIPE and text=True, for a child
    forked from the warm server (`popen_python_warm`): `pid`, `stdout` (a pipe),
    `poll`, `wait`, `send_signal`, `kill`, `communicate`, `returncode`."""

    def __init__(self, args: list[str], pid: int, stdout):
        self.args, self.pid, self.stdout, self.returncode = args, pid, stdout, None

    def poll(self) -> int | None:
        return self.wait(timeout=0, _raise=False)

    def wait(self, timeout: float | None = None, _raise: bool = True) -> int | None:
        if self.returncode is None:
            try:
                self.returncode = _warm_wait(self.pid, timeout)
            except BaseException:
                _warm_abandon(self.pid)
                raise
            if self.returncode is None and _raise:
                raise subprocess.TimeoutExpired(self.args, timeout)
        return self.returncode

    def send_signal(self, sig: int) -> None:
        if self.returncode is None:
            with contextlib.suppress(ProcessLookupError):
                os.kill(self.pid, sig)

    def kill(self) -> None:
        import signal

        self.send_signal(signal.SIGKILL)

    def communicate(self, timeout: float | None = None) -> tuple[str, None]:
        """The rest of stdout (to its end) and None, once the child ended."""
        import select

        if timeout is not None:  # the pipe's end may come after `timeout`
            ready, _, _ = select.select([self.stdout], [], [], timeout)
            if not ready:
                raise subprocess.TimeoutExpired(self.args, timeout)
        rest = self.stdout.read()
        self.wait(timeout)
        return rest, None


def popen_python_warm(args: list[str], env: dict | None = None,
                      cwd: str | os.PathLike | None = None, stderr: str = "stdout",
                      start_new_session: bool = False):
    """`subprocess.Popen([python, *args], stdout=PIPE, text=True, ...)` forked from the
    warm server (several may run at once): a `WarmProcess`, or a `subprocess.Popen`
    where the environment changes a variable read at import. `stderr`: "stdout"
    (merged into it, as stderr=STDOUT) or "devnull"; TF_CONFIG may differ (read
    when a cluster starts)."""
    import fcntl
    import tempfile

    full_env = {**os.environ, "TF_CPP_MIN_LOG_LEVEL": "2", **(env or {})}
    with tempfile.TemporaryDirectory(prefix="tfmulti-warm-") as folder:
        fifo = os.path.join(folder, "stdout")
        os.mkfifo(fifo)
        # Opened before the child exists (no reader: its open would block), without
        # waiting for a writer; blocking reads once the child holds the other end.
        reader = os.open(fifo, os.O_RDONLY | os.O_NONBLOCK)
        try:
            pid = _warm_start(args, full_env, cwd, fifo,
                              None if stderr == "stdout" else os.devnull,
                              session=start_new_session)
        except BaseException:
            os.close(reader)
            raise
        if pid is None:
            os.close(reader)
            return subprocess.Popen(
                [sys.executable, *args], stdout=subprocess.PIPE, text=True, env=full_env,
                cwd=cwd or REPO, start_new_session=start_new_session,
                stderr=subprocess.STDOUT if stderr == "stdout" else subprocess.DEVNULL)
    fcntl.fcntl(reader, fcntl.F_SETFL, fcntl.fcntl(reader, fcntl.F_GETFL) & ~os.O_NONBLOCK)
    return WarmProcess([sys.executable, *args], pid, os.fdopen(reader, "r"))


def run_recipe(name: str, *flags: str, timeout: float = 240,
               env: dict | None = None) -> subprocess.CompletedProcess:
    """Runs `python recipes/NAME.py FLAGS` in a fresh process."""
    return run_python([str(RECIPES / f"{name}.py"), *flags], timeout=timeout, env=env)


def run_recipe_warm(name: str, *flags: str, timeout: float = 240,
                    env: dict | None = None) -> subprocess.CompletedProcess:
    """`run_recipe` through `run_python_warm` (TensorFlow already imported)."""
    return run_python_warm([str(RECIPES / f"{name}.py"), *flags], timeout=timeout, env=env)


def launch_local(command: list[str], num_workers: int = 2, startup_timeout: float = 120,
                 **options) -> tuple[int, str]:
    """Runs `command` as a local cluster with `tfmulti.cluster.launch` (isolated,
    every worker reaped): (exit status, everything the launcher printed)."""
    from tfmulti.cluster import launch

    out = io.StringIO()
    code = launch(command, num_workers=num_workers, output=out,
                  startup_timeout=startup_timeout, **options)
    return code, out.getvalue()


def launch_python(args: list[str], **options) -> tuple[int, str]:
    """`launch_local([python, *args])`."""
    return launch_local([sys.executable, *args], **options)


def cluster_python_warm(args: list[str], num_workers: int = 2, timeout: float = 600,
                        grace_period: float = 30,
                        cwd: str | os.PathLike | None = None) -> tuple[int, str]:
    """A local cluster without tfmulti's launcher, as a TFJob or SLURM starts one:
    `num_workers` children of the warm server (`popen_python_warm`) run `python ARGS`,
    each with the environment the launcher gives its workers (`plan.worker_env`: its
    TF_CONFIG, on free ports of this host). For the tests of training on a cluster;
    the launcher's own are in tests/integration/test_launcher.py. Returns what
    `launch_python` does: 0 if every worker exited 0, else the first failure's
    exit status (once one fails, the others get `grace_period` s to end before they
    are killed; at `timeout` s all are); the output, each worker's lines after one
    another, prefixed "[worker I] "."""
    import threading
    import time

    from tfmulti.cluster import plan

    addresses = [f"localhost:{free_port()}" for _ in range(num_workers)]
    outputs: list[str] = [""] * num_workers
    procs, readers = [], []
    try:
        for index in range(num_workers):
            env = plan.worker_env({}, addresses, index)
            env.pop("PYTHONUNBUFFERED")  # read at a process's start: the warm one's own
            procs.append(popen_python_warm(args, env=env, cwd=cwd, start_new_session=True))

            def read(i=index):
                outputs[i] = procs[i].stdout.read()
            readers.append(threading.Thread(target=read, daemon=True))
            readers[-1].start()
        deadline, failed, failed_at = time.monotonic() + timeout, None, None
        while any(p.poll() is None for p in procs) and time.monotonic() < deadline:
            if failed is None:
                failed = next((p.poll() for p in procs if p.poll() not in (None, 0)), None)
                failed_at = time.monotonic()
            elif time.monotonic() > failed_at + grace_period:
                break
            time.sleep(0.2)
    finally:
        import signal

        for proc in procs:
            if proc.poll() is None:  # the worker and what it started (its own session)
                with contextlib.suppress(ProcessLookupError):
                    os.killpg(proc.pid, signal.SIGKILL)
                proc.wait(timeout=30)
        for reader in readers:
            reader.join(timeout=30)
    output = "".join(f"[worker {i}] {line}\n" for i, text in enumerate(outputs)
                     for line in text.splitlines())
    if failed is None:  # all ended well, or failed within the same poll, or timed out
        failed = next((p.returncode for p in procs if p.returncode != 0), 0)
    return failed, output


def free_port(host: str = "127.0.0.1") -> int:
    """A port that nothing listens on now (the OS's pick)."""
    with socket.socket() as s:
        s.bind((host, 0))
        return s.getsockname()[1]


# Shared by the unit and integration halves of a test file.


@pytest.fixture(scope="module")
def big_batch():
    """Plain Keras on one device, one update per global batch of 32 rows."""
    from tests.workers import accumulate

    return accumulate.reference()


def backup_xy():
    x = np.random.default_rng(0).random((256, 8), dtype=np.float32)
    return x, (x.sum(axis=1) > 4).astype(np.int32)


def backup_stream(step):
    import tensorflow as tf

    return tf.data.Dataset.from_tensor_slices(backup_xy()).batch(32).repeat().skip(step)


class CrashAt:
    """A callback raising RuntimeError once the optimizer reaches `iteration`."""

    def __new__(cls, iteration):
        import keras

        class Crash(keras.callbacks.Callback):
            def on_train_batch_end(self, batch, logs=None):
                if int(self.model.optimizer.iterations.numpy()) == iteration:
                    raise RuntimeError("simulated crash")

        return Crash()


def backup_model(units: int = 2):
    import keras

    keras.utils.set_random_seed(1)
    m = keras.Sequential([keras.Input((8,)), keras.layers.Dense(units)])
    m.compile(keras.optimizers.Adam(0.05),
              keras.losses.SparseCategoricalCrossentropy(from_logits=True))
    return m


def backup_fit(backup_dir, model=None, **kwargs):
    from tfmulti.training import backup

    args = dict(epochs=2, steps_per_epoch=8, save_every_steps=4, verbose=0)
    return backup.fit(model or backup_model(), backup_stream, backup_dir=str(backup_dir),
                      **{**args, **kwargs})


def backup_dict_stream(step):
    import tensorflow as tf

    from tests.workers import user_model

    x, y = user_model.examples(256, seed=5)
    dataset = tf.data.Dataset.from_tensor_slices((user_model.as_inputs(x), y))
    return dataset.batch(32).repeat().skip(step)


@contextlib.contextmanager
def simulated_hosts_or_skip(count: int = 2):
    """`count` simulated hosts (benchmarks.simulated_hosts: network namespaces joined
    by a bridge; root), or the test skipped saying why they cannot be made here."""
    from benchmarks import simulated_hosts

    ok, why = simulated_hosts.available()
    if not ok:
        pytest.skip(f"cannot make network namespaces here: {why}")
    with simulated_hosts.SimulatedHosts(count) as hosts:
        yield hosts


def stub_diagnose(monkeypatch) -> list:
    """Replaces `tfmulti.insight.diagnose.diagnose` with a stub that records the config
    it is given (returned list) and reports nothing: the CLI's parsing, without timing."""
    import tfmulti.insight.diagnose as diagnose_module

    seen = []

    class Report:
        def to_dict(self):
            return {}

    monkeypatch.setattr(diagnose_module, "diagnose",
                        lambda config, **kwargs: seen.append(config) or Report())
    return seen


def cli_main(argv, capsys) -> tuple[int, list[str], str]:
    """`cli.main(argv)`: (exit code, stderr lines, stdout); argparse's exits count too."""
    from tfmulti import cli

    try:
        code = cli.main(argv)
    except SystemExit as e:
        code = e.code
    captured = capsys.readouterr()
    return code, captured.err.splitlines(), captured.out


def write_idx(path: Path, array: np.ndarray, truncate: int = 0) -> None:
    header = bytes([0, 0, 0x08, array.ndim]) + b"".join(
        int(d).to_bytes(4, "big") for d in array.shape
    )
    payload = header + array.astype(np.uint8).tobytes()
    with gzip.open(path, "wb") as f:
        f.write(payload[: len(payload) - truncate])


@pytest.fixture(scope="module")
def fake_idx(tmp_path_factory):
    """Tiny Fashion-MNIST IDX files: 12 train and 5 test images."""
    from tfmulti.data import catalog

    src = tmp_path_factory.mktemp("src")
    rng = np.random.default_rng(1234)
    arrays = {}
    for split, n in (("train", 12), ("test", 5)):
        images = rng.integers(0, 256, size=(n, 28, 28), dtype=np.uint8)
        images[:, 0, 0] = np.arange(n)  # every image distinct
        images[0, 1, :2] = (0, 255)  # full value range present
        labels = rng.integers(0, 10, size=(n,), dtype=np.uint8)
        image_file, label_file = catalog.FASHION_MNIST_FILES[split]
        write_idx(src / image_file, images)
        write_idx(src / label_file, labels)
        arrays[split] = (images, labels)
    return src, arrays


def docstring_examples(name: str) -> list[doctest.DocTest]:
    module = importlib.import_module(name)
    tests = doctest.DocTestFinder(exclude_empty=True).find(module, name)
    return [t for t in tests if t.examples]


def run_docstring_examples(name: str, tmp_path, monkeypatch) -> None:
    """Runs module `name`'s docstring examples in `tmp_path`; fails on any failure."""
    import keras

    tests = docstring_examples(name)
    monkeypatch.chdir(tmp_path)  # examples that write files write them here,
    # and their `tempfile.mkdtemp()` folders too: `tempfile` read TMPDIR once, at
    # its first use in this process, so the variable alone would not move them.
    monkeypatch.setenv("TMPDIR", str(tmp_path))
    monkeypatch.setattr(tempfile, "tempdir", str(tmp_path))
    policy = keras.mixed_precision.global_policy()
    report: list[str] = []
    runner = doctest.DocTestRunner(optionflags=doctest.ELLIPSIS | doctest.NORMALIZE_WHITESPACE)
    try:
        for test in tests:
            runner.run(test, out=report.append)
    finally:
        keras.mixed_precision.set_global_policy(policy)
    assert runner.failures == 0, "".join(report)


def fake_slurm(monkeypatch):
    monkeypatch.delenv("CUDA_VISIBLE_DEVICES", raising=False)
    monkeypatch.setenv("PATH", "/nonexistent")  # no nvidia-smi
    monkeypatch.setenv("SLURM_PROCID", "2")
    monkeypatch.setenv("SLURM_STEP_NUM_TASKS", "3")
    monkeypatch.setenv("SLURM_STEP_NODELIST", "cpu-[1-3]")
    monkeypatch.setenv("SLURM_STEP_TASKS_PER_NODE", "1(x3)")


def assert_layout_equals_the_plain_model(figures: dict, devices: int) -> None:
    for key in ("forward", "gradients", "adam_losses", "adam_weights"):
        assert figures[key] <= 1e-5, (key, figures[key])
    assert figures["replicas_equal"]
    assert figures["slots_with_their_variable"]
    assert figures["variable_devices"] == [f"CPU:{i}" for i in range(devices)]
    # Each device holds the bytes the memory estimate gives it.
    assert figures["parameters_by_device"] == figures["estimated_parameters_by_device"]
