"""overhead: tfmulti's `fit` vs a hand-written tf.distribute loop doing the same work.

Both sides train the MLP from the same initial weights with the fused Adam
(1e-3) at batch 256 on the same Fashion-MNIST pipeline (each with its own
iterator), under MirroredStrategy over 2 virtual CPUs, 26 steps per
`tf.function` call, in one process. `fit` runs as `tfmulti.training.train` runs it
(`build_run` of the configuration, verbose 0); the loop is `CustomLoop`
(`strategy.run` in a `tf.range` loop, the reference of TensorFlow's custom
training tutorial).

The two alternate in blocks of 4 calls: `fit` trains one epoch per block,
and the loop's block runs between fit's epochs, outside fit's timed spans
(`InterleavedClock`), so a machine's drift hits both alike. Two warm-up
blocks on each side (tracing, then allocation and tf.data autotuning
settle), then 3 pairs per repeat. overhead_ratio: a repeat's total fit time
over its total loop time (goal <= 1.05).
"""

from __future__ import annotations

import statistics
import time

from tfmulti.utils import checks
from benchmarks import _harness
from tfmulti.config.train_config import DEFAULT_LEARNING_RATE, TrainConfig

__all__ = ["SETTINGS", "TOY", "check", "plot", "run", "summarize", "worker"]

SETTINGS = {"global_batch_size": 256, "steps_per_execution": 26, "calls_per_block": 4,
            "pairs_per_repeat": 3}
"""The worker's settings, also recorded in the suite's JSON."""
TOY = {"global_batch_size": 32, "steps_per_execution": 1, "calls_per_block": 1,
       "pairs_per_repeat": 1, "num_examples": 256}
"""`SETTINGS` at toy size (`_harness.toy`: the end-to-end test), reading only the
first `num_examples` training examples."""
_WARMUP_BLOCKS = 2


def worker(repeats: int, global_batch_size: int, steps_per_execution: int,
           calls_per_block: int, pairs_per_repeat: int,
           num_examples: int | None = None) -> dict:
    """Interleaved blocks of `fit` and `CustomLoop`, same work, one process, on
    Fashion-MNIST (its first `num_examples` training examples; default: all).

    Returns:
        fit and loop seconds per step of each timed block, and each repeat's
        ratio (its `pairs_per_repeat` fit blocks over its loop blocks).
    """
    import tfmulti

    tfmulti.configure_virtual_devices(2)
    from tfmulti.models import optimizers
    from tfmulti.training import run as runs
    from benchmarks.fixtures import CustomLoop, InterleavedClock
    from tfmulti.insight import timing

    k = steps_per_execution
    steps = k * calls_per_block
    config = TrainConfig(distribution="mirrored", dataset="fashion_mnist", model="mlp",
                         global_batch_size=global_batch_size, steps_per_execution=k, seed=0)
    if num_examples is not None:
        config = config.replace(dataset=_harness.first_examples(config.dataset, num_examples))
    run = runs.build_run(config)
    reference = runs.build_run(config, reuse=run).model  # the same initial weights
    with run.strategy.scope():  # the optimizer compile_model gives fit: same work
        optimizer = optimizers.fused_adam(DEFAULT_LEARNING_RATE)
    loop = CustomLoop(reference, run.strategy, optimizer, global_batch_size, k)
    iterator = iter(run.train_input.dataset)
    loop.train(iterator, calls_per_block)  # traces, fills the pipeline
    loop_seconds = []

    def loop_block():
        start = time.perf_counter()
        loop.train(iterator, calls_per_block)
        loop_seconds.append((time.perf_counter() - start) / steps)

    n = pairs_per_repeat
    fit_seconds = timing.time_fit(run.model, run.train_input, steps,
                                  epochs=_WARMUP_BLOCKS + n * repeats,
                                  clock=InterleavedClock(loop_block))[_WARMUP_BLOCKS - 1:]
    loop_seconds = loop_seconds[_WARMUP_BLOCKS:]
    ratios = [sum(fit_seconds[n * r:n * (r + 1)]) / sum(loop_seconds[n * r:n * (r + 1)])
              for r in range(repeats)]
    return {"fit_seconds_per_step": fit_seconds, "loop_seconds_per_step": loop_seconds,
            "ratios": ratios}


def check() -> None:
    """The suite has no options: nothing to check."""


def run(repeats: int) -> dict:
    """Runs the suite; returns its JSON record."""
    checks.positive_int("repeats", repeats)
    settings = _harness.toy_sized(SETTINGS, TOY)
    start = time.monotonic()
    r = _harness.run_worker("overhead", repeats=repeats, **settings)
    fit, loop = r["fit_seconds_per_step"], r["loop_seconds_per_step"]
    n = settings["pairs_per_repeat"]
    parts = [slice(n * i, n * (i + 1)) for i in range(repeats)]
    _harness.report("overhead", start, [
        f"fit {statistics.mean(fit[part]) * 1e3:.2f} ms/step, custom loop "
        f"{statistics.mean(loop[part]) * 1e3:.2f} ms/step, ratio {ratio:.3f}"
        for part, ratio in zip(parts, r["ratios"])])
    return {
        "description": "tfmulti fit (build_run, steps_per_execution K) vs a hand-written "
                       "tf.distribute loop (benchmarks.fixtures.CustomLoop: strategy.run "
                       "in a tf.range loop, K steps per tf.function call), same MLP, initial "
                       "weights, Adam, Fashion-MNIST pipeline; MirroredStrategy over 2 "
                       "virtual CPUs; interleaved blocks in one process",
        **settings, "toy": _harness.toy(),
        "fit_seconds_per_step": fit, "loop_seconds_per_step": loop,
        "overhead_ratio": _harness.summary(r["ratios"]),
        "goal": 1.05,
    }


def summarize(r: dict) -> list[str]:
    """The suite's headline lines."""
    return [f"overhead: overhead_ratio {_harness.fmt(r['overhead_ratio'], 'x', 3)} (goal <= "
            f"{r['goal']})"]


def plot(r: dict, ax) -> None:
    """Seconds per step of each interleaved block, fit and the loop."""
    ax.plot([x * 1e3 for x in r["fit_seconds_per_step"]], "o-", label="tfmulti fit")
    ax.plot([x * 1e3 for x in r["loop_seconds_per_step"]], "s-", label="custom loop")
    ax.set_xlabel("block (interleaved)")
    ax.set_ylabel("ms per step")
    s = r["overhead_ratio"]
    ax.set_title(f"Overhead: fit / loop {s['median']:.3f} "
                 f"[{s['min']:.3f}-{s['max']:.3f}]", fontsize=9)
    ax.legend(fontsize=8)
