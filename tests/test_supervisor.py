"""Tests of tfmulti.cluster.supervisor's internals that need no process: port
checks and choices. (The supervisor's process handling, its restarts and its
end with the launcher are exercised end to end in tests/test_launcher.py.)"""

from __future__ import annotations

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
    # The message `tfmulti launch --port` prints (tests/test_launcher.py
    # checks the one line and exit status 2 of the command).
    with _listening_socket() as taken:
        port = taken.getsockname()[1]
        with pytest.raises(ValueError) as info:
            supervisor._choose_ports(port, 1)
    assert str(info.value) == (
        f"port {port} (worker 0 of --port {port}) is already in use on this host; pass "
        "another --port, or leave --port out to choose free ports.")


def test_free_ports_are_distinct_and_a_free_base_is_used_as_is():
    ports = supervisor._choose_ports(None, 3)
    assert len(set(ports)) == 3 and all(1 <= p <= 65535 for p in ports)
    with _listening_socket() as probe:
        base = probe.getsockname()[1]
    if base <= 65534 and not supervisor._port_in_use(base + 1):
        assert supervisor._choose_ports(base, 2) == [base, base + 1]
    with pytest.raises(ValueError, match=r"`port` \(65535\) must be an integer from 1 to 65534"):
        supervisor._choose_ports(65535, 2)
