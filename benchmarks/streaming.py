"""streaming: input and compute overlapped by prefetch-to-device, a core each.

One device (OneDeviceStrategy, CPU:0), the MLP at batch 256, intra-op
threads 1 (the step uses one core) and 2 inter-op threads: the step runs on
one while the other serves the prefetch-to-device transfers (with 1 they
queue behind each other). The input pipeline runs in a private pool of 1
thread with a deterministic CPU-heavy per-batch map after the cache
(`costly_batch_map`), its cost calibrated to equal the step's: the hardest
case, where neither side hides behind a faster one.

Timed in one process, alternating 3 times per repeat (a repeat's ratios use
the medians):

* input alone and compute alone, each with every thread of the process on
  one core (`one_core`);
* together: `fit` with prefetch to the device, the step's threads on one core
  and the input's on the other (`DeviceCore`), as a device and its host;
* both at once uncoupled, split the same way (two threads, nothing passed
  between them): the floor any overlap can reach on this machine;
* `fit` with its threads left to the OS on both cores.

The device buffers 32 batches (`prefetch_per_replica`, 26 MB of MLP
inputs): input and step cost the same on average, so the buffer's fill is a
random walk, and each time it runs empty (the step waits) or full (the input
waits) time is lost that the other side, having no slack, never makes up; a
buffer that outlasts the machine's stalls (tens of milliseconds, several
steps) rarely hits either end, where a buffer of 2 or 8 often does.

Figures: streaming_ratio = together / max(input alone, compute alone) (goal
<= 1.10; ceiling 1.0); streaming_ratio_os_scheduled, the same with the
threads left to the OS; together_over_sum (about 0.5 when fully overlapped);
corun_floor; hardware_floor = 2 / `hardware_ceiling`.
"""

from __future__ import annotations

import statistics
import threading

from benchmarks import _harness, cpus
from tfmulti.config.train_config import TrainConfig

__all__ = ["SETTINGS", "TOY", "check", "plot", "run", "summarize", "worker"]

SETTINGS = {"global_batch_size": 256, "steps_per_execution": 16, "num_examples": 16384,
            "cycles": 3, "seconds": 0.5, "inter_op": 2, "prefetch_per_replica": 32}
"""The worker's settings, also recorded in the suite's JSON."""
TOY = {"global_batch_size": 32, "steps_per_execution": 1, "num_examples": 256, "cycles": 1,
       "seconds": 0.02, "prefetch_per_replica": 2}
"""`SETTINGS` at toy size (`_harness.toy`: the end-to-end test)."""
_PROBE_ROUNDS = 4


def worker(repeats: int, global_batch_size: int, steps_per_execution: int,
           num_examples: int, cycles: int, seconds: float, inter_op: int,
           rounds: int | None = None, prefetch_per_replica: int = 2) -> dict:
    """Input alone and compute alone on 1 core each; fit together on both.

    Each side alone is timed for about `seconds`; together is a `fit` epoch
    of about `seconds` after a warm-up epoch. `rounds` fixes the map's cost
    (default: calibrated to the step's).

    Returns:
        The map's rounds, each repeat's seconds per step of every timing, and
        its ratios.
    """
    import tensorflow as tf

    _harness.set_threads(intra_op=1, inter_op=inter_op)
    from tfmulti import data
    from tfmulti.training import run as runs
    from benchmarks.fixtures import costly_batch_map
    from tfmulti.insight import timing

    k = steps_per_execution
    tf.zeros([1]).numpy()  # the runtime and its thread pools start
    device = cpus.DeviceCore()  # before any input pipeline starts a thread

    def options(rounds: int) -> dict:
        return {"input_threads": 1, "batch_map_fn": costly_batch_map(rounds),
                "prefetch_per_replica": prefetch_per_replica}

    config = TrainConfig(distribution="one_device", dataset="synthetic", model="mlp",
                         num_examples=num_examples, global_batch_size=global_batch_size,
                         steps_per_execution=k, seed=0)
    run = runs.build_run(config, input_options=options(_PROBE_ROUNDS))
    model, strategy, probe = run.model, run.strategy, run.train_input
    timing.time_fit(model, probe, 2 * k, epochs=2)  # builds and traces
    with cpus.one_core():
        compute_s, = timing.time_compute(model, strategy, probe, k, 2 * seconds)
        probe_s = timing.time_input(probe, k, 2 * seconds)
    if rounds is None:  # calibrated: the map costs what the step costs
        rounds = max(1, round(compute_s / (probe_s / _PROBE_ROUNDS)))
    dist = data.distribute(run.train_data, strategy, global_batch_size, seed=config.seed,
                           **options(rounds))
    steps = timing.steps_for(seconds, compute_s * 1.2, k)
    out = {"rounds": rounds, "input_seconds_per_step": [], "compute_seconds_per_step": [],
           "fit_seconds_per_step": [], "fit_os_seconds_per_step": [], "ratios": [],
           "os_ratios": [], "sum_ratios": [], "corun_floors": []}

    def corun() -> float:
        # Input and compute at once, uncoupled (each in its own Python thread,
        # no data passed between them): how much slower the slower of the two
        # runs when the other occupies the other core. Streaming couples them,
        # so it cannot do better than this.
        got = {}

        def compute():
            with device.step_thread():
                got["c"] = timing.time_compute(model, strategy, dist, k, seconds)[0]

        threads = [threading.Thread(target=compute), threading.Thread(
            target=lambda: got.update(i=timing.time_input(dist, k, seconds)))]
        for t in threads:
            t.start()
        for t in threads:
            t.join()
        return max(got["c"], got["i"])

    for _ in range(repeats):
        # Each timing on a fresh iterator (fit's own, or a new one): a pipeline
        # left running while something else is timed would fill its buffers
        # in the pause and serve them for free.
        fs, os_fs, ins, cs, both = [], [], [], [], []
        for _ in range(cycles):
            with cpus.one_core():
                cs.append(timing.time_compute(model, strategy, dist, k, seconds)[0])
            with device:
                fs.append(timing.time_fit(model, dist, steps, epochs=2)[0])
            with cpus.one_core():
                ins.append(timing.time_input(dist, k, seconds))
            with device:
                both.append(corun())
            os_fs.append(timing.time_fit(model, dist, steps, epochs=2)[0])
        f, f_os, i, c, b = (statistics.median(v) for v in (fs, os_fs, ins, cs, both))
        out["input_seconds_per_step"].append(i)
        out["compute_seconds_per_step"].append(c)
        out["fit_seconds_per_step"].append(f)
        out["fit_os_seconds_per_step"].append(f_os)
        out["ratios"].append(f / max(i, c))
        out["os_ratios"].append(f_os / max(i, c))
        out["sum_ratios"].append(f / (i + c))
        out["corun_floors"].append(b / max(i, c))
    return out


