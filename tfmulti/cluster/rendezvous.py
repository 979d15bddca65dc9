"""The launchers of a launch across hosts agree on its start and its restarts (no
TensorFlow): a first handshake, then one message per event.

Every launcher's supervisor listens on the coordination port (`--port`) during
start-up; each one but host 0's connects to host 0's, the coordinator, and
says which host it is and its view of the cluster (`hosts.view_digest`). When
every host has joined with the same view, the coordinator answers `go`; a
different view, a rank taken twice, a host that does not join within the
startup timeout, or a launcher that failed its own checks ends the start-up on
every host (`abort`, exit 2) before any worker starts. Then the coordinator
starts each attempt on all hosts, hears how each host's workers ended, stops
the others when one fails, and decides: restart everywhere, or end with one
status everywhere. Training itself never passes through here: the workers
talk through TensorFlow's MultiWorkerMirroredStrategy.

Every connection between two launchers starts with a challenge and response
that proves both hold the job's shared secret, and carries each message with
an HMAC tag (`tfmulti.cluster.auth`: fresh nonces from both sides, so nothing
recorded can be replayed); a peer that fails is dropped and named in one line,
and the start-up goes on without it. Messages are JSON objects, one per line:

    follower -> coordinator   {"type": "hello", "rank": R, "view": DIGEST, "hosts": ...}
    coordinator -> follower   {"type": "go"}
    coordinator -> all        {"type": "start", "attempt": A}
    follower -> coordinator   {"type": "result", "rank": R, "attempt": A, "status": S,
                               "why": ..., "signalled": bool}
    coordinator -> all        {"type": "stop", "attempt": A, "why": ..., "preempted": bool}
    coordinator -> all        {"type": "end", "status": S, "why": ...}
    any launcher -> any       {"type": "abort", "why": ...}   (start-up only)

A launcher that disappears (its connection closes, or TCP keepalive finds its
host gone in about 25 s) fails the launch on the others.
"""

from __future__ import annotations

import os
import select
import socket
import sys
import time
from typing import Callable, Iterable, Sequence

from tfmulti.cluster import auth, exit_codes
from tfmulti.cluster._process import Outcome, Output
from tfmulti.cluster.channel import Channel
from tfmulti.utils import human

__all__ = ["LOST", "Link", "Remote", "coordinate", "follow", "join", "notify_abort"]

Remote = Callable[[], "dict | None"]
"""Polled while a host's workers run: None, or the coordinator's `stop` message
({"why", "status", "preempted"}) when another host's worker failed."""
LOST = 1
"""The exit status of a launch whose other launcher disappeared."""

_CONNECT_RETRY_S = 0.5
_ABORT_TIMEOUT_S = 2.0
_POLL_S = 0.5
_RESULTS_EXTRA_S = 30.0  # after a stop: a host's own stop time on top of the grace period
_MAX_PENDING = 64  # connections that have not authenticated yet, at host 0


def _listen(port: int, address: str | None = None) -> socket.socket:
    """A listening socket on `port` of `address`; of every address (IPv4 and IPv6 where
    there is IPv6) for None."""
    family = socket.AF_INET
    if address is None:
        try:
            socket.socket(socket.AF_INET6, socket.SOCK_STREAM).close()
            family, address = socket.AF_INET6, "::"
        except OSError:
            address = ""
    sock = socket.socket(family, socket.SOCK_STREAM)
    if family == socket.AF_INET6:
        sock.setsockopt(socket.IPPROTO_IPV6, socket.IPV6_V6ONLY, 0)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    try:
        sock.bind((address, port))
        sock.listen(64)
    except OSError as e:
        sock.close()
        raise ValueError(f"the launchers' coordination port {port} cannot be opened on this "
                         f"host ({e}); pass another --port, the same on every host.") from e
    return sock


def notify_abort(hosts: Sequence[tuple[str, int]], port: int, why: str,
                 secret: bytes | None = None) -> None:
    """Best effort, a few seconds a host at most: tells the other hosts' launchers that
    this one failed at start-up, so that they fail now instead of at their startup timeout.
    Without the job's `secret` (by default `auth.SECRET_ENV` of the environment) nothing
    is sent: the others would drop the message."""
    if secret is None:
        try:
            secret = auth.load_secret(os.environ)
        except ValueError:
            return
    for host, _ in hosts:  # itself too: its own host may be wrong in a list gone wrong
        deadline = time.monotonic() + _ABORT_TIMEOUT_S
        try:
            sock = socket.create_connection((host, port), timeout=_ABORT_TIMEOUT_S)
        except OSError:
            continue
        channel = Channel(sock, f"{host}:{port}", secret, initiator=True)
        try:
            channel.send({"type": "abort", "why": why})  # sent once both are authenticated
            while not (channel.authenticated or channel.closed) \
                    and (left := deadline - time.monotonic()) > 0:
                channel.receive(left)
        finally:
            channel.close()


