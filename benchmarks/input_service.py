"""input_service: an input-bound job, its input in the trainer against the
same input from a tf.data service worker on the other core.

One device (OneDeviceStrategy), the MLP at batch 256, every thread of the
trainer's process on the first core (intra-op threads 1). The input:
cached synthetic data and a deterministic CPU-heavy per-batch map after the
cache (`costly_batch_map`), its cost calibrated to `MAP_OVER_STEP` (1.2)
times the step's, as augmentation that outweighs the model.

Timed in one process, alternating `cycles` times per repeat (a repeat's
figures use the medians):

* map alone (the input pipeline, nothing training) and step alone (on a
  batch already on the device), on the trainer's core;
* in-process: `fit` with the input in the trainer, on its one core;
* service: `fit` reading the same batches from a tf.data service worker
  (`tfmulti.data.service.LocalService`) pinned to the second core.

Figures: speedup = in-process / service seconds per step (goal >= 1.5);
ceiling = (map + step) / max(map, step), what moving the map off the core can
give at most; of_ceiling = speedup / ceiling (goal >= 0.8).
"""

from __future__ import annotations

import os
import statistics

from benchmarks import _harness, cpus
from tfmulti.config.train_config import TrainConfig

__all__ = ["MAP_OVER_STEP", "SETTINGS", "TOY", "check", "plot", "run", "summarize", "worker"]

MAP_OVER_STEP = 1.2
"""The map's cost over the step's (calibrated in each run)."""
SETTINGS = {"global_batch_size": 256, "steps_per_execution": 8, "num_examples": 8192,
            "cycles": 3, "seconds": 1.0}
"""The worker's settings, also recorded in the suite's JSON."""
TOY = {"global_batch_size": 32, "steps_per_execution": 1, "num_examples": 256, "cycles": 1,
       "seconds": 0.05}
"""`SETTINGS` at toy size (`_harness.toy`: the end-to-end test)."""
_PROBE_ROUNDS = 4


def worker(repeats: int, global_batch_size: int, steps_per_execution: int,
           num_examples: int, cycles: int, seconds: float, rounds: int | None = None) -> dict:
    """The timings of one run (see the module doc); `rounds` fixes the map's
    cost (default: calibrated to `MAP_OVER_STEP` times the step's).

    Raises:
        ValueError: this process may use fewer than 2 cores.
    """
    every = sorted(os.sched_getaffinity(0))
    if len(every) < 2:
        raise ValueError(f"the input_service suite needs 2 cores, one for the trainer and one "
                         f"for the service worker; this process may use {len(every)}.")
    trainer, server = {every[0]}, {every[1]}
    # Every thread of this process on the trainer's core (threads started later
    # inherit it); given back at the end (the toy-size worker runs other suites).
    cpus._pin(cpus._threads(), trainer)  # pylint: disable=protected-access
    try:
        return _timings(repeats, global_batch_size, steps_per_execution, num_examples,
                        cycles, seconds, rounds, server)
    finally:
        cpus._pin(cpus._threads(), set(every))  # pylint: disable=protected-access


