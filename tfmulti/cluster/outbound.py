"""Outbound network access for isolated workers: user-mode networking (slirp4netns).

Isolated workers run in a private network namespace (`tfmulti.cluster.launcher`), which
holds only a loopback interface. Where `slirp4netns` (the Debian and Ubuntu package of
that name) is installed, the launcher attaches it to the namespace: a `tap0` interface at
`ADDRESS` whose traffic slirp4netns, a process of the host's network namespace, sends on
through ordinary sockets of its own. The workers can then connect out (a bucket, an
experiment tracker, a download; the host's own loopback services at `GATEWAY`, a DNS
forwarder at `DNS`), while nothing can connect in: slirp4netns forwards no port (it is
started without its API socket), and the namespace's addresses exist nowhere but inside
it, so no host or other namespace has a route to them.

Name lookups: where the host's /etc/resolv.conf names only resolvers on its loopback
(systemd-resolved's 127.0.0.53, a local dnsmasq), which the namespace's own loopback does
not reach, the namespace gets a mount namespace of its own in which its /etc/resolv.conf
names `DNS` instead (`namespace_resolv_conf`); slirp4netns forwards those queries to the
host's resolver.

slirp4netns rather than pasta (the package `passt`): pasta copies the host's addresses
and routes into the namespace and fails on a host without a default route (a simulated
host, a machine with several networks and none default), and by default forwards the
ports the namespace listens on.

slirp4netns lives exactly as long as the launch: the launcher holds the write end of its
`--exit-fd` pipe (closed when the launch ends, or with the launcher whichever way it dies)
and gives it a parent-death signal as well.
"""

from __future__ import annotations

import os
import selectors
import shutil
import subprocess
import tempfile
import time
from typing import Callable

__all__ = ["ADDRESS", "DNS", "GATEWAY", "PACKAGE", "RESOLV_CONF", "TOOL", "Outbound", "command",
           "find", "host_resolv_conf", "namespace_resolv_conf"]

TOOL = "slirp4netns"
PACKAGE = "slirp4netns"
"""The Debian and Ubuntu package (Fedora's and Arch's have the same name)."""
ADDRESS = "10.0.2.100"
"""The workers' address on the namespace's `tap0` (slirp4netns' default network,
10.0.2.0/24), reachable from nowhere outside the namespace."""
GATEWAY = "10.0.2.2"
"""The namespace's default route; connections to it reach the host's loopback."""
DNS = "10.0.2.3"
"""slirp4netns' forwarder to the host's DNS servers."""
RESOLV_CONF = "/etc/resolv.conf"
READY_TIMEOUT_S = 15.0
STOP_TIMEOUT_S = 5.0
_MTU = 65520  # slirp4netns' advice: the largest, fewest copies per byte


def find() -> str | None:
    """The path of `TOOL`, or None where it is not installed."""
    return shutil.which(TOOL)


def command(tool: str, pid: int, ready_fd: int, exit_fd: int) -> list[str]:
    """The command that gives the network namespace of process `pid` outbound access:
    `tap0` configured (address, default route), written to `ready_fd` when done, and
    ended when `exit_fd` reads end-of-file.

    Example:
        >>> command("slirp4netns", 1234, 5, 6)
        ['slirp4netns', '--configure', '--mtu=65520', '--ready-fd=5', '--exit-fd=6', '1234', 'tap0']
    """
    return [tool, "--configure", f"--mtu={_MTU}", f"--ready-fd={ready_fd}",
            f"--exit-fd={exit_fd}", str(pid), "tap0"]


def namespace_resolv_conf(text: str) -> str | None:
    """The resolv.conf for the namespace when the host's, `text`, names resolvers on its
    loopback only: theirs replaced by slirp4netns' forwarder `DNS` (the other lines kept);
    None when the host's serves as it is (a resolver the namespace reaches, or none).

    Example:
        >>> namespace_resolv_conf("nameserver 127.0.0.53\\noptions edns0 trust-ad\\n")
        'nameserver 10.0.2.3\\noptions edns0 trust-ad\\n'
        >>> namespace_resolv_conf("nameserver 192.0.2.1\\n") is None
        True
    """
    lines = text.splitlines()
    servers = [line.split()[1] for line in lines
               if len(line.split()) > 1 and line.split()[0] == "nameserver"]
    if not servers or not all(s.startswith("127.") or s == "::1" for s in servers):
        return None
    kept = [line for line in lines if line.split()[:1] != ["nameserver"]]
    return "\n".join([f"nameserver {DNS}", *kept]) + "\n"


