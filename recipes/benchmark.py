"""tfmulti benchmarks: ratios measured in one run, medians of several repeats.

    python recipes/benchmark.py --suite=scaling --repeats=5 --output=runs/bench/scaling.json

Suites:
  scaling  Multi-worker scaling on the CNN: 2 workers pinned to one core each
           (`tfmulti launch --pin_cpus`) vs 1 worker pinned to one core, at the
           same per-worker batch (so 2 workers process twice the global batch
           per step), 12 steps per call (--scaling_steps_per_execution).
           Figure: throughput ratio (goal >= 1.8x, 90% efficiency).
           A round launches both configurations back to back (interleaved, so
           drift on a shared machine hits both alike), each for --epochs
           epochs; each epoch after the first is a repeat (examples/s of that
           epoch, paired with the other launch's same epoch); as many rounds
           as --repeats needs. Each round also runs the same training as 2
           independent 1-worker runs at once, one per core
           (independent_pair_scaling: what the cores give without any
           synchronization) and 2 matmul processes (hardware_ceiling).
           Also MirroredStrategy over 1, 2 and 4 virtual CPUs in one process
           (same global batch; keys virtual_devices_2_vs_1, _4_vs_1; ceiling
           1.0, the virtual devices share the cores).
  pipeline Training step of a 2-stage pipeline on 2 virtual CPU devices (intra-op
           threads 1, 8 Dense(1024) layers, batch 2048; per repeat the median
           of 3 epochs of 3 steps, after a warm-up epoch; one process for the
           serial step, all its repeats first, then one for the other
           configurations, interleaved within each repeat): the naive split
           (M=1: one stage works at a time), GPipe with M = 2, 4 (micro-batches
           of 1024 and 512 rows), and the fully serial step (M=1, inter-op
           threads 1). Also the single-thread matmul rate by row count
           (matmul_gflops_by_rows): TensorFlow's CPU matmul runs at about half
           its rate below ~384 rows, which is why micro-batches stay at 512
           rows or more. Figures:
           pipeline_speedup = naive / best pipelined step time (goal >= 1.3x;
           the ceiling on CPUs is about 1.5x, since TensorFlow already overlaps
           a stage's weight and input gradients in the naive split), and
           pipeline_efficiency = (serial / 2) / pipelined (goal >= 0.85), with
           the measured bubble (1 - efficiency) next to (S-1)/(M+S-1).
  baseline Seed 000's program as written (plain Keras: MirroredStrategy() with its
           default devices, the MLP, `model.fit` on NumPy arrays, batch 32,
           steps_per_execution 1, evaluated after each epoch) vs tfmulti, each
           side in its own process with 2 virtual CPUs configured first.
           baseline_speedup: tfmulti at the same batch 32 (data.distribute,
           compile_model(steps_per_execution=K): fused Adam) / seed (Keras'
           Adam), training examples/s of
           epoch 2 (goal >= 1.8x). time_to_accuracy_speedup: wall time until the
           test accuracy first reaches 0.87, seed / tfmulti's defaults (global
           batch 256, sqrt learning-rate scaling, steps per execution auto,
           cached and prefetched input), each evaluated after every epoch and
           the evaluation counted (goal >= 4x).
  overhead tfmulti's `fit` vs a hand-written tf.distribute loop doing the same work
           (same MLP, weights, fused Adam, batch 256, data, 26 steps per call),
           MirroredStrategy over 2 virtual CPUs, interleaved blocks in one
           process. overhead_ratio = fit / loop time (goal <= 1.05).
  streaming An input pipeline with a CPU-heavy per-batch map on 1 core, a step on
           the other core (intra-op threads 1; the step's threads pinned to
           one core, the input's to the other, as a device and its host),
           the map's cost calibrated to the step's. streaming_ratio = fit with
           prefetch-to-device / max(input alone, compute alone) (goal <= 1.10;
           ceiling 1.0); streaming_ratio_os_scheduled: the same with the
           threads left to the OS.
  all      every suite above.

Writes FILE.json (every measurement, median/min/max of each ratio, the
machine: CPU model and count, whether TensorFlow runs oneDNN, versions) and
FILE.png (a plot).
"""

