"""Tests of tfmulti.launch: pure functions, launcher mechanics with tiny plain-Python workers,
network isolation, the notebook launcher, and one real 2-worker TensorFlow all-reduce.

Nothing here connects anywhere: isolation is checked by reading /proc/net/tcp{,6}."""

from __future__ import annotations

import contextlib
import json
import os
import signal
import socket
import subprocess
import sys
import textwrap
import threading
import time
from pathlib import Path

import pytest

from tests._util import REPO, run_python
from tfmulti import launch

LAUNCH_TIMEOUT = 60

# A tiny worker: writes its pid, then behaves as argv[2] says. No TensorFlow.
WORKER = textwrap.dedent('''
    import json, os, socket, sys, time
    rank = json.loads(os.environ["TF_CONFIG"])["task"]["index"]
    ports = [int(a.rsplit(":", 1)[1])
             for a in json.loads(os.environ["TF_CONFIG"])["cluster"]["worker"]]
    d, mode = sys.argv[1], sys.argv[2]

    def wait_for(name, timeout=30):
        deadline = time.monotonic() + timeout
        while not os.path.exists(os.path.join(d, name)):
            if time.monotonic() > deadline:
                sys.exit(f"timed out waiting for {name}")
            time.sleep(0.02)

    def touch(name, text=""):
        with open(os.path.join(d, name + ".tmp"), "w") as f:
            f.write(text)
        os.replace(os.path.join(d, name + ".tmp"), os.path.join(d, name))

    touch(f"pid-{rank}", str(os.getpid()))
    if mode == "print":
        print(f"out line of {rank}")
        print(f"err line of {rank}", file=sys.stderr)
    elif mode == "affinity":
        print("cpus", sorted(os.sched_getaffinity(0)), os.environ["TF_NUM_INTRAOP_THREADS"])
    elif mode == "chief_exits_5_last":
        if rank == 1:
            touch("exited-1")
            sys.exit(0)
        wait_for("exited-1")
        time.sleep(0.2)
        sys.exit(5)
    elif mode == "fail":
        if rank == 1:
            wait_for("pid-0")
            sys.exit(3)
        time.sleep(300)
    elif mode == "sleep":  # with a child process, which must not be left behind either
        import subprocess
        child = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(300)"])
        touch(f"child-{rank}", str(child.pid))
        time.sleep(300)
    elif mode == "listen":
        s = socket.socket(socket.AF_INET6, socket.SOCK_STREAM)  # like gRPC: [::]:port
        s.setsockopt(socket.IPPROTO_IPV6, socket.IPV6_V6ONLY, 0)
        s.bind(("::", ports[rank]))
        s.listen()
        touch(f"ready-{rank}", str(ports[rank]))
        wait_for("stop", timeout=60)
''')


def _alive(pid: int) -> bool:
    """Whether `pid` is a live (not zombie) process."""
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
    except (FileNotFoundError, ProcessLookupError):
        return False
    return stat.rsplit(")", 1)[1].split()[0] != "Z"


def _listening_ports() -> set[int]:
    """TCP ports in LISTEN state in this process's network namespace."""
    ports = set()
    for name in ("/proc/net/tcp", "/proc/net/tcp6"):
        with contextlib.suppress(FileNotFoundError):
            for line in Path(name).read_text().splitlines()[1:]:
                fields = line.split()
                if fields[3] == "0A":
                    ports.add(int(fields[1].rsplit(":", 1)[1], 16))
    return ports


def _wait_for(predicate, timeout: float, what: str) -> None:
    deadline = time.monotonic() + timeout
    while not predicate():
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out after {timeout} s waiting for {what}")
        time.sleep(0.05)


def _pids(d: Path, n: int) -> list[int]:
    return [int((d / f"pid-{i}").read_text()) for i in range(n)]


