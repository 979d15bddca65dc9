"""What a launch starts, computed by pure functions (no processes, no TensorFlow).

`make_plan` validates the launcher's arguments into a `LaunchPlan` (which
the supervisor process receives as JSON); `port_range`, `split_cpus`,
`worker_env` and `supervisor_command` compute each worker's ports, cores,
environment and the command that runs the supervisor. A launch across hosts
(`hosts`) is one plan per host, computed by `tfmulti.cluster.hosts`; GPU
slices by `tfmulti.cluster.gpus`.
"""

from __future__ import annotations

import dataclasses
import json
import math
import numbers
import os
from typing import Iterable, Mapping, Sequence

from tfmulti.utils import checks
from tfmulti.utils import human
from tfmulti.cluster import auth
from tfmulti.cluster import gpus as gpus_lib
from tfmulti.cluster import hosts as hosts_lib
from tfmulti.cluster import tf_config as tf_config_lib

__all__ = ["DEFAULT_GRACE_PERIOD", "DEFAULT_STARTUP_TIMEOUT", "ISOLATION_MODES", "LaunchPlan",
           "MAX_GPUS_PER_WORKER", "MAX_RESTARTS", "MAX_SECONDS", "MAX_WORKERS_PER_CORE",
           "PREEMPTION_AGREEMENT_S", "check_numbers", "in_range",
           "isolation_prefix", "make_plan", "port_range", "split_cpus", "supervisor_command",
           "worker_env"]

DEFAULT_STARTUP_TIMEOUT = 60.0
PREEMPTION_AGREEMENT_S = 20.0
"""How long a worker that got SIGTERM waits for every peer to acknowledge the step at
which all of them save (`tfmulti.training.backup`); peers answer from a watcher thread at once
unless they are gone."""
DEFAULT_GRACE_PERIOD = 60.0
"""Seconds between SIGTERM and SIGKILL when the launcher stops workers that save a
backup on SIGTERM (others get `save_notice.STOP_WITHOUT_SAVE_S`): room for the
preemption agreement (`PREEMPTION_AGREEMENT_S`), the rest of a call of steps and the
save; raise it for long steps or large models."""
ISOLATION_MODES = ("root", "userns")
MAX_WORKERS_PER_CORE = 4
"""More workers than this per core of a host need `oversubscribe`: each worker is a
TensorFlow process with its own threads and memory."""
MAX_SECONDS = 86400.0
"""The longest `startup_timeout` and `grace_period`: a day."""
MAX_RESTARTS = 1000
MAX_GPUS_PER_WORKER = 256


@dataclasses.dataclass(frozen=True)
class LaunchPlan:
    """What to start: validated arguments of `launch`, JSON-serializable for the supervisor.

    `num_workers`, `cpu_sets` and `gpu_sets` are this host's; with `hosts` (a launch
    across hosts) `port` is the launchers' coordination port and this host is
    `hosts[host_rank]`.
    """

    command: tuple[str, ...]
    num_workers: int
    port: int | None
    startup_timeout: float
    grace_period: float
    cpu_sets: tuple[tuple[int, ...], ...] | None
    max_restarts: int = 0
    hosts: tuple[tuple[str, int], ...] | None = None
    host_rank: int = 0
    gpu_sets: tuple[tuple[str, ...], ...] | None = None

    @property
    def first_worker(self) -> int:
        """The global index of this host's first worker."""
        return hosts_lib.offset(self.hosts, self.host_rank) if self.hosts else 0

    def addresses(self, ports: Sequence[int]) -> list[str]:
        """Every worker's address, for this host's worker `ports` when on one host."""
        if self.hosts:
            return hosts_lib.cluster_addresses(self.hosts, self.port)
        return [f"localhost:{p}" for p in ports]

    def to_json(self) -> str:
        return json.dumps(dataclasses.asdict(self))

    @classmethod
    def from_json(cls, text: str) -> "LaunchPlan":
        d = json.loads(text)

        def tuples(value):
            return None if value is None else tuple(tuple(v) for v in value)

        return cls(
            command=tuple(d["command"]), num_workers=d["num_workers"], port=d["port"],
            startup_timeout=d["startup_timeout"], grace_period=d["grace_period"],
            cpu_sets=tuples(d["cpu_sets"]), max_restarts=d.get("max_restarts", 0),
            hosts=tuples(d.get("hosts")), host_rank=d.get("host_rank", 0),
            gpu_sets=tuples(d.get("gpu_sets")),
        )


