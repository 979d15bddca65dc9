"""Hosts simulated on one machine, for the tests and the benchmarks of a launch across
hosts: network namespaces joined by a bridge (needs root and iproute2; no TensorFlow).

Each simulated host is a network namespace with one interface and its own address
(10.213.0.1, 10.213.0.2, ... by default); the bridge lives in a namespace of its
own, so nothing is added to the machine's own network and no traffic leaves the
namespaces made here. Processes started with `command(i, argv)` run inside host
i's namespace (and nowhere else: their view of files and processes is the
machine's).

    with SimulatedHosts(2) as hosts:
        subprocess.run(hosts.command(1, ["ping", "-c1", hosts.addresses[0]]))

A launch across them needs the launchers' shared secret: `hosts.launch_env()` is
an environment with a fresh one (`TFMULTI_LAUNCH_SECRET`) for every host's
launcher.

On exit, every process left in the namespaces is killed and the namespaces (with
their interfaces and the bridge) are deleted, also after a failure; namespaces
left by a process that was killed before it could clean up are deleted by the
next `SimulatedHosts` on the machine.
"""

from __future__ import annotations

import itertools
import os
import secrets
import shutil
import signal
import subprocess
from typing import Mapping, Sequence

__all__ = ["SimulatedHosts", "available"]

_PREFIX = "tfmsim"
_IP_TIMEOUT_S = 30.0
_counter = itertools.count()


def _ip(*args: str, check: bool = True) -> subprocess.CompletedProcess:
    result = subprocess.run(["ip", *args], capture_output=True, text=True,
                            timeout=_IP_TIMEOUT_S, stdin=subprocess.DEVNULL)
    if check and result.returncode != 0:
        raise RuntimeError(f"`ip {' '.join(args)}` failed: {result.stderr.strip()}")
    return result


def available() -> tuple[bool, str]:
    """Whether simulated hosts can be made here, and why not."""
    if shutil.which("ip") is None:
        return False, "the `ip` command (iproute2) is not installed"
    if os.geteuid() != 0:
        return False, "making network namespaces (`ip netns add`) needs root"
    return True, ""


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


def _namespaces() -> list[str]:
    return [line.split()[0] for line in _ip("netns", "list").stdout.splitlines() if line]


def _delete(namespace: str) -> None:
    """Kills the processes in `namespace` and deletes it (its interfaces go with it)."""
    pids = _ip("netns", "pids", namespace, check=False).stdout.split()
    for pid in pids:
        try:
            os.kill(int(pid), signal.SIGKILL)
        except (ProcessLookupError, ValueError):
            pass
    _ip("netns", "delete", namespace, check=False)


def _delete_stale() -> None:
    """Deletes the namespaces of earlier `SimulatedHosts` whose process is gone."""
    for name in _namespaces():
        if name.startswith(_PREFIX):
            owner = name[len(_PREFIX):].split("x", 1)[0]
            if owner.isdigit() and not _alive(int(owner)):
                _delete(name)


class SimulatedHosts:
    """`count` network namespaces, host i at address `addresses[i]`, joined by a bridge.

    Args:
        count: how many hosts; 2 by default.
        subnet: the first three numbers of the hosts' /24 network.

    Raises:
        RuntimeError: on entering, where namespaces cannot be made (see `available`).
    """

    def __init__(self, count: int = 2, subnet: str = "10.213.0"):
        if not 1 <= count <= 250:
            raise ValueError(f"`count` ({count!r}) must be from 1 to 250 hosts.")
        tag = f"{_PREFIX}{os.getpid()}x{next(_counter)}"
        self.names = [f"{tag}h{i}" for i in range(count)]
        self.switch = f"{tag}sw"
        self.addresses = [f"{subnet}.{i + 1}" for i in range(count)]
        self.secret = secrets.token_hex(32)
        """The launchers' shared secret of a launch across these hosts."""
        self._made: list[str] = []

    def launch_env(self, base: Mapping[str, str] | None = None,
                   secret: str | None = None) -> dict[str, str]:
        """`base` (this process's environment by default) with `TFMULTI_LAUNCH_SECRET` set
        to `secret` (`self.secret` by default): a launcher's environment."""
        env = dict(os.environ if base is None else base)
        env["TFMULTI_LAUNCH_SECRET"] = self.secret if secret is None else secret
        return env

    def command(self, host: int, argv: Sequence[str]) -> list[str]:
        """`argv` run inside host `host`'s network namespace."""
        return ["ip", "netns", "exec", self.names[host], *argv]

    def __enter__(self) -> "SimulatedHosts":
        ok, why = available()
        if not ok:
            raise RuntimeError(f"cannot simulate hosts: {why}.")
        _delete_stale()
        try:
            for name in (self.switch, *self.names):
                _ip("netns", "add", name)
                self._made.append(name)
            _ip("-n", self.switch, "link", "add", "br0", "type", "bridge")
            _ip("-n", self.switch, "link", "set", "br0", "up")
            for i, (name, address) in enumerate(zip(self.names, self.addresses)):
                # Both ends are made inside their namespaces: none appears on the machine.
                _ip("link", "add", "eth0", "netns", name, "type", "veth", "peer", "name",
                    f"p{i}", "netns", self.switch)
                _ip("-n", self.switch, "link", "set", f"p{i}", "master", "br0", "up")
                _ip("-n", name, "addr", "add", f"{address}/24", "dev", "eth0")
                _ip("-n", name, "link", "set", "eth0", "up")
                _ip("-n", name, "link", "set", "lo", "up")
        except BaseException:
            self.__exit__()
            raise
        return self

    def __exit__(self, *exc) -> None:
        for name in reversed(self._made):
            _delete(name)
        self._made = []
