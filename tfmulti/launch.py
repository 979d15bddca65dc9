"""Local launcher for MultiWorkerMirroredStrategy clusters: TensorFlow's `torchrun`.

    tfmulti launch --num_workers 2 -- python train.py --epochs 1

starts 2 processes of `python train.py --epochs 1` on this host, each with its own
`TF_CONFIG` (worker 0 is the chief), prefixes their output with `[worker I]`, stops all of
them when one fails or the launcher gets Ctrl-C/SIGTERM, and exits with the chief's status.

TensorFlow's gRPC servers are unauthenticated and listen on all interfaces, so by default the
workers run inside one private network namespace (`unshare --net`, loopback only): nothing
they open is reachable from other hosts, and they have no outside network access either.

From Python or a notebook:

    >>> from tfmulti import launch
    >>> launch.launch(["python", "train.py"], num_workers=2)          # doctest: +SKIP
    0
    >>> def train(lr):                                               # doctest: +SKIP
    ...     import tfmulti
    ...     strategy = tfmulti.get_strategy("multi_worker")
    ...     ...
    ...     return history.history
    >>> launch.notebook_launcher(train, args=(0.01,), num_workers=2)  # doctest: +SKIP

Layout: pure functions compute the plan, ports, environments and commands (`make_plan`,
`tf_config`, `port_range`, `split_cpus`, `worker_env`, `supervisor_command`); the thin
`_run_supervised` and `_run_workers` run them. The launcher re-runs this module as a small
supervisor (`python -m tfmulti.launch --_supervise PLAN`), under `unshare --net` when
isolated, which starts the workers and passes their output, signals and exit codes through.
The supervisor stops the workers even if the launcher is killed (e.g. a notebook kernel
restart), via its parent-death signal.
"""

from __future__ import annotations

import ctypes
import dataclasses
import errno
import fcntl
import json
import os
import shutil
import signal
import socket
import struct
import subprocess
import sys
import threading
import time
from typing import Any, Callable, Iterable, Mapping, Sequence, TextIO

DEFAULT_STARTUP_TIMEOUT = 60.0
DEFAULT_GRACE_PERIOD = 10.0
PREEMPTED_EXIT_CODE = 75  # tfmulti.backup.PREEMPTED_EXIT_CODE: saved a backup on SIGTERM
ISOLATION_MODES = ("root", "userns")

_PREFIX = "tfmulti launch"
_ERROR_PREFIX = f"{_PREFIX}: error: "
_POLL_S = 0.05
_PROBE_TIMEOUT_S = 10.0
_READER_JOIN_S = 5.0
_REAP_TIMEOUT_S = 5.0
_SUPERVISOR_EXTRA_S = 15.0  # the supervisor's own stop time on top of the grace period
_PR_SET_PDEATHSIG = 1


# ----------------------------------------------------------------------------- pure functions


@dataclasses.dataclass(frozen=True)
class LaunchPlan:
    """What to start: validated arguments of `launch`, JSON-serializable for the supervisor."""

    command: tuple[str, ...]
    num_workers: int
    port: int | None
    startup_timeout: float
    grace_period: float
    cpu_sets: tuple[tuple[int, ...], ...] | None
    max_restarts: int = 0

    def to_json(self) -> str:
        return json.dumps(dataclasses.asdict(self))

    @classmethod
    def from_json(cls, text: str) -> "LaunchPlan":
        d = json.loads(text)
        cpu_sets = d["cpu_sets"]
        return cls(
            command=tuple(d["command"]), num_workers=d["num_workers"], port=d["port"],
            startup_timeout=d["startup_timeout"], grace_period=d["grace_period"],
            cpu_sets=None if cpu_sets is None else tuple(tuple(c) for c in cpu_sets),
            max_restarts=d.get("max_restarts", 0),
        )


