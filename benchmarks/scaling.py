"""scaling: multi-worker scaling of the CNN, 2 pinned workers vs 1.

`recipes/train.py --distribution=multi_worker` (the CNN on synthetic data)
under `tfmulti launch --pin_cpus`: 2 workers pinned to one core each vs 1
worker pinned to one core, at the same per-worker batch (so 2 workers
process twice the global batch per step), the same steps per
`tf.function` call for both (--scaling_steps_per_execution). Each launch
gets exactly as many cores as it has workers.

A launch costs several seconds before its first step, so each launch trains
several epochs (--epochs): a round launches both configurations back to back
(interleaved, so drift on a shared machine hits both alike), and each epoch
after the first is a repeat (examples/s of that epoch, paired with the other
launch's same epoch); there are as many rounds as the repeats need. Each
round also runs the same training as 2 independent 1-worker runs at once,
one per core (independent_pair_scaling: what the cores give without any
synchronization), and 2 matmul processes (`hardware_ceiling`).

With `simulated_hosts` (where network namespaces can be made: root), each
round also runs the 2-worker training across 2 simulated hosts
(`benchmarks.simulated_hosts`: network namespaces joined by a bridge, one
`tfmulti launch --hosts ... --pin_cpus` in each, each on one core, 1 worker
per host): the same work as the single-host 2-worker launch, through a
virtual network instead of loopback. The two run back to back, in alternating
order from round to round, so that drift over a round hits both alike.

Figures: multi_worker_scaling = 2-worker / 1-worker examples/s (goal >=
1.8x, 90% efficiency); synchronization_efficiency = multi_worker_scaling /
independent_pair_scaling; efficiency_vs_ceiling = multi_worker_scaling /
hardware_ceiling; simulated_hosts_scaling = 2 simulated hosts x 1 worker /
1-worker examples/s, and simulated_hosts_vs_single_host = that over
multi_worker_scaling, epoch by epoch (goal: within 5% of 1.0, the simulated
network adding no real cost); all_reduce = milliseconds per all-reduce of the
CNN's gradients between 2 pinned workers (`all_reduce_worker`), on one host and
across 2 simulated hosts, and its share of a 2-worker step: the network's cost
measured directly, apart from the noise of whole training runs. Also
MirroredStrategy over 1, 2 and 4 virtual CPUs in one process ("virtual_devices",
`benchmarks.devices`).
"""

from __future__ import annotations

import dataclasses
import functools
import json
import math
import os
import statistics
import subprocess
import sys
import tempfile
import time

from tfmulti.utils import checks
from benchmarks import _harness, cpus, devices
from benchmarks import simulated_hosts as simulated_hosts_lib
from tfmulti.config.train_config import TrainConfig

__all__ = ["TRAIN_RECIPE", "all_reduce_milliseconds", "all_reduce_worker", "check",
           "launch_command", "plot", "run", "summarize", "train_config"]

TRAIN_RECIPE = os.path.join(_harness.REPO_ROOT, "recipes", "train.py")
"""The training recipe the launches run (of the checkout holding `benchmarks`)."""
# The TrainConfig fields a launch sets, in the order of its command line.
_LAUNCH_FIELDS = ("distribution", "model", "dataset", "num_examples", "epochs",
                  "global_batch_size", "steps_per_execution", "model_dir")
_LAUNCH_TIMEOUT = 900
TOY = {"per_worker_batch": 32, "num_examples": 64, "steps_per_execution": 1, "epochs": 2,
       "simulated_hosts": False, "all_reduce_iterations": 2, "all_reduce_repeats": 1}
"""The toy size (`_harness.toy`: the end-to-end test), overriding `run`'s options: one
round (epochs 2 and 1 repeat), launches of 2 and 1 steps per epoch, no simulated hosts,
2 all-reduces timed once; the virtual devices at `devices.TOY`. The 1-worker figures
come from the independent pair's first run (the same 1-worker launch on one core), not
from a launch of their own."""


@dataclasses.dataclass(frozen=True)
class _Launches:
    per_worker_batch: int
    num_examples: int
    steps_per_execution: int
    epochs: int


