"""What the suites share: worker processes, summaries, the machine record,
atomic JSON, the figure. Standard library only at import (no TensorFlow).

Every measurement runs in a fresh process (`run_worker`), because virtual
devices and thread counts must be set before TensorFlow starts; a worker
(`python -m benchmarks.worker KIND CONFIG_JSON`) prints one JSON line. At toy
size, where the figures mean nothing, every `run_worker` of a benchmark run goes
to one shared worker process instead (`python -m benchmarks.worker --serve`):
one TensorFlow start for the run, not one per measurement.
"""

from __future__ import annotations

import atexit
import json
import os
import select
import statistics
import subprocess
import sys
import tempfile
import time

from tfmulti.utils import checks

__all__ = ["REPO_ROOT", "TOY_DEVICES", "TOY_ENV", "ceiling_seconds", "close_shared_worker",
           "first_examples", "fmt", "launch_pinned", "machine_worker", "plot_results",
           "plot_step_seconds", "report", "run_sized_worker", "run_worker", "run_workers",
           "set_threads", "summary", "toy", "toy_sized", "worker_env"]

WORKER_MODULE = "benchmarks.worker"
REPO_ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
"""The checkout holding `benchmarks` (and the `tfmulti` it runs, and `recipes/`):
first on the workers' PYTHONPATH, so that a worker imports the same packages
wherever the benchmark was started from."""

TOY_ENV = "TFMULTI_BENCH_TOY"
"""The toy switch (`recipes/benchmark.py --toy` sets it): when "1", every suite
runs its whole code path at toy sizes (each suite's `TOY`, next to its real
sizes), in seconds, for the end-to-end test; its figures mean nothing. The
worker processes inherit it (`worker_env`)."""


def toy() -> bool:
    """Whether the suites run at toy size (`TOY_ENV` is "1")."""
    return os.environ.get(TOY_ENV, "") == "1"


def toy_sized(real: dict, toy_values: dict) -> dict:
    """`real` with `toy_values` over it when `toy()`, else a copy of `real`."""
    return {**real, **toy_values} if toy() else dict(real)


TOY_CEILING_SECONDS = 0.2
"""`cpus.hardware_ceiling`'s seconds at toy size (`ceiling_seconds`)."""


def ceiling_seconds(seconds: float) -> float:
    """`seconds` for `cpus.hardware_ceiling`, `TOY_CEILING_SECONDS` at toy size."""
    return TOY_CEILING_SECONDS if toy() else seconds


def first_examples(dataset: str, train_examples: int, test_examples: int | None = None):
    """A dataset function (for `TrainConfig.dataset`) of the named dataset's first
    `train_examples` training and `test_examples` (default: all) test examples,
    taken before the run's input caches and shuffles them: a toy run reads only
    those, not the whole dataset (a shuffle fills its buffer first)."""

    def first(data_dir=None):
        from tfmulti import data

        train, test = (data.load(dataset, split, data_dir=data_dir)
                       for split in ("train", "test"))
        info = data.dataset_info(dataset, data_dir)
        return {"train": train.take(train_examples),
                "test": test if test_examples is None else test.take(test_examples),
                "num_classes": info["num_classes"], "task": info["task"]}

    return first


def summary(values: list[float]) -> dict:
    """The median, min, max and count of one figure's repeats."""
    return {"median": statistics.median(values), "min": min(values), "max": max(values),
            "n": len(values)}


def fmt(s: dict, unit: str = "x", digits: int = 2) -> str:
    """A `summary` as text: '1.93x (min 1.90x, max 1.97x, 5 repeats)'."""
    return (f"{s['median']:.{digits}f}{unit} (min {s['min']:.{digits}f}, max "
            f"{s['max']:.{digits}f}, {s['n']} repeats)")


def report(suite: str, start: float, lines: list[str]) -> None:
    """Prints one line per repeat, then the suite's wall time since `start`."""
    for i, line in enumerate(lines):
        print(f"{suite} repeat {i + 1}/{len(lines)}: {line}", flush=True)
    print(f"{suite}: {time.monotonic() - start:.0f} s", flush=True)


def worker_command(kind: str, **config) -> list[str]:
    """The command line of one worker process."""
    return [sys.executable, "-m", WORKER_MODULE, kind, json.dumps(config)]


