"""`tfmulti launch --hosts` on simulated hosts: network namespaces made here, one
per host with its own address (10.213.0.1, 10.213.0.2), joined by a bridge in
a namespace of its own (benchmarks.simulated_hosts), one launcher in
each. Traffic stays inside those namespaces; they, their interfaces and every
process in them are removed after each test, also after a failure.

- 2 hosts x 2 workers train exactly as MirroredStrategy over 4 devices in
  this process (tests/workers/equivalence.py, as tests/integration/test_strategy.py does
  for one host), after an impostor (below) was dropped;
- 2 hosts x 1 worker: worker 1, on host B, is SIGKILLed at step 10; with
  --max_restarts 1 on both, both hosts restart and resume from the backup
  that both see, and end with the weights of an uninterrupted MirroredStrategy
  run over 2 devices (tests/workers/resumable.py, tfmulti.training.backup);
- a host whose launcher is killed: the other's workers are stopped within
  seconds and its launcher exits non-zero;
- a host list that differs on one host: both fail at start-up, exit 2, one
  line, no worker started;
- an impostor: a third host's launcher with another secret that claims host
  1's rank is dropped by host 0 (one line), then the real host 1 joins and the
  job trains (the 2 x 2 workers above); the impostor starts no worker and exits
  2 in one line.

Skipped, with the reason, only where network namespaces cannot be made (not
root, no iproute2).
"""

from __future__ import annotations

import contextlib
import json
import os
import re
import secrets
import signal
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import numpy as np
import pytest

from tests._util import REPO, WORKERS, simulated_hosts_or_skip
from benchmarks import simulated_hosts

pytestmark = pytest.mark.cluster

LAUNCH_TIMEOUT = 600
# A plain worker, no TensorFlow: prints its TF_CONFIG index, then sleeps.
SLEEPER = textwrap.dedent('''
    import json, os, sys, time
    print("index", json.loads(os.environ["TF_CONFIG"])["task"]["index"], flush=True)
    time.sleep(float(sys.argv[1]))
''')


@pytest.fixture
def sim():
    with simulated_hosts_or_skip(2) as hosts:
        yield hosts


def _start_launcher(sim, host: int, view: str, rank: int, log_path: Path,
                    command: list[str], *options: str,
                    secret: str | None = None) -> subprocess.Popen:
    """`tfmulti launch --hosts VIEW --host_rank RANK` in simulated host `host`, with the
    hosts' shared secret (or `secret`), its output in `log_path`."""
    with open(log_path, "w") as log:
        return subprocess.Popen(
            sim.command(host, [sys.executable, "-m", "tfmulti.cli", "launch", "--hosts", view,
                               "--host_rank", str(rank), *options, "--", *command]),
            cwd=REPO, stdout=log, stderr=subprocess.STDOUT, start_new_session=True,
            env=sim.launch_env({**os.environ, "TF_CPP_MIN_LOG_LEVEL": "2"}, secret))


class _Launchers:
    """One `tfmulti launch --hosts ...` per simulated host, output in a file each."""

    def __init__(self, sim, tmp: Path, command: list[str], *options: str,
                 views: list[str] | None = None, workers: int = 1):
        default = ",".join(f"{a}:{workers}" for a in sim.addresses)
        self.views = views or [default] * len(sim.addresses)
        self.logs = [tmp / f"host{r}.log" for r in range(len(self.views))]
        self.procs = [_start_launcher(sim, rank, view, rank, self.logs[rank], command,
                                      *options) for rank, view in enumerate(self.views)]

    def output(self, rank: int) -> str:
        return self.logs[rank].read_text()

    def wait(self, timeout: float = LAUNCH_TIMEOUT) -> list[int]:
        deadline = time.monotonic() + timeout
        for proc in self.procs:
            proc.wait(timeout=max(1.0, deadline - time.monotonic()))
        return [proc.returncode for proc in self.procs]

    def kill(self) -> None:
        for proc in self.procs:
            if proc.poll() is None:
                with contextlib.suppress(ProcessLookupError):
                    os.killpg(proc.pid, signal.SIGKILL)
                proc.wait(timeout=10)


