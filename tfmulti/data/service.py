"""The training input run by other processes: TensorFlow's tf.data service.

When the host's CPUs cannot prepare batches as fast as the devices train on
them (`tfmulti diagnose` says so), the input pipeline can run elsewhere: in
tf.data service workers on the cores the trainer does not use, or on other
hosts, which send the finished batches over gRPC.

    tfmulti train --data_service=local ...            # 1 service worker, started with the run
    tfmulti data-service --port=5050 --cpus=1         # a service of its own (another shell, host)
    tfmulti train --data_service=grpc://HOST:5050 ...

How tfmulti uses it: each input pipeline (one per worker of a multi-worker
job) is built exactly as without the service (`tfmulti.data.input_pipeline`:
the reading, maps, shuffle, batches, this worker's share, the repeat) and
handed whole to the service (`tf.data.experimental.service.distribute`,
sharding policy DYNAMIC). That pipeline is one split, so one service worker
runs it, in order: the trainer gets the batches it would have made itself, in
the same order, and every training example once per epoch, as without the
service (a second trainer's pipeline may run on another service worker). What
stays in the trainer: the prefetch to the devices.

A pipeline that runs Python (`tf.py_function`, `from_generator`, a
`keras.utils.PyDataset`) cannot run in another process: it is refused in one
line. A service worker lost mid-run ends the trainer's input: the run stops
in one line (`ServiceWatch`), never hangs; a backup resumes it.
"""

from __future__ import annotations

import atexit
import os
import signal
import subprocess
import sys
import threading
import time

import tensorflow as tf

from tfmulti.cluster import watchdog
from tfmulti.config.train_config import DATA_SERVICE_ENV, data_service_target
from tfmulti.utils import human

__all__ = ["DEFAULT_TIMEOUT_S", "LocalService", "PYTHON_OPS", "ServiceLost", "ServiceWatch",
           "check_reachable", "is_service_end", "local", "python_ops", "resolve", "serve",
           "stop_local", "through_service"]

DEFAULT_TIMEOUT_S = 300.0
"""Seconds a training step may wait for its batch from the service before the
run stops (a worker or the dispatcher lost); the first step, which also traces
and compiles the model, gets `FIRST_STEP_FACTOR` times as long."""
FIRST_STEP_FACTOR = 4
SLOW_CALL_FACTOR = 3
"""A run whose calls (steps_per_execution steps) take long waits this many
times its longest call before it stops, if that is longer than the timeout."""
READY = "tfmulti-data-service-worker-ready"
"""The line a service worker prints once it serves (`tfmulti.data.service_worker`)."""
PYTHON_OPS = frozenset({"PyFunc", "PyFuncStateless", "EagerPyFunc"})
"""The ops that call back into the trainer's Python interpreter."""
_START_TIMEOUT_S = 120.0
_WORKER_TIMEOUT_MS = 10_000
_JOB_GC_MS = 30_000
"""A job (an iterator's pipeline, its cache) freed this soon after its last
reader left (TensorFlow's default: 5 minutes, every 10, holding each fit's
copy of a cached dataset meanwhile)."""


class ServiceLost(RuntimeError):
    """The training input's service stopped serving mid-run (a lost worker)."""


_local: dict[int, "LocalService"] = {}


def local(num_workers: int) -> "LocalService":
    """A service of `num_workers` workers on this host, started on first use
    and kept for the process's later runs (`stop_local` ends them)."""
    if not _local:
        atexit.unregister(stop_local)
        atexit.register(stop_local)
    if num_workers not in _local:
        _local[num_workers] = LocalService(num_workers).start()
    return _local[num_workers]


def stop_local() -> None:
    """Stops the services `local` started."""
    while _local:
        _local.popitem()[1].stop()


def check_reachable(address: str, timeout_s: float = 5.0) -> None:
    """Raises ValueError (one line) when no dispatcher listens at `address`
    (grpc://HOST:PORT)."""
    if not watchdog.reachable(address.partition("://")[2], timeout_s):
        raise ValueError(
            f"`data_service`: no tf.data service dispatcher answers at {address}; start one "
            "with `tfmulti data-service` (it prints its address), or use "
            "--data_service=local to start one with the run.")


def resolve(value: str | None) -> tuple[str | None, str | None]:
    """A run's `data_service` (or $TFMULTI_DATA_SERVICE when it is None) as the
    address its input reads from, with a line that says so: a service started
    here for local[:N], a reachable dispatcher's address, or (None, None).

    Raises:
        ValueError: a malformed value, or no dispatcher at the address.
    """
    if value is None and os.environ.get(DATA_SERVICE_ENV, "").strip():
        value = os.environ[DATA_SERVICE_ENV]
        try:
            target = data_service_target(value)
        except ValueError as e:
            raise ValueError(f"{DATA_SERVICE_ENV}: {e}") from None
    elif value is None:
        return None, None
    else:
        target = data_service_target(value)
    if target.startswith("local:"):
        count = int(target.partition(":")[2])
        address = local(count).target
        return address, (f"training input from a tf.data service at {address} "
                         f"({human.count(count, 'worker')} on this host, started with the run)")
    check_reachable(target)
    return target, f"training input from the tf.data service at {target}"