class _Launcher:
    """`tfmulti launch` in its own session; killed with its workers if a test fails."""

    def __init__(self, tmp: Path, mode: str, *options: str, num_workers: int = 2):
        self.tmp, self.num_workers = tmp, num_workers
        script = tmp / "worker.py"
        script.write_text(WORKER)
        self.proc = subprocess.Popen(
            [sys.executable, "-m", "tfmulti.cli", "launch", "--num_workers", str(num_workers),
             *options, "--", sys.executable, str(script), str(tmp), mode],
            cwd=REPO, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
            start_new_session=True)

    def wait_for_pids(self, kinds=("pid",)) -> list[int]:
        names = [f"{kind}-{i}" for kind in kinds for i in range(self.num_workers)]
        _wait_for(lambda: all((self.tmp / n).exists() for n in names), 30,
                  f"the pid files {names}")
        return [int((self.tmp / n).read_text()) for n in names]

    def finish(self, timeout: float = LAUNCH_TIMEOUT) -> tuple[int, str, str]:
        out, err = self.proc.communicate(timeout=timeout)
        return self.proc.returncode, out, err

    def kill(self) -> None:
        if self.proc.poll() is None:
            os.killpg(self.proc.pid, signal.SIGKILL)
            self.proc.communicate(timeout=10)
        for i in range(self.num_workers):
            with contextlib.suppress(FileNotFoundError, ProcessLookupError, ValueError):
                os.killpg(int((self.tmp / f"pid-{i}").read_text()), signal.SIGKILL)


@pytest.fixture
def launcher(tmp_path):
    started = []

    def start(mode, *options, num_workers=2):
        started.append(_Launcher(tmp_path, mode, *options, num_workers=num_workers))
        return started[-1]

    yield start
    for lau in started:
        lau.kill()


def _isolation_works() -> bool:
    return launch._probe_isolation()[0] is not None


needs_isolation = pytest.mark.skipif(
    not _isolation_works(),
    reason="`unshare --net` fails here (no root, no unprivileged user namespaces)")


# ----------------------------------------------------------------------------- pure functions


def test_tf_config_lists_all_workers_and_marks_the_task():
    assert launch.tf_config([2000, 2001], 1) == {
        "cluster": {"worker": ["localhost:2000", "localhost:2001"]},
        "task": {"type": "worker", "index": 1},
    }
    with pytest.raises(ValueError, match=r"worker `index` \(2\) must be in 0..1"):
        launch.tf_config([2000, 2001], 2)


def test_port_range_and_its_errors():
    assert launch.port_range(20000, 3) == [20000, 20001, 20002]
    assert launch.port_range(65534, 2) == [65534, 65535]
    for bad in (0, 65535, "20000"):
        with pytest.raises(ValueError, match=r"`port` \(.*\) must be an integer from 1 to 65534"):
            launch.port_range(bad, 2)


def test_worker_env_sets_tf_config_and_launcher_settings():
    env = launch.worker_env({"PATH": "/bin", "TF_CONFIG": "stale"}, [3000, 3001], 0,
                            startup_timeout=30)
    assert env["PATH"] == "/bin"
    assert json.loads(env["TF_CONFIG"]) == launch.tf_config([3000, 3001], 0)
    assert env["TFMULTI_STARTUP_TIMEOUT"] == "30"
    assert env["PYTHONUNBUFFERED"] == "1"
    assert "TF_NUM_INTRAOP_THREADS" not in env

    pinned = launch.worker_env({}, [3000, 3001], 1, startup_timeout=2.5, cpus=(2, 3, 4))
    assert json.loads(pinned["TF_CONFIG"])["task"]["index"] == 1
    assert pinned["TFMULTI_STARTUP_TIMEOUT"] == "2.5"
    for name in ("TF_NUM_INTRAOP_THREADS", "TF_NUM_INTEROP_THREADS", "OMP_NUM_THREADS"):
        assert pinned[name] == "3"