def in_range(name: str, value, low, high, *, integer: bool = True, above: bool = False,
             hint: str = ""):
    """`value` if it is an integer (a finite number unless `integer`; never a bool) from
    `low` (above `low` when `above`) to `high`.

    Example:
        >>> in_range("max_restarts", 3, 0, 1000)
        3
        >>> in_range("port", 99999999999, 1, 65535, hint="e.g. 2222")
        Traceback (most recent call last):
            ...
        ValueError: `port` (99999999999) must be an integer from 1 to 65535; e.g. 2222.

    Raises:
        ValueError: naming `name`, the value and the range.
    """
    ok = (checks.is_int(value) if integer else
          isinstance(value, numbers.Real) and not isinstance(value, bool)
          and math.isfinite(value))
    if not ok or not (value > low if above else value >= low) or value > high:
        lower = f"above {low:g}" if above else f"{low:g}"
        raise ValueError(f"`{name}` ({value!r}) must be {'an integer' if integer else 'a number'}"
                         f" from {lower} to {high:g}" + (f"; {hint}" if hint else "") + ".")
    return value


def check_numbers(num_workers: int = 2, port: int | None = None,
                  startup_timeout: float = DEFAULT_STARTUP_TIMEOUT,
                  grace_period: float = DEFAULT_GRACE_PERIOD, max_restarts: int = 0,
                  gpus_per_worker: int = 0) -> None:
    """The numbers of `launch`, each in its range (before anything starts).

    Raises:
        ValueError: a number out of its range, with the range in the message.
    """
    _check_num_workers(num_workers)
    if port is not None:
        in_range("port", port, 1, 65535, hint="e.g. 2222")
    in_range("startup_timeout", startup_timeout, 0, MAX_SECONDS, integer=False, above=True,
             hint=f"seconds, e.g. {DEFAULT_STARTUP_TIMEOUT:g}")
    in_range("grace_period", grace_period, 0, MAX_SECONDS, integer=False,
             hint=f"seconds, e.g. {DEFAULT_GRACE_PERIOD:g}")
    in_range("max_restarts", max_restarts, 0, MAX_RESTARTS, hint="e.g. 3 (0: never restart)")
    in_range("gpus_per_worker", gpus_per_worker, 0, MAX_GPUS_PER_WORKER,
             hint="e.g. 1 (0: every worker sees every GPU)")


def _check_cores(num_workers: int, cores: int, oversubscribe: bool, where: str) -> None:
    """Refuses more than `MAX_WORKERS_PER_CORE` workers a core unless `oversubscribe`."""
    most = MAX_WORKERS_PER_CORE * max(cores, 1)
    if num_workers > most and not oversubscribe:
        raise ValueError(f"{where} ({num_workers}) is more than {MAX_WORKERS_PER_CORE} "
                         f"workers per core for the {human.count(cores, 'core')} of this host: "
                         f"use 1 to "
                         f"{most}, or pass --oversubscribe to start them "
                         "anyway.")


