"""Tests of tfmulti.cluster.plan: what a launch starts, computed by pure
functions (ports, cores, worker environments, the supervisor's command line,
argument validation). No processes."""

from __future__ import annotations

import json

import pytest

from tfmulti.cluster import plan as plan_lib
from tfmulti.cluster import tf_config


def test_port_range_and_its_errors():
    assert plan_lib.port_range(20000, 3) == [20000, 20001, 20002]
    assert plan_lib.port_range(65534, 2) == [65534, 65535]
    for bad in (0, 65535, "20000"):
        with pytest.raises(ValueError, match=r"`port` \(.*\) must be an integer from 1 to 65534"):
            plan_lib.port_range(bad, 2)


def test_worker_env_sets_tf_config_and_launcher_settings():
    addresses = ["localhost:3000", "localhost:3001"]
    env = plan_lib.worker_env({"PATH": "/bin", "TF_CONFIG": "stale"}, addresses, 0,
                              startup_timeout=30)
    assert env["PATH"] == "/bin"
    assert json.loads(env["TF_CONFIG"]) == tf_config.build_tf_config(addresses, 0)
    assert env["TFMULTI_STARTUP_TIMEOUT"] == "30"
    assert env["PYTHONUNBUFFERED"] == "1"
    assert "TF_NUM_INTRAOP_THREADS" not in env

    pinned = plan_lib.worker_env({}, addresses, 1, startup_timeout=2.5, cpus=(2, 3, 4))
    assert json.loads(pinned["TF_CONFIG"])["task"]["index"] == 1
    assert pinned["TFMULTI_STARTUP_TIMEOUT"] == "2.5"
    for name in ("TF_NUM_INTRAOP_THREADS", "TF_NUM_INTEROP_THREADS", "OMP_NUM_THREADS"):
        assert pinned[name] == "3"


def test_a_plan_across_hosts_is_this_hosts_share_of_one_cluster():
    cluster = (("node1", 2), ("node2", 1), ("node3", 2))
    plans = [plan_lib.make_plan(["python", "t.py"], 1, hosts=cluster, host_rank=r, port=3000)
             for r in range(3)]
    assert [p.num_workers for p in plans] == [2, 1, 2]
    assert [p.first_worker for p in plans] == [0, 2, 3]
    everyone = ["node1:3001", "node1:3002", "node2:3001", "node3:3001", "node3:3002"]
    assert all(p.addresses([]) == everyone for p in plans)
    # Worker 3 (host 2's first) gets TF_CONFIG index 3 of the same list on its host.
    env = plan_lib.worker_env({}, plans[2].addresses([]), plans[2].first_worker)
    assert json.loads(env["TF_CONFIG"]) == tf_config.build_tf_config(everyone, 3)
    assert plan_lib.LaunchPlan.from_json(plans[1].to_json()) == plans[1]
    assert plan_lib.make_plan(["python"], hosts=cluster, host_rank=0).port == 2222
    with pytest.raises(ValueError, match=r"`host_rank` \(3\) must be this host's position"):
        plan_lib.make_plan(["python"], hosts=cluster, host_rank=3)
    with pytest.raises(ValueError, match=r"`host_rank` \(1\) needs `hosts`"):
        plan_lib.make_plan(["python"], host_rank=1)


def test_split_cpus_into_contiguous_chunks():
    assert plan_lib.split_cpus([3, 0, 1, 2], 2) == ((0, 1), (2, 3))
    assert plan_lib.split_cpus(range(5), 2) == ((0, 1, 2), (3, 4))
    assert plan_lib.split_cpus([4, 7], 2) == ((4,), (7,))
    with pytest.raises(ValueError, match=r"`pin_cpus` needs one core per worker, but 3 "
                                         r"workers .* only 2 cores .* --num_workers 2"):
        plan_lib.split_cpus([0, 1], 3)


def test_make_plan_validates_and_round_trips_through_json():
    plan = plan_lib.make_plan(["python", "t.py"], 2, pin_cpus=True, port=20000,
                              available_cpus={0, 1, 2, 3})
    assert plan.cpu_sets == ((0, 1), (2, 3))
    assert plan_lib.LaunchPlan.from_json(plan.to_json()) == plan
    with pytest.raises(ValueError, match="no command to launch"):
        plan_lib.make_plan([], 2)
    with pytest.raises(ValueError, match="must be a list of arguments"):
        plan_lib.make_plan("python t.py", 2)
    with pytest.raises(ValueError, match=r"`num_workers` \(0\) must be an integer from 1 to "
                                         r"1024; e.g. 2"):
        plan_lib.make_plan(["true"], 0)
    with pytest.raises(ValueError, match=r"`startup_timeout` \(0\) must be a number from "
                                         r"above 0 to 86400; seconds"):
        plan_lib.make_plan(["true"], 2, startup_timeout=0)


def test_launcher_max_restarts_must_be_non_negative():
    # From tests/unit/test_backup.py.
    with pytest.raises(ValueError, match=r"`max_restarts` \(-1\) must be an integer from 0 to "
                                         r"1000; e.g. 3 \(0: never restart\)"):
        plan_lib.make_plan(["python"], max_restarts=-1)


