"""pipeline: the training step of a 2-stage pipeline on 2 virtual CPU devices.

The model is 8 `Dense(1024, relu)` layers split 4 + 4 over 2 virtual CPUs
(`PipelineModel`), intra-op threads 1, batch 2048, SGD on MSE. Four
configurations of the same step:

* naive: M=1, the whole batch through stage 1 then stage 2 (one stage works
  at a time);
* GPipe with M = 2 and 4 micro-batches (of 1024 and 512 rows);
* serial: M=1 with inter-op threads 1, nothing overlapped at all.

The serial step needs inter-op threads 1, so it runs in a process of its own,
all its repeats first; the others share a second process and interleave
within each repeat. Every configuration is built and warmed up (one epoch)
first; a repeat's figure is the median of 3 epochs of 3 steps, in seconds per
step.

Also the single-thread matmul rate by row count (`matmul_gflops_by_rows`):
TensorFlow's CPU matmul runs at about half its rate below ~384 rows, which is
why the micro-batches stay at 512 rows or more (smaller ones would measure
that cliff, not the schedule).

Figures:

* pipeline_speedup = naive / best pipelined step time (goal >= 1.3x). The
  best M is chosen once, by median step time (the best M of each repeat would
  pick each repeat's luckiest draw). The ceiling on CPUs is about 1.5x, since
  TensorFlow already overlaps a stage's weight and input gradients in the
  naive split.
* pipeline_efficiency = (serial / 2) / pipelined (goal >= 0.85), with the
  measured bubble (1 - efficiency) next to GPipe's (S-1)/(M+S-1).
* remat_step_ratio = the step with remat (M=4, each stage's activations
  recomputed in the backward) / the same step without.
* memory: each configuration's step (M=4 with remat among them), by
  TensorFlow's allocator (`get_memory_info("CPU:0")`: the 2 virtual CPUs
  share it), its peak during an epoch above the memory held before it, in
  MiB, next to `tfmulti estimate-memory`'s activations and gradients for the
  same configuration (`pipeline_footprint`): what the step holds beyond the
  weights and slots, measured and predicted.
"""

from __future__ import annotations

import statistics
import time

from tfmulti.utils import checks
from benchmarks import _harness

__all__ = ["MATMUL_ROWS", "MICROBATCHES", "REMAT", "SHAPE", "TOY", "check",
           "matmul_gflops_by_rows", "plot", "run", "summarize", "worker"]

MICROBATCHES = (2, 4)
"""The pipelined configurations' micro-batch counts (GPipe, 2 stages)."""
# 2048 rows split into micro-batches of 1024 and 512: TensorFlow's CPU matmul
# drops to about half its FLOP rate below ~384 rows (matmul_gflops_by_rows).
SHAPE = {"width": 1024, "batch": 2048, "steps": 3}
"""Layer width, global batch and steps per timed epoch."""
MATMUL_ROWS = (64, 128, 256, 384, 512, 1024)
REMAT = f"M={max(MICROBATCHES)} remat"
"""The configuration with remat: the largest M's, its activations recomputed."""
_STAGES = 2
_LAYERS = 8
_EPOCHS = 3
_MATMUL_SECONDS = 0.25
TOY = {"width": 32, "batch": 64, "steps": 1, "epochs": 1, "matmul_rows": (16, 32),
       "matmul_seconds": 0.01}
"""`SHAPE` and the rest at toy size (`_harness.toy`: the end-to-end test), where both
workers share one process (`_harness.run_workers`) and so the serial step's threads."""


def matmul_gflops_by_rows(width: int, rows=MATMUL_ROWS,
                          seconds: float = _MATMUL_SECONDS) -> dict:
    """Single-thread rate (GFLOP/s) of `Dense(width, relu)` forward on
    rows x width inputs, as the pipeline's stages run it: shows where
    splitting a batch into micro-batches costs FLOP rate on this CPU.

    Returns:
        str(rows) -> GFLOP/s.
    """
    import keras
    import tensorflow as tf

    from tfmulti.insight import timing

    layer = keras.layers.Dense(width, activation="relu")
    layer.build((None, width))
    rates = {}
    for n in rows:
        x = tf.random.normal((n, width))
        # Eager calls on the CPU return once computed; the first one traces.
        seconds = timing.seconds_per_call(tf.function(lambda x=x: layer(x)), seconds)
        rates[str(n)] = 2 * n * width * width / seconds / 1e9
    return rates