def make_plan(command: Sequence[str], num_workers: int = 2, pin_cpus: bool = False,
              port: int | None = None, startup_timeout: float = DEFAULT_STARTUP_TIMEOUT,
              grace_period: float = DEFAULT_GRACE_PERIOD,
              available_cpus: Iterable[int] = (), max_restarts: int = 0,
              hosts: Sequence[tuple[str, int]] | None = None, host_rank: int | None = None,
              gpus_per_worker: int = 0, available_gpus: Sequence[str] = (),
              gpus_source: str = "", oversubscribe: bool = False,
              cores: int | None = None) -> LaunchPlan:
    """Validates the arguments of `launch` and returns the plan.

    Args:
        command, num_workers, pin_cpus, port, startup_timeout, grace_period, max_restarts,
        oversubscribe: as for `launch` (`num_workers`: the workers of a host listed
            without `:N`).
        available_cpus: the cores `pin_cpus` splits.
        hosts: ((host, workers), ...) of a launch across hosts (`hosts.parse_hosts`), or
            None for this host alone.
        host_rank: this host's position in `hosts`.
        gpus_per_worker: GPUs per local worker (0: leave CUDA_VISIBLE_DEVICES alone).
        available_gpus, gpus_source: this host's GPUs (`gpus.host_gpus`) and where that
            list came from.
        cores: this host's cores, for the workers per core; by default those this
            process may run on.

    Example:
        >>> plan = make_plan(["python", "t.py"], hosts=(("a", 2), ("b", 1)), host_rank=1)
        >>> plan.num_workers, plan.port, plan.first_worker
        (1, 2222, 2)

    Raises:
        ValueError: if `command` is empty or a string, a number is out of its range
            (`check_numbers`), this host has more than `MAX_WORKERS_PER_CORE` workers per
            core without `oversubscribe`, `port` leaves no room for the workers in
            1..65535, `pin_cpus` is set with more workers than `available_cpus`,
            `host_rank` is out of range or given without `hosts`, or there are too few GPUs.
    """
    if isinstance(command, str):
        raise ValueError(f"`command` must be a list of arguments, got the string {command!r}; "
                         f"use e.g. {command.split()!r}.")
    command = tuple(command)
    if not command:
        raise ValueError("no command to launch; put it after `--`, e.g. "
                         "`tfmulti launch --num_workers 2 -- python train.py`.")
    check_numbers(num_workers, port, startup_timeout, grace_period, max_restarts,
                  gpus_per_worker)
    cores = len(os.sched_getaffinity(0)) if cores is None else cores
    where = "`num_workers`"
    if hosts:
        hosts = tuple((str(h), n) for h, n in hosts)
        for name, n in hosts:
            hosts_lib.check_workers(name, n)
        host_rank = hosts_lib.check_rank(hosts, host_rank)
        num_workers = hosts[host_rank][1]
        where = f"host {host_rank}'s number of workers in `hosts`"
        port = hosts_lib.DEFAULT_PORT if port is None else port
        hosts_lib.worker_ports(port, max(n for _, n in hosts))
    elif host_rank is not None:
        raise ValueError(f"`host_rank` ({host_rank!r}) needs `hosts`, the list of every "
                         "host of the launch, e.g. --hosts node1:2,node2:2 --host_rank 1.")
    elif port is not None:
        port_range(port, num_workers)
    _check_cores(num_workers, cores, oversubscribe, where)
    cpu_sets = split_cpus(available_cpus, num_workers) if pin_cpus else None
    gpu_sets = (gpus_lib.gpu_slices(available_gpus, num_workers, gpus_per_worker,
                                    gpus_source) if gpus_per_worker else None)
    return LaunchPlan(command, num_workers, port, float(startup_timeout),
                      float(grace_period), cpu_sets, max_restarts, hosts or None,
                      host_rank or 0, gpu_sets)


def _check_num_workers(num_workers: int) -> None:
    hosts_lib.check_workers(None, num_workers)


def port_range(base: int, num_workers: int) -> list[int]:
    """The ports of the workers for base port `base`: base .. base + num_workers - 1.

    Raises:
        ValueError: if a port would fall outside 1..65535.
    """
    _check_num_workers(num_workers)
    if not checks.is_int(base) or base < 1 or base + num_workers - 1 > 65535:
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