def make_plan(command: Sequence[str], num_workers: int = 2, pin_cpus: bool = False,
              port: int | None = None, startup_timeout: float = DEFAULT_STARTUP_TIMEOUT,
              grace_period: float = DEFAULT_GRACE_PERIOD,
              available_cpus: Iterable[int] = (), max_restarts: int = 0) -> LaunchPlan:
    """Validates the arguments of `launch` and returns the plan.

    Raises:
        ValueError: if `command` is empty or a string, `num_workers` < 1, `port` leaves no room
            for the workers in 1..65535, a timeout is negative, `max_restarts` is negative,
            or `pin_cpus` is set with more workers than `available_cpus`.
    """
    if isinstance(command, str):
        raise ValueError(f"`command` must be a list of arguments, got the string {command!r}; "
                         f"use e.g. {command.split()!r}.")
    command = tuple(command)
    if not command:
        raise ValueError("no command to launch; put it after `--`, e.g. "
                         "`tfmulti launch --num_workers 2 -- python train.py`.")
    _check_num_workers(num_workers)
    if port is not None:
        port_range(port, num_workers)
    if not startup_timeout > 0:
        raise ValueError(f"`startup_timeout` ({startup_timeout}) must be > 0 seconds; "
                         f"use e.g. {DEFAULT_STARTUP_TIMEOUT:g}.")
    if not grace_period >= 0:
        raise ValueError(f"`grace_period` ({grace_period}) must be >= 0 seconds; "
                         f"use e.g. {DEFAULT_GRACE_PERIOD:g}.")
    if isinstance(max_restarts, bool) or not isinstance(max_restarts, int) or max_restarts < 0:
        raise ValueError(f"`max_restarts` ({max_restarts!r}) must be an integer >= 0; use e.g. "
                         "3 (0: never restart).")
    cpu_sets = split_cpus(available_cpus, num_workers) if pin_cpus else None
    return LaunchPlan(command, num_workers, port, float(startup_timeout),
                      float(grace_period), cpu_sets, max_restarts)


def _check_num_workers(num_workers: int) -> None:
    if isinstance(num_workers, bool) or not isinstance(num_workers, int) or num_workers < 1:
        raise ValueError(f"`num_workers` ({num_workers!r}) must be an integer >= 1; "
                         "use e.g. 2.")


def port_range(base: int, num_workers: int) -> list[int]:
    """The ports of the workers for base port `base`: base .. base + num_workers - 1.

    Raises:
        ValueError: if a port would fall outside 1..65535.
    """
    _check_num_workers(num_workers)
    if isinstance(base, bool) or not isinstance(base, int) or base < 1 \
            or base + num_workers - 1 > 65535:
        raise ValueError(f"`port` ({base!r}) must be an integer from 1 to "
                         f"{65536 - num_workers}, so that the {num_workers} workers' ports "
                         "port..port+num_workers-1 fit in 1..65535; use e.g. 20000, or leave "
                         "it out to choose free ports.")
    return list(range(base, base + num_workers))


def tf_config(ports: Sequence[int], index: int, host: str = "localhost") -> dict:
    """TF_CONFIG of worker `index` in a cluster of workers at `host:ports[i]`.

    There is no "chief" job, so worker 0 is the chief (TensorFlow's convention).
    """
    if not 0 <= index < len(ports):
        raise ValueError(f"worker `index` ({index}) must be in 0..{len(ports) - 1}.")
    return {"cluster": {"worker": [f"{host}:{p}" for p in ports]},
            "task": {"type": "worker", "index": index}}


def split_cpus(cpus: Iterable[int], num_workers: int) -> tuple[tuple[int, ...], ...]:
    """Splits `cpus` into `num_workers` contiguous chunks, the first ones one core larger.

    Raises:
        ValueError: if there are fewer cores than workers.
    """
    _check_num_workers(num_workers)
    cpus = sorted(cpus)
    if num_workers > len(cpus):
        raise ValueError(f"`pin_cpus` needs one core per worker, but {num_workers} workers "
                         f"were asked for and only {len(cpus)} cores are available to this "
                         f"process; use --num_workers {max(len(cpus), 1)} or fewer, or drop "
                         "--pin_cpus.")
    size, extra = divmod(len(cpus), num_workers)
    chunks, start = [], 0
    for i in range(num_workers):
        end = start + size + (1 if i < extra else 0)
        chunks.append(tuple(cpus[start:end]))
        start = end
    return tuple(chunks)


