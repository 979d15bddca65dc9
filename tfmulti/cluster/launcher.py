"""Local launcher for MultiWorkerMirroredStrategy clusters: TensorFlow's `torchrun`.

    tfmulti launch --num_workers 2 -- python train.py --epochs 1

starts 2 processes of `python train.py --epochs 1` on this host, each with its own
`TF_CONFIG` (worker 0 is the chief), prefixes their output with `[worker I]`, stops all of
them when one fails or the launcher gets Ctrl-C/SIGTERM, and exits with the chief's status.

TensorFlow's gRPC servers are unauthenticated and listen on all interfaces, so by default the
workers run inside one private network namespace (`unshare --net`): nothing they open is
reachable from outside it. Where slirp4netns is installed they keep outbound network access
through it (`tfmulti.cluster.outbound`); elsewhere they have loopback only, and the launcher
says so. Where no such namespace can be made, the launch fails closed (one line, exit 2)
unless `--no_isolate` was given. The launcher needs Linux (util-linux `unshare`, prctl);
elsewhere it fails at once (one line, exit 2).

From Python or a notebook:

    from tfmulti.cluster import launch
    from tfmulti.cluster.notebook_launcher import notebook_launcher

    launch(["python", "train.py"], num_workers=2)     # the chief's exit status

    def train(lr):
        import tfmulti
        strategy = tfmulti.get_strategy("multi_worker")
        ...
        return history.history

    history = notebook_launcher(train, args=(0.01,), num_workers=2)

Layout: `tfmulti.cluster.plan` computes the plan, ports, environments and commands (pure
functions); this module starts the supervisor (`tfmulti.cluster.supervisor`) as the init of
a new PID namespace (`unshare --pid`, with `--net` when isolated), which starts the
workers and passes their output, signals and exit codes through. The supervisor stops the
workers even if the launcher is killed (e.g. a notebook kernel restart), via parent-death
signals; if the supervisor itself is killed, the kernel kills everything in its namespace.
"""

from __future__ import annotations

import ctypes
import os
import shutil
import signal
import socket
import subprocess
import sys
import threading
import time
from typing import Sequence, TextIO

from tfmulti.cluster._process import (ERROR_PREFIX, NAMESPACE_READY, NETWORK_ATTACHED, POLL_S,
                                      READER_JOIN_S, REAP_TIMEOUT_S, SUPERVISOR_ENDED, Output,
                                      StopSignals, children, pump)
from tfmulti.cluster import auth
from tfmulti.cluster import outbound as outbound_lib
from tfmulti.cluster import gpus as gpus_lib
from tfmulti.cluster import hosts as hosts_lib
from tfmulti.cluster.exit_codes import exit_status
from tfmulti.cluster.plan import (DEFAULT_GRACE_PERIOD, DEFAULT_STARTUP_TIMEOUT,
                                  ISOLATION_MODES, LaunchPlan, check_numbers, isolation_prefix,
                                  make_plan, supervisor_command)

__all__ = ["launch"]

_PROBE_TIMEOUT_S = 10.0
_SUPERVISOR_EXTRA_S = 15.0  # the supervisor's own stop time on top of the grace period
_SWEEP_S = 10.0  # the reaper's sweep after the supervisor is gone
_RESOLVE_TIMEOUT_S = 15.0
_PR_SET_PDEATHSIG = 1
# What the supervisor's parent does in the namespaces: fork the namespace's init.
_PROBE = "import os\nif not os.fork(): os._exit(0)\nos.wait()"


def _probe_namespaces(network: bool = True) -> tuple[str | None, str]:
    """The namespace mode (`ISOLATION_MODES`) that works here for a PID namespace, plus a
    network namespace when `network`; or None and why none does."""
    if shutil.which("unshare") is None:
        return None, "the `unshare` command (util-linux) is not installed"
    reasons = []
    for mode in ISOLATION_MODES:
        prefix = isolation_prefix(mode, network)
        cmd = [*prefix, "--", sys.executable, "-S", "-c", _PROBE]
        try:
            result = subprocess.run(cmd, capture_output=True, text=True,
                                    timeout=_PROBE_TIMEOUT_S, stdin=subprocess.DEVNULL)
        except (OSError, subprocess.TimeoutExpired) as e:
            reasons.append(f"`{' '.join(prefix)}`: {e}")
            continue
        if result.returncode == 0:
            return mode, ""
        reasons.append(f"`{' '.join(prefix)}`: {result.stderr.strip() or result.returncode}")
    return None, "; ".join(reasons)