@pytest.fixture
def launchers(sim, tmp_path):
    started = []

    def start(command, *options, **kwargs):
        started.append(_Launchers(sim, tmp_path, command, *options, **kwargs))
        return started[-1]

    yield start
    for launch in started:  # the namespaces' teardown kills what is left in them
        launch.kill()


def _sleeper(tmp_path: Path, seconds: float) -> list[str]:
    script = tmp_path / "sleeper.py"
    script.write_text(SLEEPER)
    return [sys.executable, str(script), str(seconds)]


def _load(path) -> dict:
    with np.load(path) as f:
        return {k: f[k] for k in f.files}


def test_simulated_hosts_reach_each_other_and_nothing_else(sim):
    names = sim.names
    server = subprocess.Popen(
        sim.command(0, [sys.executable, "-c", textwrap.dedent('''
            import socket
            with socket.create_server(("", 5000)) as s:
                s.settimeout(60)
                c, (peer, _) = s.accept()
                print(peer, flush=True)
        ''')]), stdout=subprocess.PIPE, text=True)
    try:
        client = subprocess.run(sim.command(1, [sys.executable, "-c", textwrap.dedent(f'''
            import socket, time
            for _ in range(100):
                try:
                    socket.create_connection(("{sim.addresses[0]}", 5000), timeout=5).close()
                    break
                except ConnectionRefusedError:
                    time.sleep(0.1)
        ''')]), capture_output=True, text=True, timeout=60)
        assert client.returncode == 0, client.stderr
        assert server.communicate(timeout=60)[0].strip() == sim.addresses[1]
    finally:
        server.kill()
        server.wait(timeout=10)
    # Nothing of the simulated network is in this namespace, and it all goes on exit.
    links = subprocess.run(["ip", "-o", "link"], capture_output=True, text=True).stdout
    assert "br0" not in links and not any(f" p{i}@" in links for i in range(2))
    sim.__exit__(None, None, None)
    listed = subprocess.run(["ip", "netns", "list"], capture_output=True, text=True).stdout
    assert not any(name in listed for name in [*names, sim.switch])


def test_a_host_list_that_differs_on_one_host_fails_everywhere_at_start_up(launchers,
                                                                          tmp_path, sim):
    a, b = sim.addresses
    launch = launchers(_sleeper(tmp_path, 60), "--startup_timeout", "120",
                       views=[f"{a}:1,{b}:1", f"{a}:2,{b}:1"])
    start = time.monotonic()
    assert launch.wait(timeout=120) == [2, 2]
    assert time.monotonic() - start < 60  # not the startup timeout: at once
    for rank in (0, 1):
        text = launch.output(rank)
        assert "index" not in text, text  # no worker started
        errors = [line for line in text.splitlines() if "error" in line]
        assert len(errors) == 1, text
        assert "the launcher of host 1 sees another cluster than host 0's: its --hosts is " \
               f"['{a}:2', '{b}:1']" in errors[0], text


def _wait_for(path: Path, text: str, timeout: float = 120) -> None:
    deadline = time.monotonic() + timeout
    while text not in path.read_text():
        assert time.monotonic() < deadline, path.read_text()[-3000:]
        time.sleep(0.2)


def _assert_trained_as_mirrored_over_four_devices(tmp_path):
    """What tests/workers/equivalence.py wrote in `tmp_path` (the dict-input model, a
    functional model with 2 named inputs; tuple inputs and both kinds on one host:
    tests/integration/test_strategy.py) equals its run under MirroredStrategy over 4
    devices in this process."""
    import importlib.util

    import tfmulti

    spec = importlib.util.spec_from_file_location("equivalence_worker",
                                                  WORKERS / "equivalence.py")
    worker = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(worker)
    mirrored = tfmulti.get_strategy("mirrored", devices=[f"CPU:{i}" for i in range(4)])
    want, got = worker.run(mirrored, use_dict=True), _load(tmp_path / "dict.npz")
    assert not (tmp_path / "tuple.npz").exists()
    assert np.ptp(want["losses"]) > 1e-4  # the steps differ: equality is not vacuous
    weights = [k for k in want if k.startswith("w")]
    assert weights and sorted(weights) == sorted(k for k in got if k.startswith("w"))
    for key in ("losses", "eval_loss", "eval_accuracy", *weights):
        np.testing.assert_allclose(got[key], want[key], atol=1e-5, rtol=0, err_msg=key)


