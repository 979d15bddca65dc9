"""Tests of tfmulti.cluster.rendezvous and tfmulti.cluster.channel: the launchers of a
launch across hosts authenticate each other and agree on the start-up and on every
restart. In this process: each "host" is a
thread with its own loopback address (127.0.0.1, 127.0.0.2, ...) and a fake
attempt instead of workers, so the agreement is checked without processes.
(benchmarks/tests/test_simulated_hosts.py runs real launchers on simulated hosts.)"""

from __future__ import annotations

import json
import re
import socket
import threading
import time

import pytest

from tests._util import free_port

from tfmulti.cluster import exit_codes, hosts as hosts_lib, rendezvous
from tfmulti.cluster._process import Outcome, Output
from tfmulti.cluster.channel import Channel

JOIN_TIMEOUT_S = 10.0
THREAD_TIMEOUT_S = 30.0
SECRET = b"the job's secret: 0123456789abcdef"


class _Lines(list):
    """An `Output` stream that keeps the lines."""

    def write(self, text: str) -> None:
        self.append(text.rstrip("\n"))


class _Host:
    """One launcher of the cluster, in a thread: the handshake, then `coordinate` or
    `follow` with `attempts[i]` (a function of (attempt, remote) -> Outcome) as its
    workers."""

    def __init__(self, cluster, rank, port, attempts, max_restarts=0, view=None,
                 claim=None, after_join=None, interrupted=lambda: None, secret=SECRET,
                 timeout_s=JOIN_TIMEOUT_S):
        self.rank, self.attempts, self.calls = rank, attempts, []
        self.lines = _Lines()
        self.result = self.error = None

        def run():
            try:
                view_hosts = view or cluster
                digest = hosts_lib.view_digest(view_hosts, port, max_restarts)
                link = rendezvous.join(view_hosts, rank if claim is None else claim, port,
                                       digest, timeout_s, listen_address=cluster[rank][0],
                                       secret=secret, say=Output(self.lines).say)
                if after_join:
                    after_join(link)
                with link:
                    out = Output(self.lines)
                    if rank == 0:
                        self.result = rendezvous.coordinate(link, self.attempt, max_restarts,
                                                            2, out, interrupted)
                    else:
                        self.result = rendezvous.follow(link, self.attempt, out, interrupted)
            except Exception as e:  # noqa: BLE001 (the test looks at it)
                self.error = e

        self.thread = threading.Thread(target=run, daemon=True)

    def attempt(self, attempt, remote):
        self.calls.append(attempt)
        return self.attempts[min(attempt, len(self.attempts) - 1)](attempt, remote)


def _cluster(n: int) -> tuple[tuple[str, int], ...]:
    return tuple((f"127.0.0.{i + 1}", 1) for i in range(n))


def _run(hosts: list[_Host]) -> list[_Host]:
    for h in hosts:
        h.thread.start()
    for h in hosts:
        h.thread.join(THREAD_TIMEOUT_S)
        assert not h.thread.is_alive(), f"host {h.rank} did not finish"
    return hosts


def _exits(status: int, why: str = "worker exited"):
    return lambda attempt, remote: Outcome(status, why if status else "")


def _until_stopped(attempt, remote):
    """Workers that run until another host's failure stops them."""
    deadline = time.monotonic() + THREAD_TIMEOUT_S
    while time.monotonic() < deadline:
        stop = remote()
        if stop is not None:
            return Outcome(stop["status"], stop["why"], by_peer=True)
        time.sleep(0.01)
    raise AssertionError("never stopped")


def test_every_host_succeeds():
    port, cluster = free_port(), _cluster(3)
    hosts = _run([_Host(cluster, r, port, [_exits(0)]) for r in range(3)])
    assert [(h.error, h.result, h.calls) for h in hosts] == [(None, 0, [0])] * 3


def test_a_failure_on_one_host_restarts_every_host():
    # Host 1's worker fails in attempt 0: host 0's and host 2's workers are stopped, and
    # all three start attempt 1, which succeeds.
    port, cluster = free_port(), _cluster(3)
    stops = []

    def stopped(attempt, remote):
        outcome = _until_stopped(attempt, remote)
        stops.append(outcome.why)
        return outcome

    hosts = _run([_Host(cluster, 0, port, [stopped, _exits(0)], max_restarts=1),
                  _Host(cluster, 1, port, [_exits(137, "worker 1 failed with exit code "
                                                         "137 (killed by SIGKILL)"),
                                           _exits(0)], max_restarts=1),
                  _Host(cluster, 2, port, [stopped, _exits(0)], max_restarts=1)])
    assert [(h.error, h.result, h.calls) for h in hosts] == [(None, 0, [0, 1])] * 3
    assert stops == ["worker 1 failed with exit code 137 (killed by SIGKILL) on host 1 "
                     "(127.0.0.2)"] * 2
    assert ("tfmulti launch: worker 1 failed with exit code 137 (killed by SIGKILL) on host "
            "1 (127.0.0.2): the cluster failed with exit status 137 (see above); 1 "
            "restart left") in hosts[0].lines