def _isolation_error(reason: str) -> ValueError:
    return ValueError(
        f"cannot isolate the workers in a private network namespace ({reason}), and their "
        "TensorFlow gRPC ports are unauthenticated: nothing was started. Run as root or "
        "allow unprivileged user namespaces (sysctl kernel.unprivileged_userns_clone=1, "
        "user.max_user_namespaces > 0), or pass --no_isolate (isolate=False) to run them "
        "open on all interfaces of a host whose network you trust.")


def _check_linux(platform: str) -> None:
    """Refuses any OS but Linux, before anything starts.

    Raises:
        ValueError: naming `platform` and where to run instead.
    """
    if not platform.startswith("linux"):
        raise ValueError(
            f"`tfmulti launch` needs Linux (it isolates and reaps the workers with Linux "
            f"namespaces and prctl: util-linux `unshare`), and this is {platform!r}: run it "
            "on a Linux host, container or VM (WSL 2 on Windows); on one machine without "
            "it, train on its devices in one process (`tfmulti train --distribution "
            "mirrored`).")


def _isolation_message(tool: str | None) -> str:
    """What isolation gives and costs, with or without the outbound network `tool`."""
    if tool:
        return ("workers are isolated in a private network namespace: their ports are not "
                "reachable from outside it; they reach the network outbound only, through "
                f"{outbound_lib.TOOL} (--no_isolate turns isolation off)")
    return ("workers are isolated in a private network namespace: their ports are not "
            "reachable from outside it, and they have no network beyond it (no bucket, "
            "tracker or download); install the package "
            f"{outbound_lib.PACKAGE} to keep their outbound access (--no_isolate turns "
            "isolation off)")


def _parent_death_setup(sig: int):
    """A `preexec_fn`: the child gets `sig` when the launcher's thread exits."""
    prctl = ctypes.CDLL(None, use_errno=True).prctl  # loaded before fork

    def setup():
        prctl(_PR_SET_PDEATHSIG, int(sig), 0, 0, 0)

    return setup


def _kill_supervisor(proc: subprocess.Popen) -> None:
    """SIGKILL to the supervisor, the child of `proc`: as the init of its PID namespace it
    takes every process of the launch with it; else `proc`, its subreaper parent, kills
    what is left. Then `proc` exits by itself."""
    for pid in children(proc.pid):
        try:
            os.kill(pid, signal.SIGKILL)
        except ProcessLookupError:
            pass
    try:
        proc.wait(timeout=REAP_TIMEOUT_S + _SWEEP_S)
    except subprocess.TimeoutExpired:
        proc.kill()


def _signal_supervisor(proc: subprocess.Popen, sig: int) -> None:
    """`sig` to the supervisor's process group: the supervisor acts on it; its parent
    `proc` ignores SIGINT and SIGTERM."""
    try:
        os.killpg(proc.pid, sig)
    except ProcessLookupError:
        pass


def _stop_supervisor(proc: subprocess.Popen, sig: int, grace_period: float) -> None:
    if proc.poll() is None:
        _signal_supervisor(proc, sig)
        try:
            proc.wait(timeout=grace_period + _SUPERVISOR_EXTRA_S)
        except subprocess.TimeoutExpired:
            _kill_supervisor(proc)
    proc.wait(timeout=REAP_TIMEOUT_S)


def _attach_outbound(proc: subprocess.Popen, outbound: outbound_lib.Outbound,
                     namespace_ready: threading.Event, timeout_s: float, out: Output,
                     signals: StopSignals) -> None:
    """Once the supervisor's parent `proc` says it runs in its namespaces, attaches
    `outbound` to its network namespace, then tells it to go on (with or without: a
    failure is one line, and the workers run with loopback only)."""
    deadline = time.monotonic() + timeout_s
    while not namespace_ready.wait(POLL_S):
        if proc.poll() is not None or signals.count or time.monotonic() > deadline:
            break
    ready, why = namespace_ready.is_set() and not signals.count, ""
    if ready:
        why = outbound.start(proc.pid, _parent_death_setup(signal.SIGKILL))
    elif proc.poll() is None and not signals.count:
        why = f"their namespace was not ready within {timeout_s:g} s"
    if why:
        out.say(f"the workers have no outbound network ({why}); they run with loopback only")
    answer = NETWORK_ATTACHED if ready and not why else "without\n"
    try:
        proc.stdin.write(answer.encode())
        proc.stdin.close()
    except OSError:  # the supervisor's parent is gone: its exit status tells
        pass


