"""Tests of tfmulti.cluster.launcher (`launch`, `tfmulti launch`) end to end:
output prefixes, CPU pinning, the isolation warning, exit statuses, a failing
or dying worker, SIGINT, a killed launcher, restarts, a port in use, network
isolation, and recipes/train.py on 2 workers.

The mechanics use a tiny plain-Python worker (no TensorFlow). Nothing here
connects anywhere: isolation is checked by reading /proc/net/tcp{,6}. Every
test starts the launcher (marker `cluster`); every launcher is reaped, and a
launcher started as a process is killed with its workers if a test fails.
"""

from __future__ import annotations

import contextlib
import functools
import io
import json
import os
import signal
import socket
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import pytest

from tests._util import RECIPES, REPO, WORKERS, launch_python
from tfmulti.cluster import launch, launcher, plan

pytestmark = pytest.mark.cluster

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

ISOLATION = pytest.mark.parametrize("isolate", [True, False], ids=["isolated", "no_isolate"])


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


@functools.lru_cache(maxsize=None)
def _isolation_works() -> bool:
    return launcher._probe_isolation()[0] is not None


def _needs_isolation() -> None:
    if not _isolation_works():
        pytest.skip("`unshare --net` fails here (no root, no unprivileged user namespaces)")


def _launch_worker(tmp: Path, mode: str, **options) -> tuple[int, str]:
    """The tiny worker under `launch` in this process: (exit status, output)."""
    script = tmp / "worker.py"
    script.write_text(WORKER)
    return launch_python([str(script), str(tmp), mode], **options)


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
def cli_launcher(tmp_path):
    started = []

    def start(mode, *options, num_workers=2):
        started.append(_Launcher(tmp_path, mode, *options, num_workers=num_workers))
        return started[-1]

    yield start
    for lau in started:
        lau.kill()


# ----------------------------------------------------------------------------- mechanics


@ISOLATION
def test_output_is_prefixed_with_ranks(tmp_path, isolate):
    code, out = _launch_worker(tmp_path, "print", isolate=isolate)
    assert code == 0, out
    lines = out.splitlines()
    for rank in (0, 1):
        assert f"[worker {rank}] out line of {rank}" in lines
        assert f"[worker {rank}] err line of {rank}" in lines


@pytest.mark.skipif(len(os.sched_getaffinity(0)) < 2, reason="needs 2 cores")
def test_pin_cpus_gives_each_worker_its_cores(cli_launcher):
    code, out, err = cli_launcher("affinity", "--pin_cpus").finish()
    assert code == 0, out + err
    for rank, cpus in enumerate(plan.split_cpus(os.sched_getaffinity(0), 2)):
        assert f"[worker {rank}] cpus {list(cpus)} {len(cpus)}" in out.splitlines()


def test_without_isolation_a_warning_says_the_ports_are_open(monkeypatch):
    monkeypatch.setattr(launcher, "_probe_isolation", lambda: (None, "no unshare here"))
    code, output = launch_python(["-c", "print('hi')"], num_workers=1)
    assert code == 0
    lines = output.splitlines()
    assert lines[0].startswith("tfmulti launch: warning: cannot isolate the workers in a "
                               "private network namespace (no unshare here); their "
                               "TensorFlow gRPC ports are unauthenticated and OPEN ON ALL")
    assert "[worker 0] hi" in lines


def test_exit_status_is_the_chiefs(tmp_path):
    code, out = _launch_worker(tmp_path, "chief_exits_5_last")
    assert code == 5, out
    assert "worker 0 failed with exit code 5" in out


@ISOLATION
def test_a_failing_worker_stops_the_others(tmp_path, isolate):
    start = time.monotonic()
    code, out = _launch_worker(tmp_path, "fail", isolate=isolate)
    assert time.monotonic() - start < 30
    assert code == 3, out
    assert "worker 1 failed with exit code 3; stopping the other workers" in out
    for pid in _pids(tmp_path, 2):
        assert not _alive(pid), f"worker process {pid} is still running"


def test_launcher_reports_each_restart_and_gives_up():
    # From tests/test_backup.py.
    code, text = launch_python(["-c", "import sys; sys.exit(3)"], max_restarts=2,
                               grace_period=1)
    assert code == 3, text
    assert "restart 1 of 2" in text and "restart 2 of 2" in text, text
    assert "giving up after 2 restart(s); exit status 3" in text
    assert text.count("failed with exit code 3") == 3


@ISOLATION
def test_sigint_to_the_launcher_stops_all_workers(cli_launcher, isolate):
    options = () if isolate else ("--no_isolate",)
    lau = cli_launcher("sleep", *options)
    pids = lau.wait_for_pids(("pid", "child"))
    lau.proc.send_signal(signal.SIGINT)
    code, out, err = lau.finish(timeout=30)
    assert code == 130, out + err
    assert "got SIGINT; stopping the workers" in out
    for pid in pids:
        assert not _alive(pid), f"worker process {pid} is still running"


