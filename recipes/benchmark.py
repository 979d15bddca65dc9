"""tfmulti benchmarks: ratios measured in one run, medians of several repeats.

    python recipes/benchmark.py --suite=scaling --repeats=5 --output=runs/bench/scaling.json

Suites:
  scaling  Multi-worker scaling on the CNN: 2 workers pinned to one core each
           (`tfmulti launch --pin_cpus`) vs 1 worker pinned to one core, at the
           same per-worker batch (so 2 workers process twice the global batch
           per step). Figure: throughput ratio (goal >= 1.8x, 90% efficiency).
           Each repeat runs both configurations back to back (interleaved, so
           drift on a shared machine hits both alike); throughput is the
           recipe's steady-state examples/s (median epoch after the first).
  pipeline Training step of a 2-stage pipeline on 2 virtual CPU devices (intra-op
           threads 1, 8 Dense(1024) layers, batch 512): the naive split
           (M=1: one stage works at a time), GPipe with M = 2, 4, 8, and the
           fully serial step (M=1, inter-op threads 1). Figures:
           pipeline_speedup = naive / best pipelined step time (goal >= 1.3x;
           the ceiling on CPUs is about 1.5x, since TensorFlow already overlaps
           a stage's weight and input gradients in the naive split), and
           pipeline_efficiency = (serial / 2) / pipelined (goal >= 0.85), with
           the measured bubble (1 - efficiency) next to (S-1)/(M+S-1).
  baseline Seed 000's program as written (plain Keras: MirroredStrategy() with its
           default devices, the MLP, `model.fit` on NumPy arrays, batch 32,
           steps_per_execution 1) vs tfmulti at the same batch 32 (get_strategy
           ("mirrored"), data.load + data.distribute, build_model("mlp"),
           compile_model(steps_per_execution=K)), each side in its own process
           with 2 virtual CPUs configured first. Figure: baseline_speedup =
           tfmulti / seed examples/s of the second epoch (goal >= 1.8x); both
           absolute figures are in the JSON.
  all      every suite above.

Writes FILE.json (every measurement, median/min/max of each ratio, the
machine's CPU count and the ceiling it implies) and FILE.png (a plot).
"""

from __future__ import annotations

import json
import os
import statistics
import subprocess
import sys
import tempfile
import time

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import _common  # noqa: E402
from absl import flags  # noqa: E402

SUITES = ("scaling", "pipeline", "baseline")
_SUITE = flags.DEFINE_enum("suite", "all", [*SUITES, "all"], "Which benchmarks to run.")
_OUTPUT = flags.DEFINE_string("output", "runs/benchmark.json", "Where to write the JSON.")
_REPEATS = flags.DEFINE_integer("repeats", 5, "Repeats of each measurement.", lower_bound=1)
_PER_WORKER_BATCH = flags.DEFINE_integer("per_worker_batch", 256, "Scaling: batch per worker.",
                                         lower_bound=1)
_NUM_EXAMPLES = flags.DEFINE_integer("num_examples", 12288,
                                     "Scaling: synthetic examples per epoch.", lower_bound=1)
_PIPELINE_WORKER = flags.DEFINE_string("pipeline_worker", None,
                                       "Internal: run one pipeline configuration (JSON).")
_BASELINE_WORKER = flags.DEFINE_enum("baseline_worker", None, ["seed", "tfmulti"],
                                     "Internal: run one side of the baseline suite.")
_BASELINE_SPE = flags.DEFINE_integer("baseline_steps_per_execution", 125,
                                     "Baseline: tfmulti's steps_per_execution (must divide "
                                     "60000 // 32 = 1875).", lower_bound=1)
_EPOCHS = flags.DEFINE_integer("epochs", 3, "Scaling: epochs per run (first is warm-up).",
                               lower_bound=2)

RECIPES = os.path.dirname(os.path.abspath(__file__))


def summary(values: list[float]) -> dict:
    return {"median": statistics.median(values), "min": min(values), "max": max(values),
            "n": len(values)}


