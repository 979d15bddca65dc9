"""The supervisor: the process that starts a launch's workers and waits for them.

    python -m tfmulti.cluster.supervisor PLAN_JSON [--wait_network [--resolv_conf]]
    (internal; `tfmulti launch` runs it)

`tfmulti launch` runs it, inside a private network namespace when isolated (with
`--wait_network`, it waits for the launcher to give that namespace outbound access
before it starts anything: `tfmulti.cluster.outbound`; with `--resolv_conf` too, in its
own mount namespace, it then points the namespace's /etc/resolv.conf at that network's
DNS forwarder).
It picks the ports, starts each worker in its own session with its
`TF_CONFIG`, passes their output through with `[worker I]` prefixes, stops
all of them when one fails, restarts the cluster up to `max_restarts` times,
and dies with the launcher (its parent-death signal), taking the workers
with it (theirs).
"""

from __future__ import annotations

import contextlib
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

from tfmulti.cluster import exit_codes, outbound, rendezvous, save_notice
from tfmulti.cluster import hosts as hosts_lib
from tfmulti.cluster._process import (ERROR_PREFIX, NAMESPACE_READY, NETWORK_ATTACHED, POLL_S,
                                      PREFIX, READER_JOIN_S, REAP_TIMEOUT_S, SUPERVISOR_ENDED,
                                      Outcome, Output, StopSignals, children, pump)
from tfmulti.cluster.exit_codes import describe_end, describe_exit
from tfmulti.cluster.plan import LaunchPlan, port_range, worker_env
from tfmulti.cluster.rendezvous import Remote
from tfmulti.utils import human
from tfmulti.utils.quiet import startup_filter

__all__ = []  # a process, not an API: `python -m tfmulti.cluster.supervisor`

_PR_SET_PDEATHSIG = 1
_PR_SET_CHILD_SUBREAPER = 36
_MS_BIND = 4096
_SWEEP_TIMEOUT_S = 10.0


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


def _reservation(port: int) -> socket.socket:
    """A socket bound to `port` (0: a free one) on every address, IPv4 and IPv6, and never
    listening. While it is open, the kernel gives the port to no other `bind(0)` and no
    outgoing connection, and a plain `bind` of it fails; the worker's gRPC server, which
    sets SO_REUSEADDR like this socket, can still listen on it."""
    try:
        sock = socket.socket(socket.AF_INET6, socket.SOCK_STREAM)
        address = "::"
    except OSError:  # no IPv6 here
        sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
        address = ""
    try:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        if sock.family == socket.AF_INET6:
            sock.setsockopt(socket.IPPROTO_IPV6, socket.IPV6_V6ONLY, 0)
        sock.bind((address, port))
    except OSError:
        sock.close()
        raise
    return sock


def _reserve_ports(base: int | None, num_workers: int,
                   across_hosts: bool = False) -> tuple[list[int], list[socket.socket]]:
    """Checks this host's worker ports are free (base..base+N-1, or the N after the
    coordination port `base` `across_hosts`), or picks N free ports when `base` is None;
    returns them with their reservations (`_reservation`), which the caller keeps open
    while the workers run, so that no other process takes a port between its choice here
    and the worker's gRPC server binding it seconds later."""
    held: list[socket.socket] = []
    try:
        if base is None:
            while len(held) < num_workers:
                held.append(_reservation(0))
            return [s.getsockname()[1] for s in held], held
        ports = (hosts_lib.worker_ports(base, num_workers) if across_hosts
                 else port_range(base, num_workers))
        for i, p in enumerate(ports):
            if _port_in_use(p):
                if across_hosts:
                    raise ValueError(f"port {p} (this host's worker {i}, after the "
                                     f"coordination --port {base}) is already in use on "
                                     "this host; pass another --port, the same on every "
                                     "host.")
                raise ValueError(f"port {p} (worker {i} of --port {base}) is already "
                                 "in use on this host; pass another --port, or leave --port "
                                 "out to choose free ports.")
            held.append(_reservation(p))
        return ports, held
    except BaseException:
        _release(held)
        raise


