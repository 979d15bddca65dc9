"""Environment report (`tfmulti env`): versions, devices, NCCL, CPU, oneDNN, RAM, TF_CONFIG.

What a bug report or a scaling question needs to know, as a dict
(`env_report`) or aligned text (`format_env_report`).
"""

from __future__ import annotations

import json
import os
import platform
import shutil
import subprocess
from importlib import metadata

from tfmulti.utils.tables import key_values
from tfmulti.utils import human
from tfmulti.cluster import gpus as gpus_lib

__all__ = ["cpu_model", "env_report", "format_env_report", "onednn_enabled", "worker_gpus"]


def _version(package: str) -> str | None:
    try:
        return metadata.version(package)
    except metadata.PackageNotFoundError:
        return None


def _ram_bytes() -> int | None:
    try:
        return os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
    except (ValueError, OSError, AttributeError):
        return None


def _nvidia_smi_gpus(timeout_s: float = 10.0) -> list[dict]:
    """Names and memory of the GPUs from nvidia-smi, when it exists."""
    exe = shutil.which("nvidia-smi")
    if not exe:
        return []
    try:
        out = subprocess.run(
            [exe, "--query-gpu=index,name,memory.total", "--format=csv,noheader,nounits"],
            capture_output=True, text=True, timeout=timeout_s, check=True,
        ).stdout
    except (subprocess.SubprocessError, OSError):
        return []
    gpus = []
    for line in out.strip().splitlines():
        index, name, mem = (part.strip() for part in line.split(","))
        try:
            memory_mib = int(float(mem))
        except ValueError:  # "[N/A]" on unified-memory GPUs
            memory_mib = None
        gpus.append({"index": int(index), "name": name, "memory_mib": memory_mib})
    return gpus


def cpu_model() -> str | None:
    """The CPU's model name (Linux: /proc/cpuinfo), else what `platform` says."""
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                if line.startswith("model name"):
                    return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or None


def onednn_enabled() -> bool | None:
    """Whether TensorFlow runs its oneDNN CPU kernels: its default on x86 CPUs
    with AVX-512 neural-network features (VNNI, BF16, AMX), off elsewhere
    unless TF_ENABLE_ONEDNN_OPTS=1 (and =0 turns it off). CPU speed differs
    severalfold between the two, so benchmarks record it. None where
    TensorFlow does not say."""
    try:
        from tensorflow.python.util import _pywrap_util_port
        return bool(_pywrap_util_port.IsMklEnabled())
    except (ImportError, AttributeError):
        return None


def worker_gpus(num_workers: int, gpus_per_worker: int,
                environ: dict | None = None) -> list[str]:
    """What each of `num_workers` local workers of `tfmulti launch --gpus_per_worker K`
    sees: "worker I: CUDA_VISIBLE_DEVICES=..." (`tfmulti.cluster.gpus`).

    Example:
        >>> worker_gpus(2, 1, {"CUDA_VISIBLE_DEVICES": "0,3"})
        ['worker 0: CUDA_VISIBLE_DEVICES=0', 'worker 1: CUDA_VISIBLE_DEVICES=3']

    Raises:
        ValueError: this host has fewer than `num_workers * gpus_per_worker` GPUs.
    """
    found, source = gpus_lib.host_gpus(environ)
    slices = gpus_lib.gpu_slices(found, num_workers, gpus_per_worker, source)
    return [f"worker {i}: CUDA_VISIBLE_DEVICES={','.join(s)}" for i, s in enumerate(slices)]