from __future__ import annotations

import json
import math
import os
import statistics
import subprocess
import sys
import tempfile
import time

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import _bench_utilization as utilization_suites  # noqa: E402
import _common  # noqa: E402
from absl import flags  # noqa: E402

SUITES = ("scaling", "pipeline", "baseline", "overhead", "streaming")
_SUITE = flags.DEFINE_enum("suite", "all", [*SUITES, "all"], "Which benchmarks to run.")
_OUTPUT = flags.DEFINE_string("output", "runs/benchmark.json", "Where to write the JSON.")
_REPEATS = flags.DEFINE_integer("repeats", 5, "Repeats of each measurement.", lower_bound=1)
_PER_WORKER_BATCH = flags.DEFINE_integer(
    "per_worker_batch", 512, "Scaling: batch per worker (at 256, each step's fixed costs, "
    "the all-reduce round trip among them, weigh twice as much).", lower_bound=1)
_NUM_EXAMPLES = flags.DEFINE_integer("num_examples", 12288,
                                     "Scaling: synthetic examples per epoch.", lower_bound=1)
_SCALING_SPE = flags.DEFINE_integer(
    "scaling_steps_per_execution", 12, "Scaling: steps per tf.function call of every launch "
    "(the same for 1 and 2 workers); must divide the steps per epoch of both (24 and 12 at "
    "the defaults).", lower_bound=1)
_PIPELINE_WORKER = flags.DEFINE_string("pipeline_worker", None,
                                       "Internal: run one pipeline configuration (JSON).")
_WORKER = flags.DEFINE_string("worker", None,
                              "Internal: run one measurement of the baseline, overhead, "
                              "streaming or scaling suites (JSON).")
_BASELINE_SPE = flags.DEFINE_integer("baseline_steps_per_execution", 125,
                                     "Baseline: tfmulti's steps_per_execution at batch 32 "
                                     "(must divide 625, a third of 60000 // 32 = 1875 steps).",
                                     lower_bound=1)
_EPOCHS = flags.DEFINE_integer("epochs", 4, "Scaling: epochs per launch (the first is a "
                               "warm-up; each later one is a repeat).", lower_bound=2)

RECIPES = os.path.dirname(os.path.abspath(__file__))
summary = utilization_suites.summary  # median, min, max, n of one figure's repeats


def _launch_command(num_workers: int, model_dir: str) -> list[str]:
    return [
        sys.executable, "-m", "tfmulti.cli", "launch", f"--num_workers={num_workers}",
        "--pin_cpus", "--", sys.executable, os.path.join(RECIPES, "train.py"),
        "--strategy=multi_worker", "--model=cnn", "--dataset=synthetic",
        f"--num_examples={_NUM_EXAMPLES.value}", f"--epochs={_EPOCHS.value}",
        f"--global_batch_size={_PER_WORKER_BATCH.value * num_workers}",
        f"--steps_per_execution={_SCALING_SPE.value}", f"--model_dir={model_dir}",
    ]


def _epoch_throughputs(model_dir: str) -> list[float]:
    """examples/s of each epoch after the first, from the run's metrics.json."""
    with open(os.path.join(model_dir, "metrics.json")) as f:
        metrics = json.load(f)
    examples = metrics["steps_per_epoch"] * metrics["global_batch_size"]
    return [examples / seconds for seconds in metrics["epoch_seconds"][1:]]


def _train_under_launcher(num_workers: int, model_dir: str) -> list[float]:
    """examples/s of each epoch after the first of recipes/train.py under
    `tfmulti launch --pin_cpus`."""
    command = _launch_command(num_workers, model_dir)
    # Give the whole launch `num_workers` cores, so that `--pin_cpus` hands each
    # worker exactly one: 1 worker on 1 core vs 2 workers on 1 core each.
    cores = sorted(os.sched_getaffinity(0))[:num_workers]
    result = subprocess.run(command, stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                            text=True, timeout=900,
                            preexec_fn=lambda: os.sched_setaffinity(0, cores))
    _check(result, result.stdout)
    return _epoch_throughputs(model_dir)