@ISOLATION
def test_a_killed_launcher_leaves_no_worker_behind(cli_launcher, isolate):
    options = () if isolate else ("--no_isolate",)
    lau = cli_launcher("sleep", *options)
    pids = lau.wait_for_pids(("pid", "child"))
    lau.proc.kill()  # SIGKILL: no chance to clean up; the supervisor must do it
    lau.finish(timeout=10)
    _wait_for(lambda: not any(_alive(p) for p in pids), 20,
              f"the workers and their children {pids} to exit")


def test_port_in_use_is_a_clear_error():
    # The command's contract: one line, exit status 2 (the message itself:
    # tests/test_supervisor.py).
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


@ISOLATION
def test_isolated_ports_are_not_bound_on_the_host(cli_launcher, isolate):
    _needs_isolation()
    options = () if isolate else ("--no_isolate",)
    lau = cli_launcher("listen", *options)
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


# ----------------------------------------------------------------------------- TensorFlow


def test_worker_dying_mid_training_stops_the_run(tmp_path):
    class Timed(io.StringIO):
        died_at = None

        def write(self, text):
            if "worker 1 exits now" in text and self.died_at is None:
                self.died_at = time.monotonic()
            return super().write(text)

    out = Timed()
    code = launch([sys.executable, str(WORKERS / "die_mid_training.py"), str(tmp_path)],
                  num_workers=2, output=out, grace_period=10)
    ended_at = time.monotonic()
    output = out.getvalue()
    assert code == 3, output[-3000:]
    assert out.died_at is not None, output[-3000:]
    assert ended_at - out.died_at < 30, output[-3000:]
    for rank in (0, 1):
        pid = int((tmp_path / f"worker-{rank}.pid").read_text())
        with pytest.raises(ProcessLookupError):
            os.kill(pid, 0)


def test_train_recipe_two_workers_chief_only_writes_and_evaluates_a_partial_last_batch(
        tmp_path):
    # recipes/train.py on 2 workers, synthetic
    # data, 1 epoch of 4 steps in one call (--steps_per_execution=4). The
    # test split is 1024 // 4 = 256 examples at global batch 512: worker 1's
    # share of the only test batch is empty, which crashed conv models under
    # oneDNN (workarounds fix 6).
    import keras

    from tfmulti import data

    model_dir = tmp_path / "run"
    code, output = launch_python(
        [str(RECIPES / "train.py"), "--distribution=multi_worker", "--dataset=synthetic",
         "--epochs=1", "--model=cnn", "--num_examples=1024", "--global_batch_size=512",
         "--steps_per_epoch=4", "--steps_per_execution=4", f"--model_dir={model_dir}"],
        startup_timeout=240)
    assert code == 0, output[-4000:]
    metrics = json.loads((model_dir / "metrics.json").read_text())
    # Chief-only writes.
    assert metrics["steps_per_execution"] == 4  # multi-step calls under multi-worker too
    assert metrics["distribution"] == "MultiWorkerMirroredStrategy"
    assert metrics["num_workers"] == 2 and metrics["num_replicas"] == 2
    assert (model_dir / "model.keras").is_file()
    # Only the chief wrote: one set of files, one TensorBoard run, no worker temp dirs.
    names = sorted(p.name for p in model_dir.iterdir())
    assert names == [".tfmulti-run.json", "logs", "metrics.json", "model.keras"], names
    assert "[worker 0] tfmulti: wrote" in output
    assert "[worker 1] tfmulti: wrote" not in output
    # The partial last batch: the metrics are those of the whole test split.
    test = data.load("synthetic", "test", num_examples=256)
    model = keras.models.load_model(model_dir / "model.keras")
    want = model.evaluate(test.batch(256), return_dict=True, verbose=0)
    assert metrics["test_accuracy"] == pytest.approx(want["accuracy"], abs=1e-6)
    assert metrics["test_loss"] == pytest.approx(want["loss"], abs=1e-5)


@pytest.mark.cluster
def test_train_recipe_two_workers_train_the_users_model_module(tmp_path):
    """`tfmulti launch --num_workers 2 -- python recipes/train.py --model=M:F
    --dataset=M:F`: the user's module (a dotted path from the repository root)."""
    model_dir = tmp_path / "run"
    code, output = launch_python(
        [str(RECIPES / "train.py"), "--distribution=multi_worker",
         "--model=tests.own_model:build", "--dataset=tests.own_model:data",
         "--loss=tests.own_model:smooth_loss", "--optimizer=rmsprop", "--learning_rate=0.003",
         "--global_batch_size=128", "--epochs=2", f"--model_dir={model_dir}"],
        startup_timeout=240)
    assert code == 0, output[-4000:]
    metrics = json.loads((model_dir / "metrics.json").read_text())
    assert metrics["num_workers"] == 2 and metrics["num_replicas"] == 2
    assert metrics["model"] == "tests.own_model:build" and metrics["epochs_completed"] == 2
    assert metrics["test_loss"] < 0.69 and "[worker 1] tfmulti: wrote" not in output