def python_ops(dataset: tf.data.Dataset) -> list[str]:
    """The ops of `dataset`'s graph that run Python code (`PYTHON_OPS`), sorted."""
    graph = tf.compat.v1.GraphDef.FromString(
        dataset._as_serialized_graph(  # pylint: disable=protected-access
            external_state_policy=tf.data.experimental.ExternalStatePolicy.WARN).numpy())
    ops = {node.op for node in graph.node}
    for function in graph.library.function:
        ops.update(node.op for node in function.node_def)
    return sorted(ops & PYTHON_OPS)


def through_service(dataset: tf.data.Dataset, address: str,
                    infinite: bool = True) -> tf.data.Dataset:
    """`dataset` (one input pipeline, per-replica batches, repeating) read
    from the tf.data service at `address`: the same elements in the same order.
    `infinite`: the pipeline repeats (an end is then the service's failure).

    Raises:
        ValueError: the pipeline runs Python code, which a service worker (another
            process) cannot run.
    """
    found = python_ops(dataset)
    if found:
        raise ValueError(
            f"the training input runs Python code ({', '.join(found)}: a tf.py_function, "
            "Dataset.from_generator, or a PyDataset or generator), which a tf.data service "
            "worker cannot run in its own process; express it in TensorFlow ops "
            "(Dataset.map over tf functions), or train without --data_service.")
    served = dataset.apply(tf.data.experimental.service.distribute(
        processing_mode=tf.data.experimental.service.ShardingPolicy.DYNAMIC,
        service=address))
    if not infinite:
        return served
    # The pipeline repeats forever: an end means the service lost its worker
    # (DYNAMIC hands a split out once), and is an error, not a short epoch.
    return served.apply(tf.data.experimental.assert_cardinality(tf.data.INFINITE_CARDINALITY))


def is_service_end(error: BaseException) -> bool:
    """Whether `error` is the served input's end (`through_service`)."""
    return "expected to contain an infinite number of elements" in str(error)


class ServiceWatch:
    """Stops a process whose training waits too long for the service.

    A trainer blocked on a lost service worker waits inside TensorFlow for
    ever; this thread notices that no step ended within `timeout_s` (the first
    within `FIRST_STEP_FACTOR` times that; a run whose calls take longer, within
    `SLOW_CALL_FACTOR` times its longest), writes one line to stderr and ends
    the process with status 1 (`tfmulti launch --max_restarts` then restarts
    the job, which resumes from its backup).
    """

    def __init__(self, address: str, timeout_s: float = DEFAULT_TIMEOUT_S):
        self.address, self.timeout_s = address, timeout_s
        self._last = time.monotonic()
        self._steps = 0
        self._longest = 0.0
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._watch, name="tfmulti-service-watch",
                                        daemon=True)

    def start(self) -> "ServiceWatch":
        self._last = time.monotonic()
        self._thread.start()
        return self

    def progress(self) -> None:
        """A step (or an evaluation batch) ended."""
        now = time.monotonic()
        if self._steps:  # the first call also traces: not a call's usual time
            self._longest = max(self._longest, now - self._last)
        self._steps += 1
        self._last = now

    def stop(self) -> None:
        self._stop.set()

    def _limit(self) -> float:
        # A call of many long steps may take longer than the timeout on its own:
        # the limit grows to SLOW_CALL_FACTOR times the longest call seen.
        if not self._steps:
            return self.timeout_s * FIRST_STEP_FACTOR
        return max(self.timeout_s, SLOW_CALL_FACTOR * self._longest)

    def _watch(self) -> None:
        while not self._stop.wait(min(1.0, self.timeout_s / 10)):
            waited = time.monotonic() - self._last
            if waited > self._limit():
                sys.stderr.write(
                    f"tfmulti: error: no training step ended for {waited:.0f} s, reading its "
                    f"input from the tf.data service at {self.address} (a service worker "
                    "or dispatcher lost, this worker's or another's); stopping. A run with "
                    "--backup_dir resumes from its backup (tfmulti launch --max_restarts "
                    "restarts it); raise --data_service_timeout if steps are that slow.\n")
                sys.stderr.flush()
                os._exit(1)  # pylint: disable=protected-access  (the main thread is blocked)