def _check(process, output: str) -> None:
    if process.returncode != 0:
        raise RuntimeError(f"benchmark run failed ({process.returncode}): "
                           f"{' '.join(process.args)}\n{output[-6000:]}")


def _train_independent_pair(model_dir: str) -> list[list[float]]:
    """examples/s per epoch of 2 independent 1-worker runs at once, one per
    core (no communication), one list per core; summed epoch by epoch, the
    most a synchronous 2-worker run of the same work can reach on these 2
    cores (and twice the slower core, if one core stays slower)."""
    cores = sorted(os.sched_getaffinity(0))[:2]
    runs = []
    for core in cores:
        folder = os.path.join(model_dir, f"core-{core}")
        runs.append((folder, subprocess.Popen(
            _launch_command(1, folder), stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
            text=True, preexec_fn=lambda core=core: os.sched_setaffinity(0, [core]))))
    outputs = []
    try:
        for _, process in runs:
            outputs.append(process.communicate(timeout=900)[0])
    finally:
        for _, process in runs:
            if process.poll() is None:
                process.kill()
                process.wait()
    for (_, process), output in zip(runs, outputs):
        _check(process, output)
    return [_epoch_throughputs(folder) for folder, _ in runs]


def scaling_suite(repeats: int) -> dict:
    cores = len(os.sched_getaffinity(0))
    if cores < 2:
        raise ValueError(f"the scaling suite needs at least 2 cores for 2 pinned workers, "
                         f"this process may use {cores}.")
    spe = _SCALING_SPE.value
    steps = [_NUM_EXAMPLES.value // (_PER_WORKER_BATCH.value * n) for n in (1, 2)]
    if any(s % spe for s in steps):
        raise ValueError(f"--scaling_steps_per_execution={spe} must divide the steps per "
                         f"epoch of 1 and of 2 workers ({steps[0]} and {steps[1]}); use a "
                         f"common divisor such as {math.gcd(*steps)}.")
    # A launch costs ~10 s before its first step, so each launch times several
    # epochs: a round is one launch of 1 worker and one of 2, and repeat i of
    # a round pairs their epoch i (rounds interleave the two over time).
    timed = _EPOCHS.value - 1
    rounds = -(-repeats // timed)
    one, two, pair, ratios, pair_ratios, ceilings, efficiencies = [], [], [], [], [], [], []
    per_core = [[], []]
    with tempfile.TemporaryDirectory(prefix="tfmulti-bench-") as tmp:
        for round_ in range(rounds):
            start = time.monotonic()
            a = _train_under_launcher(1, os.path.join(tmp, f"one-{round_}"))
            b = _train_under_launcher(2, os.path.join(tmp, f"two-{round_}"))
            cores_rates = _train_independent_pair(os.path.join(tmp, f"pair-{round_}"))
            c = [sum(rates) for rates in zip(*cores_rates)]
            for rates, core in zip(cores_rates, per_core):
                core += rates
            ceiling = utilization_suites.hardware_ceiling(2.0)
            one += a
            two += b
            pair += c
            ratios += [y / x for x, y in zip(a, b)]
            pair_ratios += [z / x for x, z in zip(a, c)]
            ceilings.append(ceiling)
            efficiencies += [y / x / ceiling for x, y in zip(a, b)]
            print(f"scaling round {round_ + 1}/{rounds}: per epoch, 1 worker "
                  f"{', '.join(f'{x:,.0f}' for x in a)} ex/s, 2 workers "
                  f"{', '.join(f'{y:,.0f}' for y in b)} ex/s, ratios "
                  f"{', '.join(f'{y / x:.2f}x' for x, y in zip(a, b))}; 2 independent "
                  f"1-worker runs {', '.join(f'{z / x:.2f}x' for x, z in zip(a, c))} (per "
                  f"core {' + '.join(f'{statistics.median(r):,.0f}' for r in cores_rates)} "
                  f"ex/s); "
                  f"hardware ceiling {ceiling:.2f}x ({time.monotonic() - start:.0f} s)",
                  flush=True)
    return {
        "description": "2 workers on 1 core each vs 1 worker on 1 core (tfmulti launch "
                       "--pin_cpus), CNN, same per-worker batch; per round one launch of each, "
                       f"{timed} timed epochs after a warm-up one, paired epoch by epoch",
        "per_worker_batch": _PER_WORKER_BATCH.value,
        "steps_per_execution": _SCALING_SPE.value,
        "examples_per_epoch": _NUM_EXAMPLES.value,
        "epochs_per_launch": _EPOCHS.value,
        "rounds": rounds,
        "examples_per_second_1_worker": one,
        "examples_per_second_2_workers": two,
        "multi_worker_scaling": summary(ratios),
        "examples_per_second_independent_pair": pair,
        "examples_per_second_independent_pair_per_core": per_core,
        "independent_pair_scaling": summary(pair_ratios),
        "synchronization_efficiency": summary(
            [r / p for r, p in zip(ratios, pair_ratios)]),
        "hardware_ceiling": summary(ceilings),
        "efficiency_vs_ceiling": summary(efficiencies),
        "goal": 1.8,
        "ceiling": "2 single-threaded matmul processes on 2 cores vs 1, measured once per "
                   "round (hardware_ceiling); and the same training as 2 independent "
                   "1-worker runs at once, one per core (independent_pair_scaling: no "
                   "communication, no waiting for each other); synchronization_efficiency "
                   "= multi_worker_scaling / independent_pair_scaling",
        "virtual_devices": utilization_suites.devices_scaling(repeats),
    }


PIPELINE_MICROBATCHES = (2, 4)
# 2048 rows split into micro-batches of 1024 and 512: TensorFlow's CPU matmul
# drops to about half its FLOP rate below ~384 rows (matmul_gflops_by_rows),
# so at batch 512 the suite measured that cliff, not the schedule (run 10).
PIPELINE_SHAPE = {"width": 1024, "batch": 2048, "steps": 3}
MATMUL_ROWS = (64, 128, 256, 384, 512, 1024)


def matmul_gflops_by_rows(width: int, rows=MATMUL_ROWS) -> dict:
    """Single-thread rate (GFLOP/s) of `Dense(width, relu)` forward on
    rows x width inputs, as the pipeline's stages run it: shows where
    splitting a batch into micro-batches costs FLOP rate on this CPU."""
    import keras
    import tensorflow as tf

    from tfmulti import utilization

    layer = keras.layers.Dense(width, activation="relu")
    layer.build((None, width))
    rates = {}
    for n in rows:
        x = tf.random.normal((n, width))
        # Eager calls on the CPU return once computed; the first one traces.
        seconds = utilization.seconds_per_call(tf.function(lambda x=x: layer(x)), 0.25)
        rates[str(n)] = 2 * n * width * width / seconds / 1e9
    return rates


def pipeline_worker(config: dict) -> dict:
    """Step times of pipeline configurations sharing an inter-op setting, in
    this process: each built and warmed up once, then `repeats` rounds in
    which every configuration trains `epochs` epochs in turn (interleaved);
    a repeat's figure is the median epoch's seconds per step."""
    import tensorflow as tf

    tf.config.threading.set_intra_op_parallelism_threads(1)
    tf.config.threading.set_inter_op_parallelism_threads(config["inter_op"])
    import keras
    import numpy as np

    import tfmulti
    from tfmulti.parallel import PipelineModel

    tfmulti.configure_virtual_devices(2)
    width, batch = config["width"], config["batch"]
    rng = np.random.default_rng(0)
    x = rng.standard_normal((batch, width), dtype=np.float32)
    ds = tf.data.Dataset.from_tensors((x, x)).repeat()
    steps, epochs = config["steps"], 3
    times = []

    class Timer(keras.callbacks.Callback):
        def on_epoch_begin(self, epoch, logs=None):
            self.start = time.perf_counter()

        def on_epoch_end(self, epoch, logs=None):
            times.append((time.perf_counter() - self.start) / steps)

    models = {}
    for name, microbatches in config["microbatches"].items():
        layers = [keras.layers.Dense(width, activation="relu") for _ in range(8)]
        model = PipelineModel(layers, input_shape=(width,), devices=["CPU:0", "CPU:1"],
                              num_microbatches=microbatches, partition=[4, 4])
        model.compile(optimizer=keras.optimizers.SGD(1e-4), loss="mse")
        model.fit(ds, steps_per_epoch=steps, epochs=1, verbose=0)  # builds, traces
        models[name] = model
    results = {name: [] for name in models}
    for _ in range(config["repeats"]):
        for name, model in models.items():
            times.clear()
            model.fit(ds, steps_per_epoch=steps, epochs=epochs, verbose=0, callbacks=[Timer()])
            results[name].append(statistics.median(times))
    out = {"step_seconds": results}
    if config.get("matmul_rows"):
        out["matmul_gflops_by_rows"] = matmul_gflops_by_rows(width)
    return out


def _run_pipeline_configs(microbatches: dict, inter_op: int, repeats: int,
                          **extra) -> dict:
    config = {"microbatches": microbatches, "inter_op": inter_op, "repeats": repeats,
              **PIPELINE_SHAPE, **extra}
    result = subprocess.run(
        [sys.executable, os.path.abspath(__file__), f"--pipeline_worker={json.dumps(config)}"],
        capture_output=True, text=True, timeout=600)
    if result.returncode != 0:
        raise RuntimeError(f"pipeline benchmark {config} failed:\n{result.stderr[-3000:]}")
    return json.loads(result.stdout.strip().splitlines()[-1])


def pipeline_suite(repeats: int) -> dict:
    # The serial step needs inter-op threads 1, so a process of its own; the
    # others share one, interleaved within each repeat.
    start = time.monotonic()
    overlapped = {"naive": 1, **{f"M={m}": m for m in PIPELINE_MICROBATCHES}}
    serial = _run_pipeline_configs({"serial": 1}, inter_op=1, repeats=repeats,
                                   matmul_rows=True)
    times = {**serial["step_seconds"],
             **_run_pipeline_configs(overlapped, inter_op=0, repeats=repeats)["step_seconds"]}
    rates = serial["matmul_gflops_by_rows"]
    # M chosen once, by median step time: the best M of each repeat would pick
    # each repeat's luckiest draw.
    best_m = min(PIPELINE_MICROBATCHES, key=lambda m: statistics.median(times[f"M={m}"]))
    best = times[f"M={best_m}"]
    speedups = [times["naive"][i] / best[i] for i in range(repeats)]
    efficiencies = [times["serial"][i] / 2 / best[i] for i in range(repeats)]
    bubbles = {m: [1 - s / 2 / t for s, t in zip(times["serial"], times[f"M={m}"])]
               for m in PIPELINE_MICROBATCHES}
    utilization_suites.report("pipeline", start, [
        ", ".join(f"{n} {t[i] * 1000:.0f} ms" for n, t in times.items())
        + f"; speedup {speedups[i]:.2f}x, efficiency {efficiencies[i]:.2f}"
        for i in range(repeats)])
    print(f"pipeline: single-thread Dense({PIPELINE_SHAPE['width']}) forward by rows: "
          + ", ".join(f"{n} rows {r:.0f}" for n, r in rates.items()) + " GFLOP/s", flush=True)
    shape = PIPELINE_SHAPE
    return {
        "description": f"2-stage pipeline, 2 virtual CPUs, intra-op threads 1, "
                       f"8 x Dense({shape['width']}), batch {shape['batch']}, SGD training "
                       f"step; per repeat the median of 3 epochs of {shape['steps']} steps",
        "matmul_gflops_by_rows": rates,
        "step_seconds_per_repeat": times,
        "step_seconds": {n: summary(t) for n, t in times.items()},
        "pipeline_microbatches": best_m,
        "pipeline_speedup": summary(speedups),
        "pipeline_efficiency": summary(efficiencies),
        "bubble": {f"M={m}": {"measured": summary(bubbles[m]),
                              "gpipe_theory": (2 - 1) / (m + 2 - 1)}
                   for m in PIPELINE_MICROBATCHES},
        "goals": {"pipeline_speedup": 1.3, "pipeline_efficiency": 0.85},
        "ceiling": "2 logical CPUs share 2 cores: a 2-stage pipeline can at most halve the "
                   "serial step (efficiency 1.0); the naive split already overlaps some "
                   "work, so the speedup over it is bounded near 1.5x",
    }


def plot(results: dict, path: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    suites = list(results["suites"])
    fig, axes = plt.subplots(1, len(suites), figsize=(5 * len(suites), 4), squeeze=False)
    for ax, name in zip(axes[0], suites):
        if name == "scaling":
            r = results["suites"][name]
            data = [r["examples_per_second_1_worker"], r["examples_per_second_2_workers"],
                    r["examples_per_second_independent_pair"]]
            ax.boxplot(data, tick_labels=["1 worker", "2 workers", "2 independent"])
            s = r["multi_worker_scaling"]
            ax.set_title(f"Scaling (CNN): {s['median']:.2f}x "
                         f"[{s['min']:.2f}-{s['max']:.2f}]; 2 independent runs "
                         f"{r['independent_pair_scaling']['median']:.2f}x", fontsize=9)
            ax.set_ylabel("examples / s (steady state)")
        elif name == "pipeline":
            r = results["suites"][name]
            names = list(r["step_seconds"])
            ax.bar(names, [r["step_seconds"][n]["median"] * 1000 for n in names],
                   yerr=[[(r["step_seconds"][n]["median"] - r["step_seconds"][n]["min"]) * 1000
                          for n in names],
                         [(r["step_seconds"][n]["max"] - r["step_seconds"][n]["median"]) * 1000
                          for n in names]])
            ax.set_ylabel("training step (ms)")
            ax.set_title(f"Pipeline: {r['pipeline_speedup']['median']:.2f}x over naive, "
                         f"efficiency {r['pipeline_efficiency']['median']:.2f}")
        else:
            utilization_suites.plot_suite(name, results["suites"][name], ax)
    fig.tight_layout()
    fig.savefig(path, dpi=100)


def main(argv):
    if _PIPELINE_WORKER.value:
        print(json.dumps(pipeline_worker(json.loads(_PIPELINE_WORKER.value))))
        return
    if _WORKER.value:
        print(json.dumps(utilization_suites.worker(json.loads(_WORKER.value))))
        return
    suites = SUITES if _SUITE.value == "all" else (_SUITE.value,)
    start = time.monotonic()
    machine = utilization_suites.run_worker("machine", timeout=120)
    onednn = {True: "on", False: "off"}.get(machine["onednn"], "unknown")
    print(f"machine: {machine['cpu_model']}, {machine['cpu_count']} cores, oneDNN {onednn}; "
          f"TensorFlow {machine['tensorflow']}, Keras {machine['keras']}", flush=True)
    results = {
        "command": " ".join(["python", "recipes/benchmark.py", *sys.argv[1:]]),
        "cpu_count": os.cpu_count(),
        "machine": machine,
        "repeats": _REPEATS.value,
        "suites": {},
    }
    results["suite_seconds"] = {}
    results["complete"] = False

    def write_json():
        # After every suite, atomically: a suite that fails later (a timeout
        # an hour in) leaves the finished ones on disk, never a torn file.
        os.makedirs(os.path.dirname(os.path.abspath(_OUTPUT.value)), exist_ok=True)
        tmp = _OUTPUT.value + ".tmp"
        with open(tmp, "w") as f:
            json.dump(results, f, indent=2)
        os.replace(tmp, _OUTPUT.value)

    for name in suites:
        repeats = _REPEATS.value
        suite_start = time.monotonic()
        results["suites"][name] = {
            "scaling": scaling_suite,
            "pipeline": pipeline_suite,
            "baseline": lambda n: utilization_suites.baseline_suite(n, _BASELINE_SPE.value),
            "overhead": utilization_suites.overhead_suite,
            "streaming": utilization_suites.streaming_suite,
        }[name](repeats)
        results["suite_seconds"][name] = time.monotonic() - suite_start
        results["seconds"] = time.monotonic() - start
        write_json()
    results["complete"] = True
    write_json()
    png = os.path.splitext(_OUTPUT.value)[0] + ".png"
    plot(results, png)
    for name, r in results["suites"].items():
        if name == "scaling":
            print(f"scaling: 2 vs 1 pinned workers {_fmt(r['multi_worker_scaling'])}; "
                  f"2 independent 1-worker runs at once vs 1 "
                  f"{_fmt(r['independent_pair_scaling'])}; synchronization efficiency "
                  f"{_fmt(r['synchronization_efficiency'], '')}; matmul hardware ceiling "
                  f"{_fmt(r['hardware_ceiling'])}")
            for key in ("virtual_devices_2_vs_1", "virtual_devices_4_vs_1"):
                v = r["virtual_devices"][key]
                print(f"scaling: MirroredStrategy {key.split('_')[2]} virtual devices vs 1 "
                      f"{_fmt(v)}; ceiling 1.0 (they share the cores)")
        if name == "pipeline":
            print(f"pipeline: M={r['pipeline_microbatches']}: speedup over naive "
                  f"{_fmt(r['pipeline_speedup'])}; efficiency "
                  f"{_fmt(r['pipeline_efficiency'], '')}; {r['ceiling']}")
        if name == "baseline":
            a = r["examples_per_second_seed_summary"]
            b = r["examples_per_second_tfmulti_summary"]
            print(f"baseline: baseline_speedup {_fmt(r['baseline_speedup'])}; seed "
                  f"{a['median']:,.0f} ex/s, tfmulti {b['median']:,.0f} ex/s (medians, "
                  f"steps_per_execution {r['steps_per_execution']})")
            t = r["time_to_accuracy_speedup"]
            print(f"baseline: time_to_accuracy_speedup {_fmt(t) if t else 'not measured'} "
                  f"({r['repeats_reaching_target']} of {_REPEATS.value} repeats reached "
                  f"{r['target_accuracy']} on both sides)")
        if name == "overhead":
            print(f"overhead: overhead_ratio {_fmt(r['overhead_ratio'], 'x', 3)} (goal <= "
                  f"{r['goal']})")
        if name == "streaming":
            print(f"streaming: streaming_ratio {_fmt(r['streaming_ratio'], 'x', 3)} (goal <= "
                  f"{r['goal']}); together / (input + compute) "
                  f"{_fmt(r['together_over_sum'], 'x', 3)}; floor (both at once, uncoupled) "
                  f"{_fmt(r['corun_floor'], 'x', 3)}; threads left to the OS "
                  f"{_fmt(r['streaming_ratio_os_scheduled'], 'x', 3)}")
    print(f"wrote {_OUTPUT.value} and {png} ({results['seconds']:.0f} s)")


def _fmt(s: dict, unit: str = "x", digits: int = 2) -> str:
    return (f"{s['median']:.{digits}f}{unit} (min {s['min']:.{digits}f}, max "
            f"{s['max']:.{digits}f}, {s['n']} repeats)")


if __name__ == "__main__":
    _common.run(main)
