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
                       ("node1:0", r"host 0 of `hosts` \('node1:0'\): N must be a number of "
                                   r"workers from 1 to 1024"),
                       ("node1:99999999999", r"N must be a number of workers from 1 to 1024"),
                       ("node1:２", r"N must be a number of workers"),
                       ("node1:x", r"N must be a number of workers"),
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
    monkeypatch.setenv("TFMULTI_LAUNCH_SECRET", SECRET)
    assert cli.main(["launch", *argv, "--", sys.executable, "-c", "pass"]) == 2
    assert capsys.readouterr().err == f"tfmulti launch: error: {line}\n"


SECRET = "0123456789abcdef0123456789abcdef"
HOW_TO = ("make one and give every host the same: export TFMULTI_LAUNCH_SECRET=$(python -c "
          "\"import secrets; print(secrets.token_hex(32))\") (under SLURM: export it in the "
          "batch script before `srun`), or write it to a file only you can read and pass "
          "--secret_file PATH.")


@pytest.mark.parametrize("env, mode, options, line", [
    (None, None, [],
     "a launch across hosts needs the launchers' shared secret, so that no other machine can "
     "join the job or steer it: TFMULTI_LAUNCH_SECRET is not set and no --secret_file was "
     f"given; {HOW_TO}"),
    ("too short", None, [],
     f"the launchers' secret from TFMULTI_LAUNCH_SECRET has 9 bytes, fewer than 16: too easy "
     f"to guess; {HOW_TO}"),
    ("   ", None, [], f"the launchers' secret from TFMULTI_LAUNCH_SECRET is empty; {HOW_TO}"),
    (None, 0o644, ["--secret_file", "{file}"],
     "--secret_file {file} can be read or written by others (mode 0644); make it readable "
     "only by its owner: chmod 600 {file}"),
    (None, 0o620, ["--secret_file", "{file}"],
     "--secret_file {file} can be read or written by others (mode 0620); make it readable "
     "only by its owner: chmod 600 {file}"),
    (None, None, ["--secret_file", "{file}.missing"],
     f"cannot read --secret_file {{file}}.missing (No such file or directory); give the path "
     f"of a file that holds the secret; {HOW_TO}"),
    (SECRET, 0o600, ["--secret_file", "{dir}"],
     f"--secret_file {{dir}} is not a regular file; {HOW_TO}"),
])
def test_a_launch_across_hosts_needs_a_good_secret(monkeypatch, capsys, tmp_path, env, mode,
                                                   options, line):
    # Issue 27: without a shared secret, a third machine could join as host 1.
    from tfmulti import cli

    file = tmp_path / "secret"
    file.write_text(SECRET[:20] + "\n")
    if mode is not None:
        file.chmod(mode)
    if env is None:
        monkeypatch.delenv("TFMULTI_LAUNCH_SECRET", raising=False)
    else:
        monkeypatch.setenv("TFMULTI_LAUNCH_SECRET", env)
    options = [o.format(file=file, dir=tmp_path) for o in options]
    argv = ["launch", "--hosts", "127.0.0.1:1,127.0.0.2:1", "--host_rank", "0", *options,
            "--", sys.executable, "-c", "pass"]
    assert cli.main(argv) == 2
    assert capsys.readouterr().err == \
        f"tfmulti launch: error: {line.format(file=file, dir=tmp_path)}\n"


def test_a_secret_file_readable_only_by_its_owner_is_the_secret(tmp_path):
    from tfmulti.cluster import auth

    file = tmp_path / "secret"
    file.write_text(f"  {SECRET}\n")
    file.chmod(0o600)
    environ = {auth.SECRET_ENV: "the environment's, not used"}
    assert auth.load_secret(environ, str(file)) == SECRET.encode()
    assert auth.load_secret({"TFMULTI_LAUNCH_SECRET": SECRET}) == SECRET.encode()


def test_a_secret_file_needs_hosts(capsys, tmp_path):
    from tfmulti import cli

    assert cli.main(["launch", "--secret_file", str(tmp_path), "--", "python"]) == 2
    assert capsys.readouterr().err == (
        f"tfmulti launch: error: --secret_file ('{tmp_path}') needs --hosts: the secret "
        "authenticates the launchers of a launch across hosts.\n")
