"""engines: throughput of the same 2-worker run under each cluster engine, against
`tfmulti launch`.

    python -m benchmarks.engines --repeats=3 --output=runs/bench/engines.json

The run is the `scaling` suite's 2-worker training (`scaling.train_config`: the
CNN on synthetic data, 512 examples per worker and step, 12 steps per call, 4
epochs) through `recipes/train.py --distribution=multi_worker`, on this
machine, with each engine's defaults (no pinning):

  launch   `tfmulti launch --num_workers 2 -- python recipes/train.py ...`
           (the workers' cluster from TF_CONFIG)
  srun     `srun --ntasks=2 python recipes/train.py ... --cluster_resolver=slurm`
           on a private one-node SLURM (`benchmarks.slurm_cluster`; root,
           Debian's slurm-wlm and munge) started once for the run
  ray      `tfmulti.ray.train(config, num_workers=2)`: Ray Train's
           TensorflowTrainer on a local Ray started once for the run (1 CPU per
           worker, Ray's default; Ray sets OMP_NUM_THREADS=1)

A round runs every engine once, in an order that rotates from round to round
(drift on a shared machine hits all alike); each run's figure is the
examples/s of its metrics.json (the median of its epochs after the first).
Figures: each engine's examples/s (median over the rounds) and its ratio to
`launch` in the same round (median over the rounds; goal: within 5% of 1.0).

An engine is a function in `ENGINES`: given an `ExitStack` for what it starts
(closed at the end of the run), it returns a function that trains a
`TrainConfig` on 2 workers and returns their metrics.json.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import platform
import statistics
import subprocess
import sys
import tempfile
import time
from typing import Callable

from benchmarks import _harness, scaling
from tfmulti.config.train_config import TrainConfig

__all__ = ["ENGINES", "NUM_WORKERS", "launch_engine", "main", "ray_engine", "run",
           "srun_engine", "summarize"]

NUM_WORKERS = 2
_TIMEOUT_S = 1800
# TrainConfig fields on each run's command line (model_dir added per run).
_FIELDS = ("distribution", "model", "dataset", "num_examples", "epochs", "global_batch_size",
           "steps_per_execution")
TOY = {"per_worker_batch": 32, "num_examples": 128, "steps_per_execution": 1, "epochs": 2}

Trainer = Callable[[TrainConfig], dict]


def _train_argv(config: TrainConfig) -> list[str]:
    return [sys.executable, scaling.TRAIN_RECIPE,
            *(f"--{name}={getattr(config, name)}" for name in _FIELDS),
            f"--model_dir={config.model_dir}"]


def _metrics(config: TrainConfig, output: str) -> dict:
    path = os.path.join(config.model_dir, "metrics.json")
    if not os.path.exists(path):
        raise RuntimeError(f"no metrics.json in {config.model_dir}:\n{output[-4000:]}")
    with open(path) as f:
        return json.load(f)


def launch_engine(stack: contextlib.ExitStack) -> Trainer:
    """`tfmulti launch --num_workers 2`: the reference."""

    def train(config: TrainConfig) -> dict:
        command = [sys.executable, "-m", "tfmulti.cli", "launch",
                   f"--num_workers={NUM_WORKERS}", "--", *_train_argv(config)]
        result = subprocess.run(command, stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                                text=True, timeout=_TIMEOUT_S, env=_harness.worker_env())
        if result.returncode != 0:
            raise RuntimeError(f"launch failed ({result.returncode}):\n{result.stdout[-4000:]}")
        return _metrics(config, result.stdout)

    return train


def srun_engine(stack: contextlib.ExitStack) -> Trainer:
    """`srun --ntasks=2` on a private one-node SLURM, started here once."""
    from benchmarks import slurm_cluster

    cluster = stack.enter_context(slurm_cluster.SlurmCluster())

    def train(config: TrainConfig) -> dict:
        command = ["srun", f"--ntasks={NUM_WORKERS}", "--label", *_train_argv(config),
                   "--cluster_resolver=slurm"]
        result = cluster.run(command, timeout=_TIMEOUT_S, check=False,
                             env=cluster.env(_harness.worker_env()))
        if result.returncode != 0:
            raise RuntimeError(f"srun failed ({result.returncode}):\n"
                               f"{(result.stdout + result.stderr)[-4000:]}")
        return _metrics(config, result.stdout)

    return train


def ray_engine(stack: contextlib.ExitStack) -> Trainer:
    """`tfmulti.ray.train` on 2 Ray Train workers, on a local Ray started here once."""
    import ray

    from tfmulti.ray import train as train_on_ray

    ray.init(address="local", num_cpus=max(os.cpu_count() or 1, NUM_WORKERS))
    stack.callback(ray.shutdown)

    def train(config: TrainConfig) -> dict:
        # Ray's folder for the run next to model_dir (model_dir holds tfmulti's files only).
        where, name = os.path.split(config.model_dir)
        # No backup: the same work as under launch (which is given none).
        return train_on_ray(config, num_workers=NUM_WORKERS, max_failures=0, name=name,
                            storage_path=os.path.join(where, "ray-storage"),
                            backup=False).metrics

    return train


ENGINES: dict[str, Callable[[contextlib.ExitStack], Trainer]] = {
    "launch": launch_engine,
    "srun": srun_engine,
    "ray": ray_engine,
}
"""Every engine by name; "launch" is the reference the others are held against."""


def run(repeats: int = 3, engines: tuple[str, ...] = tuple(ENGINES)) -> dict:
    """Runs `repeats` rounds of the 2-worker training under each of `engines`
    ("launch" is always among them); returns the JSON record."""
    unknown = [name for name in engines if name not in ENGINES]
    if unknown or repeats < 1:
        raise ValueError(f"engines must be among {', '.join(ENGINES)} (got {unknown}) and "
                         f"repeats >= 1 (got {repeats}).")
    names = ["launch", *[name for name in engines if name != "launch"]]
    sizes = _harness.toy_sized({}, TOY)
    examples: dict[str, list[float]] = {name: [] for name in names}
    ratios: dict[str, list[float]] = {name: [] for name in names if name != "launch"}
    start = time.monotonic()
    with contextlib.ExitStack() as stack, tempfile.TemporaryDirectory(prefix="engines") as tmp:
        trainers = {name: ENGINES[name](stack) for name in names}
        for round_ in range(repeats):
            order = names[round_ % len(names):] + names[:round_ % len(names)]
            figures = {}
            for name in order:
                config = scaling.train_config(
                    NUM_WORKERS, os.path.join(tmp, f"{name}-{round_}"), **sizes)
                figures[name] = trainers[name](config)["examples_per_second"]
                examples[name].append(figures[name])
            for name in ratios:
                ratios[name].append(figures[name] / figures["launch"])
            print(f"engines round {round_ + 1}/{repeats}: " + ", ".join(
                f"{name} {figures[name]:,.0f} examples/s" for name in names), flush=True)
    return {"suite": "engines", "repeats": repeats, "machine": platform.node(),
            "cpus": os.cpu_count(), "load_average": os.getloadavg(),
            "config": {name: getattr(scaling.train_config(NUM_WORKERS, "x", **sizes), name)
                       for name in _FIELDS},
            "examples_per_second": {n: _harness.summary(v) for n, v in examples.items()},
            "vs_launch": {n: _harness.summary(v) for n, v in ratios.items()},
            "raw": {"examples_per_second": examples, "vs_launch": ratios},
            "seconds": time.monotonic() - start}


def summarize(record: dict) -> list[str]:
    """The headline lines of a record."""
    lines = [f"{name}: {_harness.fmt(s, ' examples/s', 0)}"
             for name, s in record["examples_per_second"].items()]
    lines += [f"{name} / launch: {_harness.fmt(s)} (goal: within 5% of 1.00x)"
              for name, s in record["vs_launch"].items()]
    return lines


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m benchmarks.engines",
                                     description=__doc__.split("\n\n")[0])
    parser.add_argument("--repeats", type=int, default=3, help="rounds (default 3)")
    parser.add_argument("--engines", default=",".join(ENGINES),
                        help=f"engines to run, of {', '.join(ENGINES)} (default: all)")
    parser.add_argument("--output", default="runs/bench/engines.json", help="the JSON record")
    args = parser.parse_args(argv)
    try:
        record = run(args.repeats, tuple(filter(None, args.engines.split(","))))
    except ValueError as e:
        parser.error(str(e))
    os.makedirs(os.path.dirname(os.path.abspath(args.output)), exist_ok=True)
    with open(args.output, "w") as f:
        json.dump(record, f, indent=2)
    for line in summarize(record):
        print(line)
    print(f"engines: {record['seconds']:.0f} s; wrote {args.output}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
