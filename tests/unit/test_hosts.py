"""Tests of tfmulti.cluster.hosts: a launch across hosts computed from the same
arguments on every host (the host list, SLURM's node lists and environment,
every worker's address, the view the launchers compare). No processes."""

from __future__ import annotations

import sys

import pytest

from tfmulti.cluster import hosts


def test_parse_hosts_with_and_without_counts():
    assert hosts.parse_hosts("node1:2, node2 ,10.0.0.3:1", default_workers=3) == (
        ("node1", 2), ("node2", 3), ("10.0.0.3", 1))
    for bad, match in [("", r"must list the hosts as HOST\[:N\]"),
                       ("node1,,node2", r"host 1 of `hosts` \(''\) is not HOST or HOST:N"),
                       ("node1:0", r"host 0 of `hosts` \('node1:0'\): N must be a positive"),
                       ("node1:２", r"N must be a positive number of workers"),
                       ("node1:x", r"N must be a positive number of workers"),
                       ("node_1;rm", r"is not HOST or HOST:N"),
                       ("[::1]:2", r"is not HOST or HOST:N"),
                       ("a:1,b:2,a:1", r"host 'a' appears twice in `hosts`")]:
        with pytest.raises(ValueError, match=match):
            hosts.parse_hosts(bad, default_workers=2)


def test_every_launcher_computes_the_same_cluster():
    cluster = hosts.parse_hosts("a:2,b:1,c:3", default_workers=1)
    addresses = hosts.cluster_addresses(cluster, 3000)
    assert addresses == ["a:3001", "a:3002", "b:3001", "c:3001", "c:3002", "c:3003"]
    assert [hosts.offset(cluster, r) for r in range(3)] == [0, 2, 3]
    assert hosts.worker_ports(3000, 3) == [3001, 3002, 3003]
    with pytest.raises(ValueError, match=r"`port` \(65534\) must be an integer from 1 to "
                                         r"65533: with --hosts it is the launchers' "
                                         r"coordination port"):
        hosts.worker_ports(65534, 2)


def test_the_view_differs_with_anything_the_launchers_must_agree_on():
    cluster = (("a", 2), ("b", 2))
    digest = hosts.view_digest(cluster, 2222, 1)
    assert digest == hosts.view_digest((("a", 2), ("b", 2)), 2222, 1)
    others = [hosts.view_digest((("b", 2), ("a", 2)), 2222, 1),   # order
              hosts.view_digest((("a", 2), ("b", 1)), 2222, 1),   # a count
              hosts.view_digest((("a", 2), ("c", 2)), 2222, 1),   # a host
              hosts.view_digest(cluster, 2223, 1),                # the port
              hosts.view_digest(cluster, 2222, 0)]                # the restart budget
    assert len({digest, *others}) == 6


def test_check_rank():
    cluster = (("a", 1), ("b", 1))
    assert hosts.check_rank(cluster, 1) == 1
    with pytest.raises(ValueError, match=r"`host_rank` \(2\) must be this host's position in "
                                         r"`hosts`, an integer from 0 to 1 for the 2 hosts "
                                         r"\['a', 'b'\]"):
        hosts.check_rank(cluster, 2)
    with pytest.raises(ValueError, match=r"`host_rank` is missing: with `hosts`"):
        hosts.check_rank(cluster, None)
    with pytest.raises(ValueError, match=r"`host_rank` \(True\)"):
        hosts.check_rank(cluster, True)


@pytest.mark.parametrize("nodelist,expected", [
    ("node1", ["node1"]),
    ("node[1-3]", ["node1", "node2", "node3"]),
    ("node[1-2,7],login", ["node1", "node2", "node7", "login"]),
    ("gpu[08-11]", ["gpu08", "gpu09", "gpu10", "gpu11"]),
    ("rack[1-2]-n[1,3]", ["rack1-n1", "rack1-n3", "rack2-n1", "rack2-n3"]),
    ("a[1],b[2-3],c", ["a1", "b2", "b3", "c"]),
])
def test_expand_nodelist(nodelist, expected):
    assert hosts.expand_nodelist(nodelist) == expected