class _Dropped:
    """Says once per host that a peer there failed authentication and was dropped."""

    def __init__(self, say: Callable[[str], None]):
        self.say, self.hosts = say, []

    def __call__(self, peer: str) -> None:
        host = peer.rsplit(":", 1)[0]
        if host not in self.hosts:
            self.hosts.append(host)
            self.say(f"{peer} failed authentication: dropped it (a launcher without this "
                     f"job's secret; every host needs the same {auth.SECRET_ENV} or "
                     "--secret_file)")

    def hint(self) -> str:
        """For a start-up that failed: the hosts whose launchers were dropped, if any."""
        if not self.hosts:
            return ""
        return (f" (launchers at {', '.join(self.hosts)} failed authentication: every host "
                f"needs the same {auth.SECRET_ENV} or --secret_file)")


class Link:
    """A launcher's connections to the others once the start-up handshake is done: the
    coordinator's to every follower (`channels` by host rank), a follower's to the
    coordinator (`channels[0]`)."""

    def __init__(self, hosts: Sequence[tuple[str, int]], host_rank: int,
                 channels: dict[int, Channel]):
        self.hosts, self.host_rank, self.channels = tuple(hosts), host_rank, channels
        self.inbox: list[dict] = []
        self._lost: set[int] = set()

    @property
    def coordinator(self) -> bool:
        return self.host_rank == 0

    def describe(self, rank: int) -> str:
        """"host R (NAME)"."""
        return f"host {rank} ({self.hosts[rank][0]})"

    def send(self, message: dict, ranks: Iterable[int] | None = None) -> None:
        """Sends `message` to the peers `ranks` (all by default)."""
        for rank in (self.channels if ranks is None else ranks):
            self.channels[rank].send(message)

    def poll(self, timeout_s: float = 0.0) -> list[dict]:
        """Reads what arrived into `inbox` (waiting up to `timeout_s` for anything), each
        message with "from": the sender's host rank; a peer whose connection closed becomes
        a {"type": "lost", "from": R} message, once. Returns `inbox`."""
        open_channels = [c for c in self.channels.values() if not c.closed]
        if open_channels and not any(c.unread for c in open_channels):
            select.select(open_channels, [], [], timeout_s)
        for rank, channel in self.channels.items():
            for message in channel.receive():
                message["from"] = rank  # who sent it, whatever it says
                self.inbox.append(message)
            if channel.closed and rank not in self._lost:
                self._lost.add(rank)
                self.inbox.append({"type": "lost", "from": rank})
        return self.inbox

    def take(self, *types: str) -> dict | None:
        """Removes and returns the first message in `inbox` of one of `types`."""
        for i, message in enumerate(self.inbox):
            if message["type"] in types:
                return self.inbox.pop(i)
        return None

    def close(self) -> None:
        for channel in self.channels.values():
            channel.close()

    def __enter__(self) -> "Link":
        return self

    def __exit__(self, *exc) -> None:
        self.close()


def _abort_message(message: dict, sender: str) -> ValueError:
    return ValueError(f"the launcher of {sender} stopped the start-up: "
                      f"{message.get('why', 'no reason given')}")


def _hello_error(message: dict, hosts: Sequence[tuple[str, int]], digest: str,
                 joined: dict) -> str | None:
    """Why the coordinator refuses a follower's hello, or None."""
    rank = message.get("rank")
    if message.get("view") != digest:
        theirs = message.get("hosts")
        return (f"the launcher of host {rank} sees another cluster than host 0's: its "
                f"--hosts is {theirs!r} (view {message.get('view')}), host 0's is "
                f"{[f'{h}:{n}' for h, n in hosts]!r} (view {digest}); give every host the "
                "same --hosts, --port and --max_restarts")
    if not isinstance(rank, int) or not 1 <= rank < len(hosts):
        return f"a launcher said it is host {rank!r}, not one of 1..{len(hosts) - 1}"
    if rank in joined:
        return (f"two launchers say they are host {rank} ({hosts[rank][0]}); give each "
                "host its own --host_rank")
    return None


