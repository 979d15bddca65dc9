"""memory: sharded data parallelism (ZeRO), each worker's peak memory by stage.

A wide MLP (`SETTINGS`: four Dense(4096) layers over 28 x 28 inputs, 53.6M
parameters, 214 MB of float32) trained with Adam by 2 workers of
`tfmulti launch` (`tfmulti train --distribution=multi_worker`, synthetic
data), at each `zero_stage` in turn, the stages interleaved repeat by
repeat. Each worker runs under `benchmarks.peak_rss`, which reads its peak
resident memory from outside when it ends (the kernel's `ru_maxrss`, GNU
time's `%M`): what a per-process memory limit sees, saving included.

Figures, per stage: each worker's peak RSS (the larger of the two, median of
the repeats), its saving over stage 0 against the ideal saving with Adam on
N = 2 workers (P parameters: stage 1 shards the 8P bytes of slots, 4P saved;
stage 2 also the gradients, 6P; stage 3 also the parameters, 8P), `fraction_of_ideal` = saving / ideal (goal
>= 0.6), the bytes of optimizer state each worker holds (`metrics.json`,
read from the variables) and `step_ratio` = seconds per step over stage 0's
(epochs after the first; goal <= 1.10, stage 3 <= 1.50).

The cap: a memory limit on each worker (a cgroup v1 `memory.limit_in_bytes`
per worker, as root; `benchmarks.peak_rss --limit_bytes`) halfway between
stage 0's peak of anonymous memory and the lowest sharded stage's (the
resident set also counts the pages of TensorFlow's libraries, which the
kernel drops under a limit and reads again, so a cap between the RSS peaks
binds neither; measured: stage 0 trained under a cap 260 MiB below its peak
RSS), every stage run under it: stage 0 is killed for memory, the sharded
stages train. Where cgroups cannot be made
(not root, no memory controller) the record says why and has no cap.
"""

from __future__ import annotations

import itertools
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time

from benchmarks import _harness
from tfmulti.utils import checks

__all__ = ["SETTINGS", "TOY", "check", "launch_measured", "plot", "run", "step_seconds", "summarize"]

SETTINGS = {"width": 4096, "layers": 4, "num_examples": 384, "global_batch_size": 32,
            "epochs": 3, "stages": [0, 1, 2, 3]}
"""The runs' settings, also recorded in the suite's JSON."""
TOY = {"width": 64, "layers": 2, "num_examples": 64, "global_batch_size": 16, "epochs": 2,
       "stages": [0, 1]}
"""`SETTINGS` at toy size (`_harness.toy`: the end-to-end test)."""

NUM_WORKERS = 2
_MODEL = '''import keras


def build():
    return keras.Sequential([
        keras.Input((28, 28, 1)), keras.layers.Flatten(),
        *[keras.layers.Dense({width}, activation="relu") for _ in range({layers})],
        keras.layers.Dense(10)])
'''
_IDEAL_PARAMETER_BYTES = {0: 0, 1: 4, 2: 6, 3: 8}
"""Bytes per parameter a stage saves on each of 2 workers with Adam (float32):
half of the slots' 8 (stage 1), and half of the gradients' 4 (stage 2), and
half of the parameters' 4 (stage 3)."""
_LAUNCH_TIMEOUT = 1200


def parameters(width: int, layers: int) -> int:
    """The MLP's parameters."""
    sizes = [28 * 28, *[width] * layers, 10]
    return sum(a * b + b for a, b in itertools.pairwise(sizes))


def _train(stage: int, settings: dict, folder: str, limit_bytes: int | None = None) -> dict:
    """One 2-worker launch at `stage` (`launch_measured`)."""
    model_dir = os.path.join(folder, f"stage{stage}-{time.monotonic_ns()}")
    return launch_measured([
        "--model=zero_mlp:build", "--dataset=synthetic",
        f"--num_examples={settings['num_examples']}",
        f"--global_batch_size={settings['global_batch_size']}",
        f"--epochs={settings['epochs']}", f"--zero_stage={stage}"], model_dir,
        python_path=folder, limit_bytes=limit_bytes)