def _run_supervised(command: list[str], plan: LaunchPlan, out: Output,
                    signals: StopSignals, env: dict | None = None,
                    outbound: outbound_lib.Outbound | None = None) -> int:
    """Runs the supervisor `command` and passes its output, the launcher's signals and the
    exit status through; with `outbound`, attaches it to the supervisor's network
    namespace before any worker starts (`command` has `--wait_network`) and ends it with
    the launch. The supervisor stops the workers if the launcher dies, even by SIGKILL:
    `command`'s process gets SIGHUP then, and passes SIGTERM on."""
    errors: list[str] = []
    namespace_ready, ended = threading.Event(), threading.Event()

    def keep(text: str) -> bool:
        if text.startswith(ERROR_PREFIX):
            errors.append(text[len(ERROR_PREFIX):].strip())
            return False
        if text == NAMESPACE_READY:
            namespace_ready.set()
            return False
        if text == SUPERVISOR_ENDED:
            ended.set()
            return False
        return True

    proc = subprocess.Popen(command, stdin=subprocess.PIPE if outbound else subprocess.DEVNULL,
                            stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                            start_new_session=True, env=env,
                            preexec_fn=_parent_death_setup(signal.SIGHUP))
    reader = pump(proc.stdout, "", out, keep)
    forwarded, first_forward_at = 0, None
    try:
        if outbound is not None:
            _attach_outbound(proc, outbound, namespace_ready, plan.startup_timeout, out,
                             signals)
        while proc.poll() is None:
            if signals.count > forwarded:  # each one: a second Ctrl-C means SIGKILL now
                _signal_supervisor(proc, signals.received)
                forwarded = signals.count
                first_forward_at = first_forward_at or time.monotonic()
            if first_forward_at is not None and time.monotonic() - first_forward_at \
                    > plan.grace_period + _SUPERVISOR_EXTRA_S:
                out.say(f"the supervisor did not stop within {plan.grace_period:g} + "
                        f"{_SUPERVISOR_EXTRA_S:g} s; sending it SIGKILL")
                _kill_supervisor(proc)
                break
            time.sleep(POLL_S)
    finally:
        _stop_supervisor(proc, signal.SIGTERM, plan.grace_period)
        if outbound is not None:
            outbound.stop()
        reader.join(timeout=READER_JOIN_S)
    if errors and proc.returncode == 2:
        raise ValueError(errors[-1])
    if proc.returncode == 128 + signal.SIGKILL and not forwarded and not ended.is_set():
        out.say("the supervisor was killed (SIGKILL, e.g. by the out-of-memory killer); "
                "every process of the launch was stopped with it")
    return exit_status(proc.returncode)


def _resolve(hosts: Sequence[tuple[str, int]], timeout_s: float = _RESOLVE_TIMEOUT_S) -> None:
    """Checks that every host name resolves, within `timeout_s` in all.

    Raises:
        ValueError: naming the first host that does not.
    """
    errors: dict[str, str] = {}

    def lookup(name: str) -> None:
        try:
            socket.getaddrinfo(name, None, type=socket.SOCK_STREAM)
        except OSError as e:
            errors[name] = str(e)

    threads = [threading.Thread(target=lookup, args=(name,), daemon=True)
               for name, _ in hosts]
    deadline = time.monotonic() + timeout_s
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(max(0.0, deadline - time.monotonic()))
    for (name, _), thread in zip(hosts, threads):
        why = errors.get(name) or ("no answer within "
                                   f"{timeout_s:g} s" if thread.is_alive() else None)
        if why:
            raise ValueError(f"host {name!r} of `hosts` does not resolve ({why}); check the "
                             "name on this host (DNS, /etc/hosts), or give its address.")