def train_config(num_workers: int, model_dir: str, *, per_worker_batch: int = 512,
                 num_examples: int = 12288, steps_per_execution: int = 12,
                 epochs: int = 4) -> TrainConfig:
    """The training run of each worker of a launch of `num_workers` workers."""
    config = TrainConfig(distribution="multi_worker", model="cnn", dataset="synthetic",
                         num_examples=num_examples, epochs=epochs,
                         global_batch_size=per_worker_batch * num_workers,
                         steps_per_execution=steps_per_execution, model_dir=model_dir)
    config.validate()
    return config


def _launcher_command(argv: list[str], num_workers: int, hosts: str | None,
                      host_rank: int) -> list[str]:
    """`tfmulti launch --pin_cpus -- argv`: of `num_workers` workers on this host, or
    host `host_rank`'s launcher of a launch across `hosts` ("HOST:N,...")."""
    where = ([f"--hosts={hosts}", f"--host_rank={host_rank}"] if hosts
             else [f"--num_workers={num_workers}"])
    return [sys.executable, "-m", "tfmulti.cli", "launch", *where, "--pin_cpus", "--", *argv]


def launch_command(num_workers: int, model_dir: str, *, hosts: str | None = None,
                   host_rank: int = 0, **options) -> list[str]:
    """`tfmulti launch --pin_cpus` of `recipes/train.py` with `train_config`'s flags: of
    `num_workers` workers on this host, or host `host_rank`'s launcher of a launch across
    `hosts` ("HOST:N,...", `num_workers` in all)."""
    return _launcher_command(_train_argv(num_workers, model_dir, **options), num_workers,
                             hosts, host_rank)


def _train_argv(num_workers: int, model_dir: str, **options) -> list[str]:
    """`recipes/train.py` with `train_config`'s flags."""
    config = train_config(num_workers, model_dir, **options)
    return [sys.executable, TRAIN_RECIPE,
            *(f"--{name}={getattr(config, name)}" for name in _LAUNCH_FIELDS)]


def all_reduce_worker(out_dir: str, iterations: int = 200, repeats: int = 5) -> dict:
    """Milliseconds per all-reduce of the CNN's gradients among the workers of this
    process's cluster (TF_CONFIG): a sum over the workers of one tensor per trainable
    weight of the scaling suite's CNN, as each training step does, `iterations` of them
    in one `tf.function` call, timed `repeats` times after a warm-up call. Worker i
    writes its record to `out_dir`/worker{i}.json and returns it."""
    import tensorflow as tf

    from tfmulti.models import builders as models
    from tfmulti.runtime import strategy as strategy_lib

    strategy = strategy_lib.get_strategy("multi_worker")
    shapes = [w.shape for w in models.build_model("cnn", strategy=strategy).trainable_weights]
    with strategy.scope():
        grads = [tf.Variable(tf.random.stateless_normal(shape, seed=(0, i)))
                 for i, shape in enumerate(shapes)]

    def all_reduce():
        summed = tf.distribute.get_replica_context().all_reduce(
            "sum", [g.read_value() for g in grads])
        return tf.add_n([tf.reduce_sum(t) for t in summed])

    @tf.function
    def reduce_n(n):
        total = tf.constant(0.0)
        for _ in tf.range(n):  # each sum depends on the last: no two overlap
            total = strategy.run(all_reduce) + 0.0 * total
        return total

    float(reduce_n(tf.constant(5)))  # the warm-up traces the function
    local_sum = sum(float(tf.reduce_sum(g)) for g in grads)
    reduced_sum = float(reduce_n(tf.constant(1)))  # every worker's, the same tensors
    milliseconds = []
    for _ in range(repeats):
        start = time.perf_counter()
        float(reduce_n(tf.constant(iterations)))
        milliseconds.append((time.perf_counter() - start) / iterations * 1e3)
    index = strategy.cluster_resolver.task_id
    record = {"worker": index, "bytes": 4 * sum(int(math.prod(s)) for s in shapes),
              "tensors": len(shapes), "iterations": iterations,
              "workers": strategy.num_replicas_in_sync, "local_sum": local_sum,
              "reduced_sum": reduced_sum,
              "milliseconds_per_all_reduce": milliseconds}
    with open(os.path.join(out_dir, f"worker{index}.json"), "w") as f:
        json.dump(record, f)
    return record


def _epoch_throughputs(model_dir: str) -> list[float]:
    """examples/s of each epoch after the first, from the run's metrics.json."""
    with open(os.path.join(model_dir, "metrics.json")) as f:
        metrics = json.load(f)
    examples = metrics["steps_per_epoch"] * metrics["global_batch_size"]
    return [examples / seconds for seconds in metrics["epoch_seconds"][1:]]


