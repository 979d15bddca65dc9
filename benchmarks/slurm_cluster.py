"""A real SLURM cluster on this machine, for the tests and the benchmarks of
tfmulti under SLURM: munge, slurmctld and slurmd with a private configuration
(Debian's `slurm-wlm` and `munge`; needs root; no TensorFlow).

Everything lives in one temporary folder: the munge key and socket, the
`slurm.conf`, the controller's state, the node's spool and the logs; the ports
are free ones picked at start. Nothing is read from or written to /etc/slurm,
/etc/munge or a system munge. Commands reach the cluster through
`SLURM_CONF` (`cluster.env()`):

    with SlurmCluster() as cluster:
        subprocess.run(["srun", "-n", "2", "hostname"], env=cluster.env())

One node (the default) is this host (its short name). With `nodes=N` (2 or
more), each node is a simulated host (`benchmarks.simulated_hosts`: a network
namespace with its own address) with a host name of its own, node1, node2, ...
(a UTS namespace), that the others' names resolve to (a private /etc/hosts
bound over the file in a mount namespace of its own: the machine's stays as it
is); the controller runs in one more, `ctl`, where `run` runs the commands too.
Each node has `cpus` CPUs whatever the machine has
(`SlurmdParameters=config_overrides`), so a 2-task job runs on a 1-core machine
too. On exit the jobs are cancelled, the daemons stopped, the job
steps' processes left behind (their `slurmstepd`, working in the folder)
killed and the folder removed, also after a failure; the daemons also die with
the process that started them (`PR_SET_PDEATHSIG`).
"""

from __future__ import annotations

import ctypes
import os
import re
import shutil
import signal
import socket
import subprocess
import tempfile
import time
from typing import Mapping, Sequence

from benchmarks import simulated_hosts

__all__ = ["BINARIES", "SlurmCluster", "available", "running"]

BINARIES = ("munged", "slurmctld", "slurmd", "srun", "sbatch", "scontrol", "scancel", "squeue",
            "sinfo")
"""The programs the cluster needs (Debian packages `slurm-wlm` and `munge`)."""

_SEARCH_PATH = os.pathsep.join([os.environ.get("PATH", ""), "/usr/sbin", "/usr/bin", "/sbin"])
_START_TIMEOUT_S = 60.0
_COMMAND_TIMEOUT_S = 30.0
_FINAL_STATES = ("COMPLETED", "FAILED", "CANCELLED", "TIMEOUT", "NODE_FAIL", "OUT_OF_MEMORY",
                 "BOOT_FAIL", "DEADLINE", "PREEMPTED")


def available(nodes: int = 1) -> tuple[bool, str]:
    """Whether a cluster of `nodes` nodes can be started here, and why not."""
    needed = BINARIES + (("unshare", "nsenter") if nodes > 1 else ())
    missing = [name for name in needed if shutil.which(name, path=_SEARCH_PATH) is None]
    if missing:
        return False, (f"{', '.join(missing)} not installed (Debian packages slurm-wlm and "
                       "munge; `make test` installs them)")
    if os.geteuid() != 0:
        return False, "the private slurmd runs jobs as their user and needs root"
    return simulated_hosts.available() if nodes > 1 else (True, "")


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _with_descendants(pids: list[int]) -> list[int]:
    """`pids` and every process below them."""
    children: dict[int, list[int]] = {}
    for entry in filter(str.isdigit, os.listdir("/proc")):
        try:
            with open(f"/proc/{entry}/stat") as f:
                ppid = int(f.read().rsplit(")", 1)[1].split()[1])
        except (OSError, ValueError, IndexError):
            continue
        children.setdefault(ppid, []).append(int(entry))
    found, todo = [], list(pids)
    while todo:
        pid = todo.pop()
        found.append(pid)
        todo.extend(children.get(pid, []))
    return found


