"""Which GPUs each local worker of a launch sees (no TensorFlow).

`tfmulti launch --gpus_per_worker K` gives local worker i the i-th slice of K
of this host's GPUs as its `CUDA_VISIBLE_DEVICES`: the GPUs the launcher
itself may use (its own `CUDA_VISIBLE_DEVICES` when set, else every GPU that
`nvidia-smi -L` lists), so slices of an already restricted list stay within it.

Example:
    >>> from tfmulti.cluster import gpus
    >>> visible = gpus.visible_gpus({"CUDA_VISIBLE_DEVICES": "0,2,5,7"})
    >>> gpus.gpu_slices(visible, num_workers=2, gpus_per_worker=2)
    (('0', '2'), ('5', '7'))
    >>> gpus.parse_nvidia_smi_list("GPU 0: NVIDIA H100 (UUID: GPU-1a)\\n"
    ...                            "GPU 1: NVIDIA H100 (UUID: GPU-2b)\\n")
    ['0', '1']
"""

from __future__ import annotations

import os
import re
import shutil
import subprocess
from typing import Mapping, Sequence

from tfmulti.utils import checks

__all__ = ["gpu_slices", "host_gpus", "parse_nvidia_smi_list", "visible_gpus"]

_SMI_TIMEOUT_S = 10.0
_SMI_LINE = re.compile(r"^GPU (\d+):", re.M)


def parse_nvidia_smi_list(text: str) -> list[str]:
    """The GPU indices in the output of `nvidia-smi -L`, as strings."""
    return _SMI_LINE.findall(text)


def visible_gpus(environ: Mapping[str, str], nvidia_smi_list: str = "") -> list[str]:
    """The GPUs a process with `environ` may use: the entries of its CUDA_VISIBLE_DEVICES
    (up to the first invalid one, such as -1, where CUDA stops too) when it is set, else
    the GPUs of `nvidia_smi_list` (the output of `nvidia-smi -L`)."""
    text = environ.get("CUDA_VISIBLE_DEVICES")
    if text is None:
        return parse_nvidia_smi_list(nvidia_smi_list)
    found = []
    for entry in (e.strip() for e in text.split(",")):
        if not entry or entry.startswith("-"):
            break
        found.append(entry)
    return found


def host_gpus(environ: Mapping[str, str] | None = None) -> tuple[list[str], str]:
    """This host's GPUs that the launcher may use (`visible_gpus`, running `nvidia-smi -L`
    when CUDA_VISIBLE_DEVICES is not set), and where the list came from, in words."""
    environ = os.environ if environ is None else environ
    if "CUDA_VISIBLE_DEVICES" in environ:
        return (visible_gpus(environ),
                f"CUDA_VISIBLE_DEVICES={environ['CUDA_VISIBLE_DEVICES']!r}")
    exe = shutil.which("nvidia-smi")
    if exe is None:
        return [], "no nvidia-smi on PATH"
    try:
        result = subprocess.run([exe, "-L"], capture_output=True, text=True,
                                timeout=_SMI_TIMEOUT_S, stdin=subprocess.DEVNULL)
    except (OSError, subprocess.TimeoutExpired) as e:
        return [], f"`nvidia-smi -L` failed: {e}"
    if result.returncode != 0:
        return [], f"`nvidia-smi -L` failed: {(result.stderr or result.stdout).strip()}"
    return parse_nvidia_smi_list(result.stdout), "`nvidia-smi -L`"


def gpu_slices(gpus: Sequence[str], num_workers: int, gpus_per_worker: int,
               source: str = "") -> tuple[tuple[str, ...], ...]:
    """Worker i's GPUs: `gpus[i * K:(i + 1) * K]` for K = `gpus_per_worker`.

    Raises:
        ValueError: `gpus_per_worker` not a positive integer, or fewer than
            `num_workers * gpus_per_worker` GPUs (`source` says where `gpus` came from).
    """
    checks.positive_int("gpus_per_worker", gpus_per_worker, hint="e.g. 1")
    checks.positive_int("num_workers", num_workers, hint="e.g. 2")
    needed = num_workers * gpus_per_worker
    if len(gpus) < needed:
        found = f" ({source})" if source else ""
        raise ValueError(f"`gpus_per_worker` {gpus_per_worker} needs {needed} GPUs for "
                         f"{num_workers} workers on this host, but it has {len(gpus)}"
                         f"{found}; use fewer workers or GPUs per worker, or leave "
                         "--gpus_per_worker out.")
    return tuple(tuple(gpus[i * gpus_per_worker:(i + 1) * gpus_per_worker])
                 for i in range(num_workers))