def _serve_listener(listener: socket.socket, pending: list[Channel], secret: bytes,
                    dropped: _Dropped) -> None:
    """Accepts the connections that are waiting on `listener` (at most
    `_MAX_PENDING` waiting to authenticate: the oldest goes first)."""
    while select.select([listener], [], [], 0)[0]:
        try:
            sock, address = listener.accept()
        except OSError:
            return
        pending.append(Channel(sock, f"{address[0].removeprefix('::ffff:')}:{address[1]}",
                               secret, initiator=False, on_failure=dropped))
        if len(pending) > _MAX_PENDING:
            pending.pop(0).close()


class _Interrupted(Exception):
    """The launcher got SIGINT or SIGTERM during the start-up."""


def _coordinate_start(hosts, digest, listener, timeout_s, interrupted, secret,
                      dropped) -> dict[int, Channel]:
    deadline = time.monotonic() + timeout_s
    pending: list[Channel] = []
    joined: dict[int, Channel] = {}

    def fail(why: str) -> ValueError:
        for channel in [*pending, *joined.values()]:
            channel.send({"type": "abort", "why": why})
        return ValueError(why)

    while len(joined) < len(hosts) - 1:
        if interrupted():
            fail("host 0's launcher was interrupted")
            raise _Interrupted
        remaining = deadline - time.monotonic()
        if remaining <= 0:
            missing = [f"host {r} ({hosts[r][0]})" for r in range(1, len(hosts))
                       if r not in joined]
            raise fail(f"{', '.join(missing)} did not join within {timeout_s:g} s"
                       f"{dropped.hint()}; start `tfmulti launch` on every host, with the "
                       "same --hosts everywhere and each host's own --host_rank, or raise "
                       "--startup_timeout")
        select.select([listener, *pending, *joined.values()], [], [], min(remaining, 0.5))
        _serve_listener(listener, pending, secret, dropped)
        for channel in list(pending):
            for message in channel.receive():
                if message["type"] == "abort":
                    raise fail(str(_abort_message(message, channel.peer)))
                if message["type"] != "hello":
                    continue
                why = _hello_error(message, hosts, digest, joined)
                if why:
                    raise fail(why)
                pending.remove(channel)
                joined[message["rank"]] = channel
                break
            if channel.closed and channel in pending:
                pending.remove(channel)
        for rank, channel in joined.items():
            channel.receive()
            if channel.closed:
                raise fail(f"the launcher of host {rank} ({hosts[rank][0]}) left during "
                           "the start-up")
    for channel in pending:
        channel.close()
    for channel in joined.values():
        channel.send({"type": "go"})
    return joined


def _follow_start(hosts, host_rank, port, digest, listener, timeout_s, interrupted, secret,
                  dropped) -> Channel:
    deadline = time.monotonic() + timeout_s
    refused = False  # host 0's launcher refused this one's proof
    coordinator: Channel | None = None
    strangers: list[Channel] = []
    hello = {"type": "hello", "rank": host_rank, "view": digest,
             "hosts": [f"{h}:{n}" for h, n in hosts]}
    while True:
        if interrupted():
            if coordinator is not None:
                coordinator.send({"type": "abort",
                                  "why": f"host {host_rank}'s launcher was interrupted"})
            raise _Interrupted
        remaining = deadline - time.monotonic()
        if remaining <= 0:
            where = f"host 0 ({hosts[0][0]}:{port})"
            if refused or dropped.hosts:
                raise ValueError(
                    f"the launcher of {where} and this one failed to authenticate each "
                    f"other within {timeout_s:g} s: they hold different secrets; give "
                    f"every host the same {auth.SECRET_ENV} or --secret_file")
            raise ValueError(
                f"the launcher of {where} did not {'answer' if coordinator else 'accept'} "
                f"within {timeout_s:g} s; start `tfmulti launch` with the same --hosts on "
                "every host, check that this host reaches it on that port, or raise "
                "--startup_timeout")
        if coordinator is None:
            try:
                sock = socket.create_connection((hosts[0][0], port),
                                                timeout=min(remaining, _CONNECT_RETRY_S * 4))
                coordinator = Channel(sock, f"{hosts[0][0]}:{port}", secret, initiator=True,
                                      on_failure=dropped)
                coordinator.send(hello)
            except OSError:
                coordinator = None
        # Launchers that think this host is host 0, or that failed their own checks.
        _serve_listener(listener, strangers, secret, dropped)
        for channel in list(strangers):
            for message in channel.receive(0.05):
                if message["type"] == "abort":
                    raise _abort_message(message, channel.peer)
                if message["type"] == "hello":
                    why = (f"the launcher at {channel.peer}, host {message.get('rank')} of "
                           f"{message.get('hosts')!r}, took this launcher (host {host_rank} of "
                           f"{[f'{h}:{n}' for h, n in hosts]!r}) for host 0: the launchers' "
                           "views of the cluster differ; give every host the same --hosts")
                    channel.send({"type": "abort", "why": why})
                    raise ValueError(why)
            if channel.closed:
                strangers.remove(channel)
        if coordinator is not None:
            messages = coordinator.receive(min(remaining, _CONNECT_RETRY_S))
            for i, message in enumerate(messages):
                if message["type"] == "go":
                    for channel in strangers:
                        channel.close()
                    coordinator.unread = messages[i + 1:]  # e.g. the first "start"
                    return coordinator
                if message["type"] == "abort":
                    raise _abort_message(message, f"host 0 ({hosts[0][0]})")
            if coordinator.closed:
                refused = refused or coordinator.refused
                coordinator = None  # e.g. host 0 was still starting: try again
                time.sleep(_CONNECT_RETRY_S)
        else:
            time.sleep(_CONNECT_RETRY_S)


