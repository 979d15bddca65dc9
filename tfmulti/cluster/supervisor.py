"""The supervisor: the process that starts a launch's workers and waits for them.

    python -m tfmulti.cluster.supervisor PLAN_JSON   (internal; `tfmulti launch` runs it)

`tfmulti launch` runs it, inside a private network namespace when isolated.
It picks the ports, starts each worker in its own session with its
`TF_CONFIG`, passes their output through with `[worker I]` prefixes, stops
all of them when one fails, restarts the cluster up to `max_restarts` times,
and dies with the launcher (its parent-death signal), taking the workers
with it (theirs).
"""

from __future__ import annotations

import ctypes
import errno
import fcntl
import os
import shutil
import signal
import socket
import struct
import subprocess
import sys
import tempfile
import time
from typing import Callable, Sequence

from tfmulti.cluster import exit_codes
from tfmulti.cluster._process import (ERROR_PREFIX, POLL_S, READER_JOIN_S, REAP_TIMEOUT_S,
                                      Output, StopSignals, pump)
from tfmulti.cluster.plan import LaunchPlan, port_range, worker_env

__all__ = []  # a process, not an API: `python -m tfmulti.cluster.supervisor`

_PR_SET_PDEATHSIG = 1


def _port_in_use(port: int) -> bool:
    """Whether `port` is bound in this network namespace (IPv4 or IPv6, any address)."""
    for family, address in ((socket.AF_INET, ""), (socket.AF_INET6, "::")):
        try:
            sock = socket.socket(family, socket.SOCK_STREAM)
        except OSError:
            continue  # no IPv6 here
        with sock:
            sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
            if family == socket.AF_INET6:
                sock.setsockopt(socket.IPPROTO_IPV6, socket.IPV6_V6ONLY, 1)
            try:
                sock.bind((address, port))
            except OSError as e:
                if e.errno == errno.EADDRINUSE:
                    return True
    return False


def _choose_ports(base: int | None, num_workers: int) -> list[int]:
    """Checks base..base+N-1 are free, or picks N free ports when `base` is None."""
    if base is not None:
        ports = port_range(base, num_workers)
        for p in ports:
            if _port_in_use(p):
                raise ValueError(f"port {p} (worker {p - base} of --port {base}) is already "
                                 "in use on this host; pass another --port, or leave --port "
                                 "out to choose free ports.")
        return ports
    held = []
    try:
        while len(held) < num_workers:  # keep them bound so the ports are distinct
            sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
            held.append(sock)
            sock.bind(("", 0))
        ports = [s.getsockname()[1] for s in held]
    finally:
        for s in held:
            s.close()
    return ports


def _bring_loopback_up() -> None:
    """`ip link set lo up` without iproute2: SIOCSIFFLAGS on "lo"."""
    siocgifflags, siocsifflags, iff_up = 0x8913, 0x8914, 0x1
    layout = "16sH22x"  # struct ifreq: name, flags, padding to 40 bytes
    with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as sock:
        reply = fcntl.ioctl(sock, siocgifflags, struct.pack(layout, b"lo", 0))
        flags = struct.unpack(layout, reply)[1]
        if not flags & iff_up:
            fcntl.ioctl(sock, siocsifflags, struct.pack(layout, b"lo", flags | iff_up))


def _set_parent_death_signal(sig: int) -> None:
    """Asks the kernel to send `sig` to this process when its parent thread exits (Linux)."""
    try:
        ctypes.CDLL(None, use_errno=True).prctl(_PR_SET_PDEATHSIG, int(sig), 0, 0, 0)
    except (OSError, AttributeError):
        pass


def _child_setup(cpus: Sequence[int] | None) -> Callable[[], None]:
    prctl = ctypes.CDLL(None, use_errno=True).prctl  # loaded before fork

    def setup():
        if cpus:
            os.sched_setaffinity(0, cpus)
        prctl(_PR_SET_PDEATHSIG, int(signal.SIGKILL), 0, 0, 0)  # no orphans if we die

    return setup


def _private_tmpdir(index: int) -> str:
    """Worker `index`'s own temporary folder (its TMPDIR), inside the launcher's.
    The supervisor removes it once the worker has exited, however it ended: what a
    killed worker leaves there (TensorFlow's autograph sources, a half-written
    scratch checkpoint) does not pile up in /tmp."""
    return tempfile.mkdtemp(prefix=f"tfmulti-worker{index}-")


def _killpg(pid: int, sig: int) -> None:
    try:
        os.killpg(pid, sig)
    except (ProcessLookupError, PermissionError):
        pass


def _stop_workers(procs: list, grace_period: float, signals: StopSignals, out: Output):
    """SIGTERM to each running worker's process group; SIGKILL after `grace_period` (or a
    second Ctrl-C); then SIGKILL to every group, so no child of a worker is left behind."""
    running = [(i, p) for i, p in enumerate(procs) if p.poll() is None]
    for _, p in running:
        _killpg(p.pid, signal.SIGTERM)
    deadline = time.monotonic() + grace_period
    first_count = signals.count
    while any(p.poll() is None for _, p in running) and time.monotonic() < deadline \
            and signals.count == first_count:
        time.sleep(POLL_S)
    why = ("got a second signal" if signals.count != first_count
           else f"did not stop within {grace_period:g} s of SIGTERM")
    for i, p in running:
        if p.poll() is None:
            out.say(f"worker {i} is still running ({why}); sending SIGKILL")
    for p in procs:
        _killpg(p.pid, signal.SIGKILL)
    for p in procs:
        try:
            p.wait(timeout=REAP_TIMEOUT_S)
        except subprocess.TimeoutExpired:
            out.say(f"process {p.pid} did not exit within {REAP_TIMEOUT_S:g} s of SIGKILL")