def _host_list(hosts, host_rank: int | None,
               num_workers: int) -> tuple[tuple[tuple[str, int], ...], int | None]:
    """`hosts` as ((host, workers), ...) and the rank: from SLURM's environment for
    "slurm", else parsed."""
    if isinstance(hosts, str) and hosts.strip() == hosts_lib.SLURM:
        parsed, rank = hosts_lib.slurm_hosts(os.environ, num_workers)
        if host_rank is not None and host_rank != rank:
            raise ValueError(f"`host_rank` ({host_rank!r}) differs from this node's rank "
                             f"under SLURM ({rank}); leave --host_rank out with --hosts "
                             "slurm.")
        return parsed, rank
    if isinstance(hosts, str):
        return hosts_lib.parse_hosts(hosts, num_workers), host_rank
    return hosts_lib.parse_hosts(",".join(f"{h}:{n}" for h, n in hosts), num_workers), \
        host_rank


def launch(command: Sequence[str], num_workers: int = 2, pin_cpus: bool = False,
           port: int | None = None, startup_timeout: float = DEFAULT_STARTUP_TIMEOUT,
           isolate: bool = True, grace_period: float = DEFAULT_GRACE_PERIOD,
           output: TextIO | None = None, max_restarts: int = 0,
           hosts: str | Sequence[tuple[str, int]] | None = None,
           host_rank: int | None = None, gpus_per_worker: int = 0,
           secret_file: str | None = None, oversubscribe: bool = False) -> int:
    """Runs `command` as MultiWorkerMirroredStrategy workers: `num_workers` on this host,
    or this host's share of a cluster across `hosts`.

    Each worker gets `TF_CONFIG` (worker 0 is the chief), `TFMULTI_STARTUP_TIMEOUT`,
    `PYTHONUNBUFFERED=1` and a private `TMPDIR` (removed once it exited, however it ended),
    runs in its own session (process group), and has each line of its
    stdout and stderr written to `output` as `[worker I] line` (I: its global index). When a
    worker fails, or the launcher gets SIGINT/SIGTERM, every worker's process group gets
    SIGTERM, then SIGKILL after `grace_period` seconds while a worker saves a backup on
    SIGTERM (`save_notice`), else after `save_notice.STOP_WITHOUT_SAVE_S`.

    Across hosts, the same call (or `tfmulti launch --hosts ...` line) runs on every host
    with its own `host_rank`; the launchers check at start-up that they see the same
    cluster (else all fail), then start, stop and restart their workers together. Every
    message between them is authenticated with the job's shared secret (the environment
    variable TFMULTI_LAUNCH_SECRET, or `secret_file`): a launcher without it is dropped.
    The secret is not passed to the workers.

    Args:
        command: the worker's command line, e.g. `["python", "train.py"]`.
        num_workers: how many workers, 1 to 1024; 2 by default (with `hosts`: on a host
            listed without `:N`). More than 4 per core of this host need `oversubscribe`.
        pin_cpus: give each worker its own contiguous share of this process's cores (and set
            TF_NUM_INTRAOP_THREADS, TF_NUM_INTEROP_THREADS, OMP_NUM_THREADS to its size);
            off by default.
        port: base port; the workers use port .. port + num_workers - 1. By default free
            ports are chosen. With `hosts`: the launchers' coordination port on every host
            (2222 by default), the workers of a host use the ports after it.
        startup_timeout: seconds the workers wait for each other (passed through as
            TFMULTI_STARTUP_TIMEOUT), and the launchers across hosts; 60 by default.
        isolate: run the workers in one private network namespace (on by default), so their
            unauthenticated gRPC ports are unreachable from outside it. Isolated workers
            keep outbound network access where slirp4netns is installed
            (`tfmulti.cluster.outbound`: user-mode networking, slower than the host's
            own), else they have loopback only (the launcher says so). Where no such
            namespace can be made, `launch` fails (ValueError) before starting anything;
            False runs the workers with their ports open on all interfaces. It cannot
            apply across `hosts`: the hosts need a private network between them.
        grace_period: seconds between SIGTERM and SIGKILL when stopping workers that save
            a backup on SIGTERM (others get `save_notice.STOP_WITHOUT_SAVE_S`), and that
            a preempted worker's peers get to save; 60 by default (`DEFAULT_GRACE_PERIOD`:
            the preemption agreement, a call of steps and the save).
        output: text stream for the workers' output and the launcher's messages; by default
            `sys.stdout` at call time.
        max_restarts: after a worker fails (or is preempted, exit code 75, or 76 when no
            new backup was saved), stop the others and start all workers again, up to this
            many times; 0 by default. A job run with a backup (`tfmulti train
            --backup_dir`, `tfmulti.training.backup.fit`) resumes from its newest one. Across hosts,
            a failure on any host restarts the workers of every host.
        hosts: a launch across hosts: "HOST[:N],HOST[:N],..." (or the same as
            ((host, N), ...)), in the same order on every host; or "slurm" for the nodes
            of the SLURM job step that runs one launcher per node (`srun`). None (the
            default): this host alone.
        host_rank: this host's position in `hosts` (from SLURM's environment for "slurm").
        gpus_per_worker: give each local worker its own K GPUs (CUDA_VISIBLE_DEVICES: the
            i-th K of the GPUs this process may use); 0 (the default) leaves
            CUDA_VISIBLE_DEVICES alone.
        secret_file: with `hosts`, a file that holds the job's shared secret, readable only
            by its owner (chmod 600); by default the secret is the environment variable
            TFMULTI_LAUNCH_SECRET. At least 16 bytes, the same on every host.
        oversubscribe: start more than 4 workers per core of this host; off by default.

    Returns:
        The chief's exit status (0) when all workers exit 0; the status of the first worker
        that fails otherwise (of the last attempt, with restarts); 128 + N when the launcher
        got signal N (130 for Ctrl-C).

    Every process of the launch runs in a new PID namespace whose first process is the
    supervisor (or, where no namespace can be made, below a child subreaper): when the
    supervisor dies, even by SIGKILL, every worker and everything they started is killed.

    Raises:
        ValueError: on any OS but Linux, for bad arguments (see `make_plan`), no secret or
            a bad one with
            `hosts` (`tfmulti.cluster.auth.load_secret`), a command that is not found, a
            `port` already in use, `isolate` where no network namespace can be made, a
            host that does not resolve, too few GPUs, or launchers across hosts that do
            not agree on the cluster.
    """
    _check_linux(sys.platform)
    out = Output(output if output is not None else sys.stdout)
    check_numbers(num_workers, port, startup_timeout, grace_period, max_restarts,
                  gpus_per_worker)  # before anything else runs
    cpus = os.sched_getaffinity(0) if pin_cpus else ()
    host_list = None
    if hosts is not None:
        host_list, host_rank = _host_list(hosts, host_rank, num_workers)
    elif secret_file is not None:
        raise ValueError(f"`secret_file` ({secret_file!r}) needs `hosts`: the secret "
                         "authenticates the launchers of a launch across hosts.")
    gpus, source = gpus_lib.host_gpus() if gpus_per_worker else ([], "")
    plan = make_plan(command, num_workers, pin_cpus, port, startup_timeout, grace_period, cpus,
                     max_restarts, host_list, host_rank, gpus_per_worker, gpus, source,
                     oversubscribe)
    supervisor_env = None
    if plan.hosts:  # the supervisor's environment, never its argv (which anyone can read)
        secret = auth.load_secret(os.environ, secret_file)
        supervisor_env = {**os.environ, auth.SECRET_ENV: os.fsdecode(secret)}
    if shutil.which(plan.command[0]) is None:
        raise ValueError(f"command {plan.command[0]!r} is not found or not executable; pass "
                         "a program on PATH or a path to one, e.g. `python train.py`.")
    if plan.hosts:
        _resolve(plan.hosts)
    with StopSignals() as signals:
        network = isolate and not plan.hosts
        mode, reason = _probe_namespaces(network=network)
        tool = None
        if plan.hosts:
            name = plan.hosts[plan.host_rank][0]
            out.say(f"host {plan.host_rank} of {len(plan.hosts)} ({name}): across hosts the "
                    "workers cannot be isolated in a private network namespace; their "
                    "TensorFlow gRPC ports are unauthenticated and open on all interfaces: "
                    "run only on a private network between the hosts")
        elif isolate:
            if mode is None:
                raise _isolation_error(reason)
            tool = outbound_lib.find()
            out.say(_isolation_message(tool))
        else:
            out.say("warning: --no_isolate: the workers' TensorFlow gRPC ports are "
                    "unauthenticated and open on all interfaces")
        outbound = outbound_lib.Outbound(tool) if network and tool else None
        resolv_conf = outbound_lib.namespace_resolv_conf(
            outbound_lib.host_resolv_conf()) is not None  # a resolver on its loopback
        command = supervisor_command(plan, sys.executable, mode, network=network,
                                     wait_network=outbound is not None,
                                     resolv_conf=resolv_conf)
        return _run_supervised(command, plan, out, signals, supervisor_env, outbound)
