"""A launch across hosts, computed by pure functions (no processes, no TensorFlow).

`tfmulti launch --hosts HOST[:N],... --host_rank R` runs one launcher per
host; each computes the whole cluster from the same arguments: the hosts in
order, host R's workers are the global workers `offset(hosts, R)` onward, and
every worker's address is its host's name with a port after the launchers'
coordination port (`worker_ports`). Under SLURM (`--hosts slurm`, one launcher
per node started by `srun`) the hosts and the rank come from SLURM's
environment (`slurm_hosts`, `expand_nodelist`).

Example:
    >>> from tfmulti.cluster import hosts
    >>> cluster = hosts.parse_hosts("node1:2,node2", default_workers=1)
    >>> cluster
    (('node1', 2), ('node2', 1))
    >>> hosts.cluster_addresses(cluster, 2222)
    ['node1:2223', 'node1:2224', 'node2:2223']
    >>> hosts.offset(cluster, 1)
    2
    >>> hosts.expand_nodelist("gpu[08-10],login1")
    ['gpu08', 'gpu09', 'gpu10', 'login1']
"""

from __future__ import annotations

import hashlib
import json
import re
from typing import Mapping, Sequence

from tfmulti.utils import checks

__all__ = ["DEFAULT_PORT", "MAX_WORKERS_PER_HOST", "SLURM", "check_rank", "check_workers",
           "cluster_addresses", "expand_nodelist", "offset", "parse_hosts", "slurm_hosts",
           "view_digest", "worker_ports"]

SLURM = "slurm"
"""The `--hosts` value that takes the hosts and the rank from SLURM's environment."""
DEFAULT_PORT = 2222
"""The launchers' coordination port on every host; the workers use the ports after it."""
MAX_WORKERS_PER_HOST = 1024
"""The most workers a host runs (each has its own port after the coordination port)."""
_HOST_NAME = re.compile(r"^[A-Za-z0-9]([A-Za-z0-9.\-_]*[A-Za-z0-9])?$")
_EXAMPLE = "e.g. --hosts node1:2,node2:2"


def parse_hosts(text: str, default_workers: int) -> tuple[tuple[str, int], ...]:
    """`HOST[:N],HOST[:N],...` as ((host, workers), ...); a host without `:N` runs
    `default_workers`.

    Raises:
        ValueError: an empty list or host, a host name with characters a DNS name or an
            IPv4 address does not have, a worker count that is not a positive integer,
            or a host listed twice.
    """
    check_workers(None, default_workers)
    if not isinstance(text, str) or not text.strip():
        raise ValueError(f"`hosts` must list the hosts as HOST[:N],HOST[:N],..., got "
                         f"{text!r}; {_EXAMPLE}.")
    parsed, seen = [], set()
    for i, item in enumerate(text.split(",")):
        name, sep, count = item.strip().partition(":")
        if not _HOST_NAME.match(name):
            raise ValueError(f"host {i} of `hosts` ({item.strip()!r}) is not HOST or HOST:N "
                             f"with a host name or IPv4 address; {_EXAMPLE}.")
        if sep:
            if not (count.isascii() and count.isdigit()) or not \
                    1 <= int(count) <= MAX_WORKERS_PER_HOST:
                raise ValueError(f"host {i} of `hosts` ({item.strip()!r}): N must be a "
                                 f"number of workers from 1 to {MAX_WORKERS_PER_HOST}; "
                                 f"{_EXAMPLE}.")
            workers = int(count)
        else:
            workers = default_workers
        if name in seen:
            raise ValueError(f"host {name!r} appears twice in `hosts`; list each host once "
                             f"with its number of workers, {_EXAMPLE}.")
        seen.add(name)
        parsed.append((name, workers))
    return tuple(parsed)


def check_workers(host: str | None, workers) -> int:
    """A host's number of workers (`host` None: `num_workers`), from 1 to
    `MAX_WORKERS_PER_HOST`.

    Raises:
        ValueError: naming the host, the value and the range.
    """
    if not checks.is_int(workers) or not 1 <= workers <= MAX_WORKERS_PER_HOST:
        name = "`num_workers`" if host is None else f"the workers of host {host!r}"
        raise ValueError(f"{name} ({workers!r}) must be an integer from 1 to "
                         f"{MAX_WORKERS_PER_HOST}; e.g. 2.")
    return int(workers)


def check_rank(hosts: Sequence[tuple[str, int]], host_rank) -> int:
    """`host_rank` checked against `hosts`.

    Raises:
        ValueError: a rank that is not an integer in 0..len(hosts) - 1.
    """
    if host_rank is None:
        raise ValueError(f"`host_rank` is missing: with `hosts`, give this host's position "
                         f"in the list, 0 to {len(hosts) - 1} for the {len(hosts)} hosts "
                         f"{[h for h, _ in hosts]}.")
    if not checks.is_int(host_rank) or not 0 <= host_rank < len(hosts):
        raise ValueError(f"`host_rank` ({host_rank!r}) must be this host's position in "
                         f"`hosts`, an integer from 0 to {len(hosts) - 1} for the "
                         f"{len(hosts)} hosts {[h for h, _ in hosts]}.")
    return int(host_rank)


def worker_ports(port: int, num_workers: int) -> list[int]:
    """The ports of a host's workers: the `num_workers` ports after the coordination
    `port`.

    Raises:
        ValueError: if a port would fall outside 1..65535.
    """
    check_workers(None, num_workers)
    if not checks.is_int(port) or port < 1 or port + num_workers > 65535:
        raise ValueError(f"`port` ({port!r}) must be an integer from 1 to "
                         f"{65535 - num_workers}: with --hosts it is the launchers' "
                         f"coordination port and the {num_workers} workers of a host use "
                         "the ports after it; use e.g. 2222.")
    return list(range(port + 1, port + 1 + num_workers))