def worker(microbatches: dict, inter_op: int, repeats: int, width: int, batch: int,
           steps: int, matmul_rows: bool = False, epochs: int = _EPOCHS,
           rows: list | None = None, matmul_seconds: float = _MATMUL_SECONDS,
           memory: bool = False) -> dict:
    """Step times of pipeline configurations sharing an inter-op setting, in
    this process: each built and warmed up once, then `repeats` rounds in
    which every configuration trains `epochs` epochs in turn (interleaved); a
    repeat's figure is the median epoch's seconds per step.

    Args:
        microbatches: configuration name -> micro-batches (1: the naive split);
            a name that ends in " remat" recomputes the stages' activations.
        inter_op: TensorFlow's inter-op threads (0: its default).
        rows, matmul_seconds: `matmul_gflops_by_rows`'s (default: `MATMUL_ROWS`).
        memory: also measure each configuration's memory (`_step_memory`).

    Returns:
        {"step_seconds": name -> seconds per step, one per repeat},
        "matmul_gflops_by_rows" when `matmul_rows`, and "memory_mib" when
        `memory`.
    """
    import tensorflow as tf

    _harness.set_threads(intra_op=1, inter_op=inter_op or None)
    import keras
    import numpy as np

    import tfmulti
    from benchmarks.fixtures import interleaved_step_seconds
    from tfmulti.parallel import PipelineModel

    tfmulti.configure_virtual_devices(_STAGES)
    devices = [f"CPU:{i}" for i in range(_STAGES)]
    rng = np.random.default_rng(0)
    x = rng.standard_normal((batch, width), dtype=np.float32)
    ds = tf.data.Dataset.from_tensors((x, x)).repeat()

    def build(m, remat=False):
        layers = [keras.layers.Dense(width, activation="relu") for _ in range(_LAYERS)]
        model = PipelineModel(layers, input_shape=(width,), devices=devices,
                              num_microbatches=m, partition=[_LAYERS // 2, _LAYERS // 2],
                              remat=remat)
        model.compile(optimizer=keras.optimizers.SGD(1e-4), loss="mse")
        return model

    models = {name: build(m, remat=name.endswith(" remat")) for name, m in microbatches.items()}
    out = {"step_seconds": interleaved_step_seconds(models, ds, steps, repeats, epochs)}
    if memory:
        out["memory_mib"] = {name: _step_memory(model, ds, steps, batch)
                             for name, model in models.items()}
    if matmul_rows:
        out["matmul_gflops_by_rows"] = matmul_gflops_by_rows(
            width, MATMUL_ROWS if rows is None else rows, matmul_seconds)
    return out


NO_ALLOCATOR_STATS = ("TensorFlow's CPU allocator keeps no count with oneDNN off (its default "
                      "on CPUs without AVX-512); TF_ENABLE_ONEDNN_OPTS=1 or "
                      "TF_CPU_ALLOCATOR_USE_BFC=true gives one")


def _step_memory(model, ds, steps: int, batch: int) -> dict:
    """What `model`'s training step holds beyond what it held before, in MiB:
    "measured", the allocator's peak over an epoch above its current bytes
    before it (after an epoch that built and traced everything; None, and
    "not_measured" says why, where the allocator keeps no count), and
    "estimated", `pipeline_footprint`'s activations and gradients."""
    import tensorflow as tf

    from tfmulti.memory import footprint

    rows = footprint.pipeline_footprint(model, batch)
    out = {"measured": None,
           "estimated": sum(r["activations"] + r["gradients"] for r in rows) / 2**20}
    model.fit(ds, steps_per_epoch=steps, epochs=1, verbose=0)
    try:
        before = tf.config.experimental.get_memory_info("CPU:0")["current"]
    except ValueError:  # "Allocator stats not available": oneDNN off, TensorFlow's default
        return {**out, "not_measured": NO_ALLOCATOR_STATS}  # on CPUs without AVX-512
    tf.config.experimental.reset_memory_stats("CPU:0")
    model.fit(ds, steps_per_epoch=steps, epochs=1, verbose=0)
    peak = tf.config.experimental.get_memory_info("CPU:0")["peak"]
    return {**out, "measured": (peak - before) / 2**20}


def _sizes() -> dict:
    """`SHAPE`, the epochs per repeat and the matmul probe's rows and seconds; `TOY`'s
    at toy size."""
    return _harness.toy_sized({**SHAPE, "epochs": _EPOCHS, "matmul_rows": MATMUL_ROWS,
                               "matmul_seconds": _MATMUL_SECONDS}, TOY)


def _config(microbatches: dict, inter_op: int, repeats: int, matmul_rows: bool = False,
            memory: bool = False) -> tuple[str, dict]:
    """The worker call measuring `microbatches` with `inter_op` threads."""
    sizes = _sizes()
    return "pipeline", dict(
        microbatches=microbatches, inter_op=inter_op,
        repeats=repeats, **{k: sizes[k] for k in SHAPE}, epochs=sizes["epochs"],
        matmul_rows=matmul_rows, rows=list(sizes["matmul_rows"]),
        matmul_seconds=sizes["matmul_seconds"], memory=memory)


def check() -> None:
    """The suite has no options: nothing to check."""


def run(repeats: int) -> dict:
    """Runs the suite; returns its JSON record."""
    checks.positive_int("repeats", repeats)
    shape = _sizes()
    # The serial step needs inter-op threads 1, so a process of its own; the
    # others share one, interleaved within each repeat.
    start = time.monotonic()
    overlapped = {"naive": 1, **{f"M={m}": m for m in MICROBATCHES}, REMAT: max(MICROBATCHES)}
    serial, rest = _harness.run_workers(  # one process at toy size
        [_config({"serial": 1}, inter_op=1, repeats=repeats, matmul_rows=True),
         _config(overlapped, inter_op=0, repeats=repeats, memory=True)], timeout=600)
    times = {**serial["step_seconds"], **rest["step_seconds"]}
    rates = serial["matmul_gflops_by_rows"]
    best_m = min(MICROBATCHES, key=lambda m: statistics.median(times[f"M={m}"]))
    best = times[f"M={best_m}"]
    speedups = [times["naive"][i] / best[i] for i in range(repeats)]
    efficiencies = [times["serial"][i] / _STAGES / best[i] for i in range(repeats)]
    bubbles = {m: [1 - s / _STAGES / t for s, t in zip(times["serial"], times[f"M={m}"])]
               for m in MICROBATCHES}
    remat_ratios = [r / t for r, t in zip(times[REMAT], times[f"M={max(MICROBATCHES)}"])]
    _harness.report("pipeline", start, [
        ", ".join(f"{n} {t[i] * 1000:.0f} ms" for n, t in times.items())
        + f"; speedup {speedups[i]:.2f}x, efficiency {efficiencies[i]:.2f}"
        for i in range(repeats)])
    print(f"pipeline: single-thread Dense({shape['width']}) forward by rows: "
          + ", ".join(f"{n} rows {r:.0f}" for n, r in rates.items()) + " GFLOP/s", flush=True)
    memory = rest["memory_mib"]
    summary = _harness.summary
    return {
        "description": f"2-stage pipeline, 2 virtual CPUs, intra-op threads 1, "
                       f"8 x Dense({shape['width']}), batch {shape['batch']}, SGD training "
                       f"step; per repeat the median of {shape['epochs']} epochs of "
                       f"{shape['steps']} steps" + (" (toy size)" if _harness.toy() else ""),
        "matmul_gflops_by_rows": rates,
        "step_seconds_per_repeat": times,
        "step_seconds": {n: summary(t) for n, t in times.items()},
        "pipeline_microbatches": best_m,
        "pipeline_speedup": summary(speedups),
        "pipeline_efficiency": summary(efficiencies),
        "bubble": {f"M={m}": {"measured": summary(bubbles[m]),
                              "gpipe_theory": (_STAGES - 1) / (m + _STAGES - 1)}
                   for m in MICROBATCHES},
        "remat_step_ratio": summary(remat_ratios),
        "memory_mib": memory,
        "goals": {"pipeline_speedup": 1.3, "pipeline_efficiency": 0.85},
        "ceiling": "2 logical CPUs share 2 cores: a 2-stage pipeline can at most halve the "
                   "serial step (efficiency 1.0); the naive split already overlaps some "
                   "work, so the speedup over it is bounded near 1.5x",
    }


def _mib(value: float | None) -> str:
    return "-" if value is None else f"{value:.0f}"


def summarize(r: dict) -> list[str]:
    """The suite's headline lines."""
    lines = [f"pipeline: M={r['pipeline_microbatches']}: speedup over naive "
             f"{_harness.fmt(r['pipeline_speedup'])}; efficiency "
             f"{_harness.fmt(r['pipeline_efficiency'], '')}; {r['ceiling']}"]
    if "memory_mib" in r:  # (records before 2026-12-06 have none)
        lines.append(f"pipeline: {REMAT}: step {_harness.fmt(r['remat_step_ratio'])} the "
                     f"step without remat")
        why = next((m["not_measured"] for m in r["memory_mib"].values()
                    if m.get("not_measured")), None)
        lines.append("pipeline: a step's memory beyond the weights, measured (estimated): "
                     + ", ".join(f"{n} {_mib(m['measured'])} ({m['estimated']:.0f}) MiB"
                                 for n, m in r["memory_mib"].items())
                     + (f"; not measured: {why}" if why else ""))
    return lines


def plot(r: dict, ax) -> None:
    """Median step time of each configuration, min-max as error bars."""
    _harness.plot_step_seconds(r["step_seconds"], ax,
                               f"Pipeline: {r['pipeline_speedup']['median']:.2f}x over naive, "
                               f"efficiency {r['pipeline_efficiency']['median']:.2f}")