class LocalService:
    """A dispatcher in this process and `num_workers` service workers as child
    processes of it, on this host (`tfmulti data-service`, `--data_service=local`).

    Args:
        num_workers: service workers to start.
        cpus: the cores the workers are pinned to (all of them share these);
            default: this process's.
        port: the dispatcher's port (0: a free one).
        host: the name the workers give the dispatcher for themselves (what
            trainers on other hosts connect to); localhost by default.
        imports: modules each worker imports first (custom ops a dataset uses).
        dispatcher: HOST:PORT of another host's dispatcher to start workers
            for, instead of a dispatcher here.
    """

    protocol = "grpc"

    def __init__(self, num_workers: int = 1, cpus=None, port: int = 0, host: str = "localhost",
                 imports=(), dispatcher: str | None = None):
        self.num_workers, self.cpus, self.port, self.host = num_workers, cpus, port, host
        self.imports = tuple(imports)
        self._remote = dispatcher and data_service_target(dispatcher).partition("://")[2]
        self.dispatcher = None
        self.workers: list[subprocess.Popen] = []

    @property
    def target(self) -> str:
        """The dispatcher's address, as trainers pass it (grpc://HOST:PORT)."""
        return f"{self.protocol}://{self._dispatcher_address()}"

    def _dispatcher_address(self) -> str:
        if self._remote:
            return self._remote
        return f"{self.host}:{self.dispatcher.target.rpartition(':')[2]}"

    def start(self) -> "LocalService":
        svc = tf.data.experimental.service
        if not self._remote:
            self.dispatcher = svc.DispatchServer(svc.DispatcherConfig(
                port=self.port, protocol=self.protocol, worker_timeout_ms=_WORKER_TIMEOUT_MS,
                job_gc_check_interval_ms=_JOB_GC_MS, job_gc_timeout_ms=_JOB_GC_MS))
        try:
            self.workers = [self._start_worker() for _ in range(self.num_workers)]
            for worker in self.workers:
                _wait_ready(worker)
        except BaseException:
            self.stop()
            raise
        return self

    def _start_worker(self) -> subprocess.Popen:
        command = [sys.executable, "-m", "tfmulti.data.service_worker",
                   f"--dispatcher={self._dispatcher_address()}", f"--host={self.host}",
                   f"--parent={os.getpid()}"]
        command += [f"--import={name}" for name in self.imports]
        if self.cpus:
            command.append("--cpus=" + ",".join(str(c) for c in sorted(self.cpus)))
        env = {**os.environ, "TF_CPP_MIN_LOG_LEVEL": os.environ.get("TF_CPP_MIN_LOG_LEVEL", "2")}
        return subprocess.Popen(command, stdout=subprocess.PIPE, text=True, env=env)

    def check_workers(self) -> list[tuple[int, int]]:
        """(index, exit code) of each worker that has ended."""
        return [(i, w.returncode) for i, w in enumerate(self.workers) if w.poll() is not None]

    def restart(self, index: int) -> None:
        """Starts worker `index` anew."""
        self.workers[index] = self._start_worker()
        _wait_ready(self.workers[index])

    def stop(self) -> None:
        """Stops the workers (SIGTERM, then SIGKILL) and the dispatcher."""
        for worker in self.workers:
            if worker.poll() is None:
                worker.terminate()
        for worker in self.workers:
            try:
                worker.wait(timeout=10)
            except subprocess.TimeoutExpired:
                worker.kill()
                worker.wait()
            if worker.stdout:
                worker.stdout.close()
        self.workers = []
        if self.dispatcher is not None:
            self.dispatcher._stop()  # pylint: disable=protected-access  (no public stop)
            self.dispatcher = None

    def __enter__(self):
        return self.start()

    def __exit__(self, *exc) -> None:
        self.stop()


def _wait_ready(worker: subprocess.Popen) -> None:
    """Reads the worker's stdout until it says it is ready (or ends)."""
    result: list[str] = []

    def read():
        for line in worker.stdout:
            if line.strip() == READY:
                result.append(line)
                return

    reader = threading.Thread(target=read, daemon=True)
    reader.start()
    reader.join(_START_TIMEOUT_S)
    if not result:
        worker.kill()
        raise RuntimeError(f"a tf.data service worker did not start within "
                           f"{_START_TIMEOUT_S:g} s (exit code {worker.poll()}); its output "
                           "is above.")


def serve(num_workers: int = 1, port: int = 0, cpus=None, host: str = "localhost",
          imports=(), dispatcher: str | None = None) -> int:
    """`tfmulti data-service`: starts a service and keeps it until SIGINT or
    SIGTERM; a worker that ends is started anew (said in one line). With
    `dispatcher`, only workers that join that dispatcher (another host's).
    Returns the exit status (0)."""
    stop = threading.Event()
    for sig in (signal.SIGINT, signal.SIGTERM):
        signal.signal(sig, lambda *_: stop.set())
    service = LocalService(num_workers, cpus, port, host, imports, dispatcher)
    with service:
        where = f" on CPUs {sorted(cpus)}" if cpus else ""
        print(f"tfmulti: tf.data service at {service.target}: "
              f"{human.count(num_workers, 'worker')}{where}; train with "
              f"--data_service={service.target} (Ctrl-C stops it)", flush=True)
        while not stop.wait(1.0):
            for index, code in service.check_workers():
                print(f"tfmulti: service worker {index} ended (exit code {code}); starting it "
                      "anew", flush=True)
                service.restart(index)
    print("tfmulti: tf.data service stopped", flush=True)
    return 0
