"""tensor: the transformer's training step split over 2 virtual CPUs, by
tensor parallelism and by a pipeline.

The model is `tfmulti.models.transformer.build_transformer` (byte-level, `SHAPE`:
d_model 256, 4 heads, 4 blocks, sequences of 128 bytes), Adam on next-byte
cross-entropy, random bytes. Two measurements, each in a fresh process with
2 virtual CPU devices:

* tensor parallelism (`tensor_overhead`): the same step unsplit (every op
  on CPU:0, TensorFlow's default threading: its intra-op pool already uses
  both cores) and split T=2 over CPU:0 and CPU:1
  (`tfmulti.parallel.tensor_split.split_transformer`, the same weights),
  interleaved within each repeat. The virtual devices share the cores the
  unsplit step already uses, so the split cannot be faster here; the figure
  is what it costs: split / unsplit step time (goal <= 1.15).
* pipeline (`pipeline_speedup`): the transformer cut into 2 stages of 2
  blocks (`PipelineModel`, intra-op threads 1 so that each stage has a core
  of its own): the naive split (M=1, one stage works at a time) against
  GPipe with 2 and 4 micro-batches; naive / best pipelined step time (goal
  >= 1.25x), the best M chosen once by median step time.

Every configuration is built and warmed up (one epoch) first; a repeat's
figure is the median of 3 epochs of `steps` steps, in seconds per step.
"""

from __future__ import annotations

import statistics
import time

from tfmulti.utils import checks
from benchmarks import _harness

__all__ = ["MICROBATCHES", "SHAPE", "TOY", "check", "pipeline_worker", "plot", "run", "summarize",
           "tensor_worker"]

SHAPE = {"seq_len": 128, "d_model": 256, "num_heads": 4, "num_layers": 4, "batch": 32,
         "steps": 3}
"""The transformer's sizes, the batch and the steps per timed epoch."""
MICROBATCHES = (2, 4)
"""The pipelined configurations' micro-batch counts (GPipe, 2 stages)."""
_DEVICES = 2
_EPOCHS = 3
TOY = {"seq_len": 16, "d_model": 16, "num_heads": 2, "num_layers": 2, "batch": 8, "steps": 1,
       "epochs": 1}
"""`SHAPE` (and the epochs per repeat, 3) at toy size (`_harness.toy`: the end-to-end
test), where both workers share one process (`_harness.run_workers`) and so its default
threading; sizes given to `run` still override it."""


def _setup(intra_op: int | None, seq_len: int, batch: int):
    """Threads and 2 virtual CPUs (before TensorFlow starts); a dataset of
    random bytes repeating one batch."""
    import tensorflow as tf

    _harness.set_threads(intra_op=intra_op)
    import numpy as np

    import tfmulti

    tfmulti.configure_virtual_devices(_DEVICES)
    text = np.random.default_rng(0).integers(0, 256, (batch, seq_len + 1)).astype("int32")
    return tf.data.Dataset.from_tensors((text[:, :-1], text[:, 1:])).repeat()


def _transformer(seq_len, d_model, num_heads, num_layers):
    from tfmulti.models import transformer

    return transformer.build_transformer(seq_len=seq_len, d_model=d_model,
                                         num_heads=num_heads, num_layers=num_layers, seed=0)


def _compile(model):
    import keras

    from tfmulti.models import optimizers

    model.compile(optimizer=keras.optimizers.Adam(1e-4),
                  loss=keras.losses.SparseCategoricalCrossentropy(from_logits=True))
    optimizers.build_on_variable_devices(model.optimizer, model.trainable_variables)
    return model


def tensor_worker(repeats: int, seq_len: int, d_model: int, num_heads: int, num_layers: int,
                  batch: int, steps: int, epochs: int = _EPOCHS) -> dict:
    """Step times of the transformer unsplit and split T=2, interleaved, in
    this process (TensorFlow's default threading).

    Returns:
        {"step_seconds": {"unsplit": [...], "T=2": [...]}}, one figure per repeat.
    """
    ds = _setup(None, seq_len, batch)
    from benchmarks.fixtures import interleaved_step_seconds
    from tfmulti.parallel.tensor_split import split_transformer

    plain = _transformer(seq_len, d_model, num_heads, num_layers)
    split = split_transformer(plain, [f"CPU:{i}" for i in range(_DEVICES)])
    models = {"unsplit": _compile(plain), f"T={_DEVICES}": _compile(split)}
    return {"step_seconds": interleaved_step_seconds(models, ds, steps, repeats, epochs)}