def worker_env(base_env: Mapping[str, str], ports: Sequence[int], index: int,
               startup_timeout: float = DEFAULT_STARTUP_TIMEOUT,
               cpus: Sequence[int] | None = None) -> dict[str, str]:
    """The environment of worker `index`: `base_env` plus TF_CONFIG and launcher settings."""
    env = dict(base_env)
    env["TF_CONFIG"] = json.dumps(tf_config(ports, index))
    env["TFMULTI_STARTUP_TIMEOUT"] = f"{startup_timeout:g}"
    env["PYTHONUNBUFFERED"] = "1"
    if cpus is not None:
        threads = str(len(cpus))
        env["TF_NUM_INTRAOP_THREADS"] = threads
        env["TF_NUM_INTEROP_THREADS"] = threads
        env["OMP_NUM_THREADS"] = threads
    return env


def isolation_prefix(mode: str) -> list[str]:
    """The `unshare` command that enters a new network namespace: as root ("root"), or
    unprivileged inside a new user namespace ("userns")."""
    if mode == "root":
        return ["unshare", "--net"]
    if mode == "userns":
        return ["unshare", "--net", "--map-root-user"]
    raise ValueError(f"isolation `mode` ({mode!r}) must be one of {ISOLATION_MODES}.")


def supervisor_command(plan: LaunchPlan, python: str,
                       isolation_mode: str | None = None) -> list[str]:
    """The command that runs the supervisor, which starts the workers with `plan.command`:
    inside a private network namespace for `isolation_mode` "root" or "userns", in the
    host's namespace for None."""
    prefix = [*isolation_prefix(isolation_mode), "--"] if isolation_mode else []
    return [*prefix, python, "-m", "tfmulti.launch", "--_supervise", plan.to_json()]


def exit_status(returncode: int) -> int:
    """A shell-style exit status: 128 + N for a process killed by signal N."""
    return 128 - returncode if returncode < 0 else returncode


def _describe_exit(returncode: int) -> str:
    if returncode < 0:
        try:
            name = signal.Signals(-returncode).name
        except ValueError:
            name = f"signal {-returncode}"
        return f"exit code {exit_status(returncode)} (killed by {name})"
    if returncode == PREEMPTED_EXIT_CODE:
        return f"exit code {returncode} (preempted: saved a backup on SIGTERM)"
    return f"exit code {returncode}"


# ----------------------------------------------------------------------------- running


class _Output:
    """Writes whole lines to a text stream from several threads."""

    def __init__(self, stream: TextIO):
        self._stream = stream
        self._lock = threading.Lock()

    def line(self, text: str) -> None:
        with self._lock:
            try:
                self._stream.write(text if text.endswith("\n") else text + "\n")
                flush = getattr(self._stream, "flush", None)
                if flush:
                    flush()
            except (OSError, ValueError):
                pass  # a closed or broken output must not stop the draining of the pipes

    def say(self, message: str) -> None:
        self.line(f"{_PREFIX}: {message}")


class _StopSignals:
    """Records SIGINT/SIGTERM while active (only the main thread can install handlers)."""

    def __init__(self):
        self.received: int | None = None
        self.count = 0
        self._old: dict = {}

    def __enter__(self) -> "_StopSignals":
        if threading.current_thread() is threading.main_thread():
            for sig in (signal.SIGINT, signal.SIGTERM):
                self._old[sig] = signal.signal(sig, self._handle)
        return self

    def _handle(self, signum, frame) -> None:
        self.count += 1
        if self.received is None:
            self.received = signum

    def __exit__(self, *exc) -> None:
        for sig, handler in self._old.items():
            signal.signal(sig, handler)


def _pump(pipe, prefix: str, out: _Output, on_line: Callable[[str], bool] | None = None):
    """Copies lines from `pipe` to `out` with `prefix`, in a daemon thread."""

    def run():
        with pipe:
            for raw in iter(pipe.readline, b""):
                text = raw.decode("utf-8", "replace")
                if on_line is None or on_line(text):
                    out.line(prefix + text)

    thread = threading.Thread(target=run, daemon=True, name=f"tfmulti-pump{prefix}")
    thread.start()
    return thread


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


