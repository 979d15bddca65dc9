"""gpu-check: what tfmulti does on this machine's NVIDIA GPUs, in at most 8 minutes.

    make gpu-check    # python recipes/gpu_check.py --output=runs/gpu_check.json

Checks (`CHECKS`, in this order, each in a fresh process, since logical GPUs
and the mixed-precision policy must be set before TensorFlow starts):

  env                    `tfmulti env`: versions, the GPUs TensorFlow sees, NCCL
  mirrored_nccl          MirroredStrategy over every GPU, NCCL all-reduce
  mirrored_hierarchical  the same with HierarchicalCopyAllReduce
  float16                mixed precision float16 (Keras' loss scaling), every GPU
  bfloat16               mixed precision bfloat16, every GPU
  xla                    the train step compiled by XLA, on GPU 0
  pipeline               a 2-stage PipelineModel (GPipe, 4 micro-batches) over
                         2 logical GPUs carved from GPU 0 with memory limits
  equivalence            MirroredStrategy over every GPU vs GPU 0 alone: a few
                         SGD steps give the same weights within 1e-5 (TF32 off,
                         deterministic ops)

Each training check fits the CNN on synthetic data at `PER_GPU_BATCH`
examples per GPU and reports the examples per second of its steady-state
epochs (after one that traces and warms up). Meanwhile `nvidia-smi` is read
twice a second; each check reports every GPU's mean utilization over its
run. The JSON file is written after every check (atomically); the table is
printed at the end. Without an NVIDIA GPU the check fails at once
(`NoGPUError`), before TensorFlow starts.
"""

from __future__ import annotations

import dataclasses
import re
import shutil
import statistics
import subprocess
import threading
import time

from tfmulti.utils import checks as _checks
from tfmulti.utils.atomic import write_json_atomic
from tfmulti.utils.tables import format_table
from benchmarks import _harness
from tfmulti.cluster import gpus as gpus_lib

__all__ = ["CHECKS", "NoGPUError", "PER_GPU_BATCH", "format_results", "parse_utilization",
           "run", "worker"]

CHECKS = ("env", "mirrored_nccl", "mirrored_hierarchical", "float16", "bfloat16", "xla",
          "pipeline", "equivalence")
PER_GPU_BATCH = 512
"""Examples per GPU per step: a GPU-sized batch for the CNN on 28x28 images."""
BUDGET_S = 480.0
"""The whole check's wall time (8 minutes)."""
_SECONDS = 10.0  # each throughput measurement's timed epochs
_MIN_CHECK_S = 30.0  # a check is skipped when less than this is left
_CHECK_TIMEOUT_S = 150.0
_LOGICAL_GPU_MIB = 2048  # each of the pipeline's 2 logical GPUs
_EQUIVALENCE_STEPS = 5
_SAMPLE_S = 0.5
_UTILIZATION = re.compile(r"^\s*(\d+)\s*,\s*(\d+)\s*$", re.M)


class NoGPUError(RuntimeError):
    """There is no NVIDIA GPU here (or TensorFlow sees none)."""


def parse_utilization(text: str) -> dict[int, int]:
    """GPU index -> utilization % from `nvidia-smi --query-gpu=index,utilization.gpu
    --format=csv,noheader,nounits`.

    Example:
        >>> parse_utilization("0, 97\\n1, 12\\n")
        {0: 97, 1: 12}
    """
    return {int(i): int(u) for i, u in _UTILIZATION.findall(text)}


class _UtilizationSampler:
    """Reads every GPU's utilization with nvidia-smi twice a second, in a thread, while
    active; `means()` gives each GPU's mean over the samples."""

    def __init__(self):
        self._samples: dict[int, list[int]] = {}
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)
        self._exe = shutil.which("nvidia-smi")

    def _run(self) -> None:
        while not self._stop.wait(_SAMPLE_S):
            try:
                text = subprocess.run(
                    [self._exe, "--query-gpu=index,utilization.gpu",
                     "--format=csv,noheader,nounits"], capture_output=True, text=True,
                    timeout=5, stdin=subprocess.DEVNULL).stdout
            except (OSError, subprocess.TimeoutExpired):
                continue
            for index, value in parse_utilization(text).items():
                self._samples.setdefault(index, []).append(value)

    def __enter__(self) -> "_UtilizationSampler":
        if self._exe:
            self._thread.start()
        return self

    def __exit__(self, *exc) -> None:
        self._stop.set()
        if self._thread.is_alive():
            self._thread.join(timeout=10)

    def means(self) -> dict[str, float]:
        return {str(i): round(statistics.fmean(v), 1) for i, v in sorted(self._samples.items())}