def _check(process, output: str) -> None:
    if process.returncode != 0:
        raise RuntimeError(f"benchmark run failed ({process.returncode}): "
                           f"{' '.join(process.args)}\n{output[-6000:]}")


def _train_under_launcher(num_workers: int, model_dir: str, launches: _Launches) -> list[float]:
    """examples/s of each epoch after the first of recipes/train.py under
    `tfmulti launch --pin_cpus`."""
    command = launch_command(num_workers, model_dir, **dataclasses.asdict(launches))
    # Give the whole launch `num_workers` cores, so that `--pin_cpus` hands each
    # worker exactly one: 1 worker on 1 core vs 2 workers on 1 core each.
    cores = sorted(os.sched_getaffinity(0))[:num_workers]
    result = subprocess.run(command, stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                            text=True, timeout=_LAUNCH_TIMEOUT,
                            preexec_fn=lambda: os.sched_setaffinity(0, cores))
    _check(result, result.stdout)
    return _epoch_throughputs(model_dir)


def _train_independent_pair(model_dir: str, launches: _Launches) -> list[list[float]]:
    """examples/s per epoch of 2 independent 1-worker runs at once, one per
    core (no communication), one list per core; summed epoch by epoch, the
    most a synchronous 2-worker run of the same work can reach on these 2
    cores (and twice the slower core, if one core stays slower)."""
    cores = sorted(os.sched_getaffinity(0))[:2]
    runs = []
    try:
        for core in cores:
            folder = os.path.join(model_dir, f"core-{core}")
            runs.append((folder, subprocess.Popen(
                launch_command(1, folder, **dataclasses.asdict(launches)),
                stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                preexec_fn=lambda core=core: os.sched_setaffinity(0, [core]))))
        outputs = [process.communicate(timeout=_LAUNCH_TIMEOUT)[0] for _, process in runs]
    finally:
        for _, process in runs:  # none left behind after a timeout or a failed start
            if process.poll() is None:
                process.kill()
                process.wait()
    for (_, process), output in zip(runs, outputs):
        _check(process, output)
    return [_epoch_throughputs(folder) for folder, _ in runs]


def _across_simulated_hosts(argv: list[str]) -> None:
    """Runs `argv` as a 2-worker launch across 2 simulated hosts, 1 worker each, each
    host's launcher (and so its worker) on a core of its own."""
    cores = sorted(os.sched_getaffinity(0))[:2]
    processes = []
    with simulated_hosts_lib.SimulatedHosts(2) as sim:
        hosts = ",".join(f"{address}:1" for address in sim.addresses)
        try:
            for rank, core in enumerate(cores):
                processes.append(subprocess.Popen(
                    sim.command(rank, _launcher_command(argv, 2, hosts, rank)),
                    stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                    env=sim.launch_env(_harness.worker_env()),
                    preexec_fn=lambda core=core: os.sched_setaffinity(0, [core])))
            outputs = [p.communicate(timeout=_LAUNCH_TIMEOUT)[0] for p in processes]
        finally:
            for process in processes:  # leaving the namespaces kills what is left in them
                if process.poll() is None:
                    process.kill()
                    process.wait()
    for process, output in zip(processes, outputs):
        _check(process, output)


def _train_on_simulated_hosts(model_dir: str, launches: _Launches) -> list[float]:
    """examples/s of each epoch after the first of the 2-worker training across 2
    simulated hosts (`_across_simulated_hosts`)."""
    _across_simulated_hosts(_train_argv(2, model_dir, **dataclasses.asdict(launches)))
    return _epoch_throughputs(model_dir)


def all_reduce_milliseconds(out_dir: str, *, across_hosts: bool, iterations: int = 200,
                            repeats: int = 5) -> tuple[list[float], int]:
    """`all_reduce_worker`'s milliseconds per all-reduce (worker 0's) and bytes reduced,
    of 2 pinned workers on this host (loopback) or `across_hosts` (2 simulated hosts x 1
    worker, through their virtual network).

    Raises:
        RuntimeError: the launch failed, or a worker's record is not that of worker i of
            2 whose reduced sum is both workers' sum.
    """
    os.makedirs(out_dir)
    argv = _harness.worker_command("all_reduce", out_dir=out_dir, iterations=iterations,
                                   repeats=repeats)
    if across_hosts:
        _across_simulated_hosts(argv)
    else:
        _harness.launch_pinned(argv, 2, timeout=_LAUNCH_TIMEOUT)
    records = []
    for index in range(2):
        with open(os.path.join(out_dir, f"worker{index}.json")) as f:
            records.append(json.load(f))
    for index, record in enumerate(records):
        if (record["worker"], record["workers"]) != (index, 2) or not math.isclose(
                record["reduced_sum"], 2 * record["local_sum"], rel_tol=1e-4, abs_tol=1e-2):
            raise RuntimeError(f"the all-reduce between 2 workers did not sum both on "
                               f"worker {index}: {record}")
    return records[0]["milliseconds_per_all_reduce"], records[0]["bytes"]


