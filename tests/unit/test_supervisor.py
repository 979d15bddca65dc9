"""Tests of tfmulti.cluster.supervisor's internals that need no process: port
checks, choices and reservations. (The supervisor's process handling, its
restarts, its reaper and its end with the launcher are exercised end to end in
tests/integration/test_launcher.py.)"""

from __future__ import annotations

import contextlib
import errno
import socket

import pytest

from tfmulti.cluster import supervisor


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