# ------------------------------------------------------------------ in the worker process


def _train_config(check: str, num_gpus: int):
    from tfmulti.config.train_config import TrainConfig

    every = tuple(f"GPU:{i}" for i in range(num_gpus))
    base = dict(model="cnn", dataset="synthetic", seed=0, dropout=0.0,
                steps_per_execution=8, global_batch_size=PER_GPU_BATCH * num_gpus,
                num_examples=PER_GPU_BATCH * num_gpus * 64, distribution="mirrored",
                devices=every)
    settings = {
        "mirrored_nccl": dict(cross_device_ops="nccl"),
        "mirrored_hierarchical": dict(cross_device_ops="hierarchical_copy"),
        "float16": dict(mixed_precision="float16"),
        "bfloat16": dict(mixed_precision="bfloat16"),
        "xla": dict(distribution="one_device", devices=("GPU:0",), jit_compile=True,
                    global_batch_size=PER_GPU_BATCH, num_examples=PER_GPU_BATCH * 64),
        "pipeline": dict(distribution="pipeline", devices=("GPU:0", "GPU:1"), num_stages=2,
                         num_microbatches=4, global_batch_size=PER_GPU_BATCH,
                         num_examples=PER_GPU_BATCH * 64),
    }[check]
    return TrainConfig(**{**base, **settings})


def _throughput(check: str, num_gpus: int, seconds: float) -> dict:
    from tfmulti.training import run as runs
    from tfmulti.insight import timing

    config = _train_config(check, num_gpus)
    run_ = runs.build_run(config)
    spe = run_.steps_per_execution
    estimate = timing.time_fit(run_.model, run_.train_input, 2 * spe, epochs=2)[0]
    steps = timing.steps_for(seconds / 2, estimate, spe)
    per_step = statistics.median(timing.time_fit(run_.model, run_.train_input, steps,
                                                 epochs=3))
    return {"status": "ok", "examples_per_second": config.global_batch_size / per_step,
            "global_batch_size": config.global_batch_size, "describe": run_.describe()}


def _equivalence(num_gpus: int) -> dict:
    import numpy as np
    import tensorflow as tf

    from tfmulti.training import run as runs
    from tfmulti.config.train_config import TrainConfig

    tf.config.experimental.enable_op_determinism()
    tf.config.experimental.enable_tensor_float_32_execution(False)  # float32 matmuls
    weights = {}
    for name, distribution, devices in (
            ("one_device", "one_device", ("GPU:0",)),
            ("mirrored", "mirrored", tuple(f"GPU:{i}" for i in range(num_gpus)))):
        config = TrainConfig(model="cnn", dataset="synthetic", seed=0, dropout=0.0,
                             optimizer="sgd", learning_rate=0.05, steps_per_execution=1,
                             global_batch_size=64 * num_gpus, num_examples=64 * num_gpus * 8,
                             distribution=distribution, devices=devices)
        run_ = runs.build_run(config)
        run_.model.fit(run_.train_input.dataset, steps_per_epoch=_EQUIVALENCE_STEPS,
                       epochs=1, verbose=0, shuffle=False)
        weights[name] = [np.asarray(w) for w in run_.model.get_weights()]
    diff = max(float(np.max(np.abs(a - b))) for a, b in zip(*weights.values()))
    return {"status": "ok" if diff <= 1e-5 else "failed", "max_abs_difference": diff,
            "replicas": num_gpus, "steps": _EQUIVALENCE_STEPS}


def worker(check: str, seconds: float = _SECONDS) -> dict:
    """One check, in this (fresh) process; returns its record."""
    _checks.one_of("check", check, CHECKS)
    import tensorflow as tf

    import tfmulti

    if check == "pipeline":
        tfmulti.configure_virtual_devices(2, "GPU", memory_limit_mb=_LOGICAL_GPU_MIB)
    if check == "env":
        from tfmulti.insight import environment

        report = environment.env_report()
        return {"status": "ok" if report["gpus"] else "failed", **{
            k: report[k] for k in ("tensorflow", "keras", "built_with_cuda", "gpus",
                                   "nccl_usable", "cpu_model", "logical_devices")}}
    num_gpus = len(tf.config.list_physical_devices("GPU"))
    if check == "equivalence":
        return _equivalence(num_gpus)
    return _throughput(check, num_gpus, seconds)