def test_an_impostor_is_refused_and_the_real_hosts_2_workers_each_train_as_mirrored(tmp_path):
    # Issue 27: a third machine that said it was host 1 (the view digest is public) got
    # `go` and `start`, and the real host 1 was refused. The job that then runs is 2
    # hosts x 2 workers, which train exactly as MirroredStrategy over 4 devices.
    ok, why = simulated_hosts.available()
    if not ok:
        pytest.skip(f"cannot make network namespaces here: {why}")
    with simulated_hosts.SimulatedHosts(3) as sim:
        a, b, c = sim.addresses
        view = f"{a}:2,{b}:2"
        command = [sys.executable, str(WORKERS / "equivalence.py"), str(tmp_path), "dict"]
        logs = {name: tmp_path / f"{name}.log" for name in ("host0", "impostor", "host1")}
        procs = {}
        try:
            procs["host0"] = _start_launcher(sim, 0, view, 0, logs["host0"], command,
                                             "--startup_timeout", "300")
            procs["impostor"] = _start_launcher(
                sim, 2, view, 1, logs["impostor"], command, "--startup_timeout", "15",
                secret=secrets.token_hex(32))  # another job's secret, on host 1's rank
            _wait_for(logs["host0"], "failed authentication")
            procs["host1"] = _start_launcher(sim, 1, view, 1, logs["host1"], command,
                                             "--startup_timeout", "300")
            codes = {name: proc.wait(timeout=LAUNCH_TIMEOUT) for name, proc in procs.items()}
        finally:
            for proc in procs.values():  # leaving the namespaces kills what is left in them
                if proc.poll() is None:
                    proc.kill()
                    proc.wait(timeout=10)
    output = {name: path.read_text() for name, path in logs.items()}
    assert codes == {"host0": 0, "impostor": 2, "host1": 0}, output
    dropped = [line for line in output["host0"].splitlines() if "authentication" in line]
    assert len(dropped) == 1 and re.fullmatch(
        rf"tfmulti launch: {re.escape(c)}:\d+ failed authentication: dropped it \(a launcher "
        r"without this job's secret; every host needs the same TFMULTI_LAUNCH_SECRET or "
        r"--secret_file\)", dropped[0]), output["host0"]
    # The impostor started nothing and said why in one line.
    assert "[worker" not in output["impostor"], output["impostor"]
    errors = [line for line in output["impostor"].splitlines() if "error" in line]
    assert errors == [f"tfmulti launch: error: the launcher of host 0 ({a}:2222) and this one "
                      "failed to authenticate each other within 15 s: they hold different "
                      "secrets; give every host the same TFMULTI_LAUNCH_SECRET or "
                      "--secret_file"], output["impostor"]
    # The secret is nowhere in what the launchers or the workers printed.
    assert sim.secret not in "".join(output.values())
    # The job trained on the real hosts: all 4 workers all-reduced (global indexes, host
    # 0's 0-1, host 1's 2-3), the chief wrote what MirroredStrategy over 4 devices gets.
    for index in range(4):
        assert f"[worker {index}] total=10.0" in output[f"host{index // 2}"].splitlines(), \
            output[f"host{index // 2}"][-3000:]
    _assert_trained_as_mirrored_over_four_devices(tmp_path)