def test_split_cpus_into_contiguous_chunks():
    assert launch.split_cpus([3, 0, 1, 2], 2) == ((0, 1), (2, 3))
    assert launch.split_cpus(range(5), 2) == ((0, 1, 2), (3, 4))
    assert launch.split_cpus([4, 7], 2) == ((4,), (7,))
    with pytest.raises(ValueError, match=r"`pin_cpus` needs one core per worker, but 3 "
                                         r"workers .* only 2 cores .* --num_workers 2"):
        launch.split_cpus([0, 1], 3)


def test_make_plan_validates_and_round_trips_through_json():
    plan = launch.make_plan(["python", "t.py"], 2, pin_cpus=True, port=20000,
                            available_cpus={0, 1, 2, 3})
    assert plan.cpu_sets == ((0, 1), (2, 3))
    assert launch.LaunchPlan.from_json(plan.to_json()) == plan
    with pytest.raises(ValueError, match="no command to launch"):
        launch.make_plan([], 2)
    with pytest.raises(ValueError, match="must be a list of arguments"):
        launch.make_plan("python t.py", 2)
    with pytest.raises(ValueError, match=r"`num_workers` \(0\) must be an integer >= 1"):
        launch.make_plan(["true"], 0)
    with pytest.raises(ValueError, match=r"`startup_timeout` \(0\) must be > 0"):
        launch.make_plan(["true"], 2, startup_timeout=0)


def test_commands_for_isolated_and_non_isolated_runs():
    plan = launch.make_plan(["python", "train.py"], 2)
    supervise = ["/py", "-m", "tfmulti.launch", "--_supervise", plan.to_json()]
    assert launch.supervisor_command(plan, "/py") == supervise
    assert launch.supervisor_command(plan, "/py", "root") == ["unshare", "--net", "--",
                                                              *supervise]
    assert launch.supervisor_command(plan, "/py", "userns") == [
        "unshare", "--net", "--map-root-user", "--", *supervise]
    assert launch.LaunchPlan.from_json(supervise[-1]).command == ("python", "train.py")
    with pytest.raises(ValueError, match=r"isolation `mode` \('pid'\) must be one of"):
        launch.isolation_prefix("pid")


def test_exit_status():
    assert launch.exit_status(0) == 0
    assert launch.exit_status(3) == 3
    assert launch.exit_status(-signal.SIGKILL) == 137


# ----------------------------------------------------------------------------- mechanics


@pytest.mark.parametrize("isolate", [True, False], ids=["isolated", "no_isolate"])
def test_output_is_prefixed_with_ranks(launcher, isolate):
    options = () if isolate else ("--no_isolate",)
    code, out, err = launcher("print", *options).finish()
    assert code == 0, out + err
    lines = out.splitlines()
    for rank in (0, 1):
        assert f"[worker {rank}] out line of {rank}" in lines
        assert f"[worker {rank}] err line of {rank}" in lines


@pytest.mark.skipif(len(os.sched_getaffinity(0)) < 2, reason="needs 2 cores")
def test_pin_cpus_gives_each_worker_its_cores(launcher):
    code, out, err = launcher("affinity", "--pin_cpus").finish()
    assert code == 0, out + err
    for rank, cpus in enumerate(launch.split_cpus(os.sched_getaffinity(0), 2)):
        assert f"[worker {rank}] cpus {list(cpus)} {len(cpus)}" in out.splitlines()


def test_without_isolation_a_warning_says_the_ports_are_open(monkeypatch):
    import io

    monkeypatch.setattr(launch, "_probe_isolation", lambda: (None, "no unshare here"))
    output = io.StringIO()
    code = launch.launch([sys.executable, "-c", "print('hi')"], num_workers=1, output=output)
    assert code == 0
    lines = output.getvalue().splitlines()
    assert lines[0].startswith("tfmulti launch: warning: cannot isolate the workers in a "
                               "private network namespace (no unshare here); their "
                               "TensorFlow gRPC ports are unauthenticated and OPEN ON ALL")
    assert "[worker 0] hi" in lines