def _timings(repeats, global_batch_size, k, num_examples, cycles, seconds, rounds,
             server) -> dict:
    _harness.set_threads(intra_op=1, inter_op=2)
    from benchmarks.fixtures import costly_batch_map
    from tfmulti import data
    from tfmulti.data.service import LocalService
    from tfmulti.insight import timing
    from tfmulti.training import run as runs

    def options(rounds: int) -> dict:
        return {"batch_map_fn": costly_batch_map(rounds), "prefetch_per_replica": 8}

    config = TrainConfig(distribution="one_device", dataset="synthetic", model="mlp",
                         num_examples=num_examples, global_batch_size=global_batch_size,
                         steps_per_execution=k, seed=0)
    run = runs.build_run(config, input_options={**options(_PROBE_ROUNDS), "data_service": None})
    model, strategy, probe = run.model, run.strategy, run.train_input
    timing.time_fit(model, probe, 2 * k, epochs=2)  # builds and traces
    step_s, = timing.time_compute(model, strategy, probe, k, 2 * seconds)
    probe_s = timing.time_input(probe, k, 2 * seconds)
    if rounds is None:
        rounds = max(1, round(MAP_OVER_STEP * step_s / (probe_s / _PROBE_ROUNDS)))
    here = data.distribute(run.train_data, strategy, global_batch_size, seed=config.seed,
                           **options(rounds))
    steps = timing.steps_for(seconds, step_s * (2 + MAP_OVER_STEP), k)
    out = {"rounds": rounds, "map_seconds_per_step": [], "step_seconds_per_step": [],
           "in_process_seconds_per_step": [], "service_seconds_per_step": [],
           "speedups": [], "ceilings": [], "of_ceiling": []}
    with LocalService(1, cpus=server) as service:
        served = data.distribute(run.train_data, strategy, global_batch_size, seed=config.seed,
                                 data_service=service.target, **options(rounds))
        for _ in range(repeats):
            maps, stepped, in_process, through = [], [], [], []
            for _ in range(cycles):
                maps.append(timing.time_input(here, k, seconds))
                stepped.append(timing.time_compute(model, strategy, here, k, seconds)[0])
                in_process.append(statistics.median(timing.time_fit(model, here, steps, 3)))
                through.append(statistics.median(timing.time_fit(model, served, steps, 3)))
            m, s, a, b = (statistics.median(v) for v in (maps, stepped, in_process, through))
            out["map_seconds_per_step"].append(m)
            out["step_seconds_per_step"].append(s)
            out["in_process_seconds_per_step"].append(a)
            out["service_seconds_per_step"].append(b)
            out["speedups"].append(a / b)
            out["ceilings"].append((m + s) / max(m, s))
            out["of_ceiling"].append(a / b / ((m + s) / max(m, s)))
    return out


def check() -> None:
    """The suite has no options: nothing to check."""


def run(repeats: int) -> dict:
    """Runs the suite; returns its JSON record."""
    settings, start, r = _harness.run_sized_worker("input_service", repeats, SETTINGS, TOY)
    _harness.report("input_service", start, [
        f"map {r['map_seconds_per_step'][i] * 1e3:.2f} ms, step "
        f"{r['step_seconds_per_step'][i] * 1e3:.2f} ms; in-process "
        f"{r['in_process_seconds_per_step'][i] * 1e3:.2f} ms, service "
        f"{r['service_seconds_per_step'][i] * 1e3:.2f} ms per step: {r['speedups'][i]:.2f}x, "
        f"ceiling {r['ceilings'][i]:.2f}x, {100 * r['of_ceiling'][i]:.0f}% of it"
        for i in range(repeats)])
    summary = _harness.summary
    return {
        "description": "MLP, batch 256, one device; the trainer's process on one core "
                       "(intra-op threads 1); input: cached synthetic data + a deterministic "
                       f"CPU-heavy per-batch map ({r['rounds']} rounds, calibrated to "
                       f"{MAP_OVER_STEP}x the step's cost); in-process: fit with that input on "
                       "the trainer's core; service: the same batches from a tf.data service "
                       "worker on the other core (tfmulti.data.service.LocalService)",
        **settings, "toy": _harness.toy(), "map_rounds": r["rounds"],
        **{key: r[key] for key in ("map_seconds_per_step", "step_seconds_per_step",
                                   "in_process_seconds_per_step", "service_seconds_per_step")},
        "speedup": summary(r["speedups"]),
        "ceiling": summary(r["ceilings"]),
        "of_ceiling": summary(r["of_ceiling"]),
        "goals": {"speedup": 1.5, "of_ceiling": 0.8},
    }


def summarize(r: dict) -> list[str]:
    """The suite's headline lines."""
    fmt = _harness.fmt
    return [f"input_service: service / in-process input {fmt(r['speedup'])} (goal >= "
            f"{r['goals']['speedup']}); ceiling (map + step) / max {fmt(r['ceiling'])}; "
            f"of the ceiling {fmt(r['of_ceiling'])} (goal >= {r['goals']['of_ceiling']})"]


def plot(r: dict, ax) -> None:
    """Median seconds per step: map alone, step alone, in-process, service."""
    parts = {"map alone": r["map_seconds_per_step"], "step alone": r["step_seconds_per_step"],
             "in-process": r["in_process_seconds_per_step"],
             "service": r["service_seconds_per_step"]}
    ax.bar(list(parts), [statistics.median(v) * 1e3 for v in parts.values()])
    ax.set_ylabel("ms per step (median)")
    s = r["speedup"]
    ax.set_title(f"tf.data service: {s['median']:.2f}x the in-process input "
                 f"[{s['min']:.2f}-{s['max']:.2f}]", fontsize=9)