def running(pid: int) -> bool:
    """Whether `pid` runs (not a zombie waiting for its parent)."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[0] != "Z"
    except (OSError, IndexError):
        return False


def _die_with_parent() -> None:
    """In the child before exec: SIGTERM when the process that started it dies."""
    ctypes.CDLL(None, use_errno=True).prctl(1, signal.SIGTERM)  # PR_SET_PDEATHSIG


_CONF = """\
ClusterName=tfmulti
SlurmctldHost={ctl}
SlurmctldPort={ctld_port}
SlurmdPort={slurmd_port}
SlurmUser=root
SlurmdUser=root
AuthType=auth/munge
CredType=cred/munge
AuthInfo=socket={dir}/munge.socket
StateSaveLocation={dir}/state
SlurmdSpoolDir={dir}/spool/%n
SlurmctldPidFile={dir}/slurmctld.pid
SlurmdPidFile={dir}/slurmd-%n.pid
SlurmctldLogFile={dir}/slurmctld.log
SlurmdLogFile={dir}/slurmd-%n.log
PlugStackConfig={dir}/plugstack.conf
ProctrackType=proctrack/linuxproc
TaskPlugin=task/none
JobContainerType=job_container/none
MpiDefault=none
SchedulerType=sched/backfill
SelectType=select/cons_tres
SelectTypeParameters=CR_CPU
SlurmdParameters=config_overrides
ReturnToService=2
KillWait={kill_wait}
AccountingStorageType=accounting_storage/none
JobAcctGatherType=jobacct_gather/none
JobCompType=jobcomp/none
{node_lines}
PartitionName=main Nodes={node_names} Default=YES MaxTime=INFINITE State=UP
"""
# A command (the arguments after the first 3) with host name $0, $1 bound over
# /etc/hosts (UTS and mount namespaces of its own) in the network namespace $2.
_IN_HOST = ["unshare", "--uts", "--mount", "--", "sh", "-c",
            'hostname "$0" && mount --bind "$1" /etc/hosts && ns="$2" && shift 2 && '
            'exec nsenter --net="$ns" -- "$@"']


class SlurmCluster:
    """A SLURM cluster of `nodes` nodes with its controller, in a private folder.

    Args:
        nodes: 1 (this host, the default), or that many simulated hosts.
        cpus: each node's CPUs as SLURM counts them (its task slots); 4 by default.
        kill_wait: seconds SLURM waits between SIGTERM and SIGKILL when it stops a
            job (cancelled, requeued, out of time); 30 by default, as SLURM's.
        directory: where to make the private folder (default: the system's
            temporary folder).

    Raises:
        RuntimeError: on entering, where SLURM cannot run here (see `available`),
            or a daemon does not come up (the message holds its log's end).
    """

    def __init__(self, nodes: int = 1, cpus: int = 4, kill_wait: int = 30,
                 directory: str | None = None, subnet: str = "10.215.0"):
        if nodes < 1:
            raise ValueError(f"`nodes` ({nodes!r}) must be 1 or more.")
        self.cpus, self.kill_wait, self._parent = cpus, kill_wait, directory
        self.nodes = ([socket.gethostname().split(".")[0]] if nodes == 1
                      else [f"node{i + 1}" for i in range(nodes)])
        """The node names, in order."""
        self.dir: str | None = None
        self._daemons: list[subprocess.Popen] = []
        self._hosts = simulated_hosts.SimulatedHosts(nodes + 1, subnet) if nodes > 1 else None

    @property
    def conf(self) -> str:
        """The path of this cluster's `slurm.conf`."""
        return os.path.join(self.dir, "slurm.conf")

    def env(self, base: Mapping[str, str] | None = None) -> dict[str, str]:
        """`base` (this process's environment by default) with `SLURM_CONF` set to this
        cluster's and SLURM's programs on `PATH`: what every client command needs."""
        env = dict(os.environ if base is None else base)
        env["SLURM_CONF"] = self.conf
        env["PATH"] = os.pathsep.join([env.get("PATH", ""), "/usr/sbin", "/usr/bin"])
        for name in [name for name in env if name.startswith(("SLURM_", "SBATCH_", "SRUN_"))]:
            if name != "SLURM_CONF":  # a job's own variables would steer the commands
                del env[name]
        return env

    def command(self, argv: Sequence[str], host: int = 0) -> list[str]:
        """`argv` as run on simulated host `host` (0: the controller's, i: node i) of a
        cluster of several nodes; `argv` itself on one node."""
        if self._hosts is None:
            return list(argv)
        name = "ctl" if host == 0 else self.nodes[host - 1]
        return [*_IN_HOST, name, os.path.join(self.dir, "hosts"),
                f"/run/netns/{self._hosts.names[host]}", *argv]

    def run(self, argv: Sequence[str], timeout: float = _COMMAND_TIMEOUT_S,
            check: bool = True, **kwargs) -> subprocess.CompletedProcess:
        """`argv` (a SLURM command) run against this cluster (on the controller's host);
        its output as text."""
        kwargs.setdefault("env", self.env())
        result = subprocess.run(self.command(argv), capture_output=True, text=True, timeout=timeout,
                                stdin=subprocess.DEVNULL, **kwargs)
        if check and result.returncode != 0:
            raise RuntimeError(f"`{' '.join(argv)}` failed ({result.returncode}): "
                               f"{(result.stderr or result.stdout).strip()[-2000:]}")
        return result

    def sbatch(self, *args: str, env: Mapping[str, str] | None = None) -> int:
        """Submits a batch job (`sbatch --parsable ARGS`); returns its id."""
        result = self.run(["sbatch", "--parsable", *args], env=self.env(env))
        return int(result.stdout.strip().split(";")[0])

    def job(self, job_id: int) -> dict[str, str]:
        """`scontrol show job` of `job_id` as {field: value} (JobState, Restarts,
        ExitCode, Reason, ...)."""
        text = self.run(["scontrol", "show", "job", "--oneliner", str(job_id)]).stdout
        return dict(re.findall(r"(\w+)=(\S*)", text))

    def wait(self, job_id: int, until=None, timeout: float = 300.0) -> dict[str, str]:
        """Polls `job(job_id)` until `until(fields)` holds (default: the job has ended);
        returns its fields.

        Raises:
            TimeoutError: not within `timeout` seconds (the message has the job's fields).
        """
        until = until or (lambda job: job.get("JobState") in _FINAL_STATES)
        deadline = time.monotonic() + timeout
        while True:
            fields = self.job(job_id)
            if until(fields):
                return fields
            if time.monotonic() > deadline:
                raise TimeoutError(f"SLURM job {job_id} still {fields.get('JobState')} "
                                   f"after {timeout:g} s: {fields}")
            time.sleep(0.2)

    def node_state(self) -> str:
        """The nodes' state as `sinfo` says it: idle, allocated, mixed, completing, ...
        (one word where all nodes are in the same state)."""
        return " ".join(sorted(set(self.run(["sinfo", "--noheader", "--Node",
                                             "--format=%T"]).stdout.split())))

    def log(self, name: str, tail: int = 3000) -> str:
        """The end of a daemon's log (`slurmctld.log`, `slurmd-NODE.log`, `munged.log`)."""
        try:
            with open(os.path.join(self.dir, name), errors="replace") as f:
                return f.read()[-tail:]
        except OSError as e:
            return f"({name}: {e})"

    # ------------------------------------------------------------------ start, stop

    def __enter__(self) -> "SlurmCluster":
        ok, why = available(len(self.nodes))
        if not ok:
            raise RuntimeError(f"cannot start SLURM here: {why}.")
        self.dir = tempfile.mkdtemp(prefix="tfmslurm", dir=self._parent)
        try:
            if self._hosts is not None:
                self._hosts.__enter__()
            self._start()
        except BaseException:
            self.__exit__()
            raise
        return self

    def _start(self) -> None:
        d = self.dir
        os.chmod(d, 0o755)  # munged wants its socket's folder searchable by all
        for sub in ("state", "spool", *(f"spool/{node}" for node in self.nodes)):
            os.mkdir(os.path.join(d, sub), 0o755)
        key = os.path.join(d, "munge.key")
        with open(os.open(key, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600), "wb") as f:
            f.write(os.urandom(1024))
        open(os.path.join(d, "plugstack.conf"), "w").close()
        if self._hosts is None:
            ctl, addresses = f"{self.nodes[0]}(127.0.0.1)", ["127.0.0.1"]
        else:
            ctl, addresses = f"ctl({self._hosts.addresses[0]})", self._hosts.addresses[1:]
            with open(os.path.join(d, "hosts"), "w") as f:
                f.write("127.0.0.1 localhost\n" + "".join(
                    f"{address} {name}\n" for address, name in
                    zip(self._hosts.addresses, ["ctl", *self.nodes])))
        node_lines = "\n".join(f"NodeName={node} NodeAddr={address} CPUs={self.cpus} "
                               "State=UNKNOWN" for node, address in zip(self.nodes, addresses))
        with open(self.conf, "w") as f:
            f.write(_CONF.format(ctl=ctl, dir=d, kill_wait=self.kill_wait,
                                 ctld_port=_free_port(), slurmd_port=_free_port(),
                                 node_lines=node_lines, node_names=",".join(self.nodes)))
        socket_path = os.path.join(d, "munge.socket")
        self._daemon(["munged", "--foreground", "--force", f"--socket={socket_path}",
                      f"--key-file={key}", f"--pid-file={d}/munged.pid",
                      f"--log-file={d}/munged.log", f"--seed-file={d}/munged.seed"])
        self._until(lambda: os.path.exists(socket_path), "munged", "munged.log")
        self._daemon(["slurmctld", "-D", "-f", self.conf])
        for i, node in enumerate(self.nodes):
            self._daemon(["slurmd", "-D", "-f", self.conf, "-N", node], host=i + 1)

        def idle() -> bool:
            try:
                return self.node_state() == "idle"
            except RuntimeError:  # the controller is not answering yet
                return False

        self._until(idle, "the nodes (sinfo: idle)", f"slurmd-{self.nodes[-1]}.log")

    def _daemon(self, argv: list[str], host: int = 0) -> None:
        path = shutil.which(argv[0], path=_SEARCH_PATH)
        log = open(os.path.join(self.dir, f"{argv[0]}{host or ''}.out"), "wb")
        argv = self.command([path, *argv[1:]], host) if argv[0] != "munged" else [path, *argv[1:]]
        with log:
            self._daemons.append(subprocess.Popen(
                argv, stdin=subprocess.DEVNULL, stdout=log, stderr=log,
                env=self.env(), cwd=self.dir, start_new_session=True,
                preexec_fn=_die_with_parent))

    def _until(self, ready, what: str, log: str) -> None:
        deadline = time.monotonic() + _START_TIMEOUT_S
        while not ready():
            dead = [p.args[0] for p in self._daemons if p.poll() is not None]
            if dead or time.monotonic() > deadline:
                why = f"{', '.join(dead)} exited" if dead else f"not within {_START_TIMEOUT_S:g} s"
                raise RuntimeError(f"SLURM: {what} did not come up ({why}); "
                                   f"{log}: {self.log(log)}")
            time.sleep(0.1)

    def processes(self) -> list[int]:
        """The live processes of this cluster: its daemons, its job steps' `slurmstepd`
        and everything they started (none once it has stopped)."""
        daemons = [p.pid for p in self._daemons if p.poll() is None]
        return [pid for pid in _with_descendants(daemons + self._step_pids()) if running(pid)]

    def _step_pids(self) -> list[int]:
        """The `slurmstepd` processes of this cluster (they work in its folder)."""
        pids = []
        for entry in filter(str.isdigit, os.listdir("/proc")):
            try:
                with open(f"/proc/{entry}/stat") as f:
                    name, state = re.match(r"\d+ \((.*)\) (\S)", f.read()).groups()
                if (name == "slurmstepd" and state != "Z"
                        and os.readlink(f"/proc/{entry}/cwd").startswith(self.dir)):
                    pids.append(int(entry))
            except (OSError, AttributeError):
                continue
        return pids

    def __exit__(self, *exc) -> None:
        if self.dir is None:
            return
        if self._daemons and all(p.poll() is None for p in self._daemons):
            jobs = self.run(["squeue", "--noheader", "--format=%i"], check=False).stdout.split()
            if jobs:  # cancelled while the controller can: SIGTERM, KillWait, SIGKILL
                self.run(["scancel", *jobs], check=False)
                deadline = time.monotonic() + self.kill_wait + 10
                while self._step_pids() and time.monotonic() < deadline:
                    time.sleep(0.2)
        for p in reversed(self._daemons):  # slurmd, slurmctld, then munged
            if p.poll() is None:
                p.terminate()
                try:
                    p.wait(timeout=15)
                except subprocess.TimeoutExpired:
                    p.kill()
                    p.wait()
        self._daemons = []
        for pid in _with_descendants(self._step_pids()):  # what its job steps left
            try:
                os.kill(pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
        if self._hosts is not None:  # kills whatever is left in the nodes' namespaces
            self._hosts.__exit__()
        shutil.rmtree(self.dir, ignore_errors=True)
        self.dir = None