def check() -> None:
    """The suite has no options: nothing to check."""


def run(repeats: int) -> dict:
    """Runs the suite; returns its JSON record."""
    settings, start, r = _harness.run_sized_worker("streaming", repeats, SETTINGS, TOY)
    # 2 busy single-threaded processes on the 2 cores vs 1: each runs at
    # ceiling / 2 of its speed alone, so together / max >= 2 / ceiling. Measured
    # twice (once at toy size, where the figure means nothing).
    floors = [2 / cpus.hardware_ceiling(_harness.ceiling_seconds(2.0))
              for _ in range(1 if _harness.toy() else 2)]
    _harness.report("streaming", start, [
        f"input {r['input_seconds_per_step'][i] * 1e3:.2f} ms, compute "
        f"{r['compute_seconds_per_step'][i] * 1e3:.2f} ms, together "
        f"{r['fit_seconds_per_step'][i] * 1e3:.2f} ms per step: {r['ratios'][i]:.3f} x max, "
        f"{r['sum_ratios'][i]:.3f} x sum; both uncoupled at once: {r['corun_floors'][i]:.3f} x "
        f"max; threads left to the OS: together {r['os_ratios'][i]:.3f} x max"
        for i in range(repeats)])
    summary = _harness.summary
    return {
        "description": "MLP, batch 256, one device (intra-op threads 1: the step on 1 core; "
                       f"inter-op threads {settings['inter_op']}); "
                       "input: cached synthetic data + a deterministic CPU-heavy per-batch map "
                       f"({r['rounds']} rounds, calibrated to the step's cost) in a private "
                       "1-thread pool; input alone and compute alone timed with the process "
                       "confined to 1 core; together: the step's threads on one core, the "
                       "input's on the other (streaming_ratio; _os_scheduled: threads left "
                       "to the OS), fit with prefetch to the device "
                       f"({settings['prefetch_per_replica']} batches buffered), "
                       f"steps_per_execution {settings['steps_per_execution']}, on the 2 cores",
        **settings, "toy": _harness.toy(), "map_rounds": r["rounds"],
        "input_seconds_per_step": r["input_seconds_per_step"],
        "compute_seconds_per_step": r["compute_seconds_per_step"],
        "fit_seconds_per_step": r["fit_seconds_per_step"],
        "fit_os_scheduled_seconds_per_step": r["fit_os_seconds_per_step"],
        "streaming_ratio": summary(r["ratios"]),
        "streaming_ratio_os_scheduled": summary(r["os_ratios"]),
        "together_over_sum": summary(r["sum_ratios"]),
        "hardware_floor": summary(floors),
        "corun_floor": summary(r["corun_floors"]),
        "streaming_over_corun_floor": summary(
            [a / b for a, b in zip(r["ratios"], r["corun_floors"])]),
        "goal": 1.10,
        "ceiling": "input and compute each on one of the 2 cores, fully overlapped: 1.0 on "
                   "ideal hardware; here two busy threads slow each other, so the best "
                   "possible ratio is hardware_floor = 2 / (2 processes vs 1 throughput, "
                   "measured in the same run); without any overlap together = input + "
                   "compute, about 2.0 x max. corun_floor: the slower of input and compute "
                   "while both run at once uncoupled (two threads, nothing passed between "
                   "them), over max(alone): what this machine allows any overlap",
    }


def summarize(r: dict) -> list[str]:
    """The suite's headline lines."""
    fmt = _harness.fmt
    return [f"streaming: streaming_ratio {fmt(r['streaming_ratio'], 'x', 3)} (goal <= "
            f"{r['goal']}); together / (input + compute) "
            f"{fmt(r['together_over_sum'], 'x', 3)}; floor (both at once, uncoupled) "
            f"{fmt(r['corun_floor'], 'x', 3)}; threads left to the OS "
            f"{fmt(r['streaming_ratio_os_scheduled'], 'x', 3)}"]


def plot(r: dict, ax) -> None:
    """Median seconds per step of input alone, compute alone and together."""
    parts = {"input alone": r["input_seconds_per_step"],
             "compute alone": r["compute_seconds_per_step"],
             "together (fit)": r["fit_seconds_per_step"]}
    ax.bar(list(parts), [statistics.median(v) * 1e3 for v in parts.values()])
    ax.set_ylabel("ms per step (median)")
    s = r["streaming_ratio"]
    ax.set_title(f"Streaming: together / max = {s['median']:.3f} "
                 f"[{s['min']:.3f}-{s['max']:.3f}]", fontsize=9)