def host_resolv_conf() -> str:
    """The host's resolv.conf ("" where it cannot be read)."""
    try:
        with open(RESOLV_CONF, encoding="utf-8", errors="replace") as f:
            return f.read()
    except OSError:
        return ""


class Outbound:
    """slirp4netns attached to one namespace, from `start` to `stop`.

    Args:
        tool: the path of slirp4netns (`find`).
    """

    def __init__(self, tool: str):
        self.tool = tool
        self.proc: subprocess.Popen | None = None
        self._exit_w: int | None = None
        self._log = None

    def __repr__(self) -> str:
        return f"Outbound(tool={self.tool!r}, pid={self.proc.pid if self.proc else None})"

    def start(self, pid: int, preexec_fn: Callable[[], None] | None = None,
              timeout_s: float = READY_TIMEOUT_S) -> str:
        """Attaches slirp4netns to the network namespace of process `pid` and waits until
        the namespace's interface is configured. Returns "" when it is, else why not (and
        nothing is left running)."""
        ready_r, ready_w = os.pipe()
        exit_r, self._exit_w = os.pipe()
        self._log = tempfile.TemporaryFile()
        try:
            self.proc = subprocess.Popen(
                command(self.tool, pid, ready_w, exit_r), stdin=subprocess.DEVNULL,
                stdout=self._log, stderr=subprocess.STDOUT, pass_fds=(ready_w, exit_r),
                start_new_session=True,  # a Ctrl-C at the terminal is the launcher's
                preexec_fn=preexec_fn)
        except OSError as e:
            self.stop()
            return f"{TOOL} did not start ({e})"
        finally:
            os.close(ready_w)
            os.close(exit_r)
        try:
            answer = _read_within(ready_r, timeout_s)
        finally:
            os.close(ready_r)
        if answer:
            return ""
        if answer is not None:  # end of file: it exited (or is exiting) before it was ready
            try:
                self.proc.wait(timeout=STOP_TIMEOUT_S)
            except subprocess.TimeoutExpired:
                pass
        why = (f"{TOOL} failed: {self._last_line()}" if self.proc.poll() is not None
               else f"{TOOL} did not configure the namespace within {timeout_s:g} s")
        self.stop()
        return why

    def _last_line(self) -> str:
        """Its last lines of output, on one line ('open("/dev/net/tun"): Permission
        denied; child failed(1)')."""
        if self._log is None:
            return "no output"
        self._log.seek(0)
        lines = [line.strip() for line in self._log.read().decode("utf-8", "replace")
                 .splitlines() if line.strip()]
        return "; ".join(lines[-3:])[-300:] if lines else f"exit code {self.proc.returncode}"

    def stop(self) -> None:
        """Ends slirp4netns (end-of-file on its exit fd, SIGKILL if it lingers) and reaps
        it; a no-op when it is not running."""
        if self._exit_w is not None:
            os.close(self._exit_w)
            self._exit_w = None
        if self.proc is not None and self.proc.returncode is None:
            try:
                self.proc.wait(timeout=STOP_TIMEOUT_S)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait(timeout=STOP_TIMEOUT_S)
        if self._log is not None:
            self._log.close()
            self._log = None


def _read_within(fd: int, timeout_s: float) -> bytes | None:
    """The first byte `fd` delivers within `timeout_s` (b"" at end-of-file), or None."""
    deadline = time.monotonic() + timeout_s
    with selectors.DefaultSelector() as selector:
        selector.register(fd, selectors.EVENT_READ)
        while (left := deadline - time.monotonic()) > 0:
            if selector.select(left):
                return os.read(fd, 1)
    return None
