"""Tests of tfmulti.cluster.gpus: each local worker's CUDA_VISIBLE_DEVICES,
from CUDA_VISIBLE_DEVICES or `nvidia-smi -L` (stubbed: there is no GPU here),
through to the environments the launcher computes. No processes."""

from __future__ import annotations

import json
import types

import pytest

from tfmulti.cluster import gpus, plan

SMI = ("GPU 0: NVIDIA H100 80GB HBM3 (UUID: GPU-5d6c)\n"
       "GPU 1: NVIDIA H100 80GB HBM3 (UUID: GPU-8e1f)\n"
       "GPU 2: NVIDIA H100 80GB HBM3 (UUID: GPU-a7b2)\n"
       "GPU 3: NVIDIA H100 80GB HBM3 (UUID: GPU-f00d)\n")


def test_visible_gpus_from_the_environment_or_nvidia_smi():
    assert gpus.visible_gpus({}, SMI) == ["0", "1", "2", "3"]
    assert gpus.visible_gpus({}, "") == []
    assert gpus.visible_gpus({"CUDA_VISIBLE_DEVICES": "3,1"}, SMI) == ["3", "1"]
    assert gpus.visible_gpus({"CUDA_VISIBLE_DEVICES": "GPU-5d6c,GPU-a7b2"}) == [
        "GPU-5d6c", "GPU-a7b2"]
    assert gpus.visible_gpus({"CUDA_VISIBLE_DEVICES": ""}, SMI) == []
    assert gpus.visible_gpus({"CUDA_VISIBLE_DEVICES": "0,-1,2"}) == ["0"]  # CUDA stops at -1


def test_host_gpus_runs_nvidia_smi_only_without_cuda_visible_devices(monkeypatch):
    assert gpus.host_gpus({"CUDA_VISIBLE_DEVICES": "1,2"}) == (
        ["1", "2"], "CUDA_VISIBLE_DEVICES='1,2'")
    monkeypatch.setattr(gpus, "shutil", types.SimpleNamespace(which=lambda name: None))
    assert gpus.host_gpus({}) == ([], "no nvidia-smi on PATH")
    ran = []

    def run(cmd, **kwargs):
        ran.append(cmd)
        return types.SimpleNamespace(returncode=0, stdout=SMI, stderr="")

    monkeypatch.setattr(gpus, "shutil", types.SimpleNamespace(which=lambda name: "/x/smi"))
    monkeypatch.setattr(gpus.subprocess, "run", run)
    assert gpus.host_gpus({}) == (["0", "1", "2", "3"], "`nvidia-smi -L`")
    assert ran == [["/x/smi", "-L"]]


def test_slices_and_too_few_gpus():
    assert gpus.gpu_slices(["0", "1", "2", "3"], 2, 2) == (("0", "1"), ("2", "3"))
    assert gpus.gpu_slices(["0", "1", "2", "3"], 3, 1) == (("0",), ("1",), ("2",))
    with pytest.raises(ValueError, match=r"`gpus_per_worker` 2 needs 6 GPUs for 3 workers on "
                                         r"this host, but it has 4 \(`nvidia-smi -L`\); use "
                                         r"fewer workers"):
        gpus.gpu_slices(["0", "1", "2", "3"], 3, 2, "`nvidia-smi -L`")
    with pytest.raises(ValueError, match=r"`gpus_per_worker` must be a positive integer"):
        gpus.gpu_slices(["0"], 1, 0)


def test_each_worker_environment_sees_its_own_gpus():
    # What the supervisor gives each worker: its slice as CUDA_VISIBLE_DEVICES.
    visible = gpus.visible_gpus({"CUDA_VISIBLE_DEVICES": "4,5,6,7"})
    launch = plan.make_plan(["python", "t.py"], 2, gpus_per_worker=2, available_gpus=visible)
    assert launch.gpu_sets == (("4", "5"), ("6", "7"))
    assert plan.LaunchPlan.from_json(launch.to_json()) == launch
    addresses = launch.addresses([3000, 3001])
    envs = [plan.worker_env({"CUDA_VISIBLE_DEVICES": "4,5,6,7"}, addresses, i,
                            gpus=launch.gpu_sets[i]) for i in range(2)]
    assert [e["CUDA_VISIBLE_DEVICES"] for e in envs] == ["4,5", "6,7"]
    assert [json.loads(e["TF_CONFIG"])["task"]["index"] for e in envs] == [0, 1]
    # Without --gpus_per_worker the environment is left alone.
    assert "CUDA_VISIBLE_DEVICES" not in plan.worker_env({}, addresses, 0)
    with pytest.raises(ValueError, match=r"needs 2 GPUs for 2 workers on this host, but it "
                                         r"has 0 \(no nvidia-smi on PATH\)"):
        plan.make_plan(["python"], 2, gpus_per_worker=1, available_gpus=[],
                       gpus_source="no nvidia-smi on PATH")


def test_tfmulti_env_shows_what_each_worker_will_see(monkeypatch, capsys):
    from tfmulti import cli
    from tfmulti.insight import environment

    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "0,1,2,3")
    assert environment.worker_gpus(2, 2) == ["worker 0: CUDA_VISIBLE_DEVICES=0,1",
                                             "worker 1: CUDA_VISIBLE_DEVICES=2,3"]
    assert cli.main(["env", "--gpus_per_worker", "1", "--num_workers", "3"]) == 0
    lines = capsys.readouterr().out.splitlines()
    (row,) = [line for line in lines if line.startswith("worker_gpus")]
    assert row.split(None, 1)[1] == ("worker 0: CUDA_VISIBLE_DEVICES=0, worker 1: "
                                     "CUDA_VISIBLE_DEVICES=1, worker 2: "
                                     "CUDA_VISIBLE_DEVICES=2")
    assert "worker_gpus" not in environment.env_report()  # only when asked
    assert cli.main(["env", "--gpus_per_worker", "2", "--num_workers", "3"]) == 2
    assert capsys.readouterr().err == (
        "tfmulti env: error: --gpus_per_worker 2 needs 6 GPUs for 3 workers on this host, "
        "but it has 4 (CUDA_VISIBLE_DEVICES='0,1,2,3'); use fewer workers or GPUs per "
        "worker, or leave --gpus_per_worker out.\n")