def _train_under_launcher(num_workers: int, model_dir: str) -> float:
    """Steady-state examples/s of recipes/train.py under `tfmulti launch --pin_cpus`."""
    command = [
        sys.executable, "-m", "tfmulti.cli", "launch", f"--num_workers={num_workers}",
        "--pin_cpus", "--", sys.executable, os.path.join(RECIPES, "train.py"),
        "--strategy=multi_worker", "--model=cnn", "--dataset=synthetic",
        f"--num_examples={_NUM_EXAMPLES.value}", f"--epochs={_EPOCHS.value}",
        f"--global_batch_size={_PER_WORKER_BATCH.value * num_workers}",
        f"--model_dir={model_dir}",
    ]
    # Give the whole launch `num_workers` cores, so that `--pin_cpus` hands each
    # worker exactly one: 1 worker on 1 core vs 2 workers on 1 core each.
    cores = sorted(os.sched_getaffinity(0))[:num_workers]
    result = subprocess.run(command, capture_output=True, text=True, timeout=900,
                            preexec_fn=lambda: os.sched_setaffinity(0, cores))
    if result.returncode != 0:
        raise RuntimeError(f"benchmark run failed ({result.returncode}): "
                           f"{' '.join(command)}\n{result.stdout[-3000:]}{result.stderr[-3000:]}")
    with open(os.path.join(model_dir, "metrics.json")) as f:
        return json.load(f)["examples_per_second"]


_SPIN = """
import os, sys, time
os.sched_setaffinity(0, {int(sys.argv[1])})
import numpy as np
a = np.random.default_rng(0).random((384, 384), dtype=np.float32)
end, n = time.perf_counter() + float(sys.argv[2]), 0
while time.perf_counter() < end:
    a @ a
    n += 1
print(n)
"""


def hardware_ceiling(seconds: float = 3.0) -> float:
    """How much 2 independent single-core processes outrun 1 on this machine
    (1 thread each, no communication): the most any 2-worker run can gain."""
    env = {**os.environ, "OPENBLAS_NUM_THREADS": "1", "OMP_NUM_THREADS": "1",
           "MKL_NUM_THREADS": "1"}
    cores = sorted(os.sched_getaffinity(0))[:2]

    def spin(core):
        return subprocess.Popen([sys.executable, "-c", _SPIN, str(core), str(seconds)],
                                stdout=subprocess.PIPE, text=True, env=env)

    alone = int(spin(cores[0]).communicate(timeout=60)[0])
    pair = [spin(c) for c in cores]
    together = sum(int(p.communicate(timeout=60)[0]) for p in pair)
    return together / alone


def scaling_suite(repeats: int) -> dict:
    cores = len(os.sched_getaffinity(0))
    if cores < 2:
        raise ValueError(f"the scaling suite needs at least 2 cores for 2 pinned workers, "
                         f"this process may use {cores}.")
    one, two, ratios, ceilings = [], [], [], []
    with tempfile.TemporaryDirectory(prefix="tfmulti-bench-") as tmp:
        for repeat in range(repeats):
            start = time.monotonic()
            a = _train_under_launcher(1, os.path.join(tmp, f"one-{repeat}"))
            b = _train_under_launcher(2, os.path.join(tmp, f"two-{repeat}"))
            ceiling = hardware_ceiling()
            one.append(a)
            two.append(b)
            ratios.append(b / a)
            ceilings.append(ceiling)
            print(f"scaling repeat {repeat + 1}/{repeats}: 1 worker {a:,.0f} ex/s, "
                  f"2 workers {b:,.0f} ex/s, ratio {b / a:.2f}x, hardware ceiling "
                  f"{ceiling:.2f}x "
                  f"({time.monotonic() - start:.0f} s)", flush=True)
    return {
        "description": "2 workers on 1 core each vs 1 worker on 1 core (tfmulti launch "
                       "--pin_cpus), CNN, same per-worker batch",
        "per_worker_batch": _PER_WORKER_BATCH.value,
        "examples_per_epoch": _NUM_EXAMPLES.value,
        "examples_per_second_1_worker": one,
        "examples_per_second_2_workers": two,
        "multi_worker_scaling": summary(ratios),
        "hardware_ceiling": summary(ceilings),
        "efficiency_vs_ceiling": summary([r / c for r, c in zip(ratios, ceilings)]),
        "goal": 1.8,
        "ceiling": "2 single-threaded matmul processes on 2 cores vs 1, measured in the "
                   "same run (hardware_ceiling): no 2-worker run can beat it",
    }


