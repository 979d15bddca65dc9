"""Tests of tfmulti.cluster.launcher that start no process: the launcher needs Linux, and
says so at once on any other OS; what its isolation line says with and without the
outbound networking tool; when the namespace gets a resolv.conf of its own
(tfmulti.cluster.outbound). (The launcher end to end, its isolation and the workers'
outbound network: tests/integration/test_launcher.py.)"""

from __future__ import annotations

import pytest

from tfmulti import cli
from tfmulti.cluster import launch, launcher, outbound, plan


@pytest.mark.parametrize("platform", ["darwin", "win32", "freebsd14"])
def test_the_launch_needs_linux_and_says_so_in_one_line(monkeypatch, capsys, platform):
    # Issue 29: on macOS the launch crashed in ctypes (no prctl) after it had checked its
    # arguments; now any OS but Linux is refused first, one line, exit 2.
    monkeypatch.setattr("sys.platform", platform)
    assert cli.main(["launch", "--num_workers", "2", "--", "python", "train.py"]) == 2
    captured = capsys.readouterr()
    assert captured.out == ""
    (line,) = captured.err.splitlines()
    assert line.startswith(f"tfmulti launch: error: `tfmulti launch` needs Linux (it "
                           "isolates and reaps the workers with Linux namespaces and prctl: "
                           f"util-linux `unshare`), and this is {platform!r}: run it on a "
                           "Linux host, container or VM (WSL 2 on Windows)"), line
    with pytest.raises(ValueError, match="needs Linux"):  # the same from Python
        launch(["python", "train.py"], num_workers=2)


def test_the_isolation_line_says_what_is_kept_and_what_is_lost():
    kept = launcher._isolation_message("/usr/bin/slirp4netns")
    assert "their ports are not reachable from outside it" in kept
    assert "outbound only, through slirp4netns" in kept
    lost = launcher._isolation_message(None)
    assert "they have no network beyond it (no bucket, tracker or download); install the " \
           f"package {outbound.PACKAGE} to keep their outbound access" in lost
    assert "\n" not in kept + lost


@pytest.mark.parametrize("host, want", [
    ("nameserver 127.0.0.53\nsearch lan\n", "nameserver 10.0.2.3\nsearch lan\n"),
    ("nameserver ::1\nnameserver 127.0.0.1\n", "nameserver 10.0.2.3\n"),
    ("nameserver 127.0.0.53\nnameserver 192.0.2.1\n", None),  # one reachable: as it is
    ("# no resolver\n", None),
    ("", None),
])
def test_the_namespace_gets_its_own_resolv_conf_only_for_loopback_resolvers(host, want):
    assert outbound.namespace_resolv_conf(host) == want


def test_the_supervisor_gets_a_mount_namespace_only_to_point_names_at_the_forwarder():
    launch_plan = plan.make_plan(["python", "train.py"], 2)
    command = plan.supervisor_command(launch_plan, "python3", "root", wait_network=True,
                                      resolv_conf=True)
    assert command[:7] == ["unshare", "--pid", "--net", "--mount", "--propagation",
                           "private", "--"]
    assert command[-2:] == ["--wait_network", "--resolv_conf"]
    for options in ({"wait_network": False}, {"network": False}):  # nothing to point at
        command = plan.supervisor_command(launch_plan, "python3", "root",
                                          **{"wait_network": True, "resolv_conf": True,
                                             **options})
        assert "--mount" not in command and "--resolv_conf" not in command