def pipeline_worker(repeats: int, microbatches: dict, seq_len: int, d_model: int,
                    num_heads: int, num_layers: int, batch: int, steps: int,
                    epochs: int = _EPOCHS) -> dict:
    """Step times of the transformer as a 2-stage pipeline (half the blocks
    per stage) for each micro-batch count, interleaved, intra-op threads 1.

    Args:
        microbatches: configuration name -> micro-batches (1: the naive split).

    Returns:
        {"step_seconds": name -> seconds per step, one per repeat}.
    """
    ds = _setup(1, seq_len, batch)
    from benchmarks.fixtures import interleaved_step_seconds
    from tfmulti.parallel import PipelineModel

    models = {}
    for name, m in microbatches.items():
        model = PipelineModel(_transformer(seq_len, d_model, num_heads, num_layers),
                              devices=[f"CPU:{i}" for i in range(_DEVICES)],
                              num_microbatches=m)
        models[name] = _compile(model)
    return {"step_seconds": interleaved_step_seconds(models, ds, steps, repeats, epochs)}


def check(**shape) -> None:
    """Checks the suite's options: sizes overriding `SHAPE` (for a quick run
    at a toy size), each a positive integer of `SHAPE`'s keys.

    Raises:
        ValueError: an unknown key or a value that is not a positive integer.
    """
    for key, value in shape.items():
        checks.one_of("option", key, SHAPE, hint="the tensor suite takes sizes of SHAPE")
        checks.positive_int(key, value)


def run(repeats: int, **shape) -> dict:
    """Runs the suite; returns its JSON record.

    Args:
        repeats: repeats of each measurement.
        **shape: sizes overriding `SHAPE` (see `check`).
    """
    checks.positive_int("repeats", repeats)
    check(**shape)
    shape = {**_harness.toy_sized(SHAPE, TOY), **shape}
    epochs = shape.pop("epochs", _EPOCHS)
    start = time.monotonic()
    pipelined = {"naive": 1, **{f"M={m}": m for m in MICROBATCHES}}
    tensor, pipeline = _harness.run_workers(  # one process at toy size
        [("tensor", dict(repeats=repeats, epochs=epochs, **shape)),
         ("tensor_pipeline", dict(repeats=repeats, microbatches=pipelined, epochs=epochs,
                                  **shape))], timeout=900)
    times = {**tensor["step_seconds"], **pipeline["step_seconds"]}
    overheads = [s / u for s, u in zip(times[f"T={_DEVICES}"], times["unsplit"])]
    best_m = min(MICROBATCHES, key=lambda m: statistics.median(times[f"M={m}"]))
    speedups = [n / b for n, b in zip(times["naive"], times[f"M={best_m}"])]
    _harness.report("tensor", start, [
        ", ".join(f"{n} {t[i] * 1000:.0f} ms" for n, t in times.items())
        + f"; tensor overhead {overheads[i]:.3f}, pipeline speedup {speedups[i]:.2f}x"
        for i in range(repeats)])
    summary = _harness.summary
    return {
        "description": f"byte-level transformer (d_model {shape['d_model']}, "
                       f"{shape['num_heads']} heads, {shape['num_layers']} blocks, sequences "
                       f"of {shape['seq_len']}), batch {shape['batch']}, Adam training step "
                       f"on 2 virtual CPUs: unsplit vs tensor-parallel T=2 (default "
                       f"threading); a 2-stage pipeline naive vs GPipe (intra-op threads 1); "
                       f"per repeat the median of {epochs} epochs of {shape['steps']} steps"
                       + (" (toy size)" if _harness.toy() else ""),
        "shape": shape,
        "step_seconds_per_repeat": times,
        "step_seconds": {n: summary(t) for n, t in times.items()},
        "tensor_overhead": summary(overheads),
        "pipeline_microbatches": best_m,
        "pipeline_speedup": summary(speedups),
        "goals": {"tensor_overhead": 1.15, "pipeline_speedup": 1.25},
        "ceiling": "2 logical CPUs share 2 cores: tensor parallelism cannot speed up a step "
                   "whose unsplit form already uses both cores (its floor is 1.0, the split's "
                   "cost is the figure); a 2-stage pipeline can at most halve the serial step",
    }


def summarize(r: dict) -> list[str]:
    """The suite's headline lines."""
    return [f"tensor: T=2 step / unsplit step {_harness.fmt(r['tensor_overhead'], '', 3)} "
            f"(goal <= {r['goals']['tensor_overhead']})",
            f"tensor: transformer pipeline M={r['pipeline_microbatches']} speedup over naive "
            f"{_harness.fmt(r['pipeline_speedup'])} (goal >= {r['goals']['pipeline_speedup']}); "
            f"{r['ceiling']}"]


def plot(r: dict, ax) -> None:
    """Median step time of each configuration, min-max as error bars."""
    _harness.plot_step_seconds(r["step_seconds"], ax,
                               f"Transformer: T=2 x{r['tensor_overhead']['median']:.2f}, "
                               f"pipeline {r['pipeline_speedup']['median']:.2f}x")