def test_exit_status_is_the_chiefs(launcher):
    code, out, err = launcher("chief_exits_5_last").finish()
    assert code == 5, out + err
    assert "worker 0 failed with exit code 5" in out


@pytest.mark.parametrize("isolate", [True, False], ids=["isolated", "no_isolate"])
def test_a_failing_worker_stops_the_others(launcher, isolate):
    options = () if isolate else ("--no_isolate",)
    lau = launcher("fail", *options)
    start = time.monotonic()
    code, out, err = lau.finish(timeout=30)
    assert time.monotonic() - start < 30
    assert code == 3, out + err
    assert "worker 1 failed with exit code 3; stopping the other workers" in out
    for pid in _pids(lau.tmp, 2):
        assert not _alive(pid), f"worker process {pid} is still running"


@pytest.mark.parametrize("isolate", [True, False], ids=["isolated", "no_isolate"])
def test_sigint_to_the_launcher_stops_all_workers(launcher, isolate):
    options = () if isolate else ("--no_isolate",)
    lau = launcher("sleep", *options)
    pids = lau.wait_for_pids(("pid", "child"))
    lau.proc.send_signal(signal.SIGINT)
    code, out, err = lau.finish(timeout=30)
    assert code == 130, out + err
    assert "got SIGINT; stopping the workers" in out
    for pid in pids:
        assert not _alive(pid), f"worker process {pid} is still running"


@pytest.mark.parametrize("isolate", [True, False], ids=["isolated", "no_isolate"])
def test_a_killed_launcher_leaves_no_worker_behind(launcher, isolate):
    options = () if isolate else ("--no_isolate",)
    lau = launcher("sleep", *options)
    pids = lau.wait_for_pids(("pid", "child"))
    lau.proc.kill()  # SIGKILL: no chance to clean up; the supervisor must do it
    lau.finish(timeout=10)
    _wait_for(lambda: not any(_alive(p) for p in pids), 20,
              f"the workers and their children {pids} to exit")


def test_port_in_use_is_a_clear_error(tmp_path):
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        port = taken.getsockname()[1]
        result = subprocess.run(
            [sys.executable, "-m", "tfmulti.cli", "launch", "--no_isolate", "--num_workers", "1",
             "--port", str(port), "--", sys.executable, "-c", "pass"],
            cwd=REPO, capture_output=True, text=True, timeout=LAUNCH_TIMEOUT)
    assert result.returncode == 2
    assert result.stderr.splitlines() == [
        f"tfmulti launch: error: port {port} (worker 0 of --port {port}) is already in use on "
        "this host; pass another --port, or leave --port out to choose free ports."]


@needs_isolation
@pytest.mark.parametrize("isolate", [True, False], ids=["isolated", "no_isolate"])
def test_isolated_ports_are_not_bound_on_the_host(launcher, isolate):
    options = () if isolate else ("--no_isolate",)
    lau = launcher("listen", *options)
    _wait_for(lambda: all((lau.tmp / f"ready-{i}").exists() for i in (0, 1)), 30,
              "the workers to listen")
    ports = {int((lau.tmp / f"ready-{i}").read_text()) for i in (0, 1)}
    bound = ports & _listening_ports()
    (lau.tmp / "stop").touch()
    code, out, err = lau.finish()
    assert code == 0, out + err
    if isolate:
        assert "workers are isolated in a private network namespace" in out
        assert not bound, f"ports {bound} of isolated workers are bound on the host"
    else:
        assert bound == ports  # the check can see the ports when they are on the host
    assert not ports & _listening_ports(), "ports still held after the launcher exited"