def join(hosts: Sequence[tuple[str, int]], host_rank: int, port: int, digest: str,
         timeout_s: float, interrupted: Callable[[], bool] = lambda: False,
         listen_address: str | None = None, secret: bytes | None = None,
         say: Callable[[str], None] | None = None) -> Link | None:
    """The start-up handshake of host `host_rank`'s launcher with the others. Every
    connection between the launchers proves first that both sides hold the job's `secret`
    (`tfmulti.cluster.auth`); a peer that does not is dropped and named in one line
    (`say`), and the others go on.

    Args:
        hosts: ((host, workers), ...), the same list on every host.
        host_rank: this host's position in `hosts`; 0 coordinates.
        port: the coordination port, the same on every host.
        digest: this launcher's `hosts.view_digest`.
        timeout_s: how long to wait for the other launchers.
        interrupted: polled; True (the launcher got a signal) ends the wait.
        listen_address: the address this launcher listens on; every address of this host
            by default (an IPv4 address: several launchers on one machine, for tests).
        secret: the job's shared secret; by default `auth.SECRET_ENV` of the environment
            (where `tfmulti launch` puts it for its supervisor).
        say: where the dropped peers are named; by default this process's stdout, as
            "tfmulti launch: ..." lines.

    Returns:
        The `Link` to the other launchers, or None when `interrupted`.

    Raises:
        ValueError: no secret, the port cannot be opened, the views differ, a rank is
            taken twice, a launcher aborted, or a host did not join within `timeout_s`: on
            every host that takes part.
    """
    if secret is None:
        secret = auth.load_secret(os.environ)
    dropped = _Dropped(say or Output(sys.stdout).say)
    listener = _listen(port, listen_address)
    try:
        if len(hosts) == 1:
            return Link(hosts, host_rank, {})
        if host_rank == 0:
            return Link(hosts, 0, _coordinate_start(hosts, digest, listener, timeout_s,
                                                    interrupted, secret, dropped))
        channel = _follow_start(hosts, host_rank, port, digest, listener, timeout_s,
                                interrupted, secret, dropped)
        return Link(hosts, host_rank, {0: channel})
    except _Interrupted:
        return None
    finally:
        listener.close()


