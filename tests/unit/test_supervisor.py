"""Tests of tfmulti.cluster.supervisor's internals that need no process: port
checks, choices and reservations; how it stops workers (on fakes: who gets the
grace period, and the line that ends a stop by a signal). (The supervisor's
process handling, its restarts, its reaper and its end with the launcher are
exercised end to end in tests/integration/test_launcher.py, a stop by a signal
in tests/integration/test_launch_signals.py.)"""

from __future__ import annotations

import contextlib
import errno
import io
import signal
import socket
import tempfile
from pathlib import Path

import pytest

from tfmulti.cluster import exit_codes, supervisor
from tfmulti.cluster._process import Outcome, Output, StopSignals


def _listening_socket() -> socket.socket:
    taken = socket.socket()
    taken.bind(("127.0.0.1", 0))
    taken.listen()
    return taken


def test_port_in_use_sees_a_bound_port():
    with _listening_socket() as taken:
        port = taken.getsockname()[1]
        assert supervisor._port_in_use(port)
    assert not supervisor._port_in_use(port)


def test_a_port_in_use_is_a_clear_error():
    # The message `tfmulti launch --port` prints (tests/integration/test_launcher.py
    # checks the one line and exit status 2 of the command).
    with _listening_socket() as taken:
        port = taken.getsockname()[1]
        with pytest.raises(ValueError) as info:
            supervisor._reserve_ports(port, 1)
    assert str(info.value) == (
        f"port {port} (worker 0 of --port {port}) is already in use on this host; pass "
        "another --port, or leave --port out to choose free ports.")


@contextlib.contextmanager
def _reserved(base, num_workers):
    ports, held = supervisor._reserve_ports(base, num_workers)
    try:
        yield ports
    finally:
        supervisor._release(held)


def test_free_ports_are_distinct_and_a_free_base_is_used_as_is():
    with _reserved(None, 3) as ports:
        assert len(set(ports)) == 3 and all(1 <= p <= 65535 for p in ports)
    with _listening_socket() as probe:
        base = probe.getsockname()[1]
    if base <= 65534 and not supervisor._port_in_use(base + 1):
        with _reserved(base, 2) as ports:
            assert ports == [base, base + 1]
    with pytest.raises(ValueError, match=r"`port` \(65535\) must be an integer from 1 to 65534"):
        supervisor._reserve_ports(65535, 2)


def test_reserved_ports_are_kept_from_others_until_the_worker_listens():
    # Without --port and without a private network namespace, a chosen port is free when
    # chosen, and bound by the worker's gRPC server seconds later: the reservation keeps
    # every other bind from it meanwhile (IPv4 and IPv6), but not the worker's server,
    # which sets SO_REUSEADDR as gRPC does.
    with _reserved(None, 1) as (port,):
        for family, address in ((socket.AF_INET, "127.0.0.1"), (socket.AF_INET6, "::1")):
            with socket.socket(family) as other:
                with pytest.raises(OSError) as info:
                    other.bind((address, port))
                assert info.value.errno == errno.EADDRINUSE
        with socket.socket(socket.AF_INET6) as server:
            server.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
            server.setsockopt(socket.IPPROTO_IPV6, socket.IPV6_V6ONLY, 0)
            server.bind(("::", port))
            server.listen()
    with socket.socket() as after:  # released with the attempt
        after.bind(("127.0.0.1", port))


# ------------------------------------------------------------- stopping the workers
# `_stop_workers` on fake workers and a fake clock: no process, no waiting. A fake worker
# ignores SIGTERM (as a MultiWorkerMirroredStrategy worker does: TensorFlow catches it)
# unless it saves on it, and dies of SIGKILL.


class _Clock:
    def __init__(self):
        self.now = 0.0

    def monotonic(self) -> float:
        return self.now

    def sleep(self, seconds: float) -> None:
        self.now += seconds


class _Worker:
    """What `_stop_workers` uses of a `subprocess.Popen`. `notice`: its save-notice file;
    `posts_at`: when it posts it (None: never; 0: before the stop); a worker that holds
    its notice when a SIGTERM comes saves for `save_s` seconds, then exits 75."""

    def __init__(self, pid: int, clock: _Clock, notice: Path, posts_at: float | None = None,
                 save_s: float = 20.0):
        self.pid, self.clock, self.notice = pid, clock, notice
        self.posts_at, self.save_s = posts_at, save_s
        self.returncode = None
        self.exits_at = None
        self.signals: list[tuple[float, int]] = []
        if posts_at == 0:
            notice.write_text("")

    def signal(self, sig: int) -> None:
        self.signals.append((self.clock.now, sig))
        if sig == signal.SIGKILL and self.returncode is None:
            self.returncode = -signal.SIGKILL
        elif sig == signal.SIGTERM and self.notice.exists() and self.exits_at is None:
            self.exits_at = self.clock.now + self.save_s

    def poll(self):
        if self.posts_at is not None and self.clock.now >= self.posts_at \
                and not self.notice.exists() and self.returncode is None:
            self.notice.write_text("")
        if self.returncode is None and self.exits_at is not None \
                and self.clock.now >= self.exits_at:
            self.returncode = exit_codes.PREEMPTED
        return self.returncode

    def wait(self, timeout=None):
        return self.poll()