def _back_to_back(round_: int, on_one_host, across_hosts):
    """(on_one_host(), across_hosts()), the two called one right after the other, in
    alternating order from round to round, so that the machine's drift over a round
    (minutes) weighs on both alike; across_hosts None (no simulated hosts): (on_one_host(),
    None)."""
    if across_hosts is None:
        return on_one_host(), None
    if round_ % 2:
        across = across_hosts()
        return on_one_host(), across
    one = on_one_host()
    return one, across_hosts()


def _checked(per_worker_batch, num_examples, steps_per_execution, epochs) -> _Launches:
    launches = _Launches(
        per_worker_batch=checks.positive_int("per_worker_batch", per_worker_batch),
        num_examples=checks.positive_int("num_examples", num_examples),
        steps_per_execution=checks.positive_int("steps_per_execution", steps_per_execution),
        epochs=checks.integer("epochs", epochs, minimum=2,
                               hint="the first epoch of a launch is a warm-up"))
    spe = launches.steps_per_execution
    steps = [launches.num_examples // (launches.per_worker_batch * n) for n in (1, 2)]
    if not all(steps):
        raise ValueError(f"`num_examples` ({launches.num_examples}) must hold at least one "
                         f"step of 2 workers ({2 * launches.per_worker_batch} examples).")
    if any(s % spe for s in steps):
        raise ValueError(f"the scaling suite's steps per execution ({spe}; "
                         f"--scaling_steps_per_execution of recipes/benchmark.py) must divide "
                         f"the steps per epoch of 1 and of 2 workers ({steps[0]} and "
                         f"{steps[1]}); use a common divisor such as {math.gcd(*steps)}.")
    return launches


def check(*, per_worker_batch: int = 512, num_examples: int = 12288,
          steps_per_execution: int = 12, epochs: int = 4, simulated_hosts: bool = True) -> None:
    """Checks the options of `run` (before anything runs).

    Raises:
        ValueError: a bad option, or a steps per execution that does not
            divide the steps per epoch of 1 and of 2 workers.
    """
    _checked(per_worker_batch, num_examples, steps_per_execution, epochs)
    if not isinstance(simulated_hosts, bool):
        raise ValueError(f"`simulated_hosts` must be True or False, got {simulated_hosts!r}.")


def run(repeats: int, *, per_worker_batch: int = 512, num_examples: int = 12288,
        steps_per_execution: int = 12, epochs: int = 4, simulated_hosts: bool = True) -> dict:
    """Runs the suite; returns its JSON record.

    Args:
        repeats: paired epochs of the 1- and 2-worker launches.
        per_worker_batch: batch per worker (at 256, each step's fixed costs,
            the all-reduce round trip among them, weigh twice as much).
        num_examples: synthetic examples per epoch.
        steps_per_execution: steps per call of every launch; must divide the
            steps per epoch of 1 and of 2 workers.
        epochs: epochs per launch (the first is a warm-up).
        simulated_hosts: also train across 2 simulated hosts x 1 worker in each round,
            where network namespaces can be made (else recorded as skipped, with why).

    Raises:
        ValueError: fewer than 2 cores, or inconsistent options.
        FileNotFoundError: `TRAIN_RECIPE` is missing (not a checkout).
    """
    checks.positive_int("repeats", repeats)
    _checked(per_worker_batch, num_examples, steps_per_execution, epochs)
    reduce_options = {}
    if _harness.toy():
        per_worker_batch, num_examples, steps_per_execution, epochs, simulated_hosts = (
            TOY[k] for k in ("per_worker_batch", "num_examples", "steps_per_execution",
                             "epochs", "simulated_hosts"))
        reduce_options = {"iterations": TOY["all_reduce_iterations"],
                          "repeats": TOY["all_reduce_repeats"]}
    launches = _checked(per_worker_batch, num_examples, steps_per_execution, epochs)
    cores = len(os.sched_getaffinity(0))
    if cores < 2:
        raise ValueError(f"the scaling suite needs at least 2 cores for 2 pinned workers, "
                         f"this process may use {cores}.")
    if not os.path.isfile(TRAIN_RECIPE):
        raise FileNotFoundError(f"the scaling suite launches {TRAIN_RECIPE}, which does not "
                                f"exist; run it from a tfmulti checkout.")
    # Repeat i of a round pairs epoch i of its two launches (rounds interleave
    # the two over time).
    timed = epochs - 1
    rounds = -(-repeats // timed)
    one, two, pair, ratios, pair_ratios, ceilings, efficiencies = [], [], [], [], [], [], []
    per_core = [[], []]
    simulated, simulated_ratios, versus = [], [], []
    reduce_one, reduce_across, reduced_bytes = [], [], 0
    skipped = None if simulated_hosts else "not asked for (simulated_hosts=False)"
    if simulated_hosts and not simulated_hosts_lib.available()[0]:
        skipped = simulated_hosts_lib.available()[1]
    simulated_hosts = skipped is None
    with tempfile.TemporaryDirectory(prefix="benchmark-scaling-") as tmp:
        for round_ in range(rounds):
            start = time.monotonic()
            # At toy size the 1-worker figures are those of the independent pair's first
            # run below: the same 1-worker launch on one core, whose figures mean nothing
            # there; a launch of its own would only start one more TensorFlow process.
            a = (None if _harness.toy() else
                 _train_under_launcher(1, os.path.join(tmp, f"one-{round_}"), launches))
            b, d = _back_to_back(
                round_,
                functools.partial(_train_under_launcher, 2, os.path.join(tmp, f"two-{round_}"),
                                  launches),
                functools.partial(_train_on_simulated_hosts,
                                  os.path.join(tmp, f"hosts-{round_}"), launches)
                if simulated_hosts else None)
            reduce_in = {where: functools.partial(
                all_reduce_milliseconds, os.path.join(tmp, f"all-reduce-{where}-{round_}"),
                across_hosts=where == "hosts", **reduce_options) for where in ("one", "hosts")}
            (milliseconds, reduced_bytes), across = _back_to_back(
                round_, reduce_in["one"], reduce_in["hosts"] if simulated_hosts else None)
            reduce_one += milliseconds
            if across:
                reduce_across += across[0]
            cores_rates = _train_independent_pair(os.path.join(tmp, f"pair-{round_}"),
                                                  launches)
            if a is None:
                a = cores_rates[0]
            c = [sum(rates) for rates in zip(*cores_rates)]
            for rates, core in zip(cores_rates, per_core):
                core += rates
            ceiling = cpus.hardware_ceiling(_harness.ceiling_seconds(2.0))
            one += a
            two += b
            pair += c
            ratios += [y / x for x, y in zip(a, b)]
            if simulated_hosts:
                simulated += d
                simulated_ratios += [w / x for x, w in zip(a, d)]
                versus += [w / y for y, w in zip(b, d)]
            pair_ratios += [z / x for x, z in zip(a, c)]
            ceilings.append(ceiling)
            efficiencies += [y / x / ceiling for x, y in zip(a, b)]
            print(f"scaling round {round_ + 1}/{rounds}: 2 vs 1 pinned workers "
                  f"{', '.join(f'{y / x:.2f}x' for x, y in zip(a, b))}; 2 independent "
                  f"1-worker runs {', '.join(f'{z / x:.2f}x' for x, z in zip(a, c))} (per "
                  f"core {' + '.join(f'{statistics.median(r):,.0f}' for r in cores_rates)} "
                  f"ex/s); "
                  f"hardware ceiling {ceiling:.2f}x"
                  + (f"; 2 simulated hosts x 1 worker vs 1 "
                     f"{', '.join(f'{w / x:.2f}x' for x, w in zip(a, d))}"
                     if simulated_hosts else "")
                  + f"; all-reduce {statistics.median(milliseconds):.2f} ms on one host"
                  + (f", {statistics.median(across[0]):.2f} ms across simulated hosts"
                     if across else "")
                  + f" ({time.monotonic() - start:.0f} s)", flush=True)
    summary = _harness.summary
    step_ms = 2e3 * per_worker_batch / statistics.median(two)
    return {
        "description": "2 workers on 1 core each vs 1 worker on 1 core (tfmulti launch "
                       "--pin_cpus), CNN, same per-worker batch; per round one launch of each, "
                       f"{timed} timed epochs after a warm-up one, paired epoch by epoch",
        "per_worker_batch": per_worker_batch,
        "steps_per_execution": steps_per_execution,
        "examples_per_epoch": num_examples,
        "epochs_per_launch": epochs,
        "rounds": rounds, "toy": _harness.toy(),
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
        "simulated_hosts": (
            {"examples_per_second": simulated,
             "simulated_hosts_scaling": summary(simulated_ratios),
             "simulated_hosts_vs_single_host": summary(versus), "goal": "within 5% of 1.0"}
            if simulated_hosts else {"skipped": skipped}),
        "all_reduce": {
            "description": "milliseconds per all-reduce (sum) of the CNN's gradients between "
                           "2 pinned workers, on one host (loopback) and across 2 simulated "
                           "hosts (their virtual network), as in each training step; "
                           "share_of_step: the median over the 2-worker launch's median "
                           "step time",
            "bytes": reduced_bytes,
            "milliseconds_one_host": reduce_one,
            "milliseconds_simulated_hosts": reduce_across,
            "one_host": summary(reduce_one),
            **({"simulated_hosts": summary(reduce_across)} if reduce_across else {}),
            "step_milliseconds_2_workers": step_ms,
            "share_of_step": statistics.median(reduce_across or reduce_one) / step_ms,
        },
        "virtual_devices": devices.run(repeats),
    }


def summarize(r: dict) -> list[str]:
    """The suite's headline lines."""
    fmt = _harness.fmt
    lines = [f"scaling: 2 vs 1 pinned workers {fmt(r['multi_worker_scaling'])}; "
             f"2 independent 1-worker runs at once vs 1 "
             f"{fmt(r['independent_pair_scaling'])}; synchronization efficiency "
             f"{fmt(r['synchronization_efficiency'], '')}; matmul hardware ceiling "
             f"{fmt(r['hardware_ceiling'])}"]
    hosts = r.get("simulated_hosts", {})
    if "simulated_hosts_scaling" in hosts:
        lines.append(f"scaling: 2 simulated hosts x 1 pinned worker vs 1 "
                     f"{fmt(hosts['simulated_hosts_scaling'])}; vs the single-host 2-worker "
                     f"launch {fmt(hosts['simulated_hosts_vs_single_host'], '')}")
    reduce = r.get("all_reduce")
    if reduce:  # records before run 16 have none
        lines.append(
            f"scaling: all-reduce of the CNN's gradients ({reduce['bytes'] / 1e3:.0f} kB) "
            f"{fmt(reduce['one_host'], ' ms', 3)} on one host"
            + (f", {fmt(reduce['simulated_hosts'], ' ms', 3)} across 2 simulated hosts"
               if "simulated_hosts" in reduce else "")
            + f": {100 * reduce['share_of_step']:.1f}% of a 2-worker step "
              f"({reduce['step_milliseconds_2_workers']:.0f} ms)")
    for key in ("virtual_devices_2_vs_1", "virtual_devices_4_vs_1"):
        lines.append(f"scaling: MirroredStrategy {key.split('_')[2]} virtual devices vs 1 "
                     f"{fmt(r['virtual_devices'][key])}; ceiling 1.0 (they share the cores)")
    return lines


def plot(r: dict, ax) -> None:
    """Steady-state examples/s of 1 worker, 2 workers, 2 independent runs and 2 simulated
    hosts."""
    data = [r["examples_per_second_1_worker"], r["examples_per_second_2_workers"],
            r["examples_per_second_independent_pair"]]
    labels = ["1 worker", "2 workers", "2 independent"]
    if r.get("simulated_hosts", {}).get("examples_per_second"):
        data.append(r["simulated_hosts"]["examples_per_second"])
        labels.append("2 sim. hosts")
    ax.boxplot(data, tick_labels=labels)
    s = r["multi_worker_scaling"]
    ax.set_title(f"Scaling (CNN): {s['median']:.2f}x "
                 f"[{s['min']:.2f}-{s['max']:.2f}]; 2 independent runs "
                 f"{r['independent_pair_scaling']['median']:.2f}x", fontsize=9)
    ax.set_ylabel("examples / s (steady state)")