def _killpg(pid: int, sig: int) -> None:
    try:
        os.killpg(pid, sig)
    except (ProcessLookupError, PermissionError):
        pass


def _stop_workers(procs: list, grace_period: float, signals: _StopSignals, out: _Output):
    """SIGTERM to each running worker's process group; SIGKILL after `grace_period` (or a
    second Ctrl-C); then SIGKILL to every group, so no child of a worker is left behind."""
    running = [(i, p) for i, p in enumerate(procs) if p.poll() is None]
    for _, p in running:
        _killpg(p.pid, signal.SIGTERM)
    deadline = time.monotonic() + grace_period
    first_count = signals.count
    while any(p.poll() is None for _, p in running) and time.monotonic() < deadline \
            and signals.count == first_count:
        time.sleep(_POLL_S)
    why = ("got a second signal" if signals.count != first_count
           else f"did not stop within {grace_period:g} s of SIGTERM")
    for i, p in running:
        if p.poll() is None:
            out.say(f"worker {i} is still running ({why}); sending SIGKILL")
    for p in procs:
        _killpg(p.pid, signal.SIGKILL)
    for p in procs:
        try:
            p.wait(timeout=_REAP_TIMEOUT_S)
        except subprocess.TimeoutExpired:
            out.say(f"process {p.pid} did not exit within {_REAP_TIMEOUT_S:g} s of SIGKILL")