PIPELINE_MICROBATCHES = (2, 4, 8)


def pipeline_worker(config: dict) -> dict:
    """Median step time of one pipeline configuration, in this process."""
    import tensorflow as tf

    tf.config.threading.set_intra_op_parallelism_threads(1)
    tf.config.threading.set_inter_op_parallelism_threads(config["inter_op"])
    import keras
    import numpy as np

    import tfmulti
    from tfmulti.parallel import PipelineModel

    tfmulti.configure_virtual_devices(2)
    width, batch = 1024, 512
    layers = [keras.layers.Dense(width, activation="relu") for _ in range(8)]
    model = PipelineModel(layers, input_shape=(width,), devices=["CPU:0", "CPU:1"],
                          num_microbatches=config["microbatches"], partition=[4, 4])
    model.compile(optimizer=keras.optimizers.SGD(1e-4), loss="mse")
    rng = np.random.default_rng(0)
    x = rng.standard_normal((batch, width), dtype=np.float32)
    ds = tf.data.Dataset.from_tensors((x, x)).repeat()
    steps, epochs = 8, 6
    times = []

    class Timer(keras.callbacks.Callback):
        def on_epoch_begin(self, epoch, logs=None):
            self.start = time.perf_counter()

        def on_epoch_end(self, epoch, logs=None):
            times.append((time.perf_counter() - self.start) / steps)

    model.fit(ds, steps_per_epoch=steps, epochs=epochs, verbose=0, callbacks=[Timer()])
    return {"step_seconds": statistics.median(times[1:]), **config}


def _run_pipeline_config(config: dict) -> float:
    result = subprocess.run(
        [sys.executable, os.path.abspath(__file__), f"--pipeline_worker={json.dumps(config)}"],
        capture_output=True, text=True, timeout=600)
    if result.returncode != 0:
        raise RuntimeError(f"pipeline benchmark {config} failed:\n{result.stderr[-3000:]}")
    return json.loads(result.stdout.strip().splitlines()[-1])["step_seconds"]