def test_restarts_run_out_and_every_host_ends_with_the_status():
    port, cluster = free_port(), _cluster(2)
    hosts = _run([_Host(cluster, 0, port, [_until_stopped], max_restarts=1),
                  _Host(cluster, 1, port, [_exits(3, "worker 1 failed with exit code 3")],
                        max_restarts=1)])
    assert [(h.error, h.result, h.calls) for h in hosts] == [(None, 3, [0, 1])] * 2
    assert hosts[0].lines[-1].endswith("giving up after 1 restart; exit status 3")
    assert hosts[1].lines[-1].startswith("tfmulti launch: host 0 (127.0.0.1): worker 1 "
                                         "failed")


def test_preemption_elsewhere_lets_the_workers_save():
    # A preempted host's peers are not SIGTERMed at once: `preempted` lets them save.
    port, cluster = free_port(), _cluster(2)
    seen = []

    def saving(attempt, remote):
        deadline = time.monotonic() + THREAD_TIMEOUT_S
        while (stop := remote()) is None and time.monotonic() < deadline:
            time.sleep(0.01)
        seen.append(stop)
        return Outcome(exit_codes.PREEMPTED, stop["why"], by_peer=True)

    hosts = _run([_Host(cluster, 0, port, [saving]),
                  _Host(cluster, 1, port, [_exits(exit_codes.PREEMPTED_UNSAVED)])])
    assert [h.result for h in hosts] == [exit_codes.PREEMPTED_UNSAVED] * 2
    assert seen[0]["preempted"] and seen[0]["status"] == exit_codes.PREEMPTED_UNSAVED
    assert "NO NEW BACKUP" in hosts[0].lines[-1]


def test_a_signal_on_one_host_ends_the_launch_without_restarts():
    port, cluster = free_port(), _cluster(2)

    def signalled(attempt, remote):
        return Outcome(143, "the launcher got SIGTERM", signalled=True)

    hosts = _run([_Host(cluster, 0, port, [_until_stopped], max_restarts=3),
                  _Host(cluster, 1, port, [signalled], max_restarts=3)])
    assert [(h.result, h.calls) for h in hosts] == [(143, [0])] * 2


def test_a_signal_to_host_0_while_it_waits_for_the_others_ends_every_host():
    # Host 0's workers are done, host 1's still run: Ctrl-C on host 0 ends both.
    port, cluster = free_port(), _cluster(2)
    stops, signalled = [], threading.Event()

    def stopped(attempt, remote):
        outcome = _until_stopped(attempt, remote)
        stops.append(outcome.why)
        return outcome

    def done(attempt, remote):
        signalled.set()
        return Outcome(0)

    hosts = _run([_Host(cluster, 0, port, [done], max_restarts=1,
                        interrupted=lambda: 2 if signalled.is_set() else None),
                  _Host(cluster, 1, port, [stopped], max_restarts=1)])
    assert [(h.error, h.result, h.calls) for h in hosts] == [(None, 130, [0])] * 2
    assert stops == ["the launcher of host 0 (127.0.0.1) got signal 2"]


def test_a_lost_launcher_ends_the_launch_everywhere():
    # Host 2's launcher disappears while its workers run: the others stop theirs and end
    # (no restart: its host cannot take part any more).
    port, cluster = free_port(), _cluster(3)

    def vanish(attempt, remote):
        raise ConnectionAbortedError("host 2 dies")  # its link closes on the way out

    hosts = _run([_Host(cluster, 0, port, [_until_stopped], max_restarts=2),
                  _Host(cluster, 1, port, [_until_stopped], max_restarts=2),
                  _Host(cluster, 2, port, [vanish], max_restarts=2)])
    assert isinstance(hosts[2].error, ConnectionAbortedError)
    assert [(h.result, h.calls) for h in hosts[:2]] == [(rendezvous.LOST, [0])] * 2
    assert "the launcher of host 2 (127.0.0.3) is gone" in hosts[0].lines[-1]


def test_a_lost_coordinator_ends_the_followers():
    port, cluster = free_port(), _cluster(2)

    def vanish(attempt, remote):
        raise ConnectionAbortedError("host 0 dies")

    stops = []

    def stopped(attempt, remote):
        outcome = _until_stopped(attempt, remote)
        stops.append(outcome.why)
        return outcome

    hosts = _run([_Host(cluster, 0, port, [vanish], max_restarts=1),
                  _Host(cluster, 1, port, [stopped], max_restarts=1)])
    assert (hosts[1].error, hosts[1].result, hosts[1].calls) == (None, rendezvous.LOST, [0])
    assert stops == ["the launcher of host 0 (127.0.0.1) is gone"]