def worker_env(base_env: Mapping[str, str], addresses: Sequence[str], index: int,
               startup_timeout: float = DEFAULT_STARTUP_TIMEOUT,
               cpus: Sequence[int] | None = None,
               gpus: Sequence[str] | None = None) -> dict[str, str]:
    """The environment of worker `index` of the cluster at `addresses`: `base_env` (less
    the launchers' secret, `auth.SECRET_ENV`) plus TF_CONFIG, the launcher's settings, and,
    when given, its cores' thread counts and its GPUs (CUDA_VISIBLE_DEVICES).

    Example:
        >>> env = worker_env({}, ["node1:2223", "node2:2223"], 1, gpus=("2", "3"))
        >>> env["CUDA_VISIBLE_DEVICES"], env["TF_CONFIG"]
        ('2,3', '{"cluster": {"worker": ["node1:2223", "node2:2223"]}, "task": {"type": "worker", "index": 1}}')
    """
    env = dict(base_env)
    env.pop(auth.SECRET_ENV, None)  # the launchers' secret: never the workers'
    env["TF_CONFIG"] = json.dumps(tf_config_lib.build_tf_config(list(addresses), index))
    env["TFMULTI_STARTUP_TIMEOUT"] = f"{startup_timeout:g}"
    env[tf_config_lib.LAUNCHED_ENV] = "1"  # `distribution="auto"` may join this cluster
    env["PYTHONUNBUFFERED"] = "1"
    if cpus is not None:
        threads = str(len(cpus))
        env["TF_NUM_INTRAOP_THREADS"] = threads
        env["TF_NUM_INTEROP_THREADS"] = threads
        env["OMP_NUM_THREADS"] = threads
    if gpus is not None:
        env["CUDA_VISIBLE_DEVICES"] = ",".join(gpus)
    return env


def isolation_prefix(mode: str, network: bool = True, mount: bool = False) -> list[str]:
    """The `unshare` command that runs a program in a new PID namespace, in a new
    network namespace when `network`, and in a new mount namespace (private: its mounts
    are seen nowhere else, and go with it) when `mount`: as root ("root"), or
    unprivileged inside a new user namespace ("userns").

    The program itself stays in the PID namespace it came from; its first child is the new
    namespace's init, and when that child dies, even by SIGKILL, the kernel kills every
    process left in the namespace.

    Example:
        >>> isolation_prefix("root")
        ['unshare', '--pid', '--net']
        >>> isolation_prefix("userns", network=False)
        ['unshare', '--pid', '--map-root-user']
        >>> isolation_prefix("root", mount=True)
        ['unshare', '--pid', '--net', '--mount', '--propagation', 'private']

    Raises:
        ValueError: an unknown `mode`.
    """
    if mode not in ISOLATION_MODES:
        raise ValueError(f"isolation `mode` ({mode!r}) must be one of {ISOLATION_MODES}.")
    prefix = ["unshare", "--pid"]
    if network:
        prefix.append("--net")
    if mount:
        prefix += ["--mount", "--propagation", "private"]
    if mode == "userns":
        prefix.append("--map-root-user")
    return prefix


def supervisor_command(plan: LaunchPlan, python: str, isolation_mode: str | None = None,
                       network: bool = True, wait_network: bool = False,
                       resolv_conf: bool = False) -> list[str]:
    """The command that runs the supervisor, which starts the workers with `plan.command`.

    The process it starts forks the supervisor and stays its parent: a child subreaper that
    passes on its exit status and kills whatever the workers leave behind. For
    `isolation_mode` "root" or "userns" the supervisor is the init of a new PID namespace
    (`isolation_prefix`), in a private network namespace when `network`; for None (no
    namespace can be made) it runs in the host's namespaces. With `wait_network` it starts
    nothing until the launcher has attached the namespace's outbound network
    (`tfmulti.cluster.outbound`); with `resolv_conf` as well, it runs in a mount namespace
    of its own, whose /etc/resolv.conf it then points at that network's DNS forwarder.

    Example:
        >>> plan = make_plan(["python", "train.py"], 2)
        >>> supervisor_command(plan, "python3", "root")[:6]
        ['unshare', '--pid', '--net', '--', 'python3', '-m']
        >>> supervisor_command(plan, "python3")[:3]
        ['python3', '-m', 'tfmulti.cluster.supervisor']
        >>> supervisor_command(plan, "python3", "root", wait_network=True)[-1]
        '--wait_network'
    """
    resolv_conf = resolv_conf and wait_network and network and isolation_mode is not None
    prefix = ([*isolation_prefix(isolation_mode, network, mount=resolv_conf), "--"]
              if isolation_mode else [])
    return [*prefix, python, "-m", "tfmulti.cluster.supervisor", plan.to_json(),
            *(["--wait_network"] if wait_network else []),
            *(["--resolv_conf"] if resolv_conf else [])]