def test_a_killed_launcher_fails_the_other_host_within_seconds(launchers, tmp_path):
    launch = launchers(_sleeper(tmp_path, 300))
    deadline = time.monotonic() + 120
    while not all("index" in launch.output(r) for r in (0, 1)):
        assert time.monotonic() < deadline, launch.output(0) + launch.output(1)
        time.sleep(0.2)
    launch.procs[1].kill()  # host B's launcher, SIGKILL
    killed_at = time.monotonic()
    codes = launch.wait(timeout=90)
    assert time.monotonic() - killed_at < 60
    assert codes[0] != 0 and codes[1] == -signal.SIGKILL, launch.output(0)
    assert "on host 1" in launch.output(0) and "stopping this host's workers" in \
        launch.output(0)
    # Each launcher said that its workers' ports are open (across hosts they must be).
    assert "host 0 of 2 (10.213.0.1): across hosts the workers cannot be isolated in a " \
           "private network namespace" in launch.output(0)


def test_a_worker_killed_on_host_b_restarts_both_hosts_from_the_shared_backup(
        launchers, tmp_path):
    import keras

    from tests.workers import resumable
    from tfmulti.config.train_config import TrainConfig
    from tfmulti.training.train import train

    # One epoch of 16 steps, a backup every 4: worker 1 dies at step 10, both hosts
    # resume at step 8.
    config = {"epochs": 1}
    launch = launchers([sys.executable, str(WORKERS / "resumable.py"), str(tmp_path),
                        "multi_worker", "--kill", "10:1", "--config", json.dumps(config)],
                       "--max_restarts", "1", "--grace_period", "5",
                       "--startup_timeout", "300")
    codes = launch.wait()
    outputs = [launch.output(r) for r in (0, 1)]
    assert codes == [0, 0], "\n".join(o[-3000:] for o in outputs)
    assert "[worker 1] resumable: worker 1 sends itself SIGKILL at step 10" in outputs[1]
    assert "worker 1 failed with exit code 137 (killed by SIGKILL) on host 1" in outputs[0]
    resumed = f"resuming from {tmp_path / 'backup' / 'tfmulti-ckpt-8'}: global step 8"
    for rank in (0, 1):
        assert f"restart 1 of 1: starting this host's workers again" in outputs[rank]
        assert f"[worker {rank}] tfmulti: {resumed}" in outputs[rank], outputs[rank][-3000:]

    class Keep(keras.callbacks.Callback):
        def on_train_end(self, logs=None):
            self.weights = [np.array(w) for w in self.model.get_weights()]

    keep = Keep()  # the uninterrupted run, on one host: MirroredStrategy over 2 devices
    train(TrainConfig(**{**resumable.FIELDS, **config, "verbose": 0},
                      distribution="mirrored", devices=("CPU:0", "CPU:1"),
                      backup_dir=str(tmp_path / "reference")), callbacks=[keep])
    final = _load(tmp_path / "final.npz")
    assert int(final.pop("iterations")) == 16
    got = [final[f"arr_{i}"] for i in range(len(final))]
    assert len(got) == len(keep.weights)
    for a, b in zip(got, keep.weights):
        np.testing.assert_allclose(a, b, atol=1e-5, rtol=0)


def test_the_all_reduce_across_two_hosts_sums_both_workers(tmp_path):
    """The scaling suite's all-reduce through the simulated network (its own hosts)."""
    ok, why = simulated_hosts.available()
    if not ok:
        pytest.skip(f"cannot make network namespaces here: {why}")
    from benchmarks import scaling

    milliseconds, reduced = scaling.all_reduce_milliseconds(
        str(tmp_path / "reduce"), across_hosts=True, iterations=3, repeats=2)
    assert reduced == 4 * 34826 and len(milliseconds) == 2
    worker1 = json.loads((tmp_path / "reduce" / "worker1.json").read_text())
    assert worker1["reduced_sum"] == pytest.approx(2 * worker1["local_sum"], rel=1e-4)
    listed = subprocess.run(["ip", "netns", "list"], capture_output=True, text=True).stdout
    assert f"tfmsim{os.getpid()}x" not in listed  # its hosts are gone with their launch