def pipeline_suite(repeats: int) -> dict:
    configs = {"serial": {"microbatches": 1, "inter_op": 1},
               "naive": {"microbatches": 1, "inter_op": 0}}
    configs.update({f"M={m}": {"microbatches": m, "inter_op": 0}
                    for m in PIPELINE_MICROBATCHES})
    times = {name: [] for name in configs}
    speedups, efficiencies = [], []
    bubbles = {m: [] for m in PIPELINE_MICROBATCHES}
    for repeat in range(repeats):
        start = time.monotonic()
        for name, config in configs.items():
            times[name].append(_run_pipeline_config(config))
        best = min(times[f"M={m}"][-1] for m in PIPELINE_MICROBATCHES)
        speedups.append(times["naive"][-1] / best)
        efficiencies.append(times["serial"][-1] / 2 / best)
        for m in PIPELINE_MICROBATCHES:
            bubbles[m].append(1 - times["serial"][-1] / 2 / times[f"M={m}"][-1])
        print(f"pipeline repeat {repeat + 1}/{repeats}: " + ", ".join(
            f"{n} {t[-1] * 1000:.0f} ms" for n, t in times.items())
            + f"; speedup {speedups[-1]:.2f}x, efficiency {efficiencies[-1]:.2f} "
            f"({time.monotonic() - start:.0f} s)", flush=True)
    return {
        "description": "2-stage pipeline, 2 virtual CPUs, intra-op threads 1, "
                       "8 x Dense(1024), batch 512, SGD training step",
        "step_seconds": {n: summary(t) for n, t in times.items()},
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


BASELINE_BATCH = 32


def baseline_worker(side: str, steps_per_execution: int) -> dict:
    """Examples/s of the second training epoch (the first traces) of one side."""
    import tfmulti

    tfmulti.configure_virtual_devices(2)
    import keras
    import tensorflow as tf

    import tfmulti.data
    import tfmulti.models

    times = []

    class Timer(keras.callbacks.Callback):
        def on_epoch_begin(self, epoch, logs=None):
            self.start = time.perf_counter()

        def on_epoch_end(self, epoch, logs=None):
            times.append(time.perf_counter() - self.start)

    train = tfmulti.data.load("fashion_mnist")
    if side == "seed":
        # Seed 000 as written: train_images / 255.0 as NumPy arrays, plain
        # MirroredStrategy() with its default devices, fit(batch_size=32).
        images, labels = next(iter(train.batch(100_000).as_numpy_iterator()))
        train_images = images.reshape(-1, 28, 28)
        train_labels = labels
        strategy = tf.distribute.MirroredStrategy()
        with strategy.scope():
            model = keras.Sequential([
                keras.Input(shape=(28, 28)),
                keras.layers.Flatten(),  # the seed's shape bug fixed, nothing else
                keras.layers.Dense(512, activation="relu"),
                keras.layers.Dropout(0.2),
                keras.layers.Dense(10),
            ])
            model.compile(optimizer="adam",
                          loss=keras.losses.SparseCategoricalCrossentropy(from_logits=True),
                          metrics=["accuracy"])
        model.fit(train_images, train_labels, batch_size=BASELINE_BATCH, epochs=2, verbose=0,
                  callbacks=[Timer()])
        examples = len(train_images)
        steps = -(-examples // BASELINE_BATCH)
    else:
        strategy = tfmulti.get_strategy("mirrored")
        dist = tfmulti.data.distribute(train, strategy, BASELINE_BATCH, seed=0)
        if dist.steps_per_epoch % steps_per_execution:
            raise ValueError(f"steps_per_execution {steps_per_execution} does not divide "
                             f"{dist.steps_per_epoch} steps per epoch")
        model = tfmulti.models.build_model("mlp", strategy=strategy)
        tfmulti.models.compile_model(model, strategy=strategy,
                                     steps_per_execution=steps_per_execution)
        model.fit(**dist.fit_kwargs(), epochs=2, verbose=0, callbacks=[Timer()])
        steps = dist.steps_per_epoch
        examples = steps * BASELINE_BATCH
    return {"side": side, "examples_per_second": examples / times[1],
            "epoch_seconds": times[1], "first_epoch_seconds": times[0],
            "examples_per_epoch": examples, "steps_per_epoch": steps,
            "num_replicas": strategy.num_replicas_in_sync,
            "devices": list(strategy.extended.worker_devices),
            "steps_per_execution": 1 if side == "seed" else steps_per_execution}


def _run_baseline_side(side: str) -> dict:
    command = [sys.executable, os.path.abspath(__file__), f"--baseline_worker={side}",
               f"--baseline_steps_per_execution={_BASELINE_SPE.value}"]
    result = subprocess.run(command, capture_output=True, text=True, timeout=600)
    if result.returncode != 0:
        raise RuntimeError(f"baseline benchmark ({side}) failed:\n{result.stderr[-3000:]}")
    return json.loads(result.stdout.strip().splitlines()[-1])


def baseline_suite(repeats: int) -> dict:
    seed, ours, ratios = [], [], []
    info = {}
    for repeat in range(repeats):
        start = time.monotonic()
        a = _run_baseline_side("seed")
        b = _run_baseline_side("tfmulti")
        info = {"seed": {k: v for k, v in a.items() if k not in ("examples_per_second",)},
                "tfmulti": {k: v for k, v in b.items() if k not in ("examples_per_second",)}}
        seed.append(a["examples_per_second"])
        ours.append(b["examples_per_second"])
        ratios.append(ours[-1] / seed[-1])
        print(f"baseline repeat {repeat + 1}/{repeats}: seed {seed[-1]:,.0f} ex/s "
              f"({a['num_replicas']} replica(s)), tfmulti {ours[-1]:,.0f} ex/s "
              f"({b['num_replicas']} replica(s), steps_per_execution "
              f"{_BASELINE_SPE.value}), ratio {ratios[-1]:.2f}x "
              f"({time.monotonic() - start:.0f} s)", flush=True)
    return {
        "description": "seed 000 as written (plain Keras, MirroredStrategy() default devices, "
                       "fit on NumPy, batch 32, steps_per_execution 1) vs tfmulti (mirrored, "
                       "data.distribute, build_model mlp, compile_model steps_per_execution "
                       "K), batch 32, each in its own process with 2 virtual CPUs; "
                       "examples/s of epoch 2",
        "global_batch_size": BASELINE_BATCH,
        "steps_per_execution": _BASELINE_SPE.value,
        "examples_per_second_seed": seed,
        "examples_per_second_tfmulti": ours,
        "examples_per_second_seed_summary": summary(seed),
        "examples_per_second_tfmulti_summary": summary(ours),
        "baseline_speedup": summary(ratios),
        "last_repeat": info,
        "goal": 1.8,
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
            data = [r["examples_per_second_1_worker"], r["examples_per_second_2_workers"]]
            ax.boxplot(data, tick_labels=["1 worker", "2 workers"])
            s = r["multi_worker_scaling"]
            ax.set_title(f"Scaling (CNN): {s['median']:.2f}x "
                         f"[{s['min']:.2f}-{s['max']:.2f}], hardware ceiling "
                         f"{r['hardware_ceiling']['median']:.2f}x", fontsize=9)
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
        elif name == "baseline":
            r = results["suites"][name]
            ax.boxplot([r["examples_per_second_seed"], r["examples_per_second_tfmulti"]],
                       tick_labels=["seed 000", f"tfmulti (K={r['steps_per_execution']})"])
            s = r["baseline_speedup"]
            ax.set_title(f"Baseline (MLP, batch 32): {s['median']:.2f}x "
                         f"[{s['min']:.2f}-{s['max']:.2f}]", fontsize=9)
            ax.set_ylabel("examples / s (epoch 2)")
    fig.tight_layout()
    fig.savefig(path, dpi=100)


def main(argv):
    if _PIPELINE_WORKER.value:
        print(json.dumps(pipeline_worker(json.loads(_PIPELINE_WORKER.value))))
        return
    if _BASELINE_WORKER.value:
        print(json.dumps(baseline_worker(_BASELINE_WORKER.value, _BASELINE_SPE.value)))
        return
    suites = SUITES if _SUITE.value == "all" else (_SUITE.value,)
    results = {
        "command": " ".join(["python", "recipes/benchmark.py", *sys.argv[1:]]),
        "cpu_count": os.cpu_count(),
        "repeats": _REPEATS.value,
        "suites": {},
    }
    for name in suites:
        results["suites"][name] = {"scaling": scaling_suite,
                                   "pipeline": pipeline_suite,
                                   "baseline": baseline_suite}[name](_REPEATS.value)
    os.makedirs(os.path.dirname(os.path.abspath(_OUTPUT.value)), exist_ok=True)
    with open(_OUTPUT.value, "w") as f:
        json.dump(results, f, indent=2)
    png = os.path.splitext(_OUTPUT.value)[0] + ".png"
    plot(results, png)
    for name, r in results["suites"].items():
        if name == "scaling":
            s = r["multi_worker_scaling"]
            c = r["hardware_ceiling"]
            print(f"scaling: 2 vs 1 pinned workers {s['median']:.2f}x "
                  f"(min {s['min']:.2f}, max {s['max']:.2f}, {s['n']} repeats); hardware "
                  f"ceiling {c['median']:.2f}x (min {c['min']:.2f}, max {c['max']:.2f})")
        if name == "pipeline":
            sp, ef = r["pipeline_speedup"], r["pipeline_efficiency"]
            print(f"pipeline: speedup over naive {sp['median']:.2f}x (min {sp['min']:.2f}, "
                  f"max {sp['max']:.2f}); efficiency {ef['median']:.2f} (min {ef['min']:.2f}, "
                  f"max {ef['max']:.2f}); {r['ceiling']}")
        if name == "baseline":
            sp = r["baseline_speedup"]
            a = r["examples_per_second_seed_summary"]
            b = r["examples_per_second_tfmulti_summary"]
            print(f"baseline: tfmulti / seed 000 {sp['median']:.2f}x (min {sp['min']:.2f}, "
                  f"max {sp['max']:.2f}); seed {a['median']:,.0f} ex/s, tfmulti "
                  f"{b['median']:,.0f} ex/s (medians, steps_per_execution "
                  f"{r['steps_per_execution']})")
    print(f"wrote {_OUTPUT.value} and {png}")


if __name__ == "__main__":
    _common.run(main)