@pytest.mark.parametrize("options, message", [
    ({"num_workers": 100000}, r"`num_workers` \(100000\) must be an integer from 1 to 1024"),
    ({"num_workers": True}, r"`num_workers` \(True\) must be an integer from 1 to 1024"),
    ({"port": 99999999999}, r"`port` \(99999999999\) must be an integer from 1 to 65535"),
    ({"port": 0}, r"`port` \(0\) must be an integer from 1 to 65535"),
    ({"startup_timeout": 1e300}, r"`startup_timeout` \(1e\+300\) must be a number from above 0 "
                                 r"to 86400"),
    ({"startup_timeout": float("nan")}, r"`startup_timeout` \(nan\) must be a number from"),
    ({"grace_period": -1.0}, r"`grace_period` \(-1.0\) must be a number from 0 to 86400"),
    ({"grace_period": float("inf")}, r"`grace_period` \(inf\) must be a number from 0 to 86400"),
    ({"max_restarts": 10**9}, r"`max_restarts` \(1000000000\) must be an integer from 0 to "
                              r"1000"),
    ({"gpus_per_worker": 10**6}, r"`gpus_per_worker` \(1000000\) must be an integer from 0 "
                                 r"to 256"),
    ({"hosts": (("a", 10**11), ("b", 1)), "host_rank": 1},
     r"the workers of host 'a' \(100000000000\) must be an integer from 1 to 1024"),
    ({"hosts": (("a", 1024), ("b", 1)), "host_rank": 1, "port": 65000},
     r"`port` \(65000\) must be an integer from 1 to 64511: with --hosts"),
])
def test_every_number_of_a_launch_is_refused_outside_its_range(options, message):
    # Issue 27: 100000 workers exited 2 with no message, a port of 99999999999 said
    # "from 1 to -99999934464".
    options = {"num_workers": 2, "cores": 1000, **options}
    with pytest.raises(ValueError, match=message):
        plan_lib.make_plan(["python"], **options)


def test_more_than_four_workers_per_core_need_oversubscribe():
    # Issue 27: --num_workers 3000 started 3,000 processes on 2 cores.
    assert plan_lib.make_plan(["python"], 8, cores=2).num_workers == 8
    with pytest.raises(ValueError, match=r"`num_workers` \(9\) is more than 4 workers per core "
                                         r"for the 2 cores of this host: use 1 to 8, or "
                                         r"pass --oversubscribe"):
        plan_lib.make_plan(["python"], 9, cores=2)
    assert plan_lib.make_plan(["python"], 9, cores=2, oversubscribe=True).num_workers == 9
    # Across hosts: this host's own count, against this host's cores.
    cluster = (("a", 1), ("b", 9))
    assert plan_lib.make_plan(["python"], hosts=cluster, host_rank=0, cores=2).num_workers == 1
    with pytest.raises(ValueError, match=r"host 1's number of workers in `hosts` \(9\) is more "
                                         r"than 4 workers per core"):
        plan_lib.make_plan(["python"], hosts=cluster, host_rank=1, cores=2)


def test_the_launchers_secret_never_reaches_the_workers():
    env = plan_lib.worker_env({"TFMULTI_LAUNCH_SECRET": "s" * 32, "PATH": "/bin"},
                              ["localhost:3000"], 0)
    assert "TFMULTI_LAUNCH_SECRET" not in env and env["PATH"] == "/bin"
    assert "s" * 32 not in env["TF_CONFIG"]


def test_commands_for_isolated_and_non_isolated_runs():
    plan = plan_lib.make_plan(["python", "train.py"], 2)
    supervise = ["/py", "-m", "tfmulti.cluster.supervisor", plan.to_json()]
    assert plan_lib.supervisor_command(plan, "/py") == supervise
    # Always a new PID namespace where one can be made; a network one when isolated.
    assert plan_lib.supervisor_command(plan, "/py", "root") == [
        "unshare", "--pid", "--net", "--", *supervise]
    assert plan_lib.supervisor_command(plan, "/py", "root", network=False) == [
        "unshare", "--pid", "--", *supervise]
    assert plan_lib.supervisor_command(plan, "/py", "userns") == [
        "unshare", "--pid", "--net", "--map-root-user", "--", *supervise]
    assert plan_lib.LaunchPlan.from_json(supervise[-1]).command == ("python", "train.py")
    with pytest.raises(ValueError, match=r"isolation `mode` \('pid'\) must be one of"):
        plan_lib.isolation_prefix("pid")


def test_the_default_grace_period_covers_the_preemption_agreement():
    # SIGTERM -> the agreement (up to PREEMPTION_AGREEMENT_S) -> the rest of a call of
    # steps -> the save, all before SIGKILL: the same default everywhere a launch starts.
    import inspect

    from tfmulti import cli
    from tfmulti.cluster import launch

    default = plan_lib.DEFAULT_GRACE_PERIOD
    assert default >= 2 * plan_lib.PREEMPTION_AGREEMENT_S
    assert inspect.signature(launch).parameters["grace_period"].default == default
    assert plan_lib.make_plan(["python"]).grace_period == default
    assert cli.build_parser().parse_args(["launch", "--", "python"]).grace_period == default