@pytest.mark.parametrize("case", ["workers", "max_restarts"])
def test_a_different_view_fails_the_start_up_on_every_host(case):
    # Host 1 got another worker count for host 1, or another --max_restarts.
    port, cluster = free_port(), _cluster(2)
    other = (dict(view=(cluster[0], (cluster[1][0], 2))) if case == "workers"
             else dict(max_restarts=1))
    hosts = _run([_Host(cluster, 0, port, [_exits(0)]),
                  _Host(cluster, 1, port, [_exits(0)], **other)])
    assert [h.calls for h in hosts] == [[], []]  # no worker started anywhere
    assert str(hosts[0].error).startswith("the launcher of host 1 sees another cluster than "
                                          "host 0's")
    assert str(hosts[1].error).startswith("the launcher of host 0 (127.0.0.1) stopped the "
                                          "start-up: the launcher of host 1 sees another "
                                          "cluster")


def test_a_rank_taken_twice_fails_the_start_up():
    port, cluster = free_port(), _cluster(3)
    hosts = _run([_Host(cluster, 0, port, [_exits(0)]),
                  _Host(cluster, 1, port, [_exits(0)]),
                  _Host(cluster, 2, port, [_exits(0)], claim=1)])
    assert hosts[0].error is not None and all(h.calls == [] for h in hosts)
    assert "two launchers say they are host 1 (127.0.0.2)" in str(hosts[0].error)


def test_a_host_that_never_joins_fails_the_start_up_after_the_timeout(monkeypatch):
    monkeypatch.setattr(rendezvous, "_CONNECT_RETRY_S", 0.1)
    port, cluster = free_port(), _cluster(2)
    start = time.monotonic()
    with pytest.raises(ValueError, match=r"host 1 \(127.0.0.2\) did not join within 1 s"):
        rendezvous.join(cluster, 0, port, "view", 1.0, listen_address="127.0.0.1",
                        secret=SECRET)
    assert time.monotonic() - start < 5
    with pytest.raises(ValueError, match=r"the launcher of host 0 \(127.0.0.1:\d+\) did not "
                                         r"accept within 1 s"):
        rendezvous.join(cluster, 1, port, "view", 1.0, listen_address="127.0.0.2",
                        secret=SECRET)


def test_a_launcher_that_failed_its_own_checks_stops_the_others_at_once():
    port, cluster = free_port(), _cluster(2)
    coordinator = _Host(cluster, 0, port, [_exits(0)])
    coordinator.thread.start()
    time.sleep(0.5)
    rendezvous.notify_abort(cluster, port, "host 1: port 2223 is already in use", SECRET)
    coordinator.thread.join(THREAD_TIMEOUT_S)
    assert str(coordinator.error).endswith("stopped the start-up: host 1: port 2223 is "
                                           "already in use")


def test_a_launcher_taken_for_host_0_refuses():
    # Host 1 was given the hosts in another order: it takes itself for host 0's address.
    port, cluster = free_port(), _cluster(2)
    swapped = (cluster[1], cluster[0])
    follower = _Host(cluster, 1, port, [_exits(0)], view=swapped)
    _run([follower])
    assert "took this launcher (host 1 of ['127.0.0.2:1', '127.0.0.1:1']) for host 0: the " \
           "launchers' views of the cluster differ" in str(follower.error)


def _socket_pair() -> tuple[socket.socket, socket.socket]:
    """Both ends of a TCP connection on 127.0.0.1: (the connecting one, the accepted one)."""
    with socket.socket() as server:
        server.bind(("127.0.0.1", 0))
        server.listen()
        a = socket.create_connection(server.getsockname(), timeout=5)
        b, _ = server.accept()
    return a, b


def _channels(left_secret=SECRET, right_secret=SECRET):
    """(initiator, acceptor, the peers the acceptor dropped, the initiator's)."""
    a, b = _socket_pair()
    dropped_by_right, dropped_by_left = [], []
    left = Channel(a, "a", left_secret, initiator=True,
                              on_failure=dropped_by_left.append)
    right = Channel(b, "b", right_secret, initiator=False,
                               on_failure=dropped_by_right.append)
    return left, right, dropped_by_right, dropped_by_left


def _exchange(*channels, rounds: int = 6) -> list[list[dict]]:
    """What each channel received over a few rounds of the handshake."""
    got = [[] for _ in channels]
    for _ in range(rounds):
        for i, channel in enumerate(channels):
            got[i] += channel.receive(0.1)
    return got