@needs_isolation
def test_multi_worker_all_reduce_in_the_namespace(tmp_path):
    script = tmp_path / "allreduce.py"
    script.write_text(textwrap.dedent('''
        import json, os
        import tensorflow as tf
        rank = json.loads(os.environ["TF_CONFIG"])["task"]["index"]
        strategy = tf.distribute.MultiWorkerMirroredStrategy()
        value = strategy.run(lambda: tf.constant(float(rank + 1)))
        total = strategy.reduce(tf.distribute.ReduceOp.SUM, value, axis=None)
        print(f"total={float(total)}")
    '''))
    result = subprocess.run(
        [sys.executable, "-m", "tfmulti.cli", "launch", "--num_workers", "2", "--",
         sys.executable, str(script)],
        cwd=REPO, capture_output=True, text=True, timeout=180,
        env={**os.environ, "TF_CPP_MIN_LOG_LEVEL": "2"})
    assert result.returncode == 0, result.stdout + result.stderr
    assert "private network namespace" in result.stdout
    lines = result.stdout.splitlines()
    assert "[worker 0] total=3.0" in lines and "[worker 1] total=3.0" in lines, result.stdout


# ----------------------------------------------------------------------------- notebooks


def test_notebook_launcher_returns_the_chiefs_value(capsys):
    offset = 40

    def train(scale):
        import json
        import os

        rank = json.loads(os.environ["TF_CONFIG"])["task"]["index"]
        print(f"hello from rank {rank}")
        return {"rank": rank, "value": offset + scale * rank}

    assert launch.notebook_launcher(train, args=(2,), num_workers=2) == {"rank": 0, "value": 40}
    out = capsys.readouterr().out
    assert "[worker 0] hello from rank 0" in out and "[worker 1] hello from rank 1" in out


def test_notebook_launcher_raises_with_the_workers_traceback():
    def train():
        import json
        import os

        if json.loads(os.environ["TF_CONFIG"])["task"]["index"] == 1:
            raise ValueError("boom in rank 1")
        return "chief"

    with pytest.raises(RuntimeError, match=r"(?s)worker 1 failed:.*ValueError: boom in rank 1"):
        launch.notebook_launcher(train, num_workers=2, isolate=False)


def test_notebook_launcher_rejects_what_workers_cannot_receive():
    import tensorflow as tf

    with pytest.raises(ValueError, match=r"cannot pickle `function` or `args` .*lock.*create "
                                         r"TensorFlow objects, locks"):
        launch.notebook_launcher(lambda lock: None, args=(threading.Lock(),))

    weights = tf.Variable(1.0)
    with pytest.raises(ValueError, match=r"captured variable `weights` is a TensorFlow/Keras "
                                         r"object .*create models, tensors"):
        launch.notebook_launcher(lambda: weights.numpy())
    with pytest.raises(ValueError, match=r"args\[0\] is a TensorFlow/Keras object"):
        launch.notebook_launcher(lambda t: None, args=(tf.constant(1.0),))


def test_notebook_worker_puts_the_kernels_path_first(tmp_path):
    # A kernel that put a local checkout first (sys.path.insert(0, ...)) must
    # have its workers import the same copy, not the installed one.
    import pickle

    import cloudpickle

    local = tmp_path / "checkout"
    (local / "absl").mkdir(parents=True)
    (local / "absl" / "__init__.py").write_text("LOCAL = True\n")
    payload = tmp_path / "payload"
    with open(payload, "wb") as f:
        pickle.dump([str(local)], f)
        f.write(cloudpickle.dumps((lambda: getattr(__import__("absl"), "LOCAL", False), ())))
    results = tmp_path / "results"
    results.mkdir()
    env = {"TF_CONFIG": json.dumps({"cluster": {"worker": ["localhost:1"]},
                                    "task": {"type": "worker", "index": 0}})}
    done = run_python(["-m", "tfmulti._notebook_worker", str(payload), str(results)],
                      timeout=120, env=env)
    assert done.returncode == 0, done.stderr[-2000:]
    assert pickle.loads((results / "result-0.pkl").read_bytes()) is True
