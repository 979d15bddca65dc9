"""What measures and attacks tfmulti from a checkout: the benchmark suites,
the fault-injection campaign, the simulated hosts and the GPU check harness.
Not part of the installed package: the wheel holds `tfmulti` only (setup.cfg,
`[options.packages.find]`); `recipes/benchmark.py`, `recipes/chaos.py` and
`recipes/gpu_check.py` put the repository root on sys.path to import this,
and the worker processes get it on PYTHONPATH (`_harness.worker_env`).

  the suites           this module (`SUITES`, `run_benchmark`) and one module
                       each (below); `_harness`, `worker`, `fixtures`, `cpus`,
                       `devices`
  the fault campaign   `chaos` (kill a 2-worker training at random moments of
                       every phase, resume it, hold it against an
                       uninterrupted run), `chaos_checks`, and `failpoints`
                       (arming the product's failpoints in the workers)
  simulated hosts      `simulated_hosts` (network namespaces joined by a
                       bridge; needs root), for the `scaling` suite
  the engines          `engines` (the same 2-worker run under srun and Ray
                       against `tfmulti launch`: `python -m benchmarks.engines`)
                       and `slurm_cluster` (a private munge, slurmctld and
                       slurmd on one node or two simulated hosts; needs root)
  the GPU check        `gpu_check` (`recipes/gpu_check.py`, `make gpu-check`)
  their tests          `benchmarks/tests` (pytest runs them with `tests/`)

The benchmark suites: ratios measured within one run, medians of several repeats.

    import benchmarks as bench
    bench.run_benchmark(["overhead"], repeats=5, output="runs/bench/overhead.json")

or, from a checkout, `python recipes/benchmark.py --suite=overhead`. Timed
tests would flake on a shared machine, so the figures come from here, not
from the test suite; BENCHMARKS.md gives the latest figures and their
commands, docs/contributing/benchmark_history.md the runs, the goals and each
suite's method.

Suites (`SUITES`, in the order `all` runs them; each module's docstring
explains its method and figures):

  scaling    2 `tfmulti launch --pin_cpus` workers on 1 core each vs 1 worker
             on 1 core (the CNN), and MirroredStrategy over 1, 2 and 4
             virtual CPUs (`devices`)
  pipeline   a 2-stage pipeline on 2 virtual CPUs: the naive split, GPipe
             with 2 and 4 micro-batches, and the fully serial step
  baseline   seed 000's program as written vs tfmulti: throughput at batch 32
             and wall time to a test accuracy of 0.87
  overhead   tfmulti's `fit` vs a hand-written tf.distribute loop doing the
             same work, interleaved in one process
  streaming  an input pipeline and a training step of equal cost on a core
             each, overlapped by prefetch-to-device
  input_service  an input-bound job on one core: its input in-process vs
             from a tf.data service worker on the other core
  own        the user's own model and data functions vs the built-in MLP
             (`fit`, same network), and TFRecord files read by 2 pinned
             workers sharding by files vs by examples
  tensor     the byte-level transformer on 2 virtual CPUs: tensor-parallel
             T=2 vs unsplit (its cost), a 2-stage pipeline vs the naive split
  memory     sharded data parallelism (ZeRO) on 2 workers: each worker's peak
             memory (from outside) and step time by zero_stage, and a
             per-worker memory cap under which stage 0 dies and a sharded
             stage trains
  embeddings a two-tower model's two 1M-row tables: SGD, Adam's dense update
             and lazy Adam (sparse_updates='lazy'), examples/s on one device

Each suite module has `run(repeats, **options) -> dict` (its JSON record),
`check(**options)` (the same options, checked before anything runs),
`summarize(record) -> list[str]` (its headline lines) and `plot(record, ax)`
(its panel of the figure). Measurements run in fresh worker processes
(`python -m benchmarks.worker KIND CONFIG_JSON`), since virtual devices
and thread counts must be set before TensorFlow starts (at toy size, every
measurement of a run shares one: `_harness.run_worker`); this process never
imports TensorFlow. The other modules: `fixtures` (what the suites hold
tfmulti against, and their clocks), `cpus` (which core each thread runs on;
`hardware_ceiling`), `worker`.

`run_benchmark` writes FILE.json after every suite, atomically (a suite that
fails later leaves the finished ones on disk, never a torn file), with every
measurement, the median/min/max of each ratio and the machine (CPU model and
count, whether TensorFlow runs oneDNN, versions); `complete` becomes true
once every suite has run; then FILE.png (one panel per suite).
"""

