"""The benchmark suites of tfmulti: ratios measured in one run, medians of several repeats.

    python recipes/benchmark.py --suite=scaling --repeats=5 --output=runs/bench/scaling.json

Suites (`benchmarks`; each suite module's docstring explains its method):
  scaling    2 pinned workers vs 1 (`tfmulti launch --pin_cpus`), on one host
             and on 2 simulated hosts, and MirroredStrategy over 1, 2 and 4
             virtual CPUs
  pipeline   a 2-stage pipeline: naive split, GPipe M = 2 and 4, serial step
  baseline   seed 000's program as written vs tfmulti: throughput at batch 32
             and time to a test accuracy of 0.87
  overhead   tfmulti's fit vs a hand-written tf.distribute loop
  streaming  input and compute of equal cost on a core each, overlapped
  own        your own model and data functions vs the built-in MLP, and
             TFRecord files on 2 pinned workers sharded by files vs examples
  tensor     the transformer: tensor-parallel T=2 vs unsplit, pipeline vs naive
  memory     ZeRO on 2 workers: peak memory per worker by zero_stage, and a cap
             under which stage 0 dies and a sharded stage trains
  all        every suite above.

--toy runs every suite's whole code path at toy size (each suite's `TOY`; it
overrides the size flags), in seconds: what the end-to-end test runs
(benchmarks/tests/test_end_to_end.py); its figures mean nothing.

Writes FILE.json after every suite (every measurement, median/min/max of each
ratio, the machine: CPU model and count, whether TensorFlow runs oneDNN,
versions; `complete` once all have run) and FILE.png (a plot).
"""

from __future__ import annotations

import os
import sys

_RECIPES = os.path.dirname(os.path.abspath(__file__))
# A checkout-only script: `benchmarks` sits at the repository root, next to
# `recipes/`, and is not part of the installed package.
sys.path[:0] = [_RECIPES, os.path.dirname(_RECIPES)]
import _common  # noqa: E402  (sets the TF log level before TensorFlow loads)
from absl import flags  # noqa: E402

import benchmarks as bench  # noqa: E402  (no TensorFlow: the suites run it in workers)

_SUITE = flags.DEFINE_multi_enum("suite", ["all"], [*bench.SUITES, "all"],
                                "Which benchmarks to run (repeat the flag for several).")
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
_SIMULATED_HOSTS = flags.DEFINE_boolean(
    "scaling_simulated_hosts", True, "Scaling: also train across 2 simulated hosts x 1 "
    "pinned worker (network namespaces: needs root; recorded as skipped otherwise).")
_EPOCHS = flags.DEFINE_integer("epochs", 4, "Scaling: epochs per launch (the first is a "
                               "warm-up; each later one is a repeat).", lower_bound=2)
_BASELINE_SPE = flags.DEFINE_integer("baseline_steps_per_execution", 125,
                                     "Baseline: tfmulti's steps_per_execution at batch 32 "
                                     "(must divide 625, a third of 60000 // 32 = 1875 steps).",
                                     lower_bound=1)
_OWN_EPOCH_SECONDS = flags.DEFINE_float(
    "own_epoch_seconds", 1.5, "Own: seconds per timed epoch of the own-model vs built-in "
    "measurement (long enough that a 3% difference is not noise).", lower_bound=0.1)
_OWN_EXAMPLES_PER_FILE = flags.DEFINE_integer(
    "own_examples_per_file", 2048, "Own: examples in each of the 8 TFRecord files (about "
    "3.2 kB each) that the pinned workers read.", lower_bound=1)
_TOY = flags.DEFINE_boolean(
    "toy", False, "Run every suite's whole code path at toy size (tiny models, few "
    "examples and steps, one round; each suite's TOY, overriding the size flags above), "
    "in seconds: a smoke test, its figures mean nothing. Sets TFMULTI_BENCH_TOY=1 for "
    "the suites and their workers.")
_OWN_EPOCHS = flags.DEFINE_integer("own_epochs", 4, "Own: epochs per launch of the file "
                                   "workers (the first is a warm-up; each later one is a "
                                   "repeat).", lower_bound=2)


def main(argv):
    if _TOY.value:  # the suites and their worker processes (which inherit it) read it
        os.environ[bench._harness.TOY_ENV] = "1"
    names = list(bench.SUITES) if "all" in _SUITE.value else list(dict.fromkeys(_SUITE.value))
    options = {
        "scaling": {"per_worker_batch": _PER_WORKER_BATCH.value,
                    "num_examples": _NUM_EXAMPLES.value,
                    "steps_per_execution": _SCALING_SPE.value, "epochs": _EPOCHS.value,
                    "simulated_hosts": _SIMULATED_HOSTS.value},
        "baseline": {"steps_per_execution": _BASELINE_SPE.value},
        "own": {"epoch_seconds": _OWN_EPOCH_SECONDS.value,
                "examples_per_file": _OWN_EXAMPLES_PER_FILE.value, "epochs": _OWN_EPOCHS.value},
    }
    bench.run_benchmark(names, _REPEATS.value, _OUTPUT.value, options=options,
                        command=" ".join(["python", "recipes/benchmark.py", *sys.argv[1:]]))


if __name__ == "__main__":
    _common.run(main)