def test_channel_messages_wait_for_both_proofs_then_arrive_in_order():
    left, right, dropped, _ = _channels()
    assert left.send({"type": "start", "attempt": 0}) and left.send({"type": "go"})
    assert not left.authenticated  # queued until both sides proved the secret
    got_left, got_right = _exchange(left, right)
    assert left.authenticated and right.authenticated and dropped == []
    assert got_right == [{"type": "start", "attempt": 0}, {"type": "go"}]
    assert right.send({"type": "end", "status": 0}) and left.receive(1.0) == [
        {"type": "end", "status": 0}]
    left.close()
    right.close()
    assert not right.send({"type": "go"})


def test_a_peer_with_another_secret_is_dropped_on_both_sides():
    left, right, dropped, _ = _channels(left_secret=b"another job's secret, 32 bytes..")
    left.send({"type": "hello", "rank": 1})
    got = _exchange(left, right)
    assert got == [[], []] and right.closed and right.failed and dropped == ["b"]
    assert left.closed and left.refused and not left.authenticated  # told, not trusted


def test_a_peer_without_a_secret_is_dropped():
    # The attack of issue 27: a plain hello (the view digest is public) with no proof.
    a, b = _socket_pair()
    dropped = []
    right = Channel(b, "b", SECRET, initiator=False, on_failure=dropped.append)
    a.sendall(json.dumps({"type": "hello", "rank": 1, "view": "v"}).encode() + b"\n")
    assert right.receive(1.0) == [] and right.closed and right.failed and dropped == ["b"]
    a.close()
    a, b = _socket_pair()  # something else on the port
    right = Channel(b, "b", SECRET, initiator=False, on_failure=dropped.append)
    a.sendall(b"GET / HTTP/1.1\n")
    assert right.receive(1.0) == [] and right.failed
    a.close()


def _recording_pair():
    """An authenticated pair whose initiator's socket records every line it sends."""
    left, right, dropped, _ = _channels()
    sent = []
    real_sendall = left.sock.sendall

    class Recorder:
        def __getattr__(self, name):
            return getattr(real, name)

        def sendall(self, data):
            sent.append(data)
            return real_sendall(data)

    real, left.sock = left.sock, Recorder()
    left.send({"type": "result", "attempt": 0, "status": 0})
    _exchange(left, right)
    return left, right, dropped, sent, real


def test_a_replayed_message_is_refused():
    # Within the connection: the recorded result sent again.
    left, right, dropped, sent, real = _recording_pair()
    real.sendall(sent[-1])
    assert right.receive(1.0) == [] and right.failed and dropped == ["b"]
    # On a new connection: the whole recorded conversation of the initiator, replayed
    # (fresh nonces: its proof and its tags do not fit).
    a, b = _socket_pair()
    again = []
    other = Channel(b, "b", SECRET, initiator=False, on_failure=again.append)
    for data in sent:
        a.sendall(data)
        other.receive(0.2)
    assert other.failed and not other.authenticated and again == ["b"]
    a.close()


def test_a_tampered_message_is_refused():
    left, right, dropped, sent, real = _recording_pair()
    tag, _, payload = sent[-1].partition(b" ")
    left._sent -= 1  # the same position: only the content differs
    real.sendall(tag + b" " + payload.replace(b'"status": 0', b'"status": 1'))
    assert right.receive(1.0) == [] and right.failed and dropped == ["b"]


def test_join_needs_a_secret(monkeypatch):
    monkeypatch.delenv("TFMULTI_LAUNCH_SECRET", raising=False)
    with pytest.raises(ValueError, match=r"needs the launchers' shared secret.*"
                                         r"TFMULTI_LAUNCH_SECRET is not set"):
        rendezvous.join(_cluster(2), 0, free_port(), "view", 1.0,
                        listen_address="127.0.0.1")


def test_an_impostor_is_dropped_and_the_real_host_still_joins():
    # A third launcher with another secret says it is host 1 before host 1 starts.
    port, cluster = free_port(), _cluster(3)[:2]
    coordinator = _Host(cluster, 0, port, [_exits(0)])
    impostor = _Host((cluster[0], ("127.0.0.3", 1)), 1, port, [_exits(0)], view=cluster,
                     secret=b"an impostor's own secret, 32 b..", timeout_s=2.0)
    coordinator.thread.start()
    _run([impostor])
    assert "failed to authenticate each other within 2 s" in str(impostor.error)
    real = _Host(cluster, 1, port, [_exits(0)])
    _run([real])
    coordinator.thread.join(THREAD_TIMEOUT_S)
    assert [(h.error, h.result, h.calls) for h in (coordinator, real)] == [(None, 0, [0])] * 2
    assert impostor.calls == []
    dropped = [line for line in coordinator.lines if "failed authentication" in line]
    # Once, though the impostor tried again and again (its connections come from
    # 127.0.0.1 here: one machine).
    assert len(dropped) == 1 and re.match(r"tfmulti launch: 127\.0\.0\.1:\d+ failed "
                                          r"authentication: dropped it", dropped[0])