def env_report(gpus_per_worker: int = 0, num_workers: int = 1) -> dict:
    """Collects what a bug report or a scaling question needs to know.

    Lists physical and logical devices (starting the TensorFlow runtime, so
    call `configure_virtual_devices` first if you want it to count them).
    With `gpus_per_worker`, also what each of `num_workers` local workers of
    `tfmulti launch --gpus_per_worker` would see ("worker_gpus", `worker_gpus`).
    """
    import tensorflow as tf

    physical_gpus = tf.config.list_physical_devices("GPU")
    gpu_details = []
    for gpu in physical_gpus:
        details = tf.config.experimental.get_device_details(gpu)
        gpu_details.append({
            "device": gpu.name,
            "name": details.get("device_name"),
            "compute_capability": details.get("compute_capability"),
        })
    smi = _nvidia_smi_gpus()
    for entry, row in zip(gpu_details, smi):
        entry["memory_mib"] = row["memory_mib"]
        entry["name"] = entry["name"] or row["name"]
    built_with_cuda = tf.test.is_built_with_cuda()
    if not built_with_cuda:
        nccl = "no: TensorFlow was built without CUDA"
    elif not physical_gpus:
        nccl = "no: no GPU visible"
    elif platform.system() != "Linux":
        nccl = "no: NCCL needs Linux"
    else:
        nccl = "yes"
    tf_config = os.environ.get("TF_CONFIG")
    try:
        tf_config_value = json.loads(tf_config) if tf_config else None
    except json.JSONDecodeError:
        tf_config_value = f"<invalid JSON> {tf_config}"
    report = {
        "python": platform.python_version(),
        "platform": platform.platform(),
        "tfmulti": _version("tfmulti"),
        "tensorflow": tf.__version__,
        "keras": _version("keras"),
        "tensorflow_datasets": _version("tensorflow-datasets"),
        "absl_py": _version("absl-py"),
        "numpy": _version("numpy"),
        "built_with_cuda": built_with_cuda,
        "physical_devices": [d.name for d in tf.config.list_physical_devices()],
        "logical_devices": [d.name for d in tf.config.list_logical_devices()],
        "gpus": gpu_details,
        "nccl_usable": nccl,
        "cpu_count": os.cpu_count(),
        "cpu_affinity": len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else None,
        "cpu_model": cpu_model(),
        "onednn": onednn_enabled(),
        "ram_bytes": _ram_bytes(),
        "tf_config": tf_config_value,
    }
    if gpus_per_worker:
        report["worker_gpus"] = worker_gpus(num_workers, gpus_per_worker)
    return report


def _gpu_text(gpu: dict) -> str:
    """A GPU of the report in words: 'GPU:0 NVIDIA H200, compute capability 9.0, 140 GiB'."""
    device = str(gpu.get("device") or "").replace("/physical_device:", "")
    words = [" ".join(str(w) for w in (device, gpu.get("name")) if w) or "a GPU"]
    capability = gpu.get("compute_capability")
    if isinstance(capability, (list, tuple)) and capability:
        words.append("compute capability " + ".".join(map(str, capability)))
    if gpu.get("memory_mib") is not None:
        words.append(human.size(gpu["memory_mib"] * 2**20))
    return ", ".join(words)


def format_env_report(report: dict) -> str:
    """The report as aligned `key  value` lines, numbers as people read them (RAM as
    `ram  23.5 GiB`; `--json` keeps `ram_bytes` in bytes).

    Example:
        >>> print(format_env_report({"cpu_count": 64, "ram_bytes": 25232932864, "gpus": [
        ...     {"device": "/physical_device:GPU:0", "name": "NVIDIA H200",
        ...      "compute_capability": [9, 0], "memory_mib": 143771}], "tf_config": None}))
        cpu_count  64
        ram        23.5 GiB
        gpus       GPU:0 NVIDIA H200, compute capability 9.0, 140 GiB
        tf_config  not set
    """
    pairs = []
    for key, value in report.items():
        if key == "ram_bytes":
            key, value = "ram", human.size(value) if value else value
        if key == "gpus" and isinstance(value, list):
            value = "; ".join(_gpu_text(g) if isinstance(g, dict) else str(g)
                              for g in value) or "none"
        elif isinstance(value, list):
            value = ", ".join(json.dumps(v) if isinstance(v, dict) else str(v)
                              for v in value) or "none"
        elif isinstance(value, int) and not isinstance(value, bool):
            value = human.number(value)
        elif value is None:
            value = "not set" if key == "tf_config" else "unknown"
        pairs.append((key, value))
    return key_values(pairs)
