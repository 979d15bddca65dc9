"""Tests for tfmulti.insight.environment (`tfmulti env`), in-process: the
report's keys and values, its text form, nvidia-smi parsing, the CPU model
and oneDNN. The `tfmulti env` subprocess cases (the oneDNN flag forced both
ways, TF_CONFIG in the text) stay in tests/integration/test_recipes.py."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import types

import pytest
import tensorflow as tf

from tfmulti.insight import environment

KEYS = ("python", "platform", "tfmulti", "tensorflow", "keras", "tensorflow_datasets",
        "absl_py", "numpy", "built_with_cuda", "physical_devices", "logical_devices", "gpus",
        "nccl_usable", "cpu_count", "cpu_affinity", "cpu_model", "onednn", "ram_bytes",
        "tf_config")


def _no_nvidia_smi(monkeypatch):
    monkeypatch.setattr(environment, "shutil", types.SimpleNamespace(which=lambda name: None))


def test_env_report_keys_and_values(monkeypatch):
    _no_nvidia_smi(monkeypatch)
    tf_config = {"cluster": {"worker": ["localhost:1234"]}, "task": {"type": "worker",
                                                                     "index": 0}}
    monkeypatch.setenv("TF_CONFIG", json.dumps(tf_config))
    report = environment.env_report()
    assert tuple(report) == KEYS
    assert report["python"] == ".".join(map(str, sys.version_info[:3]))
    assert report["tensorflow"] == tf.__version__
    assert report["keras"].startswith("3.")
    cpus = [d for d in report["logical_devices"] if ":CPU:" in d]
    assert len(cpus) == len(tf.config.list_logical_devices("CPU")) == 4  # tests/conftest.py
    assert report["cpu_count"] == os.cpu_count()
    assert report["onednn"] in (True, False)
    assert report["onednn"] == environment.onednn_enabled()
    assert report["cpu_model"] == environment.cpu_model()
    assert report["ram_bytes"] is None or report["ram_bytes"] > 2**20
    assert report["tf_config"] == tf_config
    if not report["built_with_cuda"]:
        assert report["nccl_usable"] == "no: TensorFlow was built without CUDA"
    elif not report["gpus"]:
        assert report["nccl_usable"] == "no: no GPU visible"
    json.dumps(report)  # `tfmulti env --json`

    monkeypatch.setenv("TF_CONFIG", "{not json")
    assert environment.env_report()["tf_config"] == "<invalid JSON> {not json"
    monkeypatch.delenv("TF_CONFIG")
    assert environment.env_report()["tf_config"] is None


def test_format_env_report():
    report = {"python": "3.11.7", "ram_bytes": 3 * 2**30, "gpus": [{"name": "H200"}],
              "logical_devices": ["/device:CPU:0", "/device:CPU:1"], "physical_devices": [],
              "cpu_model": None, "tf_config": None}
    lines = environment.format_env_report(report).splitlines()
    width = len("physical_devices")
    assert lines == [
        f"{'python'.ljust(width)}  3.11.7",
        f"{'ram'.ljust(width)}  3.00 GiB",  # --json keeps ram_bytes
        f"{'gpus'.ljust(width)}  H200",
        f"{'logical_devices'.ljust(width)}  /device:CPU:0, /device:CPU:1",
        f"{'physical_devices'.ljust(width)}  none",
        f"{'cpu_model'.ljust(width)}  unknown",
        f"{'tf_config'.ljust(width)}  not set",
    ]


def test_format_env_report_of_the_real_report_shows_tf_config(monkeypatch):
    _no_nvidia_smi(monkeypatch)
    monkeypatch.setenv("TF_CONFIG", json.dumps({"cluster": {"worker": ["localhost:1234"]}}))
    text = environment.format_env_report(environment.env_report())
    assert "localhost:1234" in text
    assert {line.split()[0] for line in text.splitlines()} == set(KEYS) - {"ram_bytes"} | {"ram"}


def _fake_nvidia_smi(monkeypatch, stdout="", error=None):
    calls = []

    def run(args, **kwargs):
        calls.append(args)
        if error is not None:
            raise error
        return subprocess.CompletedProcess(args, 0, stdout=stdout, stderr="")

    monkeypatch.setattr(environment, "shutil",
                        types.SimpleNamespace(which=lambda name: f"/fake/{name}"))
    monkeypatch.setattr(environment, "subprocess",
                        types.SimpleNamespace(run=run, SubprocessError=subprocess.SubprocessError))
    return calls


def test_nvidia_smi_rows_without_a_memory_figure(monkeypatch):
    # Unified-memory GPUs (e.g. GB10) report memory.total as "[N/A]": the
    # environment report keeps the GPU and leaves its memory unknown.
    calls = _fake_nvidia_smi(monkeypatch, "0, NVIDIA GB10, [N/A]\n1, NVIDIA H200, 143771\n")
    assert environment._nvidia_smi_gpus() == [
        {"index": 0, "name": "NVIDIA GB10", "memory_mib": None},
        {"index": 1, "name": "NVIDIA H200", "memory_mib": 143771}]
    assert calls[0][0] == "/fake/nvidia-smi"
    assert "--query-gpu=index,name,memory.total" in calls[0]


@pytest.mark.parametrize("error", [subprocess.TimeoutExpired("nvidia-smi", 10),
                                   subprocess.CalledProcessError(9, "nvidia-smi"),
                                   FileNotFoundError("nvidia-smi")])
def test_nvidia_smi_failing_means_no_gpus(monkeypatch, error):
    _fake_nvidia_smi(monkeypatch, error=error)
    assert environment._nvidia_smi_gpus() == []


def test_no_nvidia_smi_means_no_gpus(monkeypatch):
    _no_nvidia_smi(monkeypatch)
    assert environment._nvidia_smi_gpus() == []


def test_cpu_model(monkeypatch, tmp_path):
    real_open = open
    cpuinfo = tmp_path / "cpuinfo"
    cpuinfo.write_text("processor\t: 0\nvendor_id\t: GenuineIntel\n"
                       "model name\t: Intel(R) Xeon(R) Test CPU @ 2.00GHz\n")

    def fake_open(path, *args, **kwargs):
        return real_open(cpuinfo if path == "/proc/cpuinfo" else path, *args, **kwargs)

    monkeypatch.setattr("builtins.open", fake_open)
    assert environment.cpu_model() == "Intel(R) Xeon(R) Test CPU @ 2.00GHz"

    # No /proc/cpuinfo (macOS, Windows): what `platform` says, None if nothing.
    def no_cpuinfo(path, *args, **kwargs):
        if path == "/proc/cpuinfo":
            raise FileNotFoundError(path)
        return real_open(path, *args, **kwargs)

    monkeypatch.setattr("builtins.open", no_cpuinfo)
    monkeypatch.setattr(environment.platform, "processor", lambda: "arm")
    assert environment.cpu_model() == "arm"
    monkeypatch.setattr(environment.platform, "processor", lambda: "")
    assert environment.cpu_model() is None


def test_onednn_enabled_is_what_tensorflow_says(monkeypatch):
    from tensorflow.python.util import _pywrap_util_port

    assert environment.onednn_enabled() is bool(_pywrap_util_port.IsMklEnabled())
    monkeypatch.setattr(_pywrap_util_port, "IsMklEnabled", lambda: 0)
    assert environment.onednn_enabled() is False
    monkeypatch.delattr(_pywrap_util_port, "IsMklEnabled")  # TensorFlow does not say
    assert environment.onednn_enabled() is None
