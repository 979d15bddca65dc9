"""Tests of benchmarks.gpu_check (`make gpu-check`) on a machine without a GPU:
the one-line failure, and the runner's JSON and table with the GPU measurements
replaced by recorded ones (the measurements themselves need a GPU)."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest

from tests._util import RECIPES, REPO
from benchmarks import gpu_check

RECORDS = {
    "env": {"status": "ok", "tensorflow": "2.21.0", "gpus": [{"device": "GPU:0"}]},
    "mirrored_nccl": {"status": "ok", "examples_per_second": 91234.0},
    "mirrored_hierarchical": {"status": "ok", "examples_per_second": 90000.4},
    "float16": {"status": "ok", "examples_per_second": 150000.0},
    "bfloat16": {"status": "ok", "examples_per_second": 140000.0},
    "xla": {"status": "ok", "examples_per_second": 60000.0},
    "pipeline": {"status": "ok", "examples_per_second": 20000.0},
    "equivalence": {"status": "ok", "max_abs_difference": 3e-7},
}


def _fake_gpus(monkeypatch, found=("0", "1")):
    monkeypatch.setattr(gpu_check.gpus_lib, "host_gpus",
                        lambda: (list(found), "`nvidia-smi -L`" if found else
                                 "no nvidia-smi on PATH"))


def _fake_workers(monkeypatch, records=RECORDS, errors=()):
    calls = []

    def run_worker(kind, timeout, check, seconds):
        assert kind == "gpu_check" and 0 < timeout <= 150
        calls.append(check)
        if check in errors:
            raise errors[check]
        return dict(records[check])

    monkeypatch.setattr(gpu_check._harness, "run_worker", run_worker)
    return calls


def test_no_gpu_fails_at_once_and_writes_nothing(monkeypatch, tmp_path):
    _fake_gpus(monkeypatch, found=())
    calls = _fake_workers(monkeypatch)
    with pytest.raises(gpu_check.NoGPUError, match=r"^no NVIDIA GPU found \(no nvidia-smi on "
                                                   r"PATH\); make gpu-check needs a machine"):
        gpu_check.run(str(tmp_path / "out.json"))
    assert calls == [] and not (tmp_path / "out.json").exists()


@pytest.mark.slow
def test_the_recipe_without_a_gpu_is_one_line_and_exit_1(tmp_path):
    env = {k: v for k, v in os.environ.items() if k != "CUDA_VISIBLE_DEVICES"}
    env["PATH"] = os.pathsep.join(p for p in env["PATH"].split(os.pathsep)
                                  if not os.path.exists(os.path.join(p, "nvidia-smi")))
    result = subprocess.run([sys.executable, str(RECIPES / "gpu_check.py"),
                             f"--output={tmp_path / 'out.json'}"], cwd=REPO, env=env,
                            capture_output=True, text=True, timeout=120)
    assert result.returncode == 1
    assert result.stderr.splitlines() == [
        "gpu_check.py: error: no NVIDIA GPU found (no nvidia-smi on PATH); make gpu-check "
        "needs a machine with one or more."]
    assert not (tmp_path / "out.json").exists()


def test_every_check_runs_in_order_into_the_json_and_the_table(monkeypatch, tmp_path):
    _fake_gpus(monkeypatch)
    calls = _fake_workers(monkeypatch, errors={
        "xla": RuntimeError("benchmark worker gpu_check failed (1):\nTraceback ...\n"
                            "ResourceExhaustedError: OOM when allocating tensor"),
        "pipeline": subprocess.TimeoutExpired(["python"], 150)})
    output = tmp_path / "runs" / "gpu.json"
    results = gpu_check.run(str(output))
    assert calls == list(gpu_check.CHECKS)
    assert json.loads(output.read_text()) == results
    assert results["complete"] and results["gpus"] == ["0", "1"]
    checks = results["checks"]
    assert checks["xla"]["status"] == "failed"
    assert checks["xla"]["error"] == "ResourceExhaustedError: OOM when allocating tensor"
    assert checks["pipeline"]["status"] == "failed"
    assert "timed out after 150 seconds" in checks["pipeline"]["error"]
    assert checks["float16"]["examples_per_second"] == 150000.0
    table = gpu_check.format_results(results).splitlines()
    assert table[0].split() == ["check", "status", "examples/s", "GPU", "utilization", "%",
                                "note"]
    assert [row.split()[0] for row in table[1:]] == list(gpu_check.CHECKS)
    assert table[2].split()[:3] == ["mirrored_nccl", "ok", "91,234"]
    assert table[6].split()[:3] == ["xla", "failed", "-"]
    assert table[-1].split()[-3:] == ["max", "difference", "3.0e-07"]


def test_checks_past_the_budget_are_skipped(monkeypatch, tmp_path):
    _fake_gpus(monkeypatch)
    calls = _fake_workers(monkeypatch)
    results = gpu_check.run(str(tmp_path / "out.json"), budget_s=1.0)
    assert calls == []
    assert {r["status"] for r in results["checks"].values()} == {"skipped"}


def test_tensorflow_without_cuda_is_one_error(monkeypatch, tmp_path):
    _fake_gpus(monkeypatch)
    _fake_workers(monkeypatch, records={
        **RECORDS, "env": {"status": "failed", "built_with_cuda": False, "gpus": []}})
    with pytest.raises(gpu_check.NoGPUError, match=r"`nvidia-smi -L` lists 2 GPU\(s\) but "
                                                   r"TensorFlow sees none \(built with CUDA: "
                                                   r"False\); install"):
        gpu_check.run(str(tmp_path / "out.json"))
    assert json.loads((tmp_path / "out.json").read_text())["complete"] is False


@pytest.mark.parametrize("check", [c for c in gpu_check.CHECKS
                                   if c not in ("env", "equivalence")])
def test_each_training_check_is_a_valid_configuration(check):
    for num_gpus in (1, 4):
        config = gpu_check._train_config(check, num_gpus)
        config.validate()
        assert config.global_batch_size % gpu_check.PER_GPU_BATCH == 0


def test_parse_utilization():
    assert gpu_check.parse_utilization("0, 97\n1, 5\n") == {0: 97, 1: 5}
    assert gpu_check.parse_utilization("[N/A]\n") == {}