from __future__ import annotations

import os
import sys
import time
from collections.abc import Mapping, Sequence

from tfmulti.utils import checks
from tfmulti.utils.atomic import write_json_atomic
from benchmarks import (_harness, baseline, embeddings, input_service, memory, overhead, own,
                        pipeline, scaling, streaming, tensor)

__all__ = ["SUITES", "run_benchmark", "run_suite"]

SUITES = {"scaling": scaling, "pipeline": pipeline, "baseline": baseline,
          "overhead": overhead, "streaming": streaming, "input_service": input_service,
          "own": own, "tensor": tensor, "memory": memory, "embeddings": embeddings}
"""Suite name -> its module, in the order `all` runs them."""


def run_suite(name: str, repeats: int, **options) -> dict:
    """Runs one suite; returns its JSON record.

    Args:
        name: one of `SUITES`.
        repeats: repeats of each measurement.
        **options: the suite's own options (see its `run`), e.g.
            `run_suite("baseline", 5, steps_per_execution=125)`.
    """
    checks.one_of("suite", name, SUITES)
    checks.positive_int("repeats", repeats)
    return SUITES[name].run(repeats, **options)


def run_benchmark(names: Sequence[str], repeats: int, output: str, *,
                  options: Mapping[str, Mapping] | None = None,
                  command: str | None = None) -> dict:
    """Runs the suites `names` in turn; writes `output` (JSON) and its .png.

    Prints the machine first, each suite's progress as it runs, then every
    suite's headline lines.

    Args:
        names: suite names (of `SUITES`), run in this order.
        repeats: repeats of each measurement.
        output: the JSON path; the figure goes next to it (.png).
        options: suite name -> that suite's options (`run_suite`); suites
            not in `names` are ignored.
        command: the command line recorded in the JSON (default: this
            process's).

    Returns:
        What the JSON holds.
    """
    names = list(names)
    if not names:
        raise ValueError("`names` is empty; pass one or more of "
                         f"{list(SUITES)}.")
    for name in names:
        checks.one_of("suite", name, SUITES)
    options = {name: dict(o) for name, o in (options or {}).items()}
    for name in options:
        checks.one_of("options", name, SUITES, hint="its keys are suite names")
    checks.positive_int("repeats", repeats)
    for name in names:  # every suite's options, before the first one runs
        SUITES[name].check(**options.get(name, {}))
    start = time.monotonic()
    machine = _harness.run_worker("machine", timeout=120)
    onednn = {True: "on", False: "off"}.get(machine["onednn"], "unknown")
    print(f"machine: {machine['cpu_model']}, {machine['cpu_count']} cores, oneDNN {onednn}; "
          f"TensorFlow {machine['tensorflow']}, Keras {machine['keras']}", flush=True)
    results = {
        "command": command if command is not None else " ".join(["python", *sys.argv]),
        "cpu_count": os.cpu_count(),
        "machine": machine,
        "repeats": repeats,
        "suites": {},
        "suite_seconds": {},
        "complete": False,
    }
    for name in names:
        suite_start = time.monotonic()
        results["suites"][name] = run_suite(name, repeats, **options.get(name, {}))
        results["suite_seconds"][name] = time.monotonic() - suite_start
        results["seconds"] = time.monotonic() - start
        write_json_atomic(output, results)
    results["complete"] = True
    write_json_atomic(output, results)
    png = os.path.splitext(output)[0] + ".png"
    _harness.plot_results(results, png, {name: SUITES[name].plot for name in results["suites"]})
    for name, record in results["suites"].items():
        for line in SUITES[name].summarize(record):
            print(line)
    print(f"wrote {output} and {png} ({results['seconds']:.0f} s)")
    return results