def worker_env() -> dict:
    """This environment, with this checkout first on PYTHONPATH (`benchmarks`
    and `tfmulti`)."""
    path = os.environ.get("PYTHONPATH")
    return {**os.environ,
            "PYTHONPATH": REPO_ROOT + (os.pathsep + path if path else "")}


TOY_DEVICES = 4
"""The logical CPUs of the shared toy-size worker (`run_worker`), configured
before its first worker runs: the most any worker asks for (the `devices`
worker's 4); a worker's own `configure_virtual_devices(n)`, n <= 4, then
changes nothing."""


class _SharedWorker:
    """The toy-size worker process (`python -m benchmarks.worker --serve`):
    one `[kind, config]` JSON line in on its stdin, one `{"result": ...}` or
    `{"error": traceback}` line out on its stdout per call; its stderr (and
    what the workers print) goes to a temporary file, shown when it fails."""

    def __init__(self):
        self.log = tempfile.TemporaryFile(mode="w+")
        self.process = subprocess.Popen(
            [sys.executable, "-m", WORKER_MODULE, "--serve", str(TOY_DEVICES)],
            stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=self.log, text=True,
            env=worker_env())

    def _log_tail(self) -> str:
        self.log.seek(0)
        return self.log.read()[-3000:]

    def call(self, kind: str, config: dict, timeout: float) -> dict:
        failed = f"benchmark worker {kind} {config} failed (the shared toy-size worker"
        try:
            self.process.stdin.write(json.dumps([kind, config]) + "\n")
            self.process.stdin.flush()
            ready = select.select([self.process.stdout], [], [], timeout)[0]
            line = self.process.stdout.readline() if ready else None
        except BrokenPipeError:
            line = ""
        if line is None:  # the worker still runs: no end of input would stop it
            self.process.kill()
            self.close()
            raise subprocess.TimeoutExpired(self.process.args, timeout)
        if not line:
            self.close()
            raise RuntimeError(f"{failed} ended, {self.process.returncode}):\n{self._log_tail()}")
        reply = json.loads(line)
        if "error" in reply:
            raise RuntimeError(f"{failed}):\n{reply['error'][-3000:]}")
        return reply["result"]

    def close(self) -> None:
        """Ends the process (end of its input; killed if it is still running 60 s
        later)."""
        try:
            self.process.stdin.close()
        except BrokenPipeError:
            pass
        try:
            self.process.wait(timeout=60)
        except subprocess.TimeoutExpired:
            self.process.kill()
            self.process.wait()
        self.process.stdout.close()
        self.log.close()


_shared: list[_SharedWorker] = []  # the toy-size worker, once started


def close_shared_worker() -> None:
    """Ends the shared toy-size worker of `run_worker`, if one runs (also at exit)."""
    while _shared:
        _shared.pop().close()


atexit.register(close_shared_worker)


def run_worker(kind: str, timeout: float = 900, **config) -> dict:
    """Runs worker `kind` with `config` (its keyword arguments) in a fresh
    process; returns the JSON object it printed last. At toy size (`toy`), in
    the shared worker process instead (started by the first call, ended at
    exit or by `close_shared_worker`; a timeout or a crash ends it, the next
    call starts another).

    Raises:
        RuntimeError: the worker failed or printed no result (its stderr's
            tail, or its traceback, in the message).
        subprocess.TimeoutExpired: it ran longer than `timeout` seconds.
    """
    if toy():
        if not _shared or _shared[0].process.poll() is not None:
            close_shared_worker()
            _shared.append(_SharedWorker())
        try:
            return _shared[0].call(kind, config, timeout)
        finally:
            if _shared and _shared[0].process.poll() is not None:
                close_shared_worker()
    result = subprocess.run(worker_command(kind, **config), capture_output=True, text=True,
                            timeout=timeout, env=worker_env())
    lines = result.stdout.strip().splitlines()
    if result.returncode != 0 or not lines:
        raise RuntimeError(f"benchmark worker {kind} {config} failed ({result.returncode}):\n"
                           f"{result.stderr[-3000:]}")
    return json.loads(lines[-1])


def run_sized_worker(kind: str, repeats: int, real: dict,
                     toy_values: dict) -> tuple[dict, float, dict]:
    """A one-worker suite's run: `repeats` checked, worker `kind` run at the
    settings of its size (`toy_sized`); (the settings, the start time for
    `report`, the worker's result)."""
    checks.positive_int("repeats", repeats)
    settings = toy_sized(real, toy_values)
    start = time.monotonic()
    return settings, start, run_worker(kind, repeats=repeats, **settings)