def launch_measured(flags: list[str], model_dir: str, python_path: str | None = None,
                    env: dict | None = None, limit_bytes: int | None = None) -> dict:
    """One launch of `tfmulti train --distribution=multi_worker FLAGS
    --model_dir=MODEL_DIR` on `NUM_WORKERS` workers, each under
    `benchmarks.peak_rss` (with `limit_bytes`): {"returncode",
    "peak_rss_bytes" (by worker), "peak_anon_bytes", "metrics" (the chief's
    metrics.json, None where it failed), "oom_kills" (processes the kernel
    killed for memory, under `limit_bytes`), "output" (its tail)}.
    `python_path` goes first on the workers' PYTHONPATH; `env`, over theirs."""
    # (here, not at the top: `python -m benchmarks.peak_rss` imports this package first)
    from benchmarks import peak_rss  # pylint: disable=import-outside-toplevel

    limit = [f"--limit_bytes={limit_bytes}"] if limit_bytes else []
    command = [sys.executable, "-m", "tfmulti.cli", "launch", f"--num_workers={NUM_WORKERS}",
               "--", sys.executable, "-m", "benchmarks.peak_rss", *limit, "--",
               sys.executable, "-m", "tfmulti.cli", "train", "--distribution=multi_worker",
               *flags, f"--model_dir={model_dir}"]
    worker_env = {**_harness.worker_env(), **(env or {})}
    if python_path:
        worker_env["PYTHONPATH"] = python_path + os.pathsep + worker_env["PYTHONPATH"]
    result = subprocess.run(command, stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                            text=True, timeout=_LAUNCH_TIMEOUT, env=worker_env, check=False)
    peaks, anon, oom_kills = {}, {}, 0
    for line in result.stdout.splitlines():
        worker = int(line.split("]")[0].split()[1]) if line.startswith("[worker ") else None
        if worker is not None and peak_rss.LINE + " " in line:
            peaks[worker] = peak_rss.parse(line)[0]
        if worker is not None and peak_rss.ANON_LINE + " " in line:
            anon[worker] = peak_rss.parse(line, peak_rss.ANON_LINE)[0]
        oom_kills += sum(peak_rss.parse(line, peak_rss.OOM_LINE))
    metrics = None
    path = os.path.join(model_dir, "metrics.json")
    if result.returncode == 0 and os.path.exists(path):
        with open(path) as f:
            metrics = json.load(f)
    return {"returncode": result.returncode,
            "peak_rss_bytes": [peaks.get(w) for w in range(NUM_WORKERS)],
            "peak_anon_bytes": [anon.get(w) for w in range(NUM_WORKERS)],
            "metrics": metrics, "oom_kills": oom_kills, "output": result.stdout[-4000:]}


def _checked(run: dict, what: str) -> dict:
    if run["returncode"] != 0 or None in run["peak_rss_bytes"]:
        raise RuntimeError(f"memory suite: {what} failed ({run['returncode']}):\n"
                           f"{run['output']}")
    return run


def step_seconds(metrics: dict) -> float:
    """Seconds per step over the epochs after the first (the first traces)."""
    seconds = metrics["epoch_seconds"][1:] or metrics["epoch_seconds"]
    return statistics.median(seconds) / metrics["steps_per_epoch"]


def check() -> None:
    """The suite has no options: nothing to check."""


def run(repeats: int) -> dict:
    """Runs the suite; returns its JSON record."""
    checks.positive_int("repeats", repeats)
    settings = _harness.toy_sized(SETTINGS, TOY)
    stages = settings["stages"]
    start = time.monotonic()
    runs: dict[int, list[dict]] = {stage: [] for stage in stages}
    with tempfile.TemporaryDirectory(prefix="tfmulti-memory-") as folder:
        with open(os.path.join(folder, "zero_mlp.py"), "w") as f:
            f.write(_MODEL.format(width=settings["width"], layers=settings["layers"]))
        for repeat in range(repeats):
            order = stages if repeat % 2 == 0 else stages[::-1]  # drift hits all alike
            for stage in order:
                runs[stage].append(_checked(_train(stage, settings, folder),
                                            f"zero_stage={stage}"))
        peaks = {stage: int(statistics.median(max(r["peak_rss_bytes"]) for r in runs[stage]))
                 for stage in stages}
        anon = {stage: int(statistics.median(max(r["peak_anon_bytes"]) for r in runs[stage]))
                for stage in stages}
        cap = _cap(stages, anon, settings, folder)
    p = parameters(settings["width"], settings["layers"])
    record_stages = {}
    for stage in stages:
        saving = peaks[0] - peaks[stage]
        ideal = _IDEAL_PARAMETER_BYTES[stage] * p
        state = runs[stage][0]["metrics"].get("optimizer_state_bytes") or {}
        record_stages[str(stage)] = {
            "peak_rss_bytes": peaks[stage],
            "peak_rss_bytes_by_worker": [r["peak_rss_bytes"] for r in runs[stage]],
            "peak_anon_bytes": anon[stage],
            "peak_anon_bytes_by_worker": [r["peak_anon_bytes"] for r in runs[stage]],
            "saving_bytes": saving, "ideal_saving_bytes": ideal,
            "fraction_of_ideal": saving / ideal if ideal else None,
            "optimizer_state_bytes_per_worker": sum(state.values()) if state else None,
            "step_seconds": [step_seconds(r["metrics"]) for r in runs[stage]],
            "step_ratio": _harness.summary([
                step_seconds(r["metrics"]) / step_seconds(z["metrics"])
                for r, z in zip(runs[stage], runs[0])]),
        }
    _harness.report("memory", start, [
        "; ".join(f"zero_stage={stage} peak RSS {max(runs[stage][i]['peak_rss_bytes']) / 2**20:.0f}"
                  f" MiB per worker, step {record_stages[str(stage)]['step_seconds'][i]:.3f} s"
                  for stage in stages)
        for i in range(repeats)])
    return {
        "description": f"{NUM_WORKERS} workers (tfmulti launch), an MLP of {settings['layers']} "
                       f"Dense({settings['width']}) layers ({p:,} parameters), Adam, batch "
                       f"{settings['global_batch_size']}, {settings['epochs']} epochs of "
                       f"{settings['num_examples']} synthetic examples, at each zero_stage; "
                       "each worker's peak RSS read from outside (wait4's ru_maxrss, as GNU "
                       "time's %M), the larger of the 2 workers, median of the repeats",
        **settings, "toy": _harness.toy(), "parameters": p, "num_workers": NUM_WORKERS,
        "stages_measured": record_stages, "cap": cap,
        "goal": {"fraction_of_ideal": 0.6, "step_ratio": 1.10, "step_ratio_stage_3": 1.50},
    }