def _release(sockets: list[socket.socket]) -> None:
    for sock in sockets:
        sock.close()


def _bring_loopback_up() -> None:
    """`ip link set lo up` without iproute2: SIOCSIFFLAGS on "lo"."""
    siocgifflags, siocsifflags, iff_up = 0x8913, 0x8914, 0x1
    layout = "16sH22x"  # struct ifreq: name, flags, padding to 40 bytes
    with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as sock:
        reply = fcntl.ioctl(sock, siocgifflags, struct.pack(layout, b"lo", 0))
        flags = struct.unpack(layout, reply)[1]
        if not flags & iff_up:
            fcntl.ioctl(sock, siocsifflags, struct.pack(layout, b"lo", flags | iff_up))


def _prctl(option: int, value: int) -> bool:
    """prctl(option, value) (Linux); whether it succeeded."""
    try:
        return ctypes.CDLL(None, use_errno=True).prctl(option, value, 0, 0, 0) == 0
    except (OSError, AttributeError):
        return False


def _point_resolv_conf_at_forwarder() -> None:
    """In a private mount namespace: a bind mount over /etc/resolv.conf that names
    slirp4netns' DNS forwarder instead of the host's loopback resolvers
    (`outbound.namespace_resolv_conf`); it goes with the namespace. A failure is one line:
    the workers then look names up as the host's file says."""
    text = outbound.namespace_resolv_conf(outbound.host_resolv_conf())
    if text is None:
        return
    try:
        with tempfile.NamedTemporaryFile("w", prefix="tfmulti-resolv-", suffix=".conf",
                                         delete=False) as f:
            f.write(text)
        os.chmod(f.name, 0o644)
        try:
            libc = ctypes.CDLL(None, use_errno=True)
            if libc.mount(f.name.encode(), outbound.RESOLV_CONF.encode(), None,
                          _MS_BIND, None) != 0:
                raise OSError(ctypes.get_errno(), os.strerror(ctypes.get_errno()))
        finally:
            os.unlink(f.name)  # the mount keeps the file
    except OSError as e:
        print(f"{PREFIX}: the workers' name lookups may fail: the host's "
              f"{outbound.RESOLV_CONF} names only resolvers on its loopback, and the "
              f"namespace could not get its own ({e})", flush=True)


def _set_parent_death_signal(sig: int) -> None:
    """Asks the kernel to send `sig` to this process when its parent thread exits (Linux)."""
    _prctl(_PR_SET_PDEATHSIG, int(sig))


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


def _stop_workers(procs: list, grace_period: float, signals: StopSignals, out: Output,
                  first: int = 0, notices: Sequence[str | None] = ()):
    """SIGTERM to each running worker's process group; SIGKILL after `grace_period` (or a
    second Ctrl-C) when a worker saves on SIGTERM (its `notices` file is posted,
    `tfmulti.cluster.save_notice`), else after `save_notice.STOP_WITHOUT_SAVE_S`: a
    MultiWorkerMirroredStrategy worker does not die of SIGTERM (TensorFlow catches it),
    and all of them get the grace period when one saves, since they save together. A
    worker that posts its notice after the SIGTERM (its handler came too late to see it)
    gets SIGTERM again. Then SIGKILL to every group, so no child of a worker is left
    behind. As the init of a PID namespace, then also SIGKILL to every other process in it
    (a worker's child that left its process group)."""
    notices = list(notices) or [None] * len(procs)
    running = [(i, p) for i, p in enumerate(procs) if p.poll() is None]
    saving = {i for i, _ in running if notices[i] and save_notice.posted(notices[i])}
    for _, p in running:
        _killpg(p.pid, signal.SIGTERM)
    short = min(grace_period, save_notice.STOP_WITHOUT_SAVE_S)
    start, first_count = time.monotonic(), signals.count
    while any(p.poll() is None for _, p in running) and signals.count == first_count:
        for i, p in running:
            if i not in saving and notices[i] and p.poll() is None \
                    and save_notice.posted(notices[i]):
                saving.add(i)
                _killpg(p.pid, signal.SIGTERM)
        waited = time.monotonic() - start
        if waited >= grace_period or (not saving and waited >= short):
            break
        time.sleep(POLL_S)
    why = ("got a second signal" if signals.count != first_count
           else f"did not stop within {grace_period:g} s of SIGTERM" if saving
           else f"did not exit within {short:g} s of SIGTERM and saves no backup on it")
    for i, p in running:
        if p.poll() is None:
            out.say(f"worker {first + i} is still running ({why}); sending SIGKILL")
    for p in procs:
        _killpg(p.pid, signal.SIGKILL)
    for p in procs:
        try:
            p.wait(timeout=REAP_TIMEOUT_S)
        except subprocess.TimeoutExpired:
            out.say(f"process {p.pid} did not exit within {REAP_TIMEOUT_S:g} s of SIGKILL")
    if os.getpid() == 1:
        _kill_namespace()


