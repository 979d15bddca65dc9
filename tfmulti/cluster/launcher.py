"""Local launcher for MultiWorkerMirroredStrategy clusters: TensorFlow's `torchrun`.

    tfmulti launch --num_workers 2 -- python train.py --epochs 1

starts 2 processes of `python train.py --epochs 1` on this host, each with its own
`TF_CONFIG` (worker 0 is the chief), prefixes their output with `[worker I]`, stops all of
them when one fails or the launcher gets Ctrl-C/SIGTERM, and exits with the chief's status.

TensorFlow's gRPC servers are unauthenticated and listen on all interfaces, so by default the
workers run inside one private network namespace (`unshare --net`, loopback only): nothing
they open is reachable from other hosts, and they have no outside network access either.

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
functions); this module starts the supervisor (`tfmulti.cluster.supervisor`, under
`unshare --net` when isolated), which starts the workers and passes their output, signals and
exit codes through. The supervisor stops the workers even if the launcher is killed (e.g. a
notebook kernel restart), via its parent-death signal.
"""

from __future__ import annotations

import os
import shutil
import signal
import subprocess
import sys
import time
from typing import Sequence, TextIO

from tfmulti.cluster._process import (ERROR_PREFIX, POLL_S, READER_JOIN_S, REAP_TIMEOUT_S,
                                      Output, StopSignals, pump)
from tfmulti.cluster.exit_codes import exit_status
from tfmulti.cluster.plan import (DEFAULT_GRACE_PERIOD, DEFAULT_STARTUP_TIMEOUT,
                                  ISOLATION_MODES, LaunchPlan, isolation_prefix, make_plan,
                                  supervisor_command)

__all__ = ["launch"]

_PROBE_TIMEOUT_S = 10.0
_SUPERVISOR_EXTRA_S = 15.0  # the supervisor's own stop time on top of the grace period


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
    proc.wait(timeout=REAP_TIMEOUT_S)


def _run_supervised(command: list[str], plan: LaunchPlan, out: Output,
                    signals: StopSignals) -> int:
    """Runs the supervisor `command` and passes its output, the launcher's signals and the
    exit status through. The supervisor stops the workers if the launcher dies, even by
    SIGKILL (its parent-death signal is SIGTERM)."""
    errors: list[str] = []

    def keep(text: str) -> bool:
        if text.startswith(ERROR_PREFIX):
            errors.append(text[len(ERROR_PREFIX):].strip())
            return False
        return True

    proc = subprocess.Popen(command, stdin=subprocess.DEVNULL, stdout=subprocess.PIPE,
                            stderr=subprocess.STDOUT, start_new_session=True)
    reader = pump(proc.stdout, "", out, keep)
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
            time.sleep(POLL_S)
    finally:
        _stop_supervisor(proc, signal.SIGTERM, plan.grace_period)
        reader.join(timeout=READER_JOIN_S)
    if errors and proc.returncode == 2:
        raise ValueError(errors[-1])
    return exit_status(proc.returncode)


def launch(command: Sequence[str], num_workers: int = 2, pin_cpus: bool = False,
           port: int | None = None, startup_timeout: float = DEFAULT_STARTUP_TIMEOUT,
           isolate: bool = True, grace_period: float = DEFAULT_GRACE_PERIOD,
           output: TextIO | None = None, max_restarts: int = 0) -> int:
    """Runs `command` as `num_workers` MultiWorkerMirroredStrategy workers on this host.

    Each worker gets `TF_CONFIG` (worker 0 is the chief), `TFMULTI_STARTUP_TIMEOUT`,
    `PYTHONUNBUFFERED=1` and a private `TMPDIR` (removed once it exited, however it
    ended), runs in its own session (process group), and has each line of its
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
    out = Output(output if output is not None else sys.stdout)
    cpus = os.sched_getaffinity(0) if pin_cpus else ()
    plan = make_plan(command, num_workers, pin_cpus, port, startup_timeout, grace_period, cpus,
                     max_restarts)
    if shutil.which(plan.command[0]) is None:
        raise ValueError(f"command {plan.command[0]!r} is not found or not executable; pass "
                         "a program on PATH or a path to one, e.g. `python train.py`.")
    mode = None
    with StopSignals() as signals:
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