@pytest.mark.parametrize("nodelist,match", [
    ("", "has an empty entry"), ("a,,b", "has an empty entry"),
    ("node[1-3", r"unbalanced '\['"), ("node1-3]", r"unbalanced '\]'"),
    ("node[3-1]", "runs backwards"), ("node[a-b]", "is not a number or a range"),
])
def test_expand_nodelist_refuses_malformed_lists(nodelist, match):
    with pytest.raises(ValueError, match=match):
        hosts.expand_nodelist(nodelist)


def test_slurm_hosts_from_the_job_steps_environment():
    env = {"SLURM_STEP_NODELIST": "node[07-08]", "SLURM_JOB_NODELIST": "node[07-09]",
           "SLURM_STEP_TASKS_PER_NODE": "1(x2)", "SLURMD_NODENAME": "node08",
           "SLURM_NODEID": "1"}
    assert hosts.slurm_hosts(env, 2) == ((("node07", 2), ("node08", 2)), 1)
    # Without SLURMD_NODENAME: SLURM_NODEID, over the job's nodes without a step list.
    env = {"SLURM_JOB_NODELIST": "node[07-09]", "SLURM_NODEID": "2"}
    assert hosts.slurm_hosts(env, 1) == ((("node07", 1), ("node08", 1), ("node09", 1)), 2)
    with pytest.raises(ValueError, match=r"--hosts slurm needs SLURM_STEP_NODELIST or "
                                         r"SLURM_JOB_NODELIST .* `srun`"):
        hosts.slurm_hosts({}, 1)
    with pytest.raises(ValueError, match=r"one launcher per node, but SLURM started 2\(x2\) "
                                         r"tasks per node .* --ntasks-per-node=1"):
        hosts.slurm_hosts({"SLURM_STEP_NODELIST": "n[1-2]",
                           "SLURM_STEP_TASKS_PER_NODE": "2(x2)", "SLURM_NODEID": "0"}, 1)
    with pytest.raises(ValueError, match=r"this node, 'n9' \(SLURMD_NODENAME\), is not in"):
        hosts.slurm_hosts({"SLURM_STEP_NODELIST": "n[1-2]", "SLURMD_NODENAME": "n9"}, 1)
    with pytest.raises(ValueError, match=r"needs this node's rank: SLURMD_NODENAME or "
                                         r"SLURM_NODEID, got SLURM_NODEID=''"):
        hosts.slurm_hosts({"SLURM_STEP_NODELIST": "n[1-2]"}, 1)


@pytest.mark.parametrize("argv,line", [
    (["--hosts", "a:1,b:1", "--host_rank", "2"],
     "--host_rank (2) must be this host's position in --hosts, an integer from 0 to 1 for "
     "the 2 hosts ['a', 'b']."),
    (["--hosts", "a:1,b:1"],
     "--host_rank is missing: with --hosts, give this host's position in the list, 0 to 1 "
     "for the 2 hosts ['a', 'b']."),
    (["--host_rank", "1"],
     "--host_rank (1) needs --hosts, the list of every host of the launch, e.g. --hosts "
     "node1:2,node2:2 --host_rank 1."),
    (["--hosts", "a:1,nowhere:1", "--host_rank", "0"],
     "host 'nowhere' of --hosts does not resolve ([Errno -2] Name or service not known); "
     "check the name on this host (DNS, /etc/hosts), or give its address."),
    (["--hosts", "slurm"],
     "--hosts slurm needs SLURM_STEP_NODELIST or SLURM_JOB_NODELIST in the environment: run "
     "the launcher under `srun` inside a SLURM allocation, one task per node (srun "
     "--ntasks-per-node=1)."),
])
def test_launch_across_hosts_refuses_bad_arguments_before_starting_anything(
        monkeypatch, capsys, argv, line):
    import socket

    from tfmulti import cli

    def getaddrinfo(name, *args, **kwargs):  # no DNS in the tests
        if name == "nowhere":
            raise socket.gaierror(-2, "Name or service not known")
        return [(socket.AF_INET, socket.SOCK_STREAM, 6, "", ("10.0.0.1", 0))]

    monkeypatch.setattr(socket, "getaddrinfo", getaddrinfo)
    for name in ("SLURM_STEP_NODELIST", "SLURM_JOB_NODELIST"):
        monkeypatch.delenv(name, raising=False)
    assert cli.main(["launch", *argv, "--", sys.executable, "-c", "pass"]) == 2
    assert capsys.readouterr().err == f"tfmulti launch: error: {line}\n"