def _wait_workers(procs: list, signals: StopSignals, out: Output,
                  grace_period: float) -> int:
    """Waits until all workers exit 0 (returns 0), one fails (returns its status) or the
    launcher gets a signal (returns 128 + signal). A preempted worker's peers get up to
    `grace_period` seconds to finish saving their backup before they are stopped."""
    while True:
        if signals.received is not None:
            out.say(f"got {signal.Signals(signals.received).name}; stopping the workers")
            return 128 + signals.received
        codes = [p.poll() for p in procs]
        for i, code in enumerate(codes):
            if code == exit_codes.PREEMPTED:
                out.say(f"worker {i} was preempted ({exit_codes.describe_exit(code)}); waiting up to "
                        f"{grace_period:g} s for the other workers to save and exit")
                deadline = time.monotonic() + grace_period
                while any(p.poll() is None for p in procs) and time.monotonic() < deadline \
                        and signals.received is None:
                    time.sleep(POLL_S)
                return code
            if code is not None and code != 0:
                out.say(f"worker {i} failed with {exit_codes.describe_exit(code)}; "
                        "stopping the other workers")
                return exit_codes.exit_status(code)
        if all(code == 0 for code in codes):
            return 0
        time.sleep(POLL_S)


def _run_workers(plan: LaunchPlan, out: Output, signals: StopSignals) -> int:
    """Starts the workers in this network namespace and waits for them."""
    ports = _choose_ports(plan.port, plan.num_workers)
    out.say(f"starting {plan.num_workers} worker{'s' if plan.num_workers > 1 else ''}: "
            + ", ".join(f"localhost:{p}" for p in ports))
    procs, pumps, tmpdirs = [], [], []
    try:
        for i in range(plan.num_workers):
            cpus = plan.cpu_sets[i] if plan.cpu_sets else None
            env = worker_env(os.environ, ports, i, plan.startup_timeout, cpus)
            tmpdirs.append(_private_tmpdir(i))
            env["TMPDIR"] = tmpdirs[-1]
            try:
                procs.append(subprocess.Popen(
                    plan.command, env=env, stdin=subprocess.DEVNULL, stdout=subprocess.PIPE,
                    stderr=subprocess.PIPE, start_new_session=True,
                    preexec_fn=_child_setup(cpus)))
            except OSError as e:
                raise ValueError(f"cannot start worker {i} with {list(plan.command)!r} "
                                 f"({e}); check the command's path and permissions.") from e
        for i, p in enumerate(procs):
            pumps += [pump(p.stdout, f"[worker {i}] ", out),
                      pump(p.stderr, f"[worker {i}] ", out)]
        return _wait_workers(procs, signals, out, plan.grace_period)
    finally:
        _stop_workers(procs, plan.grace_period, signals, out)
        for t in pumps:
            t.join(timeout=READER_JOIN_S)
        for folder in tmpdirs:  # after every worker's process group got SIGKILL
            shutil.rmtree(folder, ignore_errors=True)


def _run_with_restarts(plan: LaunchPlan, out: Output, signals: StopSignals) -> int:
    """Runs the workers; after a failure, restarts all of them up to `plan.max_restarts`
    times (each restart and its cause are reported). A signal to the launcher never
    restarts."""
    for attempt in range(plan.max_restarts + 1):
        if attempt:
            out.say(f"restart {attempt} of {plan.max_restarts}: starting all "
                    f"{plan.num_workers} workers again (a resumable job continues from its "
                    "backup)")
        status = _run_workers(plan, out, signals)
        if status == 0 or signals.received is not None:
            return status
        if attempt < plan.max_restarts:
            why = ("was preempted (its backup is saved)" if status == exit_codes.PREEMPTED
                   else f"failed with exit status {status} (see above)")
            out.say(f"the cluster {why}; {plan.max_restarts - attempt} restart(s) left")
    if plan.max_restarts:
        out.say(f"giving up after {plan.max_restarts} restart(s); exit status {status}")
    return status


def _supervise(plan_json: str) -> int:
    """The supervisor: starts the workers (in its network namespace) and waits for them."""
    _set_parent_death_signal(signal.SIGTERM)
    sys.stdout.reconfigure(encoding="utf-8", errors="backslashreplace")
    out = Output(sys.stdout)
    try:
        plan = LaunchPlan.from_json(plan_json)
        try:
            _bring_loopback_up()  # down in a new network namespace; a no-op on the host
        except OSError as e:
            raise ValueError(f"cannot bring up the loopback interface ({e}); rerun with "
                             "--no_isolate.") from e
        with StopSignals() as signals:
            return _run_with_restarts(plan, out, signals)
    except ValueError as e:
        out.line(f"{ERROR_PREFIX}{e}")
        return 2



if __name__ == "__main__":
    if len(sys.argv) != 2:
        sys.exit("usage: python -m tfmulti.cluster.supervisor PLAN_JSON (internal; use "
                 "`tfmulti launch`)")
    sys.exit(_supervise(sys.argv[1]))