def _stopped_by_signal(outcome: Outcome, procs: list, first: int) -> str:
    """The one-line end of an attempt stopped by a signal to the launcher: how each worker
    ended, and the launcher's exit status."""
    ends = ", ".join(f"worker {first + i} {_ended(p.returncode)}" for i, p in enumerate(procs))
    name = signal.Signals(outcome.status - 128).name
    return f"stopped by {name} to the launcher: {ends}; exit status {outcome.status}"


def _ended(returncode: int | None) -> str:
    if returncode is None:
        return "is still running"
    if returncode < 0:  # "exit code 137 (killed by SIGKILL)" -> "was killed by SIGKILL"
        return "was " + describe_exit(returncode).split(" (", 1)[1][:-1]
    if returncode == exit_codes.PREEMPTED:
        return f"saved a backup (exit code {returncode})"
    if returncode == exit_codes.PREEMPTED_UNSAVED:
        return f"saved no new backup (exit code {returncode})"
    return f"exited with code {returncode}"


def _kill_namespace() -> None:
    """As the init of a PID namespace: SIGKILL to every other process in it, then reap
    them (orphans become init's children)."""
    try:
        os.kill(-1, signal.SIGKILL)  # from init: every process of the namespace but init
    except ProcessLookupError:
        return
    deadline = time.monotonic() + REAP_TIMEOUT_S
    while time.monotonic() < deadline:
        try:
            pid, _ = os.waitpid(-1, os.WNOHANG)
        except ChildProcessError:
            return
        if not pid:
            time.sleep(POLL_S)