def coordinate(link: Link, run_attempt: Callable[[int, Remote], Outcome], max_restarts: int,
               grace_period: float, out: Output,
               interrupted: Callable[[], int | None] = lambda: None) -> int:
    """Host 0's launcher after the start-up: starts each attempt on every host (its own
    workers through `run_attempt(attempt, remote)`), stops the other hosts' workers when
    one fails, and decides: restart everywhere (up to `max_restarts` times), or end with
    one status everywhere. A lost launcher, or a signal to any launcher, ends the launch;
    `interrupted()` (the signal this launcher got, or None) is polled while it waits for
    the other hosts.

    Returns:
        The launch's exit status: 0, the first failure's, or `LOST`.
    """
    for attempt in range(max_restarts + 1):
        link.send({"type": "start", "attempt": attempt})
        results: dict[int, dict] = {}
        state = {"first": None, "stopped": False}  # the first failure (rank, result)

        def absorb() -> None:
            link.poll()
            while (message := link.take("result", "lost")) is not None:
                rank = message["from"]
                if message["type"] == "lost":
                    message = {"status": LOST, "why": f"the launcher of {link.describe(rank)} "
                               "is gone", "lost": True}
                elif message.get("attempt") != attempt:
                    continue
                results.setdefault(rank, message)
                if results[rank]["status"] != 0 and not results[rank].get("by_peer") \
                        and state["first"] is None:
                    state["first"] = (rank, results[rank])

        def stop_others() -> dict | None:
            absorb()
            if state["first"] is None or state["stopped"]:
                return None
            rank, result = state["first"]
            state["stopped"] = True
            stop = {"type": "stop", "attempt": attempt, "status": result["status"],
                    "why": f"{result['why']} on {link.describe(rank)}",
                    "preempted": result["status"] in (exit_codes.PREEMPTED,
                                                       exit_codes.PREEMPTED_UNSAVED)}
            link.send(stop, [r for r in link.channels
                             if r != rank and not link.channels[r].closed])
            return stop

        local = run_attempt(attempt, stop_others)
        results[0] = local.to_message()
        if local.status != 0 and not local.by_peer and state["first"] is None:
            state["first"] = (0, results[0])
        stop_others()
        deadline = None
        while len(results) < len(link.hosts):
            if (sig := interrupted()) is not None:
                why = f"the launcher of {link.describe(0)} got signal {sig}"
                out.say(f"{why}; ending the launch on every host")
                link.send({"type": "end", "status": 128 + sig, "why": why})
                return 128 + sig
            if state["stopped"]:
                deadline = deadline or time.monotonic() + grace_period + _RESULTS_EXTRA_S
                if time.monotonic() > deadline:
                    for rank in range(len(link.hosts)):
                        results.setdefault(rank, {"status": LOST, "lost": True, "why": (
                            f"the launcher of {link.describe(rank)} did not report within "
                            f"{grace_period + _RESULTS_EXTRA_S:g} s")})
                    break
            link.poll(_POLL_S)
            stop_others()
        first = state["first"]
        if first is None:
            link.send({"type": "end", "status": 0, "why": "every worker exited 0"})
            return 0
        rank, result = first
        status = result["status"]
        why = (f"{result['why']} on {link.describe(rank)}: the cluster "
               f"{exit_codes.describe_end(status)}")
        if attempt < max_restarts and status not in exit_codes.FINAL and not any(
                r.get("lost") or r.get("signalled") for r in results.values()):
            out.say(f"{why}; {human.count(max_restarts - attempt, 'restart')} left")
            continue
        if max_restarts and attempt == max_restarts:
            why += f"; giving up after {human.count(max_restarts, 'restart')}"
        out.say(f"{why}; exit status {status}")
        link.send({"type": "end", "status": status, "why": why})
        return status
    raise AssertionError("unreachable")


def follow(link: Link, run_attempt: Callable[[int, Remote], Outcome], out: Output,
           interrupted: Callable[[], int | None] = lambda: None) -> int:
    """A launcher other than host 0's after the start-up: runs each attempt the coordinator
    starts, stops when it says so, reports how this host's workers ended, and ends with
    the status the coordinator decides (`LOST` if the coordinator is gone). A signal to
    this launcher between attempts (`interrupted()`) ends it at once, and the launch on
    the other hosts (they lose it).

    Returns:
        The launch's exit status.
    """
    coordinator = link.describe(0)
    gone = f"the launcher of {coordinator} is gone"
    while True:
        message = None
        while message is None:
            if (sig := interrupted()) is not None:
                return 128 + sig
            link.poll(_POLL_S)
            message = link.take("start", "end", "lost")
        if message["type"] == "lost":
            out.say(f"{gone}; ending the launch on this host")
            return LOST
        if message["type"] == "end":
            if message["status"]:
                out.say(f"{coordinator}: {message.get('why')}; exit status "
                        f"{message['status']}")
            return message["status"]
        attempt = message["attempt"]
        lost = []

        def remote() -> dict | None:
            link.poll()
            stop = link.take("stop", "lost", "end")
            if stop is None:
                return None
            if stop["type"] == "lost":
                lost.append(stop)
                return {"status": LOST, "why": gone, "preempted": False}
            if stop["type"] == "end":  # e.g. host 0's launcher got a signal
                link.inbox.insert(0, stop)  # what ends the launch, after this attempt
                return {"status": stop["status"], "why": stop.get("why", "the launch ended"),
                        "preempted": False}
            return stop if stop.get("attempt") == attempt else None

        local = run_attempt(attempt, remote)
        if lost:
            return LOST
        sent = link.channels[0].send({"type": "result", "attempt": attempt,
                                      **local.to_message()})
        if not sent and not any(m["type"] == "end" for m in link.inbox):
            out.say(f"{gone}; ending the launch on this host")
            return LOST
