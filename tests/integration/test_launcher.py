"""Tests of tfmulti.cluster.launcher (`launch`, `tfmulti launch`) end to end:
output prefixes, CPU pinning, the isolation warning, exit statuses, a failing
or dying worker, SIGINT, a killed launcher, restarts, a port in use, network
isolation and the isolated workers' outbound network, and recipes/train.py on
2 workers.

The mechanics use a tiny plain-Python worker (no TensorFlow). Isolation on
this host is checked by reading /proc/net/tcp{,6}; the outbound network of
isolated workers (slirp4netns) on simulated hosts (benchmarks.simulated_hosts:
network namespaces made here, joined by a bridge of their own), where a
worker connects to a server on another simulated host, and that host cannot
connect to the workers' ports; no other connection leaves this machine's
loopback. Every test starts the launcher (marker `cluster`); every launcher is
reaped, and a launcher started as a process is killed with its workers (and
slirp4netns) if a test fails.
"""

from __future__ import annotations

import contextlib
import functools
import io
import json
import os
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import textwrap
import time
from pathlib import Path

import pytest

from tests._util import RECIPES, REPO, WORKERS, launch_python, simulated_hosts_or_skip
from tfmulti.cluster import exit_codes, launch, launcher, outbound, plan
from tfmulti.cluster._process import children

pytestmark = pytest.mark.cluster

LAUNCH_TIMEOUT = 60