def _wait_workers(procs: list, signals: _StopSignals, out: _Output,
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
            if code == PREEMPTED_EXIT_CODE:
                out.say(f"worker {i} was preempted ({_describe_exit(code)}); waiting up to "
                        f"{grace_period:g} s for the other workers to save and exit")
                deadline = time.monotonic() + grace_period
                while any(p.poll() is None for p in procs) and time.monotonic() < deadline \
                        and signals.received is None:
                    time.sleep(_POLL_S)
                return code
            if code is not None and code != 0:
                out.say(f"worker {i} failed with {_describe_exit(code)}; "
                        "stopping the other workers")
                return exit_status(code)
        if all(code == 0 for code in codes):
            return 0
        time.sleep(_POLL_S)


def _run_workers(plan: LaunchPlan, out: _Output, signals: _StopSignals) -> int:
    """Starts the workers in this network namespace and waits for them."""
    ports = _choose_ports(plan.port, plan.num_workers)
    out.say(f"starting {plan.num_workers} worker{'s' if plan.num_workers > 1 else ''}: "
            + ", ".join(f"localhost:{p}" for p in ports))
    procs, pumps = [], []
    try:
        for i in range(plan.num_workers):
            cpus = plan.cpu_sets[i] if plan.cpu_sets else None
            env = worker_env(os.environ, ports, i, plan.startup_timeout, cpus)
            try:
                procs.append(subprocess.Popen(
                    plan.command, env=env, stdin=subprocess.DEVNULL, stdout=subprocess.PIPE,
                    stderr=subprocess.PIPE, start_new_session=True,
                    preexec_fn=_child_setup(cpus)))
            except OSError as e:
                raise ValueError(f"cannot start worker {i} with {list(plan.command)!r} "
                                 f"({e}); check the command's path and permissions.") from e
        for i, p in enumerate(procs):
            pumps += [_pump(p.stdout, f"[worker {i}] ", out),
                      _pump(p.stderr, f"[worker {i}] ", out)]
        return _wait_workers(procs, signals, out, plan.grace_period)
    finally:
        _stop_workers(procs, plan.grace_period, signals, out)
        for t in pumps:
            t.join(timeout=_READER_JOIN_S)


def _run_with_restarts(plan: LaunchPlan, out: _Output, signals: _StopSignals) -> int:
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
            why = ("was preempted (its backup is saved)" if status == PREEMPTED_EXIT_CODE
                   else f"failed with exit status {status} (see above)")
            out.say(f"the cluster {why}; {plan.max_restarts - attempt} restart(s) left")
    if plan.max_restarts:
        out.say(f"giving up after {plan.max_restarts} restart(s); exit status {status}")
    return status


def _probe_isolation() -> tuple[str | None, str]:
    """The isolation mode that works here, or None and why none does."""
    if shutil.which("unshare") is None:
        return None, "the `unshare` command (util-linux) is not installed"
    reasons = []
    for mode in ISOLATION_MODES:
        cmd = [*isolation_prefix(mode), "--", sys.executable, "-S", "-c", ""]
        try:
            result = subprocess.run(cmd, capture_output=True, text=True,
                                    timeout=_PROBE_TIMEOUT_S, stdin=subprocess.DEVNULL)
        except (OSError, subprocess.TimeoutExpired) as e:
            reasons.append(f"`{' '.join(cmd[:-4])}`: {e}")
            continue
        if result.returncode == 0:
            return mode, ""
        reasons.append(f"`{' '.join(cmd[:-4])}`: {result.stderr.strip() or result.returncode}")
    return None, "; ".join(reasons)


def _stop_supervisor(proc: subprocess.Popen, sig: int, grace_period: float) -> None:
    if proc.poll() is None:
        try:
            proc.send_signal(sig)
            proc.wait(timeout=grace_period + _SUPERVISOR_EXTRA_S)
        except subprocess.TimeoutExpired:
            proc.kill()  # its workers get SIGKILL from the kernel (parent-death signal)
    proc.wait(timeout=_REAP_TIMEOUT_S)


def _run_supervised(command: list[str], plan: LaunchPlan, out: _Output,
                    signals: _StopSignals) -> int:
    """Runs the supervisor `command` and passes its output, the launcher's signals and the
    exit status through. The supervisor stops the workers if the launcher dies, even by
    SIGKILL (its parent-death signal is SIGTERM)."""
    errors: list[str] = []

    def keep(text: str) -> bool:
        if text.startswith(_ERROR_PREFIX):
            errors.append(text[len(_ERROR_PREFIX):].strip())
            return False
        return True

    proc = subprocess.Popen(command, stdin=subprocess.DEVNULL, stdout=subprocess.PIPE,
                            stderr=subprocess.STDOUT, start_new_session=True)
    pump = _pump(proc.stdout, "", out, keep)
    forwarded, first_forward_at = 0, None
    try:
        while proc.poll() is None:
            if signals.count > forwarded:  # each one: a second Ctrl-C means SIGKILL now
                proc.send_signal(signals.received)
                forwarded = signals.count
                first_forward_at = first_forward_at or time.monotonic()
            if first_forward_at is not None and time.monotonic() - first_forward_at \
                    > plan.grace_period + _SUPERVISOR_EXTRA_S:
                out.say(f"the supervisor did not stop within {plan.grace_period:g} + "
                        f"{_SUPERVISOR_EXTRA_S:g} s; sending it SIGKILL")
                proc.kill()  # its workers get SIGKILL from the kernel (parent-death signal)
                break
            time.sleep(_POLL_S)
    finally:
        _stop_supervisor(proc, signal.SIGTERM, plan.grace_period)
        pump.join(timeout=_READER_JOIN_S)
    if errors and proc.returncode == 2:
        raise ValueError(errors[-1])
    return exit_status(proc.returncode)


def _supervise(plan_json: str) -> int:
    """The supervisor: starts the workers (in its network namespace) and waits for them."""
    _set_parent_death_signal(signal.SIGTERM)
    sys.stdout.reconfigure(encoding="utf-8", errors="backslashreplace")
    out = _Output(sys.stdout)
    try:
        plan = LaunchPlan.from_json(plan_json)
        try:
            _bring_loopback_up()  # down in a new network namespace; a no-op on the host
        except OSError as e:
            raise ValueError(f"cannot bring up the loopback interface ({e}); rerun with "
                             "--no_isolate.") from e
        with _StopSignals() as signals:
            return _run_with_restarts(plan, out, signals)
    except ValueError as e:
        out.line(f"{_ERROR_PREFIX}{e}")
        return 2


def launch(command: Sequence[str], num_workers: int = 2, pin_cpus: bool = False,
           port: int | None = None, startup_timeout: float = DEFAULT_STARTUP_TIMEOUT,
           isolate: bool = True, grace_period: float = DEFAULT_GRACE_PERIOD,
           output: TextIO | None = None, max_restarts: int = 0) -> int:
    """Runs `command` as `num_workers` MultiWorkerMirroredStrategy workers on this host.

    Each worker gets `TF_CONFIG` (worker 0 is the chief), `TFMULTI_STARTUP_TIMEOUT` and
    `PYTHONUNBUFFERED=1`, runs in its own session (process group), and has each line of its
    stdout and stderr written to `output` as `[worker I] line`. When a worker fails, or the
    launcher gets SIGINT/SIGTERM, every worker's process group gets SIGTERM, then SIGKILL
    after `grace_period` seconds.

    Args:
        command: the worker's command line, e.g. `["python", "train.py"]`.
        num_workers: how many workers; 2 by default.
        pin_cpus: give each worker its own contiguous share of this process's cores (and set
            TF_NUM_INTRAOP_THREADS, TF_NUM_INTEROP_THREADS, OMP_NUM_THREADS to its size);
            off by default.
        port: base port; the workers use port .. port + num_workers - 1. By default free
            ports are chosen.
        startup_timeout: seconds the workers wait for each other (passed through as
            TFMULTI_STARTUP_TIMEOUT); 60 by default.
        isolate: run the workers in one private network namespace (on by default), so their
            unauthenticated gRPC ports are unreachable from other hosts; isolated workers
            have no outside network access. Where that is impossible, a warning says the
            ports are open on all interfaces.
        grace_period: seconds between SIGTERM and SIGKILL when stopping workers, and that
            a preempted worker's peers get to save; 10 by default.
        max_restarts: after a worker fails (or is preempted, exit code 75), stop the others
            and start all workers again, up to this many times; 0 by default. A job run
            with a backup (`recipes/train.py --backup_dir`, `tfmulti.backup.fit`) resumes
            from it.
        output: text stream for the workers' output and the launcher's messages; by default
            `sys.stdout` at call time.

    Returns:
        The chief's exit status (0) when all workers exit 0; the status of the first worker
        that fails otherwise (of the last attempt, with restarts); 128 + N when the launcher got signal N (130 for Ctrl-C).

    Raises:
        ValueError: for bad arguments (see `make_plan`), a command that is not found, or a
            `port` already in use.
    """
    out = _Output(output if output is not None else sys.stdout)
    cpus = os.sched_getaffinity(0) if pin_cpus else ()
    plan = make_plan(command, num_workers, pin_cpus, port, startup_timeout, grace_period, cpus,
                     max_restarts)
    if shutil.which(plan.command[0]) is None:
        raise ValueError(f"command {plan.command[0]!r} is not found or not executable; pass "
                         "a program on PATH or a path to one, e.g. `python train.py`.")
    mode = None
    with _StopSignals() as signals:
        if isolate:
            mode, reason = _probe_isolation()
            if mode is not None:
                out.say("workers are isolated in a private network namespace: their ports "
                        "are not reachable from other hosts, and they have no outside "
                        "network access (--no_isolate turns this off)")
            else:
                    out.say(f"warning: cannot isolate the workers in a private network "
                        f"namespace ({reason}); their TensorFlow gRPC ports are "
                        "unauthenticated and OPEN ON ALL INTERFACES; run as root or enable "
                        "unprivileged user namespaces, or firewall the ports")
        else:
            out.say("warning: --no_isolate: the workers' TensorFlow gRPC ports are "
                    "unauthenticated and open on all interfaces")
        command = supervisor_command(plan, sys.executable, mode)
        return _run_supervised(command, plan, out, signals)


def notebook_launcher(function: Callable, args: Sequence = (), num_workers: int = 2,
                      **launch_options) -> Any:
    """Runs `function(*args)` on `num_workers` workers from a notebook; see
    `tfmulti.notebook.notebook_launcher`."""
    from tfmulti import notebook

    return notebook.notebook_launcher(function, args, num_workers, **launch_options)


if __name__ == "__main__":
    if len(sys.argv) != 3 or sys.argv[1] != "--_supervise":
        sys.exit("usage: python -m tfmulti.launch --_supervise PLAN_JSON "
                 "(internal; use `tfmulti launch`)")
    sys.exit(_supervise(sys.argv[2]))