# ------------------------------------------------------------------ the runner


@dataclasses.dataclass
class _Budget:
    deadline: float

    def left(self) -> float:
        return self.deadline - time.monotonic()


def _run_check(check: str, budget: _Budget, seconds: float) -> dict:
    if budget.left() < _MIN_CHECK_S:
        return {"status": "skipped", "error": "the 8-minute budget ran out"}
    start = time.monotonic()
    with _UtilizationSampler() as sampler:
        try:
            record = _harness.run_worker("gpu_check", timeout=min(_CHECK_TIMEOUT_S,
                                                                  budget.left()),
                                         check=check, seconds=seconds)
        except (RuntimeError, subprocess.TimeoutExpired) as e:
            lines = [line for line in str(e).splitlines() if line.strip()]
            record = {"status": "failed", "error": lines[-1] if lines else repr(e)}
    record["seconds"] = round(time.monotonic() - start, 1)
    record["utilization_percent"] = sampler.means()
    return record


def format_results(results: dict) -> str:
    """The checks of `results` (what `run` writes) as a table.

    Example:
        >>> print(format_results({"checks": {
        ...     "env": {"status": "ok", "utilization_percent": {}},
        ...     "xla": {"status": "ok", "examples_per_second": 51234.5,
        ...             "utilization_percent": {"0": 93.5}},
        ...     "pipeline": {"status": "failed", "error": "OOM",
        ...                  "utilization_percent": {"0": 10.0}}}}))
        check     status  examples/s  GPU utilization %  note
        env       ok               -  -
        xla       ok          51,234  0: 94
        pipeline  failed           -  0: 10              OOM
    """
    rows = []
    for name, r in results["checks"].items():
        rate = r.get("examples_per_second")
        util = ", ".join(f"{i}: {u:.0f}" for i, u in r.get("utilization_percent", {}).items())
        note = r.get("error") or (f"max difference {r['max_abs_difference']:.1e}"
                                  if "max_abs_difference" in r else "")
        rows.append([name, r["status"], f"{rate:,.0f}" if rate else "-", util or "-", note])
    return format_table(["check", "status", "examples/s", "GPU utilization %", "note"], rows,
                        left=(0, 1, 3, 4))


def run(output: str, *, checks=CHECKS, seconds: float = _SECONDS,
        budget_s: float = BUDGET_S) -> dict:
    """Runs `checks` on this machine's GPUs, writes `output` (JSON) after each.

    Args:
        output: the JSON file.
        checks: which of `CHECKS`, in that order.
        seconds: each throughput measurement's timed epochs, about.
        budget_s: the whole run's wall time; checks that would start later are skipped.

    Returns:
        What `output` holds: "gpus", "checks" (name -> record), "complete".

    Raises:
        NoGPUError: no NVIDIA GPU here (nvidia-smi or CUDA_VISIBLE_DEVICES lists none), or
            TensorFlow sees none (the `env` check).
    """
    for check in checks:
        _checks.one_of("check", check, CHECKS)
    _checks.positive_number("seconds", seconds)
    found, source = gpus_lib.host_gpus()
    if not found:
        raise NoGPUError(f"no NVIDIA GPU found ({source}); make gpu-check needs a machine "
                         "with one or more.")
    budget = _Budget(time.monotonic() + budget_s)
    results = {"gpus": found, "gpus_source": source, "budget_seconds": budget_s,
               "per_gpu_batch": PER_GPU_BATCH, "checks": {}, "complete": False}
    for check in checks:
        print(f"gpu-check: {check} ...", flush=True)
        results["checks"][check] = record = _run_check(check, budget, seconds)
        write_json_atomic(output, results)
        if check == "env" and record["status"] == "failed":
            why = record.get("error") or f"built with CUDA: {record.get('built_with_cuda')}"
            raise NoGPUError(f"{source} lists {len(found)} GPU(s) but TensorFlow sees none "
                             f"({why}); install a TensorFlow built with CUDA (pip install "
                             "'tensorflow[and-cuda]').")
    results["complete"] = True
    results["seconds"] = round(budget_s - budget.left(), 1)
    write_json_atomic(output, results)
    return results