def _cap(stages: list[int], peaks: dict, settings: dict, folder: str) -> dict:
    """Every stage under one per-worker cap, halfway between the `peaks` of
    anonymous memory (what a limit cannot reclaim: the resident set also
    counts the libraries' pages, which the kernel drops under a limit and
    reads again) of stage 0 and of the lowest sharded stage; none at toy size.
    {"limit_bytes", "lowest_stage", "<stage>": {"returncode", "oom_kills",
    "peak_rss_bytes"}}."""
    from benchmarks import peak_rss  # pylint: disable=import-outside-toplevel  (see _train)

    why = peak_rss.limit_unavailable() or (
        "toy size, where the peaks are close (benchmarks/tests/test_peak_rss.py tests the "
        "limit)" if _harness.toy() else None)
    lowest = min((s for s in stages if s), key=lambda s: peaks[s], default=None)
    if why or lowest is None:
        return {"skipped": why or "no sharded stage measured"}
    if not all(peaks[s] for s in stages):
        return {"skipped": "the anonymous memory of the workers could not be read"}
    limit = (peaks[0] + peaks[lowest]) // 2
    out = {"limit_bytes": limit, "lowest_stage": lowest}
    for stage in stages:
        run = _train(stage, settings, folder, limit_bytes=limit)
        out[str(stage)] = {"returncode": run["returncode"], "oom_kills": run["oom_kills"],
                           "peak_rss_bytes": run["peak_rss_bytes"]}
        if run["returncode"] not in (0, 128 + 9) or (run["returncode"] and not run["oom_kills"]):
            out[str(stage)]["output"] = run["output"]  # neither trained nor killed for memory
    return out


def summarize(r: dict) -> list[str]:
    """The suite's headline lines."""
    lines = []
    for stage, s in r["stages_measured"].items():
        if stage == "0":
            lines.append(f"memory: zero_stage=0 peak RSS {s['peak_rss_bytes'] / 2**20:.0f} MiB "
                         f"per worker ({r['parameters']:,} parameters, Adam, 2 workers)")
            continue
        lines.append(f"memory: zero_stage={stage} peak RSS {s['peak_rss_bytes'] / 2**20:.0f} "
                     f"MiB per worker, {s['fraction_of_ideal']:.2f} of the ideal saving (goal "
                     f">= {r['goal']['fraction_of_ideal']}); step "
                     f"{_harness.fmt(s['step_ratio'], 'x', 3)} of stage 0's (goal <= "
                     f"{r['goal']['step_ratio_stage_3' if stage == '3' else 'step_ratio']})")
    cap = r["cap"]
    if "skipped" in cap:
        lines.append(f"memory: no cap: {cap['skipped']}")
    else:
        exits = ", ".join(f"zero_stage={stage} exits {cap[stage]['returncode']} "
                          f"({cap[stage]['oom_kills']} killed for memory)"
                          for stage in r["stages_measured"] if stage in cap)
        lines.append(f"memory: under a cap of {cap['limit_bytes'] / 2**20:.0f} MiB per worker: "
                     f"{exits}")
    return lines


def plot(r: dict, ax) -> None:
    """Each stage's peak RSS per worker (median), the ideal as a dashed line."""
    stages = list(r["stages_measured"])
    peaks = [r["stages_measured"][s]["peak_rss_bytes"] / 2**20 for s in stages]
    ax.bar([f"stage {s}" for s in stages], peaks)
    ideal = [peaks[0] - r["stages_measured"][s]["ideal_saving_bytes"] / 2**20 for s in stages]
    ax.plot(range(len(stages)), ideal, "k--", label="stage 0 - ideal saving")
    if "limit_bytes" in r["cap"]:
        ax.axhline(r["cap"]["limit_bytes"] / 2**20, color="r", label="cap")
    ax.set_ylabel("peak RSS per worker (MiB)")
    ax.set_title(f"ZeRO: {r['parameters'] / 1e6:.1f}M parameters, Adam, 2 workers", fontsize=9)
    ax.legend(fontsize=7)
