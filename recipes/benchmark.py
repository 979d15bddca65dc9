"""tfmulti benchmarks: ratios measured in one run, medians of several repeats.

    python recipes/benchmark.py --suite=scaling --repeats=5 --output=runs/bench/scaling.json

Suites:
  scaling  Multi-worker scaling on the CNN: 2 workers pinned to their own cores
           (`tfmulti launch --pin_cpus`) vs 1 pinned worker, at the same
           per-worker batch (so 2 workers process twice the global batch per
           step). Figure: throughput ratio (goal >= 1.8x, 90% efficiency).
           Each repeat runs both configurations back to back (interleaved, so
           drift on a shared machine hits both alike); throughput is the
           recipe's steady-state examples/s (median epoch after the first).
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

SUITES = ("scaling",)
_SUITE = flags.DEFINE_enum("suite", "all", [*SUITES, "all"], "Which benchmarks to run.")
_OUTPUT = flags.DEFINE_string("output", "runs/benchmark.json", "Where to write the JSON.")
_REPEATS = flags.DEFINE_integer("repeats", 5, "Repeats of each measurement.", lower_bound=1)
_PER_WORKER_BATCH = flags.DEFINE_integer("per_worker_batch", 64, "Scaling: batch per worker.",
                                         lower_bound=1)
_NUM_EXAMPLES = flags.DEFINE_integer("num_examples", 6144,
                                     "Scaling: synthetic examples per epoch.", lower_bound=1)
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
    result = subprocess.run(command, capture_output=True, text=True, timeout=900)
    if result.returncode != 0:
        raise RuntimeError(f"benchmark run failed ({result.returncode}): "
                           f"{' '.join(command)}\n{result.stdout[-3000:]}{result.stderr[-3000:]}")
    with open(os.path.join(model_dir, "metrics.json")) as f:
        return json.load(f)["examples_per_second"]


def scaling_suite(repeats: int) -> dict:
    cores = len(os.sched_getaffinity(0))
    if cores < 2:
        raise ValueError(f"the scaling suite needs at least 2 cores for 2 pinned workers, "
                         f"this process may use {cores}.")
    one, two, ratios = [], [], []
    with tempfile.TemporaryDirectory(prefix="tfmulti-bench-") as tmp:
        for repeat in range(repeats):
            start = time.monotonic()
            a = _train_under_launcher(1, os.path.join(tmp, f"one-{repeat}"))
            b = _train_under_launcher(2, os.path.join(tmp, f"two-{repeat}"))
            one.append(a)
            two.append(b)
            ratios.append(b / a)
            print(f"scaling repeat {repeat + 1}/{repeats}: 1 worker {a:,.0f} ex/s, "
                  f"2 workers {b:,.0f} ex/s, ratio {b / a:.2f}x "
                  f"({time.monotonic() - start:.0f} s)", flush=True)
    return {
        "description": "2 pinned workers vs 1 pinned worker, CNN, same per-worker batch",
        "per_worker_batch": _PER_WORKER_BATCH.value,
        "examples_per_epoch": _NUM_EXAMPLES.value,
        "examples_per_second_1_worker": one,
        "examples_per_second_2_workers": two,
        "speedup_2_vs_1_workers": summary(ratios),
        "goal": 1.8,
        "ceiling": f"{cores} cores: 2 workers on 1 core each can at most double 1 worker "
                   "on 1 core (2.0x), less what gradient all-reduce costs",
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
            s = r["speedup_2_vs_1_workers"]
            ax.set_title(f"Scaling (CNN): {s['median']:.2f}x "
                         f"[{s['min']:.2f}-{s['max']:.2f}], goal {r['goal']}x")
            ax.set_ylabel("examples / s (steady state)")
    fig.tight_layout()
    fig.savefig(path, dpi=100)


def main(argv):
    suites = SUITES if _SUITE.value == "all" else (_SUITE.value,)
    results = {
        "command": " ".join(["python", "recipes/benchmark.py", *sys.argv[1:]]),
        "cpu_count": os.cpu_count(),
        "repeats": _REPEATS.value,
        "suites": {},
    }
    for name in suites:
        results["suites"][name] = {"scaling": scaling_suite}[name](_REPEATS.value)
    os.makedirs(os.path.dirname(os.path.abspath(_OUTPUT.value)), exist_ok=True)
    with open(_OUTPUT.value, "w") as f:
        json.dump(results, f, indent=2)
    png = os.path.splitext(_OUTPUT.value)[0] + ".png"
    plot(results, png)
    for name, r in results["suites"].items():
        if name == "scaling":
            s = r["speedup_2_vs_1_workers"]
            print(f"scaling: 2 vs 1 pinned workers {s['median']:.2f}x "
                  f"(min {s['min']:.2f}, max {s['max']:.2f}, {s['n']} repeats); {r['ceiling']}")
    print(f"wrote {_OUTPUT.value} and {png}")


if __name__ == "__main__":
    _common.run(main)
