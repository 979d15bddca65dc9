"""Tests of tfmulti.cluster.watchdog: a worker whose peers never join is stopped
after the startup timeout, with a message naming the peer it waited for."""

from __future__ import annotations


from tfmulti.cluster import watchdog


def test_reachable_is_false_for_a_closed_port_and_a_bad_address():
    assert not watchdog.reachable("localhost:1", timeout_s=1.0)
    assert not watchdog.reachable("no-port-here", timeout_s=1.0)
