"""The scaling suite's virtual-device part: MirroredStrategy over 1, 2 and 4 virtual CPUs.

One process with 4 virtual CPU devices; `fit` (tfmulti's `build_run`: the
MLP on synthetic data, global batch 256, steps_per_execution 16) under
MirroredStrategy over the first 1, 2 and 4 of them, the same global batch
for each, interleaved within each repeat (one epoch of about a second per
count). Keys virtual_devices_2_vs_1 and virtual_devices_4_vs_1: examples/s
over that of 1 device. The ceiling is 1.0: the virtual devices share the
same cores (1 device already uses all of them through intra-op threads), so
more replicas add work (all-reduce, smaller matmuls), never compute.
"""

from __future__ import annotations

import time

from tfmulti.utils import checks
from benchmarks import _harness
from tfmulti.config.train_config import TrainConfig

__all__ = ["SETTINGS", "TOY", "reductions", "run", "worker"]

SETTINGS = {"global_batch_size": 256, "steps_per_execution": 16, "num_examples": 16384,
            "seconds": 1.0, "device_counts": [1, 2, 4]}
"""The worker's settings, also recorded in the scaling suite's JSON."""
TOY = {"global_batch_size": 32, "steps_per_execution": 1, "num_examples": 256,
       "seconds": 0.02}
"""`SETTINGS` at toy size (`_harness.toy`: the end-to-end test)."""


def worker(repeats: int, global_batch_size: int, steps_per_execution: int,
           num_examples: int, seconds: float, device_counts: list) -> dict:
    """examples/s of fit under MirroredStrategy over each count of virtual
    CPUs, same global batch, interleaved in each repeat, one process.

    Returns:
        {"examples_per_second": str(count) -> one figure per repeat}.
    """
    import tfmulti

    tfmulti.configure_virtual_devices(max(device_counts))
    from tfmulti.training import run as runs
    from tfmulti.insight import timing

    config = TrainConfig(distribution="mirrored", dataset="synthetic", model="mlp",
                         num_examples=num_examples, global_batch_size=global_batch_size,
                         steps_per_execution=steps_per_execution, seed=0)
    setups = {}
    for n in device_counts:
        run = runs.build_run(config.replace(devices=tuple(f"CPU:{i}" for i in range(n))))
        estimate = timing.time_fit(run.model, run.train_input, 2 * steps_per_execution,
                                   epochs=2)[0]
        setups[n] = (run, timing.steps_for(seconds, estimate, steps_per_execution))
    rates = {n: [] for n in device_counts}
    for _ in range(repeats):
        for n, (run, steps) in setups.items():
            seconds_per_step = timing.time_fit(run.model, run.train_input, steps, epochs=2)[0]
            rates[n].append(global_batch_size / seconds_per_step)
    return {"examples_per_second": {str(n): r for n, r in rates.items()}}


def run(repeats: int) -> dict:
    """Runs the virtual-device measurement; returns its JSON record (the
    scaling suite's "virtual_devices")."""
    checks.positive_int("repeats", repeats)
    settings = _harness.toy_sized(SETTINGS, TOY)
    start = time.monotonic()
    r = _harness.run_worker("devices", repeats=repeats, **settings)["examples_per_second"]
    one = r["1"]
    ratios = {n: [a / b for a, b in zip(r[n], one)] for n in r if n != "1"}
    _harness.report("scaling (virtual devices)", start, [
        ", ".join(f"{n} device(s) {r[n][i]:,.0f} ex/s" for n in r) for i in range(repeats)])
    return {
        "description": "MirroredStrategy over 1, 2 and 4 of 4 virtual CPUs (tfmulti fit, MLP, "
                       "synthetic data, global batch 256, steps_per_execution 16), interleaved "
                       "in one process",
        **settings,
        "examples_per_second": r,
        **{f"virtual_devices_{n}_vs_1": _harness.summary(v) for n, v in ratios.items()},
        "ceiling": "1.0: virtual CPU devices share the same 2 cores (1 device already uses "
                   "both through intra-op threads); more replicas add work (all-reduce, "
                   "smaller matmuls), never compute",
    }


def reductions(model: str = "mlp", repeats: int = 3) -> dict:
    """Mirrored x 2 (2 virtual CPUs) with the gradients reduced by TensorFlow's
    collectives (`cross_device_ops="auto"`: ring all-reduce on CPUs) and
    through one device ("reduce_to_one"): `model` on synthetic data, global
    batch 256, 1 step per call; examples/s, the medians of `repeats` epochs of
    16 steps each, alternating, in this process (make it a fresh one). Run
    from the repository's root: `PYTHONPATH=. python -c "from benchmarks
    import devices; print(devices.reductions('mlp'))"`."""
    import statistics

    import tfmulti
    from tfmulti.insight import timing
    from tfmulti.training import run as runs

    tfmulti.configure_virtual_devices(2)
    built = {}
    for ops in ("auto", "reduce_to_one"):
        config = TrainConfig(model=model, dataset="synthetic", num_examples=8192,
                             global_batch_size=256, steps_per_execution=1,
                             cross_device_ops=ops, seed=0, distribution="mirrored",
                             devices=("CPU:0", "CPU:1"))
        run = runs.build_run(config)
        timing.time_fit(run.model, run.train_input, 1, epochs=2)  # builds and traces
        built[ops] = run
    seconds: dict = {ops: [] for ops in built}
    for _ in range(repeats):
        for ops, run in built.items():
            seconds[ops] += timing.time_fit(run.model, run.train_input, 16, epochs=2)
    rates = {ops: round(256 / statistics.median(s)) for ops, s in seconds.items()}
    return {"model": model, "examples_per_second": rates,
            "reduce_to_one_over_auto": round(rates["reduce_to_one"] / rates["auto"], 2)}