def run_workers(calls: list[tuple[str, dict]], timeout: float = 900) -> list[dict]:
    """Runs each `(kind, config)` of `calls` as `run_worker` does, in turn; returns
    their results in order.

    At toy size all of them run in one process (worker kind "several",
    `benchmarks.worker.run_several`, in the shared worker of `run_worker`): one
    TensorFlow start for the lot instead of one per measurement. The calls must
    then set TensorFlow up alike (at most `TOY_DEVICES` virtual devices);
    threads are those the first worker of the process set (`set_threads`).
    """
    if not toy():
        return [run_worker(kind, timeout, **config) for kind, config in calls]
    return run_worker("several", timeout,
                      calls=[[kind, config] for kind, config in calls])["results"]


def set_threads(intra_op: int | None = None, inter_op: int | None = None) -> None:
    """Sets TensorFlow's intra-op and inter-op threads (None: its default), which
    must happen before its runtime starts. At toy size, where workers share a
    process (`run_workers`), a later worker finds the runtime started and keeps
    the threads the first one set (the figures mean nothing there)."""
    import tensorflow as tf

    try:
        if intra_op is not None:
            tf.config.threading.set_intra_op_parallelism_threads(intra_op)
        if inter_op is not None:
            tf.config.threading.set_inter_op_parallelism_threads(inter_op)
    except RuntimeError:  # "... cannot be modified after initialization"
        if not toy():
            raise


def launch_pinned(command: list[str], num_workers: int, timeout: float = 900) -> str:
    """Runs `command` as `num_workers` workers under `tfmulti launch --pin_cpus`,
    the launch confined to the first `num_workers` cores of this process, so
    that each worker gets exactly one; returns what the launch printed.

    Args:
        command: each worker's command line (e.g. `worker_command(...)`).
        num_workers: workers, and cores, of the launch.
        timeout: seconds the whole launch may take.

    Raises:
        RuntimeError: the launch failed (its output's tail in the message).
        subprocess.TimeoutExpired: it ran longer than `timeout` seconds.
    """
    launch = [sys.executable, "-m", "tfmulti.cli", "launch", f"--num_workers={num_workers}",
              "--pin_cpus", "--", *command]
    cores = sorted(os.sched_getaffinity(0))[:num_workers]
    result = subprocess.run(launch, stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                            text=True, timeout=timeout, env=worker_env(),
                            preexec_fn=lambda: os.sched_setaffinity(0, cores))
    if result.returncode != 0:
        raise RuntimeError(f"benchmark launch failed ({result.returncode}): "
                           f"{' '.join(launch)}\n{result.stdout[-6000:]}")
    return result.stdout


def machine_worker() -> dict:
    """What the figures depend on beyond the core count: the CPU, whether
    TensorFlow runs its oneDNN kernels (several times faster convolutions;
    on by default only on CPUs with AVX-512 neural-network features), the
    versions."""
    from tfmulti.insight import environment

    env = environment.env_report()
    return {key: env[key] for key in ("cpu_model", "onednn", "cpu_count", "tensorflow",
                                      "keras", "platform")}


def plot_step_seconds(step_seconds: dict, ax, title: str) -> None:
    """A suite's panel: the median step time of each configuration (name ->
    `summary` of seconds per step), min-max as error bars."""
    names = list(step_seconds)
    medians = [step_seconds[n]["median"] * 1000 for n in names]
    ax.bar(names, medians,
           yerr=[[m - step_seconds[n]["min"] * 1000 for n, m in zip(names, medians)],
                 [step_seconds[n]["max"] * 1000 - m for n, m in zip(names, medians)]])
    ax.set_ylabel("training step (ms)")
    ax.set_title(title)


def plot_results(results: dict, path: str, draw: dict) -> None:
    """One panel per suite of `results["suites"]`, side by side, saved to
    `path`; `draw` maps a suite name to its `plot(result, ax)`."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    suites = list(results["suites"])
    fig, axes = plt.subplots(1, len(suites), figsize=(5 * len(suites), 4), squeeze=False)
    for ax, name in zip(axes[0], suites):
        draw[name](results["suites"][name], ax)
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)