def _sweep_descendants(timeout_s: float = _SWEEP_TIMEOUT_S) -> None:
    """As a child subreaper whose own child has exited: SIGKILL every process left below
    this one (the kernel made the orphans this process's children) and reap it, until none
    is left or `timeout_s` passed."""
    me = os.getpid()
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        for pid in children(me):
            try:
                os.kill(pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
        try:
            pid, _ = os.waitpid(-1, os.WNOHANG)
        except ChildProcessError:
            return  # no child left: a killed one's own children were adopted and reaped too
        if not pid:
            time.sleep(POLL_S)


def _wait_preempted(procs: list, signals: StopSignals, grace_period: float) -> int:
    """Waits up to `grace_period` for the workers that were told to save (a peer got
    SIGTERM) to exit. Returns PREEMPTED_UNSAVED if any worker exited so (no new backup),
    else PREEMPTED."""
    deadline = time.monotonic() + grace_period
    while any(p.poll() is None for p in procs) and time.monotonic() < deadline \
            and signals.received is None:
        time.sleep(POLL_S)
    codes = [p.poll() for p in procs]
    return (exit_codes.PREEMPTED_UNSAVED if exit_codes.PREEMPTED_UNSAVED in codes
            else exit_codes.PREEMPTED)


def _wait_workers(procs: list, signals: StopSignals, out: Output, grace_period: float,
                  first: int = 0, remote: Remote | None = None) -> Outcome:
    """Waits until all workers exit 0, one fails, the launcher gets a signal, or `remote`
    (polled) says another host's worker failed. A preempted worker's peers get up to
    `grace_period` seconds to finish saving their backup before they are stopped. Workers
    are named by their global index (`first` is this host's first)."""
    while True:
        if signals.received is not None:
            name = signal.Signals(signals.received).name
            out.say(f"got {name}; stopping the workers")
            return Outcome(128 + signals.received, f"the launcher got {name}", signalled=True)
        codes = [p.poll() for p in procs]
        for i, code in enumerate(codes):
            if code in (exit_codes.PREEMPTED, exit_codes.PREEMPTED_UNSAVED):
                what = ("was preempted" if code == exit_codes.PREEMPTED
                        else "was preempted without a new backup")
                why = f"worker {first + i} {what} ({exit_codes.describe_exit(code)})"
                out.say(f"{why}; waiting up to {grace_period:g} s for the other workers to "
                        "exit")
                return Outcome(_wait_preempted(procs, signals, grace_period), why)
            if code is not None and code != 0:
                why = f"worker {first + i} failed with {exit_codes.describe_exit(code)}"
                out.say(f"{why}; stopping the other workers")
                return Outcome(exit_codes.exit_status(code), why)
        if all(code == 0 for code in codes):
            return Outcome(0)
        stop = remote() if remote is not None else None
        if stop is not None:
            if stop.get("preempted"):
                out.say(f"{stop['why']}; waiting up to {grace_period:g} s for this host's "
                        "workers to save and exit")
                status = _wait_preempted(procs, signals, grace_period)
                return Outcome(max(status, stop["status"]), stop["why"], by_peer=True)
            out.say(f"{stop['why']}; stopping this host's workers")
            return Outcome(stop["status"], stop["why"], by_peer=True)
        time.sleep(POLL_S)


def _run_workers(plan: LaunchPlan, out: Output, signals: StopSignals,
                 ports: Sequence[int] | None = None, remote: Remote | None = None) -> Outcome:
    """Starts this host's workers (on `ports`, else on ports reserved for this attempt)
    and waits for them (`_wait_workers`)."""
    reservations = []
    if ports is None:
        ports, reservations = _reserve_ports(plan.port, plan.num_workers)
    addresses, first = plan.addresses(ports), plan.first_worker
    mine = addresses[first:first + plan.num_workers]
    where = (f"host {plan.host_rank} of {len(plan.hosts)} ({plan.hosts[plan.host_rank][0]}): "
             if plan.hosts else "")
    out.say(f"{where}starting {plan.num_workers} worker{'s' if plan.num_workers > 1 else ''}"
            + (f" ({first}..{first + plan.num_workers - 1} of {len(addresses)})"
               if plan.hosts else "") + ": " + ", ".join(mine))
    procs, pumps, tmpdirs, notices = [], [], [], []
    try:
        for i in range(plan.num_workers):
            cpus = plan.cpu_sets[i] if plan.cpu_sets else None
            gpus = plan.gpu_sets[i] if plan.gpu_sets else None
            env = worker_env(os.environ, addresses, first + i, plan.startup_timeout, cpus,
                             gpus)
            tmpdirs.append(_private_tmpdir(first + i))
            notices.append(os.path.join(tmpdirs[-1], "tfmulti-save-notice"))
            env["TMPDIR"], env[save_notice.ENV] = tmpdirs[-1], notices[-1]
            try:
                procs.append(subprocess.Popen(
                    plan.command, env=env, stdin=subprocess.DEVNULL, stdout=subprocess.PIPE,
                    stderr=subprocess.PIPE, start_new_session=True,
                    preexec_fn=_child_setup(cpus)))
            except OSError as e:
                raise ValueError(f"cannot start worker {first + i} with "
                                 f"{list(plan.command)!r} ({e}); check the command's path "
                                 "and permissions.") from e
        for i, p in enumerate(procs):
            pumps += [pump(p.stdout, f"[worker {first + i}] ", out),
                      pump(p.stderr, f"[worker {first + i}] ", out, startup_filter())]
        outcome = _wait_workers(procs, signals, out, plan.grace_period, first, remote)
    finally:
        _stop_workers(procs, plan.grace_period, signals, out, first, notices)
        _release(reservations)
        for t in pumps:
            t.join(timeout=READER_JOIN_S)
        for folder in tmpdirs:  # after every worker's process group got SIGKILL
            shutil.rmtree(folder, ignore_errors=True)
    if outcome.signalled:
        out.say(_stopped_by_signal(outcome, procs, first))
    return outcome


def _run_with_restarts(plan: LaunchPlan, out: Output, signals: StopSignals) -> int:
    """Runs the workers; after a failure, restarts all of them up to `plan.max_restarts`
    times (each restart and its cause are reported). A signal to the launcher never
    restarts, nor does an exit status in `exit_codes.FINAL` (bad input, a NaN loss)."""
    for attempt in range(plan.max_restarts + 1):
        if attempt:
            out.say(f"restart {attempt} of {plan.max_restarts}: starting all "
                    f"{plan.num_workers} workers again (a resumable job continues from its "
                    "backup)")
        status = _run_workers(plan, out, signals).status
        if status == 0 or signals.received is not None:
            return status
        if status in exit_codes.FINAL:
            out.say(f"the cluster {describe_end(status)}; not restarted (exit status "
                    f"{status} ends every attempt the same way); exit status {status}")
            return status
        if attempt < plan.max_restarts:
            out.say(f"the cluster {describe_end(status)}; "
                    f"{human.count(plan.max_restarts - attempt, 'restart')} left")
    if status == exit_codes.PREEMPTED_UNSAVED:
        out.say(f"the cluster {describe_end(status)}")
    if plan.max_restarts:
        out.say(f"giving up after {human.count(plan.max_restarts, 'restart')}; exit status "
                f"{status}")
    return status


def _run_across_hosts(plan: LaunchPlan, out: Output, signals: StopSignals) -> int:
    """This host's part of a launch across hosts: the start-up handshake with the other
    launchers, then every attempt as the coordinator (host 0) decides."""
    hosts, rank = plan.hosts, plan.host_rank
    ports, reservations = [], []
    try:
        try:
            ports, reservations = _reserve_ports(plan.port, plan.num_workers, across_hosts=True)
            digest = hosts_lib.view_digest(hosts, plan.port, plan.max_restarts)
            link = rendezvous.join(hosts, rank, plan.port, digest, plan.startup_timeout,
                                   interrupted=lambda: signals.received is not None,
                                   say=out.say)
        except ValueError as e:
            rendezvous.notify_abort(hosts, plan.port, f"host {rank}: {e}")
            raise
        if link is None:
            out.say(f"got {signal.Signals(signals.received).name} during the start-up")
            return 128 + signals.received
        with link:
            def run_attempt(attempt: int, remote: Remote) -> Outcome:
                if attempt:
                    out.say(f"restart {attempt} of {plan.max_restarts}: starting this "
                            "host's workers again (a resumable job continues from its "
                            "backup)")
                return _run_workers(plan, out, signals, ports, remote)

            def interrupted() -> int | None:
                return signals.received

            if rank == 0:
                return rendezvous.coordinate(link, run_attempt, plan.max_restarts,
                                             plan.grace_period, out, interrupted)
            return rendezvous.follow(link, run_attempt, out, interrupted)
    finally:
        _release(reservations)


def _supervise(plan_json: str) -> int:
    """The supervisor: starts the workers (in its network namespace) and waits for them."""
    with StopSignals() as signals:  # first: as a PID namespace's init it ignores the rest
        signal.signal(signal.SIGHUP, signal.SIG_DFL)
        _set_parent_death_signal(signal.SIGTERM)
        sys.stdout.reconfigure(encoding="utf-8", errors="backslashreplace")
        out = Output(sys.stdout)
        try:
            return _supervise_plan(plan_json, out, signals)
        finally:  # through `out`'s lock: a worker's reader may still be writing
            out.line(SUPERVISOR_ENDED)


def _supervise_plan(plan_json: str, out: Output, signals: StopSignals) -> int:
    """`_supervise` once the signals and the output are set up."""
    try:
        plan = LaunchPlan.from_json(plan_json)
        try:
            _bring_loopback_up()  # down in a new network namespace; a no-op on the host
        except OSError as e:
            raise ValueError(f"cannot bring up the loopback interface ({e}); rerun with "
                             "--no_isolate.") from e
        if plan.hosts:
            return _run_across_hosts(plan, out, signals)
        return _run_with_restarts(plan, out, signals)
    except ValueError as e:
        out.line(f"{ERROR_PREFIX}{e}")
        return 2


def main(plan_json: str, wait_network: bool = False, resolv_conf: bool = False) -> int:
    """The launcher's child: forks the supervisor and stays its parent, a child subreaper.

    In a new PID namespace (`unshare --pid`, `plan.isolation_prefix`) the supervisor is the
    namespace's init, and everything of the launch dies with it. Without one, orphans below
    this process (a worker's children, once the supervisor and the workers were SIGKILLed)
    become its children, and once the supervisor has exited it kills and reaps them all.
    The launcher signals the process group: the supervisor acts on SIGINT/SIGTERM, this
    process ignores them; its parent-death signal (SIGHUP, set by the launcher) becomes
    SIGTERM to the supervisor. Returns the supervisor's exit status (128 + N when it was
    killed by signal N).

    With `wait_network`, it first prints `NAMESPACE_READY` and waits for a line (or the
    end) of its standard input: the launcher's word that the namespace's outbound network
    is attached (`NETWORK_ATTACHED`: then, with `resolv_conf`, it points the mount
    namespace's /etc/resolv.conf at its DNS forwarder), or that it is not to be.
    """
    launcher = os.getppid()
    _prctl(_PR_SET_CHILD_SUBREAPER, 1)
    for sig in (signal.SIGINT, signal.SIGTERM):
        signal.signal(sig, signal.SIG_IGN)
    child = [0]

    def launcher_died(signum, frame):
        if not child[0]:
            os._exit(128 + signum)
        os.kill(child[0], signal.SIGTERM)

    signal.signal(signal.SIGHUP, launcher_died)
    _set_parent_death_signal(signal.SIGHUP)
    if os.getppid() != launcher:  # the launcher died before that
        return 128 + signal.SIGHUP
    if wait_network:
        sys.stdout.write(NAMESPACE_READY)
        sys.stdout.flush()
        if sys.stdin.readline() == NETWORK_ATTACHED and resolv_conf:
            _point_resolv_conf_at_forwarder()
    sys.stdout.flush()
    child[0] = os.fork()
    if child[0] == 0:
        code = 2
        try:
            code = _supervise(plan_json)
        finally:
            with contextlib.suppress(OSError, ValueError):  # the launcher may be gone
                sys.stdout.flush()
            os._exit(code)
    _, status = os.waitpid(child[0], 0)
    _sweep_descendants()
    return exit_codes.exit_status(os.waitstatus_to_exitcode(status))


if __name__ == "__main__":
    if len(sys.argv) < 2 or sys.argv[2:] not in ([], ["--wait_network"],
                                                 ["--wait_network", "--resolv_conf"]):
        sys.exit("usage: python -m tfmulti.cluster.supervisor PLAN_JSON [--wait_network "
                 "[--resolv_conf]] (internal; use `tfmulti launch`)")
    sys.exit(main(sys.argv[1], wait_network="--wait_network" in sys.argv[2:],
                  resolv_conf="--resolv_conf" in sys.argv[2:]))