# A tiny worker: writes its pid (as the host sees it: the launch runs in a PID namespace),
# then behaves as argv[2] says. No TensorFlow.
WORKER = textwrap.dedent('''
    import json, os, socket, sys, time
    HOST_PID = "int(open('/proc/self/status').read().split('NSpid:')[1].split()[0])"
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

    touch(f"pid-{rank}", str(eval(HOST_PID)))
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
        child = subprocess.Popen([sys.executable, "-c", (
            "import os, sys, time\\n"
            f"pid = {HOST_PID}\\n"
            f"open(os.path.join(sys.argv[1], 'child-{rank}.tmp'), 'w').write(str(pid))\\n"
            f"os.replace(os.path.join(sys.argv[1], 'child-{rank}.tmp'), "
            f"os.path.join(sys.argv[1], 'child-{rank}'))\\n"
            "time.sleep(300)"), d])
        time.sleep(300)
    elif mode == "exit_76_once":  # preempted without a save, then a clean run
        if not os.path.exists(os.path.join(d, f"preempted-{rank}")):
            touch(f"preempted-{rank}")
            sys.exit(76)
    elif mode == "tmp":  # a file in its temporary folder; worker 1 then dies by SIGKILL
        import signal, tempfile
        touch(f"tmp-{rank}", tempfile.mkstemp(prefix="left-")[1])
        if rank == 1:
            wait_for("tmp-0")
            os.kill(os.getpid(), signal.SIGKILL)
        time.sleep(300)
    elif mode in ("listen", "outbound"):
        if mode == "outbound":  # out of the namespace: the server named in `target-RANK`
            touch(f"interfaces-{rank}", " ".join(n for _, n in socket.if_nameindex()))
            host, port = open(os.path.join(d, f"target-{rank}")).read().split()
            try:
                socket.create_connection((host, int(port)), timeout=30).close()
                touch(f"reached-{rank}", "yes")
            except OSError as e:
                touch(f"reached-{rank}", repr(e))
        s = socket.socket(socket.AF_INET6, socket.SOCK_STREAM)  # like gRPC: [::]:port,
        s.setsockopt(socket.IPPROTO_IPV6, socket.IPV6_V6ONLY, 0)  # SO_REUSEADDR
        s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
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
    return launcher._probe_namespaces()[0] is not None


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

    def __init__(self, tmp: Path, mode: str, *options: str, num_workers: int = 2,
                 env: dict | None = None, where=lambda argv: argv):
        self.tmp, self.num_workers = tmp, num_workers
        script = tmp / "worker.py"
        script.write_text(WORKER)
        self.proc = subprocess.Popen(
            where([sys.executable, "-m", "tfmulti.cli", "launch", "--num_workers",
                   str(num_workers), *options, "--", sys.executable, str(script), str(tmp),
                   mode]),
            cwd=REPO, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
            start_new_session=True, env=env)
        # The launcher's own children (as the host sees them: it is not in the launch's
        # PID namespace) live while it runs; `kill` ends them too.
        self.helpers: set[int] = set()

    def children_named(self, name: str) -> list[int]:
        """The launcher's children whose command line holds `name`."""
        found = [pid for pid in children(self.proc.pid)
                 if name.encode() in _cmdline(pid)]
        self.helpers.update(found)
        return found

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
        for pid in [*_processes_with(str(self.tmp)), *filter(_alive, self.helpers)]:
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, signal.SIGKILL)


def _cmdline(pid: int) -> bytes:
    with contextlib.suppress(OSError):
        return Path(f"/proc/{pid}/cmdline").read_bytes()
    return b""


@pytest.fixture
def cli_launcher(tmp_path):
    started = []

    def start(mode, *options, num_workers=2, env=None, where=lambda argv: argv):
        started.append(_Launcher(tmp_path, mode, *options, num_workers=num_workers, env=env,
                                 where=where))
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


def _deny_namespaces(tmp: Path) -> dict:
    """An environment whose PATH finds an `unshare` that fails as in a container without
    the capability (and no unprivileged user namespaces)."""
    bin_dir = tmp / "denied-bin"
    bin_dir.mkdir()
    fake = bin_dir / "unshare"
    fake.write_text("#!/bin/sh\necho 'unshare: unshare failed: Operation not permitted' >&2\n"
                    "exit 1\n")
    fake.chmod(0o755)
    return {**os.environ, "PATH": f"{bin_dir}{os.pathsep}{os.environ['PATH']}"}


def _processes_with(marker: str) -> list[int]:
    """Live processes whose command line holds `marker`."""
    found = []
    for entry in Path("/proc").iterdir():
        if entry.name.isdigit():
            with contextlib.suppress(OSError):
                if marker.encode() in (entry / "cmdline").read_bytes() \
                        and _alive(int(entry.name)):
                    found.append(int(entry.name))
    return found


def test_isolation_fails_closed_where_no_namespace_can_be_made(tmp_path):
    # No namespace (simulated by an `unshare` that is denied): one line, exit 2, and no
    # worker started; --no_isolate runs them (open on all interfaces, as it says).
    script = tmp_path / "worker.py"
    script.write_text(WORKER)
    command = [sys.executable, "-m", "tfmulti.cli", "launch", "--num_workers", "2", "--",
               sys.executable, str(script), str(tmp_path), "print"]
    env = _deny_namespaces(tmp_path)
    result = subprocess.run(command, cwd=REPO, capture_output=True, text=True, env=env,
                            timeout=LAUNCH_TIMEOUT)
    assert result.returncode == 2, result.stdout + result.stderr
    assert result.stdout == ""
    (line,) = result.stderr.splitlines()
    assert line.startswith(
        "tfmulti launch: error: cannot isolate the workers in a private network namespace "
        "(`unshare --pid --net`: unshare: unshare failed: Operation not permitted; "
        "`unshare --pid --net --map-root-user`: unshare: unshare failed: Operation not "
        "permitted), and their "
        "TensorFlow gRPC ports are unauthenticated: nothing was started."), line
    assert "or pass --no_isolate" in line
    time.sleep(1)
    assert not list(tmp_path.glob("pid-*")) and not _processes_with(str(tmp_path))

    opened = subprocess.run([*command[:4], "--no_isolate", *command[4:]], cwd=REPO,
                            capture_output=True, text=True, env=env, timeout=LAUNCH_TIMEOUT)
    assert opened.returncode == 0, opened.stdout + opened.stderr
    assert "[worker 1] out line of 1" in opened.stdout.splitlines()
    assert "tfmulti launch: warning: --no_isolate: the workers' TensorFlow gRPC ports are " \
           "unauthenticated and open on all interfaces" in opened.stdout.splitlines()


def test_the_unprivileged_mode_runs_in_a_user_namespace(monkeypatch):
    # What a non-root user gets where user namespaces are allowed (here forced, as root):
    # the same isolation, the workers mapped to root of a new user namespace, and the
    # namespace's outbound interface where slirp4netns is installed.
    _needs_isolation()
    monkeypatch.setattr(launcher, "ISOLATION_MODES", ("userns",))
    code, output = launch_python(
        ["-c", "import socket; print('uid_map', open('/proc/self/uid_map').read().split(), "
               "[name for _, name in socket.if_nameindex()])"], num_workers=1)
    assert code == 0, output
    assert "workers are isolated in a private network namespace" in output
    interfaces = ['lo', 'tap0'] if outbound.find() else ['lo']
    assert f"[worker 0] uid_map ['0', '0', '1'] {interfaces}" in output.splitlines()


def test_an_unprivileged_users_isolated_workers_keep_the_outbound_network(tmp_path):
    # The usual case on a laptop: not root. `unshare` maps the user to root of a new user
    # namespace, and slirp4netns must join that namespace to configure the network. Run
    # as nobody, capabilities dropped, with /dev/net/tun open to all as distributions
    # ship it (this machine's is 0600: a node of the same device is bind-mounted over it
    # in a mount namespace of this test's, gone with it), the package copied where
    # nobody can read it, and the system's Python (the virtual environment's is root's).
    _needs_outbound_tool()
    python = shutil.which("python3", path="/usr/bin:/bin")
    if python is None or not shutil.which("setpriv"):
        pytest.skip("needs /usr/bin/python3 and setpriv (util-linux)")
    shared = Path(tempfile.mkdtemp(prefix="tfmulti-nobody-"))
    try:
        shared.chmod(0o755)
        shutil.copytree(REPO / "tfmulti", shared / "tfmulti",
                        ignore=shutil.ignore_patterns("__pycache__"))
        (shared / "dev").mkdir()
        script = ("import socket; print('interfaces', [n for _, n in socket.if_nameindex()])"
                  "; socket.create_server(('127.0.0.1', 0)).close()")
        as_nobody = textwrap.dedent(f'''
            mount -t tmpfs -o size=1m tmpfs {shared}/dev && mknod -m 666 {shared}/dev/tun \\
              c 10 200 && mount --bind {shared}/dev/tun /dev/net/tun && exec setpriv \\
              --reuid=65534 --regid=65534 --clear-groups --inh-caps=-all \\
              --bounding-set=-all env HOME={shared} TMPDIR={shared} PYTHONPATH={shared} \\
              {python} -c "from tfmulti.cluster import launch; import sys; \\
              sys.exit(launch(['{python}', '-c', \\"{script}\\"], num_workers=1))"
        ''')
        result = subprocess.run(["unshare", "--mount", "--propagation", "private", "sh", "-c",
                                 as_nobody], capture_output=True, text=True,
                                timeout=LAUNCH_TIMEOUT)
    finally:
        shutil.rmtree(shared, ignore_errors=True)
    assert result.returncode == 0, result.stdout + result.stderr
    assert "they reach the network outbound only, through slirp4netns" in result.stdout
    assert "[worker 0] interfaces ['lo', 'tap0']" in result.stdout.splitlines(), \
        result.stdout
    assert "/dev/net/tun" not in Path("/proc/self/mounts").read_text()  # nothing leaked


def _needs_outbound_tool() -> None:
    _needs_isolation()
    if outbound.find() is None:
        pytest.skip(f"{outbound.TOOL} is not installed (`make test` installs the package "
                    f"{outbound.PACKAGE})")
    if not os.path.exists("/dev/net/tun"):
        pytest.skip(f"no /dev/net/tun here (a container without it): {outbound.TOOL} "
                    "cannot make the namespace's interface")


@pytest.fixture
def sim():
    with simulated_hosts_or_skip(2) as hosts:
        yield hosts


# From a simulated host: how a connection to each address:port given ends.
PROBE = textwrap.dedent('''
    import json, socket, sys
    ends = {}
    for target in sys.argv[1:]:
        host, port = target.rsplit(":", 1)
        try:
            socket.create_connection((host, int(port)), timeout=10).close()
            ends[target] = "connected"
        except OSError as e:
            ends[target] = type(e).__name__ + (f" errno {e.errno}" if e.errno else "")
    print(json.dumps(ends))
''')


def test_isolated_workers_reach_another_host_and_it_cannot_reach_their_ports(
        cli_launcher, sim, tmp_path):
    # Issue 29: isolated workers had only `lo` (no bucket, tracker or download). The
    # launcher runs on simulated host A; worker 0 connects to a server on simulated host
    # B, worker 1 to one on A's loopback (at slirp4netns' gateway), while B (and A
    # itself) cannot connect to their ports.
    _needs_outbound_tool()
    a, b = sim.addresses
    accept = textwrap.dedent('''
        import socket, sys
        with socket.create_server((sys.argv[1], 5000)) as s:
            s.settimeout(120)
            print(s.accept()[1][0], flush=True)
    ''')
    servers = [subprocess.Popen(sim.command(host, [sys.executable, "-c", accept, address]),
                                stdout=subprocess.PIPE, text=True)
               for host, address in ((1, b), (0, "127.0.0.1"))]
    try:
        (tmp_path / "target-0").write_text(f"{b} 5000")
        (tmp_path / "target-1").write_text(f"{outbound.GATEWAY} 5000")
        lau = cli_launcher("outbound", where=functools.partial(sim.command, 0))
        _wait_for(lambda: all((tmp_path / f"ready-{i}").exists() for i in (0, 1)), 60,
                  "the workers to listen")
        (helper,) = lau.children_named(outbound.TOOL)
        ports = [int((tmp_path / f"ready-{i}").read_text()) for i in (0, 1)]
        probes = {host: subprocess.run(
            sim.command(host, [sys.executable, "-c", PROBE,
                               *(f"{address}:{p}" for p in ports
                                 for address in (a, "127.0.0.1", outbound.ADDRESS))]),
            capture_output=True, text=True, timeout=60) for host in (0, 1)}
        (tmp_path / "stop").touch()
        code, out, err = lau.finish()
        peers = [server.communicate(timeout=60)[0].strip() for server in servers]
    finally:
        for server in servers:
            if server.poll() is None:
                server.kill()
                server.wait(timeout=10)
    assert code == 0, out + err
    assert "they reach the network outbound only, through slirp4netns" in out
    for i in (0, 1):
        assert (tmp_path / f"reached-{i}").read_text() == "yes"
        assert (tmp_path / f"interfaces-{i}").read_text() == "lo tap0"
    # B sees host A's address, A's loopback its own: the namespace's is nowhere outside.
    assert peers == [a, "127.0.0.1"]
    for host, probe in probes.items():
        assert probe.returncode == 0, probe.stderr
        for target, end in json.loads(probe.stdout).items():
            # Nothing listens on A's addresses, and no host has a route to the namespace.
            want = ("OSError errno 101" if target.startswith(outbound.ADDRESS)
                    else "ConnectionRefusedError errno 111")
            assert end == want, (host, target, end)
    _wait_for(lambda: not _alive(helper), 10, "slirp4netns to exit with the launch")
    assert not _processes_with(str(tmp_path))


# A resolver on 127.0.0.53:53 (as systemd-resolved's): every name is argv[1] (A records;
# no AAAA), for 120 s.
RESOLVER = textwrap.dedent('''
    import socket, struct, sys, time
    answer = socket.inet_aton(sys.argv[1])
    with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as s:
        s.bind(("127.0.0.53", 53))
        s.settimeout(1)
        deadline = time.monotonic() + 120
        while time.monotonic() < deadline:
            try:
                query, peer = s.recvfrom(512)
            except socket.timeout:
                continue
            end = query.index(b"\\0", 12) + 5  # the question: name, type, class
            is_a = query[end - 4:end - 2] == b"\\0\\1"
            header = query[:2] + b"\\x81\\x80" + struct.pack(">HHHH", 1, int(is_a), 0, 0)
            record = b"\\xc0\\x0c" + struct.pack(">HHIH", 1, 1, 60, 4) + answer
            s.sendto(header + query[12:end] + (record if is_a else b""), peer)
''')


def test_isolated_workers_look_names_up_through_a_resolver_on_the_hosts_loopback(
        cli_launcher, sim, tmp_path):
    # Where the host's /etc/resolv.conf names only 127.0.0.53 (systemd-resolved, here a
    # file bind-mounted in a mount namespace of the test's), the workers' namespace gets
    # its own naming slirp4netns' forwarder, which asks the host's resolver: a worker
    # connects to B by a name that only that resolver knows.
    _needs_outbound_tool()
    a, b = sim.addresses
    resolv = tmp_path / "resolv.conf"
    resolv.write_text("nameserver 127.0.0.53\noptions edns0 trust-ad\n")
    procs = [subprocess.Popen(sim.command(0, [sys.executable, "-c", RESOLVER, b])),
             subprocess.Popen(sim.command(1, [sys.executable, "-c", textwrap.dedent('''
                 import socket, sys
                 with socket.create_server((sys.argv[1], 5000)) as s:
                     s.settimeout(120)
                     for _ in range(2):
                         s.accept()[0].close()
             '''), b]))]
    try:
        for rank in (0, 1):
            (tmp_path / f"target-{rank}").write_text("tracker.example 5000")

        def where(argv):  # the host's resolver on its loopback, in the test's mounts only
            return ["unshare", "--mount", "--propagation", "private", "sh", "-c",
                    'mount --bind "$0" /etc/resolv.conf && exec "$@"', str(resolv),
                    *sim.command(0, argv)]

        lau = cli_launcher("outbound", where=where)
        _wait_for(lambda: all((tmp_path / f"ready-{i}").exists() for i in (0, 1)), 60,
                  "the workers to listen")
        (tmp_path / "stop").touch()
        code, out, err = lau.finish()
    finally:
        for proc in procs:
            proc.kill()
            proc.wait(timeout=10)
    assert code == 0, out + err
    for rank in (0, 1):
        assert (tmp_path / f"reached-{rank}").read_text() == "yes", out
    assert "name lookups may fail" not in out
    assert Path("/etc/resolv.conf").read_text() != resolv.read_text()  # nothing leaked


def _one_worker_with_loopback_only() -> list[str]:
    """Launches one isolated worker that lists its interfaces, asserts it sees only
    `lo`, and returns the launch's output lines."""
    code, output = launch_python(
        ["-c", "import socket; print('interfaces', [n for _, n in socket.if_nameindex()])"],
        num_workers=1)
    assert code == 0, output
    lines = output.splitlines()
    assert "[worker 0] interfaces ['lo']" in lines
    return lines


def test_without_the_networking_tool_isolated_workers_have_loopback_and_are_told(
        monkeypatch):
    _needs_isolation()
    monkeypatch.setattr(outbound, "find", lambda: None)
    lines = _one_worker_with_loopback_only()
    (said,) = [line for line in lines if "isolated" in line]
    assert said.endswith("they have no network beyond it (no bucket, tracker or download); "
                         "install the package slirp4netns to keep their outbound access "
                         "(--no_isolate turns isolation off)")


def test_a_networking_tool_that_fails_leaves_loopback_and_one_line(monkeypatch, tmp_path):
    _needs_isolation()
    fake = tmp_path / "slirp4netns"
    fake.write_text("#!/bin/sh\necho 'slirp4netns: cannot open /dev/net/tun' >&2\nexit 1\n")
    fake.chmod(0o755)
    monkeypatch.setattr(outbound, "find", lambda: str(fake))
    lines = _one_worker_with_loopback_only()
    assert [line for line in lines if "outbound network (" in line] == [
        "tfmulti launch: the workers have no outbound network (slirp4netns failed: "
        "slirp4netns: cannot open /dev/net/tun); they run with loopback only"]


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


def test_preempted_without_a_backup_is_not_reported_as_saved(tmp_path):
    # Exit 76: SIGTERM, but the workers did not agree on a step, so nothing new was saved;
    # the launcher must not say the backup is saved, and --max_restarts still restarts.
    code, out = _launch_worker(tmp_path, "exit_76_once", isolate=False, grace_period=5)
    assert code == exit_codes.PREEMPTED_UNSAVED, out
    assert "its backup is saved" not in out
    assert "the cluster was preempted, but NO NEW BACKUP was saved (the workers did not " \
           "agree on a step to save at); a restart resumes from the previous backup" in out

    for name in ("preempted-0", "preempted-1"):
        (tmp_path / name).unlink()
    code, out = _launch_worker(tmp_path, "exit_76_once", isolate=False, grace_period=5,
                               max_restarts=1)
    assert code == 0, out
    assert "its backup is saved" not in out
    assert "the cluster was preempted, but NO NEW BACKUP was saved" in out
    assert "; 1 restart left" in out and "restart 1 of 1" in out


def test_each_worker_has_a_private_tmpdir_removed_however_it_ended(tmp_path, monkeypatch):
    """What a SIGKILLed worker (or TensorFlow's autograph, which removes its
    sources only at a normal exit) leaves in its temporary folder does not pile
    up in the launcher's: worker 1 is SIGKILLed, worker 0 stopped, and both
    workers' temporary folders are gone."""
    outer = tmp_path / "tmp"
    outer.mkdir()
    monkeypatch.setenv("TMPDIR", str(outer))
    code, out = _launch_worker(tmp_path, "tmp", grace_period=1)
    assert code == 128 + signal.SIGKILL, out
    left = [Path((tmp_path / f"tmp-{rank}").read_text()) for rank in (0, 1)]
    assert left[0].parent != left[1].parent  # private: one folder per worker
    for path in left:
        assert path.parent.parent == outer and path.name.startswith("left-")
        assert not path.exists()
    assert list(outer.iterdir()) == []


def test_launcher_reports_each_restart_and_gives_up():
    # From tests/unit/test_backup.py.
    code, text = launch_python(["-c", "import sys; sys.exit(3)"], max_restarts=2,
                               grace_period=1)
    assert code == 3, text
    assert "restart 1 of 2" in text and "restart 2 of 2" in text, text
    assert "giving up after 2 restarts; exit status 3" in text
    assert text.count("failed with exit code 3") == 3


def test_a_worker_killed_by_sigkill_is_not_reported_as_the_supervisor_killed():
    """The launch ends with the killed worker's status, 137, which is also what a
    SIGKILLed supervisor gives: only the supervisor's own death is reported as such."""
    code, text = launch_python(
        ["-c", "import json, os, signal, time\n"
               "if json.loads(os.environ['TF_CONFIG'])['task']['index'] == 1:\n"
               "    os.kill(os.getpid(), signal.SIGKILL)\n"
               "time.sleep(60)\n"], grace_period=1)
    assert code == 128 + signal.SIGKILL, text
    assert "worker 1 failed with exit code 137 (killed by SIGKILL)" in text, text
    assert "the supervisor was killed" not in text, text
    assert "internal:" not in text, text


@pytest.mark.parametrize("code", sorted(exit_codes.FINAL))
def test_launcher_does_not_restart_an_exit_a_restart_would_repeat(code):
    """Bad input (2) or a NaN loss (65) ends every attempt the same way."""
    status, text = launch_python(["-c", f"import sys; sys.exit({code})"], max_restarts=2,
                                 grace_period=1)
    assert status == code, text
    assert "restart 1 of 2" not in text and "restarts left" not in text, text
    assert f"not restarted (exit status {code} ends every attempt the same way)" in text


@ISOLATION
def test_sigint_to_the_launcher_stops_all_workers(cli_launcher, isolate):
    options = () if isolate else ("--no_isolate",)
    lau = cli_launcher("sleep", *options)
    pids = lau.wait_for_pids(("pid", "child"))
    lau.proc.send_signal(signal.SIGINT)
    code, out, err = lau.finish(timeout=30)
    assert code == 130, out + err
    assert "got SIGINT; stopping the workers" in out
    summary = [line for line in out.splitlines()
               if line.startswith("tfmulti launch: stopped by SIGINT to the launcher: ")]
    assert len(summary) == 1 and summary[0].endswith("; exit status 130"), out
    for pid in pids:
        assert not _alive(pid), f"worker process {pid} is still running"


def _tmpdir_inside(tmp_path: Path, monkeypatch) -> None:
    """A launch whose launcher or supervisor gets SIGKILL cannot remove its workers'
    temporary folders: they go to the test's own folder, not /tmp."""
    (tmp_path / "tmp").mkdir()
    monkeypatch.setenv("TMPDIR", str(tmp_path / "tmp"))


@ISOLATION
def test_a_killed_launcher_leaves_no_worker_behind(cli_launcher, isolate, tmp_path,
                                                   monkeypatch):
    _tmpdir_inside(tmp_path, monkeypatch)
    options = () if isolate else ("--no_isolate",)
    lau = cli_launcher("sleep", *options)
    pids = lau.wait_for_pids(("pid", "child"))
    helpers = lau.children_named(outbound.TOOL)  # the isolated workers' network
    assert len(helpers) == (1 if isolate and outbound.find() else 0), helpers
    lau.proc.kill()  # SIGKILL: no chance to clean up; the supervisor must do it
    lau.finish(timeout=10)
    _wait_for(lambda: not any(_alive(p) for p in pids + helpers), 20,
              f"the workers, their children and slirp4netns {pids + helpers} to exit")


@pytest.mark.parametrize("namespaces", [True, False], ids=["pid_namespace", "subreaper"])
def test_a_killed_supervisor_leaves_no_process_behind(cli_launcher, tmp_path, namespaces,
                                                      monkeypatch):
    # The out-of-memory killer's SIGKILL to the supervisor: the workers die by their
    # parent-death signal, and their own children (not in the workers' process groups'
    # reach) must die too: by the PID namespace's end, or, where no namespace can be made
    # (an `unshare` that is denied, --no_isolate), by the reaper above the supervisor.
    _tmpdir_inside(tmp_path, monkeypatch)
    options = () if namespaces else ("--no_isolate",)
    env = None if namespaces else _deny_namespaces(tmp_path)
    lau = cli_launcher("sleep", *options, env=env)
    pids = lau.wait_for_pids(("pid", "child"))
    marked = _processes_with(str(tmp_path))
    assert set(pids) <= set(marked), (pids, marked)
    # The supervisor's parent (under `unshare --pid`), beside slirp4netns when isolated.
    (middle,) = lau.children_named("tfmulti.cluster.supervisor")
    (supervisor,) = children(middle)
    assert b"tfmulti.cluster.supervisor" in Path(f"/proc/{supervisor}/cmdline").read_bytes()
    os.kill(supervisor, signal.SIGKILL)
    code, out, err = lau.finish(timeout=30)
    _wait_for(lambda: not _processes_with(str(tmp_path)), 20,
              f"every process of the launch {marked} to exit")
    assert code == 137, out + err
    assert "the supervisor was killed (SIGKILL, e.g. by the out-of-memory killer)" in out
    assert not any(_alive(pid) for pid in lau.helpers), "slirp4netns outlived the launch"


def test_port_in_use_is_a_clear_error():
    # The command's contract: one line, exit status 2 (the message itself:
    # tests/unit/test_supervisor.py).
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
    for rank in (0, 1):  # both started (their pids are of the launch's PID namespace)
        assert (tmp_path / f"worker-{rank}.pid").is_file()
    assert not _processes_with(str(tmp_path)), "a worker is still running"


def test_train_recipe_two_workers_chief_only_writes_and_evaluates_a_partial_last_batch(
        tmp_path):
    # recipes/train.py on 2 workers, synthetic
    # data, 1 epoch of 4 steps in one call (--steps_per_execution=4). The
    # test split is 1024 // 4 = 256 examples at global batch 512: worker 1's
    # share of the only test batch is empty, which crashed conv models under
    # oneDNN (the keras_fixes fix "convolutions on an empty batch under oneDNN").
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