def cluster_addresses(hosts: Sequence[tuple[str, int]], port: int) -> list[str]:
    """Every worker's `host:port`, in global worker order (worker 0, the chief, first)."""
    return [f"{name}:{p}" for name, n in hosts for p in worker_ports(port, n)]


def offset(hosts: Sequence[tuple[str, int]], host_rank: int) -> int:
    """The global index of host `host_rank`'s first worker."""
    return sum(n for _, n in hosts[:host_rank])


def view_digest(hosts: Sequence[tuple[str, int]], port: int, max_restarts: int) -> str:
    """What every launcher of a cluster must agree on, as a short hash: the workers'
    addresses in order (so the hosts, their worker counts and the port) and the restart
    budget."""
    view = {"workers": cluster_addresses(hosts, port), "max_restarts": max_restarts}
    return hashlib.sha256(json.dumps(view, sort_keys=True).encode()).hexdigest()[:16]


_RANGE = re.compile(r"^(\d+)(?:-(\d+))?$")


def _expand_brackets(pattern: str) -> list[str]:
    """One host expression of a SLURM node list: `prefix[ranges]suffix...`."""
    start = pattern.find("[")
    if start < 0:
        if "]" in pattern:
            raise ValueError(f"unbalanced ']' in the SLURM node list entry {pattern!r}.")
        return [pattern]
    end = pattern.find("]", start)
    if end < 0:
        raise ValueError(f"unbalanced '[' in the SLURM node list entry {pattern!r}.")
    names = []
    for part in pattern[start + 1:end].split(","):
        match = _RANGE.match(part.strip())
        if not match:
            raise ValueError(f"{part!r} in the SLURM node list entry {pattern!r} is not a "
                             "number or a range such as 1-3.")
        low, high = match.group(1), match.group(2) or match.group(1)
        if int(high) < int(low):
            raise ValueError(f"the range {part!r} in the SLURM node list entry "
                             f"{pattern!r} runs backwards.")
        width = len(low) if low.startswith("0") else 0  # node[01-10]: zero-padded
        names += [f"{pattern[:start]}{str(n).zfill(width)}"
                  for n in range(int(low), int(high) + 1)]
    return [name + rest for name in names for rest in _expand_brackets(pattern[end + 1:])]


def expand_nodelist(nodelist: str) -> list[str]:
    """SLURM's compact node list (`node[1-3,7],gpu[01-02]`) as host names, in order.

    Raises:
        ValueError: an empty list, unbalanced brackets or a malformed range.
    """
    entries, depth, current = [], 0, ""
    for char in nodelist.strip():
        if char == "," and depth == 0:
            entries.append(current)
            current = ""
            continue
        depth += (char == "[") - (char == "]")
        current += char
    entries.append(current)
    if not nodelist.strip() or any(not e.strip() for e in entries):
        raise ValueError(f"the SLURM node list {nodelist!r} has an empty entry.")
    return [name for entry in entries for name in _expand_brackets(entry.strip())]


def _one_task_per_node(tasks_per_node: str) -> bool:
    """SLURM_STEP_TASKS_PER_NODE such as `1(x4)` or `1,1`: one task on every node."""
    return all(re.fullmatch(r"1(\(x\d+\))?", part) for part in tasks_per_node.split(","))


def slurm_hosts(environ: Mapping[str, str],
                num_workers: int) -> tuple[tuple[tuple[str, int], ...], int]:
    """The hosts (each with `num_workers` workers) and this node's rank, from the
    environment of a SLURM job step with one task per node (`srun --ntasks-per-node=1`).

    The nodes are those of the step (SLURM_STEP_NODELIST, else SLURM_JOB_NODELIST); the
    rank is SLURMD_NODENAME's position among them, else SLURM_NODEID.

    Raises:
        ValueError: outside a SLURM job, more than one task per node, or a node name or
            id that is not in the node list.
    """
    nodelist = environ.get("SLURM_STEP_NODELIST") or environ.get("SLURM_JOB_NODELIST")
    if not nodelist:
        raise ValueError("--hosts slurm needs SLURM_STEP_NODELIST or SLURM_JOB_NODELIST in "
                         "the environment: run the launcher under `srun` inside a SLURM "
                         "allocation, one task per node (srun --ntasks-per-node=1).")
    tasks = environ.get("SLURM_STEP_TASKS_PER_NODE")
    if tasks and not _one_task_per_node(tasks):
        raise ValueError(f"--hosts slurm runs one launcher per node, but SLURM started "
                         f"{tasks} tasks per node (SLURM_STEP_TASKS_PER_NODE); use "
                         "`srun --ntasks-per-node=1 tfmulti launch --hosts slurm ...`.")
    names = expand_nodelist(nodelist)
    hosts = parse_hosts(",".join(names), num_workers)
    node = environ.get("SLURMD_NODENAME")
    if node:
        if node not in names:
            raise ValueError(f"this node, {node!r} (SLURMD_NODENAME), is not in the step's "
                             f"node list {nodelist!r}.")
        return hosts, names.index(node)
    node_id = environ.get("SLURM_NODEID", "")
    if not (node_id.isascii() and node_id.isdigit()):
        raise ValueError(f"--hosts slurm needs this node's rank: SLURMD_NODENAME or "
                         f"SLURM_NODEID, got SLURM_NODEID={node_id!r}; run under `srun`.")
    return hosts, check_rank(hosts, int(node_id))
