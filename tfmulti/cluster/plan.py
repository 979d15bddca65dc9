"""What a launch starts, computed by pure functions (no processes, no TensorFlow).

`make_plan` validates the launcher's arguments into a `LaunchPlan` (which
the supervisor process receives as JSON); `port_range`, `split_cpus`,
`worker_env` and `supervisor_command` compute each worker's ports, cores,
environment and the command that runs the supervisor.
"""

from __future__ import annotations

import dataclasses
import json
from typing import Iterable, Mapping, Sequence

from tfmulti import _checks
from tfmulti.cluster import tf_config as tf_config_lib

__all__ = ["DEFAULT_GRACE_PERIOD", "DEFAULT_STARTUP_TIMEOUT", "ISOLATION_MODES", "LaunchPlan",
           "PREEMPTION_AGREEMENT_S",
           "isolation_prefix", "make_plan", "port_range", "split_cpus", "supervisor_command",
           "worker_env"]

DEFAULT_STARTUP_TIMEOUT = 60.0
PREEMPTION_AGREEMENT_S = 20.0
"""How long a worker that got SIGTERM waits for every peer to acknowledge the step at
which all of them save (`tfmulti.backup`); peers answer from a watcher thread at once
unless they are gone."""
DEFAULT_GRACE_PERIOD = 60.0
"""Seconds between SIGTERM and SIGKILL when the launcher stops workers: room for the
preemption agreement (`PREEMPTION_AGREEMENT_S`), the rest of a call of steps and the
save; raise it for long steps or large models."""
ISOLATION_MODES = ("root", "userns")


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
    _checks.positive_number("startup_timeout", startup_timeout,
                            hint=f"seconds, e.g. {DEFAULT_STARTUP_TIMEOUT:g}")
    _checks.finite_number("grace_period", grace_period, minimum=0,
                          hint=f"seconds, e.g. {DEFAULT_GRACE_PERIOD:g}")
    _checks.non_negative_int("max_restarts", max_restarts, hint="e.g. 3 (0: never restart)")
    cpu_sets = split_cpus(available_cpus, num_workers) if pin_cpus else None
    return LaunchPlan(command, num_workers, port, float(startup_timeout),
                      float(grace_period), cpu_sets, max_restarts)


def _check_num_workers(num_workers: int) -> None:
    _checks.positive_int("num_workers", num_workers, hint="e.g. 2")


def port_range(base: int, num_workers: int) -> list[int]:
    """The ports of the workers for base port `base`: base .. base + num_workers - 1.

    Raises:
        ValueError: if a port would fall outside 1..65535.
    """
    _check_num_workers(num_workers)
    if not _checks.is_int(base) or base < 1 or base + num_workers - 1 > 65535:
        raise ValueError(f"`port` ({base!r}) must be an integer from 1 to "
                         f"{65536 - num_workers}, so that the {num_workers} workers' ports "
                         "port..port+num_workers-1 fit in 1..65535; use e.g. 20000, or leave "
                         "it out to choose free ports.")
    return list(range(base, base + num_workers))


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
    env["TF_CONFIG"] = json.dumps(tf_config_lib.build_tf_config(
        [f"localhost:{p}" for p in ports], index))
    env["TFMULTI_STARTUP_TIMEOUT"] = f"{startup_timeout:g}"
    env[tf_config_lib.LAUNCHED_ENV] = "1"  # `distribution="auto"` may join this cluster
    env["PYTHONUNBUFFERED"] = "1"
    if cpus is not None:
        threads = str(len(cpus))
        env["TF_NUM_INTRAOP_THREADS"] = threads
        env["TF_NUM_INTEROP_THREADS"] = threads
        env["OMP_NUM_THREADS"] = threads
    return env


def isolation_prefix(mode: str, network: bool = True) -> list[str]:
    """The `unshare` command that runs a program in a new PID namespace, and in a new
    network namespace when `network`: as root ("root"), or unprivileged inside a new user
    namespace ("userns").

    The program itself stays in the PID namespace it came from; its first child is the new
    namespace's init, and when that child dies, even by SIGKILL, the kernel kills every
    process left in the namespace.

    Example:
        >>> isolation_prefix("root")
        ['unshare', '--pid', '--net']
        >>> isolation_prefix("userns", network=False)
        ['unshare', '--pid', '--map-root-user']

    Raises:
        ValueError: an unknown `mode`.
    """
    if mode not in ISOLATION_MODES:
        raise ValueError(f"isolation `mode` ({mode!r}) must be one of {ISOLATION_MODES}.")
    prefix = ["unshare", "--pid"]
    if network:
        prefix.append("--net")
    if mode == "userns":
        prefix.append("--map-root-user")
    return prefix


def supervisor_command(plan: LaunchPlan, python: str, isolation_mode: str | None = None,
                       network: bool = True) -> list[str]:
    """The command that runs the supervisor, which starts the workers with `plan.command`.

    The process it starts forks the supervisor and stays its parent: a child subreaper that
    passes on its exit status and kills whatever the workers leave behind. For
    `isolation_mode` "root" or "userns" the supervisor is the init of a new PID namespace
    (`isolation_prefix`), in a private network namespace when `network`; for None (no
    namespace can be made) it runs in the host's namespaces.

    Example:
        >>> plan = make_plan(["python", "train.py"], 2)
        >>> supervisor_command(plan, "python3", "root")[:6]
        ['unshare', '--pid', '--net', '--', 'python3', '-m']
        >>> supervisor_command(plan, "python3")[:3]
        ['python3', '-m', 'tfmulti.cluster.supervisor']
    """
    prefix = [*isolation_prefix(isolation_mode, network), "--"] if isolation_mode else []
    return [*prefix, python, "-m", "tfmulti.cluster.supervisor", plan.to_json()]