@pytest.fixture
def stop(monkeypatch, tmp_path):
    """`stop(*workers_posts_at, grace_period=60)`: stops fake workers; returns them and
    the launcher's lines."""
    clock = _Clock()
    monkeypatch.setattr(supervisor, "time", clock)

    def run(*posts_at, grace_period=60.0, save_s=20.0):
        folder = Path(tempfile.mkdtemp(dir=tmp_path))
        workers = [_Worker(100 + i, clock, folder / f"notice-{i}", p, save_s)
                   for i, p in enumerate(posts_at)]
        by_pid = {w.pid: w for w in workers}
        monkeypatch.setattr(supervisor, "_killpg", lambda pid, sig: by_pid[pid].signal(sig))
        lines = io.StringIO()
        with StopSignals() as signals:
            supervisor._stop_workers(workers, grace_period, signals, Output(lines), 0,
                                     [str(w.notice) for w in workers])
        return workers, lines.getvalue()

    return run


def _first(worker: _Worker, sig: int) -> float | None:
    return next((at for at, s in worker.signals if s == sig), None)


def test_workers_that_save_nothing_on_sigterm_are_killed_within_seconds(stop):
    # No backup: SIGTERM does not end a MultiWorkerMirroredStrategy worker, so waiting
    # for the grace period (60 s) kept it training; it gets a few seconds.
    workers, lines = stop(None, None, grace_period=60.0)
    for w in workers:
        assert _first(w, signal.SIGTERM) == 0.0
        assert _first(w, signal.SIGKILL) < 60.0
        assert w.returncode == -signal.SIGKILL
    assert lines.count("saves no backup on it); sending SIGKILL") == 2, lines


def test_workers_that_save_on_sigterm_get_the_grace_period(stop):
    # Worker 0 posts its notice: it saves and exits 75; worker 1, which posted none (its
    # peers save together with it), is not killed before the grace period either.
    workers, lines = stop(0, None, grace_period=60.0, save_s=20.0)
    assert workers[0].returncode == exit_codes.PREEMPTED
    assert _first(workers[0], signal.SIGKILL) >= 20.0  # the final sweep, after it exited
    assert _first(workers[1], signal.SIGKILL) >= 60.0
    assert "worker 0 is still running" not in lines
    assert "worker 1 is still running (did not stop within 60 s of SIGTERM)" in lines
    both, lines = stop(0, 0, grace_period=60.0, save_s=20.0)
    assert [w.returncode for w in both] == [exit_codes.PREEMPTED] * 2
    assert "still running" not in lines


def test_a_notice_posted_after_the_sigterm_gets_another_sigterm(stop):
    # Its handler came just after the first SIGTERM (TensorFlow's swallowed that one).
    workers, lines = stop(1.0, grace_period=60.0, save_s=10.0)
    (w,) = workers
    assert [s for _, s in w.signals][:2] == [signal.SIGTERM, signal.SIGTERM]
    assert w.returncode == exit_codes.PREEMPTED, lines


def test_a_saving_worker_is_killed_at_the_end_of_the_grace_period(stop):
    workers, lines = stop(0, grace_period=30.0, save_s=100.0)
    assert 30.0 <= _first(workers[0], signal.SIGKILL) < 100.0
    assert "worker 0 is still running (did not stop within 30 s of SIGTERM)" in lines


def test_the_end_of_a_stop_by_a_signal_says_how_each_worker_ended():
    class Ended:
        def __init__(self, returncode):
            self.returncode = returncode

    outcome = Outcome(128 + signal.SIGTERM, "the launcher got SIGTERM", signalled=True)
    line = supervisor._stopped_by_signal(
        outcome, [Ended(75), Ended(76), Ended(-9), Ended(-40), Ended(1), Ended(None)], first=2)
    assert line == ("stopped by SIGTERM to the launcher: worker 2 saved a backup (exit code "
                    "75), worker 3 saved no new backup (exit code 76), worker 4 was killed by "
                    "SIGKILL, worker 5 was killed by signal 40, worker 6 exited with code 1, "
                    "worker 7 is still running; exit status 143")
