"""The utilization suites of recipes/benchmark.py: baseline (throughput and time
to accuracy against seed 000), overhead, streaming, and the virtual-device part
of scaling.

Every measurement runs in a fresh process (`run_worker`), because virtual
devices and thread counts must be set before TensorFlow starts; a worker
prints one JSON line. Each suite's ratio is taken within a repeat.
"""

from __future__ import annotations

import contextlib
import json
import os
import statistics
import subprocess
import sys
import threading
import time

BENCHMARK = os.path.join(os.path.dirname(os.path.abspath(__file__)), "benchmark.py")
TARGET_ACCURACY = 0.87
BASELINE_BATCH = 32
# tfmulti's side of the time-to-accuracy race: TrainConfig's defaults (global
# batch 256; Adam 1e-3 tuned for base batch 256, so sqrt scaling keeps it and
# no warmup is needed), its default steps per execution ("auto": 26 of the
# 234 steps per epoch per call), and data.distribute's streaming (cache,
# prefetch to the devices), under get_strategy("auto") (MirroredStrategy, 2
# replicas).
TTA_TFMULTI = {"global_batch_size": 256, "learning_rate": 1e-3, "lr_scaling": "sqrt",
               "base_batch_size": 256, "warmup_epochs": 0.0, "steps_per_execution": "auto"}
MAX_EPOCHS = {"seed": 8, "tfmulti": 12}


def summary(values: list[float]) -> dict:
    return {"median": statistics.median(values), "min": min(values), "max": max(values),
            "n": len(values)}


def report(suite: str, start: float, lines: list[str]) -> None:
    """Prints one line per repeat, then the suite's wall time since `start`."""
    for i, line in enumerate(lines):
        print(f"{suite} repeat {i + 1}/{len(lines)}: {line}", flush=True)
    print(f"{suite}: {time.monotonic() - start:.0f} s", flush=True)


def run_worker(kind: str, timeout: float = 900, **config) -> dict:
    """Runs `benchmark.py --worker=...` in a fresh process; returns its JSON line."""
    command = [sys.executable, BENCHMARK, f"--worker={json.dumps({'kind': kind, **config})}"]
    result = subprocess.run(command, capture_output=True, text=True, timeout=timeout)
    if result.returncode != 0:
        raise RuntimeError(f"benchmark worker {kind} {config} failed:\n{result.stderr[-3000:]}")
    return json.loads(result.stdout.strip().splitlines()[-1])


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

    spinning = []
    try:
        spinning.append(spin(cores[0]))
        alone = int(spinning[0].communicate(timeout=60)[0])
        spinning[:] = [spin(c) for c in cores]
        together = sum(int(p.communicate(timeout=60)[0]) for p in spinning)
    finally:
        for p in spinning:  # none left behind after a timeout
            if p.poll() is None:
                p.kill()
                p.wait()
    return together / alone


def machine_worker() -> dict:
    """What the figures depend on beyond the core count: the CPU, whether
    TensorFlow runs its oneDNN kernels (several times faster convolutions;
    on by default only on CPUs with AVX-512 neural-network features), the
    versions."""
    from tfmulti import environment

    report = environment.env_report()
    return {key: report[key] for key in ("cpu_model", "onednn", "cpu_count", "tensorflow",
                                         "keras", "platform")}


def worker(config: dict) -> dict:
    """The `--worker` entry point: dispatches to one of the workers below."""
    kind = config.pop("kind")
    return {"seed": seed_worker, "tfmulti": tfmulti_worker, "overhead": overhead_worker,
            "streaming": streaming_worker, "devices": devices_worker,
            "machine": machine_worker}[kind](**config)


# --------------------------------------------------------------------------
# baseline: seed 000 as written vs tfmulti
# --------------------------------------------------------------------------

def _fashion_mnist_arrays(split: str):
    """Seed 000's `fashion_mnist.load_data()` and `/ 255.0`: the same IDX files
    (the Debian package's), else the prepared TFDS data."""
    import tfmulti.data

    folder, _ = tfmulti.data.find_fashion_mnist_idx()
    if folder is not None:
        images, labels = (tfmulti.data.read_idx(folder / name)
                          for name in tfmulti.data.FASHION_MNIST_FILES[split])
        return images / 255.0, labels
    images, labels = next(iter(tfmulti.data.load("fashion_mnist", split).batch(100_000)
                               .as_numpy_iterator()))
    return images.reshape(-1, 28, 28), labels


def seed_worker(seed: int) -> dict:
    """Seed 000's program as written, with a per-epoch evaluation, until 0.87.

    Plain Keras, `MirroredStrategy()` with its default devices (2 virtual
    CPUs), the MLP built in scope, `adam`, `fit` on NumPy arrays with batch 32
    and `validation_data` (evaluated after each epoch, batch 32). The clock
    starts when the model is built (the arrays are already in memory) and
    stops at the end of the first evaluation reaching 0.87. Also returns the
    training-only examples/s of epoch 2 (the baseline throughput).
    """
    import tfmulti

    tfmulti.configure_virtual_devices(2)
    import keras
    import tensorflow as tf

    train_images, train_labels = _fashion_mnist_arrays("train")
    test_images, test_labels = _fashion_mnist_arrays("test")
    keras.utils.set_random_seed(seed)
    race = _Race()
    race.start()
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
    model.fit(train_images, train_labels, batch_size=BASELINE_BATCH,
              epochs=MAX_EPOCHS["seed"], validation_data=(test_images, test_labels),
              verbose=0, callbacks=[race.callback(lambda logs: logs["val_accuracy"])])
    return {"side": "seed", **race.result(len(train_images)),
            "num_replicas": strategy.num_replicas_in_sync,
            "devices": list(strategy.extended.worker_devices)}


class _Race:
    """Clock of a time-to-accuracy run: training time per epoch (up to the
    evaluation), wall time at each evaluation, first crossing of the target."""

    def start(self):
        self.t0 = time.perf_counter()
        self.train_seconds, self.accuracy, self.wall = [], [], []
        self.time_to_accuracy = None

    def callback(self, accuracy_of):
        import keras

        race = self

        class Race(keras.callbacks.Callback):
            def on_epoch_begin(self, epoch, logs=None):
                self._begin = time.perf_counter()
                self._trained = False

            def on_test_begin(self, logs=None):  # fit's own validation starts
                if not self._trained:
                    race.train_seconds.append(time.perf_counter() - self._begin)
                    self._trained = True

            def on_epoch_end(self, epoch, logs=None):
                if not self._trained:
                    race.train_seconds.append(time.perf_counter() - self._begin)
                    self._trained = True
                accuracy = float(accuracy_of(logs))
                race.accuracy.append(accuracy)
                race.wall.append(time.perf_counter() - race.t0)
                if accuracy >= TARGET_ACCURACY and race.time_to_accuracy is None:
                    race.time_to_accuracy = race.wall[-1]
                    self.model.stop_training = True

        return Race()

    def result(self, examples_per_epoch: int) -> dict:
        return {"time_to_accuracy": self.time_to_accuracy,
                "epochs_to_accuracy": len(self.accuracy) if self.time_to_accuracy else None,
                "accuracy_per_epoch": self.accuracy, "wall_seconds_per_epoch": self.wall,
                "train_seconds_per_epoch": self.train_seconds,
                "examples_per_second": (examples_per_epoch / self.train_seconds[1]
                                        if len(self.train_seconds) > 1 else None)}


def tfmulti_worker(seed: int, steps_per_execution: int) -> dict:
    """tfmulti's side of the baseline, in one process: first the race, then the
    throughput at seed 000's batch.

    Race: tfmulti's defaults (TTA_TFMULTI) until the test accuracy reaches
    0.87, evaluated after each epoch on the whole test split (cached in
    memory after its first read, as the seed holds its arrays); the clock
    starts before the data pipeline and the model are built, so reading and
    caching the data are inside the race.

    Throughput: batch 32 on the same 2 replicas (get_strategy("mirrored"),
    data.distribute, build_model, compile_model(steps_per_execution=K)),
    training examples/s over a full epoch's steps after a warm-up third of
    an epoch (K must divide 1875 / 3 = 625).
    """
    import tfmulti

    tfmulti.configure_virtual_devices(2)
    from tfmulti import data, models, training, utilization

    c = TTA_TFMULTI
    train, test = data.load("fashion_mnist", "train"), data.load("fashion_mnist", "test")
    race = _Race()
    race.start()
    strategy = tfmulti.get_strategy("auto")
    train_input = data.distribute(train, strategy, c["global_batch_size"], seed=seed)
    test_input = data.distribute(test, strategy, c["global_batch_size"], training=False,
                                 cache=True)
    model = models.build_model("mlp", strategy=strategy, seed=seed)
    models.compile_model(
        model, strategy=strategy, learning_rate=c["learning_rate"],
        lr_scaling=c["lr_scaling"], global_batch_size=c["global_batch_size"],
        base_batch_size=c["base_batch_size"], warmup_epochs=c["warmup_epochs"],
        steps_per_epoch=train_input.steps_per_epoch,
        steps_per_execution=training.resolve_steps_per_execution(
            c["steps_per_execution"], train_input.steps_per_epoch))

    def test_accuracy(logs):
        return model.evaluate(**test_input.evaluate_kwargs(), verbose=0,
                              return_dict=True)["accuracy"]

    model.fit(**train_input.fit_kwargs(), epochs=MAX_EPOCHS["tfmulti"], verbose=0,
              callbacks=[race.callback(test_accuracy)])
    result = {"side": "tfmulti", **race.result(train_input.steps_per_epoch
                                               * c["global_batch_size"]),
              "num_replicas": strategy.num_replicas_in_sync, **c,
              "steps_per_execution": model.steps_per_execution}

    strategy = tfmulti.get_strategy("mirrored")
    dist = data.distribute(train, strategy, BASELINE_BATCH, seed=0)
    model = models.build_model("mlp", strategy=strategy)
    models.compile_model(model, strategy=strategy, steps_per_execution=steps_per_execution)
    # A warm-up third of an epoch, then three thirds: one full epoch of steps,
    # its reshuffle included, timed.
    third = dist.steps_per_epoch // 3
    seconds = statistics.mean(utilization.time_fit(model, dist, third, epochs=4))
    result["examples_per_second_batch_32"] = BASELINE_BATCH / seconds
    result["steps_per_execution_batch_32"] = steps_per_execution
    return result


def baseline_suite(repeats: int, steps_per_execution: int) -> dict:
    seed_rate, ours_rate, speedups = [], [], []
    seed_tta, ours_tta, tta_speedups = [], [], []
    runs = []
    for repeat in range(repeats):
        start = time.monotonic()
        # Up to MAX_EPOCHS["seed"] epochs: on the slowest CPU seen, 137-144 s each.
        seed = run_worker("seed", seed=repeat, timeout=2400)
        race = run_worker("tfmulti", seed=repeat, steps_per_execution=steps_per_execution)
        runs.append({"seed": seed, "tfmulti": race})
        seed_rate.append(seed["examples_per_second"])
        ours_rate.append(race["examples_per_second_batch_32"])
        speedups.append(ours_rate[-1] / seed_rate[-1])
        line = (f"baseline repeat {repeat + 1}/{repeats}: batch 32: seed {seed_rate[-1]:,.0f} "
                f"ex/s, tfmulti {ours_rate[-1]:,.0f} ex/s, {speedups[-1]:.2f}x")
        if seed["time_to_accuracy"] and race["time_to_accuracy"]:
            seed_tta.append(seed["time_to_accuracy"])
            ours_tta.append(race["time_to_accuracy"])
            tta_speedups.append(seed_tta[-1] / ours_tta[-1])
            line += (f"; time to {TARGET_ACCURACY}: seed {seed_tta[-1]:.1f} s "
                     f"({seed['epochs_to_accuracy']} epochs), tfmulti {ours_tta[-1]:.1f} s "
                     f"({race['epochs_to_accuracy']} epochs), {tta_speedups[-1]:.2f}x")
        else:
            line += (f"; {TARGET_ACCURACY} not reached (seed {seed['accuracy_per_epoch']}, "
                     f"tfmulti {race['accuracy_per_epoch']})")
        print(f"{line} ({time.monotonic() - start:.0f} s)", flush=True)
    if len(tta_speedups) < repeats:
        print(f"baseline: WARNING: only {len(tta_speedups)} of {repeats} repeats reached "
              f"{TARGET_ACCURACY} on both sides; time_to_accuracy_speedup summarizes those "
              f"(see runs[*].seed/tfmulti.accuracy_per_epoch)", flush=True)
    return {
        "description": "seed 000 as written (plain Keras, MirroredStrategy() default devices, "
                       "fit on NumPy, batch 32, steps_per_execution 1, evaluated after each "
                       "epoch) vs tfmulti, each side in its own process with 2 virtual CPUs",
        "global_batch_size": BASELINE_BATCH,
        "steps_per_execution": steps_per_execution,
        "examples_per_second_seed": seed_rate,
        "examples_per_second_tfmulti": ours_rate,
        "examples_per_second_seed_summary": summary(seed_rate),
        "examples_per_second_tfmulti_summary": summary(ours_rate),
        "baseline_speedup": summary(speedups),
        "target_accuracy": TARGET_ACCURACY,
        "tfmulti_tta_config": TTA_TFMULTI,
        "time_to_accuracy_seed": seed_tta,
        "time_to_accuracy_tfmulti": ours_tta,
        "time_to_accuracy_seed_summary": summary(seed_tta) if seed_tta else None,
        "time_to_accuracy_tfmulti_summary": summary(ours_tta) if ours_tta else None,
        "time_to_accuracy_speedup": summary(tta_speedups) if tta_speedups else None,
        "repeats_reaching_target": len(tta_speedups),
        "runs": runs,
        "goals": {"baseline_speedup": 1.8, "time_to_accuracy_speedup": 4.0},
    }


# --------------------------------------------------------------------------
# overhead: tfmulti's fit vs a hand-written tf.distribute loop
# --------------------------------------------------------------------------

OVERHEAD = {"global_batch_size": 256, "steps_per_execution": 26, "calls_per_block": 4,
            "pairs_per_repeat": 3}


def overhead_worker(repeats: int, global_batch_size: int, steps_per_execution: int,
                    calls_per_block: int, pairs_per_repeat: int) -> dict:
    """Interleaved blocks of `fit` and `CustomLoop`, same work, one process.

    Both train the MLP (same initial weights, Adam 1e-3) on Fashion-MNIST from the same
    `data.distribute` pipeline (own iterators), under MirroredStrategy over 2 virtual CPUs,
    K steps per call; each timed block is `calls_per_block` calls, and a repeat's ratio is
    the total time of its `pairs_per_repeat` fit blocks over that of its loop blocks. `fit`
    runs as `tfmulti.training` runs it (compile_model defaults, steps_per_execution=K,
    verbose 0); the loop's block runs between fit's epochs, outside fit's timed spans.
    """
    import tfmulti

    tfmulti.configure_virtual_devices(2)
    from tfmulti import data, models, optimizers, utilization

    batch, k = global_batch_size, steps_per_execution
    steps = k * calls_per_block
    strategy = tfmulti.get_strategy("mirrored")
    dist = data.distribute(data.load("fashion_mnist"), strategy, batch, seed=0)
    model = models.build_model("mlp", strategy=strategy, seed=0)
    models.compile_model(model, strategy=strategy, steps_per_execution=k)
    reference = models.build_model("mlp", strategy=strategy, seed=0)
    with strategy.scope():  # the optimizer compile_model gives fit: same work
        optimizer = optimizers.fused_adam(1e-3)
    loop = utilization.CustomLoop(reference, strategy, optimizer, batch, k)
    iterator = iter(dist.dataset)
    loop.train(iterator, calls_per_block)  # traces, fills the pipeline
    loop_seconds = []

    def loop_block():
        start = time.perf_counter()
        loop.train(iterator, calls_per_block)
        loop_seconds.append((time.perf_counter() - start) / steps)

    # Two warm-up blocks on each side (tracing, then allocation and tf.data
    # autotuning settle), then `pairs_per_repeat` interleaved pairs per repeat.
    n = pairs_per_repeat
    fit_seconds = utilization.time_fit(model, dist, steps, epochs=2 + n * repeats,
                                       between=loop_block)[1:]
    loop_seconds = loop_seconds[2:]
    ratios = [sum(fit_seconds[n * r:n * (r + 1)]) / sum(loop_seconds[n * r:n * (r + 1)])
              for r in range(repeats)]
    return {"fit_seconds_per_step": fit_seconds, "loop_seconds_per_step": loop_seconds,
            "ratios": ratios}


def overhead_suite(repeats: int) -> dict:
    start = time.monotonic()
    r = run_worker("overhead", repeats=repeats, **OVERHEAD)
    fit, loop = r["fit_seconds_per_step"], r["loop_seconds_per_step"]
    n = OVERHEAD["pairs_per_repeat"]
    parts = [slice(n * i, n * (i + 1)) for i in range(repeats)]
    report("overhead", start, [
        f"fit {statistics.mean(fit[part]) * 1e3:.2f} ms/step, custom loop "
        f"{statistics.mean(loop[part]) * 1e3:.2f} ms/step, ratio {ratio:.3f}"
        for part, ratio in zip(parts, r["ratios"])])
    return {
        "description": "tfmulti fit (compile_model, steps_per_execution K) vs a hand-written "
                       "tf.distribute loop (tfmulti.utilization.CustomLoop: strategy.run in a "
                       "tf.range loop, K steps per tf.function call), same MLP, initial "
                       "weights, Adam, Fashion-MNIST pipeline; MirroredStrategy over 2 "
                       "virtual CPUs; interleaved blocks in one process",
        **OVERHEAD,
        "fit_seconds_per_step": fit, "loop_seconds_per_step": loop,
        "overhead_ratio": summary(r["ratios"]),
        "goal": 1.05,
    }


# --------------------------------------------------------------------------
# streaming: input and compute overlapped by prefetch-to-device
# --------------------------------------------------------------------------

# inter_op 2: the step runs on one inter-op thread while the other serves the
# prefetch-to-device transfers; with 1 they queue behind each other (streaming
# 1.27 x max measured, and even uncoupled input and compute slowed each other
# 1.27x). prefetch_per_replica 32: input and step cost the same on average, so
# the buffer's fill is a random walk, and each time it runs empty (the step
# waits) or full (the input waits) time is lost that the other side, having
# no slack, never makes up; a buffer that outlasts the machine's stalls
# (40-90 ms here, 4-9 steps) rarely hits either end (8 vs 2: 1.09-1.11 vs
# 1.20 x max; 32 vs 8, alternating, 2 repeats each, in a slow phase on
# 2026-12-01: 0.96, 1.06, 1.27, 1.23 vs 1.23, 1.27, 1.42, 1.51). 32 batches
# of 256 MLP inputs are 26 MB.
STREAMING = {"global_batch_size": 256, "steps_per_execution": 16, "num_examples": 16384,
             "cycles": 3, "seconds": 0.5, "inter_op": 2, "prefetch_per_replica": 32}


def _threads() -> set[int]:
    return {int(tid) for tid in os.listdir("/proc/self/task")}


def _pin(threads, cores) -> None:
    for tid in threads:
        try:
            os.sched_setaffinity(tid, cores)
        except OSError:  # the thread ended meanwhile
            pass


@contextlib.contextmanager
def one_core():
    """Confines every thread of this process to one core, then frees them.

    Timing the input or the step "alone" otherwise lets its helper threads
    (tf.data's prefetch and copy, the executor, Python) use the idle second
    core, which they cannot when the other side runs beside it."""
    every = os.sched_getaffinity(0)
    _pin(_threads(), {min(every)})
    try:
        yield
    finally:
        _pin(_threads(), every)


class DeviceCore:
    """One core stands in for the device, the other for its host.

    Built once TensorFlow's runtime has started and before any input pipeline
    runs, it takes the threads that exist then (Python's main thread,
    TensorFlow's inter-op and intra-op pools: the ones that run the step) as
    the step's; every thread started later (tf.data's pools and runners,
    prefetch-to-device's transfers) is the input's. Within `with`, the step's
    threads run on the first core only and the input's on the second only,
    re-checked every 20 ms for new threads (a new thread inherits its
    creator's core, which may be the step's). So each side has exactly the
    core it had when timed alone under `one_core`, as a device and its host
    would, instead of the OS mixing the two sides' threads on both cores.
    """

    def __init__(self):
        every = sorted(os.sched_getaffinity(0))
        if len(every) < 2:
            raise ValueError(f"the streaming suite needs 2 cores, one for the step and one for "
                             f"the input; this process may use {len(every)}.")
        self.every, self.step_core, self.input_core = set(every), {every[0]}, {every[1]}
        self.step_threads = _threads()
        self._stop = threading.Event()

    @contextlib.contextmanager
    def step_thread(self):
        """Counts the calling thread as the step's while inside (enter it from
        that thread)."""
        tid = threading.get_native_id()
        self.step_threads.add(tid)
        os.sched_setaffinity(0, self.step_core)
        try:
            yield
        finally:
            self.step_threads.discard(tid)

    def _apply(self) -> None:
        now = _threads()
        _pin(now & self.step_threads, self.step_core)
        _pin(now - self.step_threads, self.input_core)

    def _keep(self) -> None:
        while not self._stop.wait(0.02):
            self._apply()

    def __enter__(self):
        self._apply()
        self._stop.clear()
        self._keeper = threading.Thread(target=self._keep, daemon=True)
        self._keeper.start()
        return self

    def __exit__(self, *exc):
        self._stop.set()
        self._keeper.join()
        _pin(_threads(), self.every)


def streaming_worker(repeats: int, global_batch_size: int, steps_per_execution: int,
                     num_examples: int, cycles: int, seconds: float, inter_op: int,
                     rounds: int | None = None, prefetch_per_replica: int = 2) -> dict:
    """Input alone and compute alone on 1 core each; fit together on both.

    One device (OneDeviceStrategy, CPU:0), intra-op threads 1 (the step uses
    one core), `inter_op` inter-op threads; the input pipeline runs in a
    private pool of 1 thread (`input_threads=1`) with a deterministic
    CPU-heavy per-batch map (`costly_batch_map`) after the cache, its cost
    calibrated to equal the step's (the hardest case: neither side hides
    behind a faster one). Input alone and compute alone are timed for about
    `seconds` each with every thread of the process confined to one core
    (`one_core`). Together = `fit` with data.distribute's prefetch to the
    device (`prefetch_per_replica` batches buffered there; an epoch of about
    `seconds` after a warm-up epoch) with the step's threads on one core and
    the input's on the other (`DeviceCore`): each side has the core it had
    alone, as a device and its host would. Also per cycle: both at once,
    uncoupled, split the same way (`corun`), and `fit` with its threads left
    to the OS on both cores. They alternate `cycles` times per repeat; the
    repeat's ratios use their medians.
    """
    import tensorflow as tf

    tf.config.threading.set_intra_op_parallelism_threads(1)
    tf.config.threading.set_inter_op_parallelism_threads(inter_op)
    import tfmulti
    from tfmulti import data, models, utilization

    batch, k = global_batch_size, steps_per_execution
    strategy = tfmulti.get_strategy("one_device")
    tf.zeros([1]).numpy()  # the runtime and its thread pools start
    device = DeviceCore()  # before any input pipeline starts a thread
    source = data.load("synthetic", num_examples=num_examples)

    def pipeline(rounds):
        return data.distribute(source, strategy, batch, seed=0, input_threads=1,
                               batch_map_fn=utilization.costly_batch_map(rounds),
                               prefetch_per_replica=prefetch_per_replica)

    model = models.build_model("mlp", strategy=strategy, seed=0)
    models.compile_model(model, strategy=strategy, steps_per_execution=k)
    probe_rounds = 4
    probe = pipeline(probe_rounds)
    utilization.time_fit(model, probe, 2 * k, epochs=2)  # builds and traces
    with one_core():
        compute_s, = utilization.time_compute(model, strategy, probe, k, 2 * seconds)
        probe_s = utilization.time_input(probe, k, 2 * seconds)
    if rounds is None:  # calibrated: the map costs what the step costs
        rounds = max(1, round(compute_s / (probe_s / probe_rounds)))
    dist = pipeline(rounds)
    steps = utilization.steps_for(seconds, compute_s * 1.2, k)
    out = {"rounds": rounds, "input_seconds_per_step": [], "compute_seconds_per_step": [],
           "fit_seconds_per_step": [], "fit_os_seconds_per_step": [], "ratios": [],
           "os_ratios": [], "sum_ratios": [], "corun_floors": []}

    def corun() -> float:
        # Input and compute at once, uncoupled (each in its own Python thread,
        # no data passed between them): how much slower the slower of the two
        # runs when the other occupies the other core. Streaming couples them,
        # so it cannot do better than this.
        got = {}

        def compute():
            with device.step_thread():
                got["c"] = utilization.time_compute(model, strategy, dist, k, seconds)[0]

        threads = [threading.Thread(target=compute), threading.Thread(
            target=lambda: got.update(i=utilization.time_input(dist, k, seconds)))]
        for t in threads:
            t.start()
        for t in threads:
            t.join()
        return max(got["c"], got["i"])

    for _ in range(repeats):
        # Each timing on a fresh iterator (fit's own, or a new one): a pipeline
        # left running while something else is timed would fill its buffers
        # in the pause and serve them for free. The three alternate `cycles`
        # times; the repeat's ratio uses their medians.
        fs, os_fs, ins, cs, both = [], [], [], [], []
        for _ in range(cycles):
            with one_core():
                cs.append(utilization.time_compute(model, strategy, dist, k, seconds)[0])
            with device:
                fs.append(utilization.time_fit(model, dist, steps, epochs=2)[0])
            with one_core():
                ins.append(utilization.time_input(dist, k, seconds))
            with device:
                both.append(corun())
            os_fs.append(utilization.time_fit(model, dist, steps, epochs=2)[0])
        f, f_os, i, c, b = (statistics.median(v) for v in (fs, os_fs, ins, cs, both))
        out["input_seconds_per_step"].append(i)
        out["compute_seconds_per_step"].append(c)
        out["fit_seconds_per_step"].append(f)
        out["fit_os_seconds_per_step"].append(f_os)
        out["ratios"].append(f / max(i, c))
        out["os_ratios"].append(f_os / max(i, c))
        out["sum_ratios"].append(f / (i + c))
        out["corun_floors"].append(b / max(i, c))
    return out


def streaming_suite(repeats: int) -> dict:
    start = time.monotonic()
    r = run_worker("streaming", repeats=repeats, **STREAMING)
    # 2 busy single-threaded processes on the 2 cores vs 1: each runs at
    # ceiling / 2 of its speed alone, so together / max >= 2 / ceiling.
    floors = [2 / hardware_ceiling(2.0) for _ in range(2)]
    report("streaming", start, [
        f"input {r['input_seconds_per_step'][i] * 1e3:.2f} ms, compute "
        f"{r['compute_seconds_per_step'][i] * 1e3:.2f} ms, together "
        f"{r['fit_seconds_per_step'][i] * 1e3:.2f} ms per step: {r['ratios'][i]:.3f} x max, "
        f"{r['sum_ratios'][i]:.3f} x sum; both uncoupled at once: {r['corun_floors'][i]:.3f} x "
        f"max; threads left to the OS: together {r['os_ratios'][i]:.3f} x max"
        for i in range(repeats)])
    return {
        "description": "MLP, batch 256, one device (intra-op threads 1: the step on 1 core; "
                       f"inter-op threads {STREAMING['inter_op']}); "
                       "input: cached synthetic data + a deterministic CPU-heavy per-batch map "
                       f"({r['rounds']} rounds, calibrated to the step's cost) in a private "
                       "1-thread pool; input alone and compute alone timed with the process "
                       "confined to 1 core; together: the step's threads on one core, the "
                       "input's on the other (streaming_ratio; _os_scheduled: threads left "
                       "to the OS), fit with prefetch to the device "
                       f"({STREAMING['prefetch_per_replica']} batches buffered), "
                       f"steps_per_execution {STREAMING['steps_per_execution']}, on the 2 cores",
        **STREAMING, "map_rounds": r["rounds"],
        "input_seconds_per_step": r["input_seconds_per_step"],
        "compute_seconds_per_step": r["compute_seconds_per_step"],
        "fit_seconds_per_step": r["fit_seconds_per_step"],
        "fit_os_scheduled_seconds_per_step": r["fit_os_seconds_per_step"],
        "streaming_ratio": summary(r["ratios"]),
        "streaming_ratio_os_scheduled": summary(r["os_ratios"]),
        "together_over_sum": summary(r["sum_ratios"]),
        "hardware_floor": summary(floors),
        "corun_floor": summary(r["corun_floors"]),
        "streaming_over_corun_floor": summary(
            [a / b for a, b in zip(r["ratios"], r["corun_floors"])]),
        "goal": 1.10,
        "ceiling": "input and compute each on one of the 2 cores, fully overlapped: 1.0 on "
                   "ideal hardware; here two busy threads slow each other, so the best "
                   "possible ratio is hardware_floor = 2 / (2 processes vs 1 throughput, "
                   "measured in the same run); without any overlap together = input + "
                   "compute, about 2.0 x max. corun_floor: the slower of input and compute "
                   "while both run at once uncoupled (two threads, nothing passed between "
                   "them), over max(alone): what this machine allows any overlap",
    }


# --------------------------------------------------------------------------
# scaling: MirroredStrategy over 1, 2 and 4 virtual devices
# --------------------------------------------------------------------------

DEVICES = {"global_batch_size": 256, "steps_per_execution": 16, "num_examples": 16384,
           "seconds": 1.0, "device_counts": [1, 2, 4]}


def devices_worker(repeats: int, global_batch_size: int, steps_per_execution: int,
                   num_examples: int, seconds: float, device_counts: list) -> dict:
    """examples/s of fit under MirroredStrategy over 1, 2, 4 of 4 virtual CPUs,
    same global batch, interleaved in each repeat, one process."""
    import tfmulti

    tfmulti.configure_virtual_devices(max(device_counts))
    from tfmulti import data, models, utilization

    source = data.load("synthetic", num_examples=num_examples)
    setups = {}
    for n in device_counts:
        strategy = tfmulti.get_strategy("mirrored", devices=[f"CPU:{i}" for i in range(n)])
        dist = data.distribute(source, strategy, global_batch_size, seed=0)
        model = models.build_model("mlp", strategy=strategy, seed=0)
        models.compile_model(model, strategy=strategy, steps_per_execution=steps_per_execution)
        estimate = utilization.time_fit(model, dist, 2 * steps_per_execution, epochs=2)[0]
        setups[n] = (dist, model, utilization.steps_for(seconds, estimate, steps_per_execution))
    rates = {n: [] for n in device_counts}
    for _ in range(repeats):
        for n, (dist, model, steps) in setups.items():
            seconds_per_step = utilization.time_fit(model, dist, steps, epochs=2)[0]
            rates[n].append(global_batch_size / seconds_per_step)
    return {"examples_per_second": {str(n): r for n, r in rates.items()}}


def devices_scaling(repeats: int) -> dict:
    start = time.monotonic()
    r = run_worker("devices", repeats=repeats, **DEVICES)["examples_per_second"]
    one = r["1"]
    ratios = {n: [a / b for a, b in zip(r[n], one)] for n in r if n != "1"}
    report("scaling (virtual devices)", start, [
        ", ".join(f"{n} device(s) {r[n][i]:,.0f} ex/s" for n in r) for i in range(repeats)])
    return {
        "description": "MirroredStrategy over 1, 2 and 4 of 4 virtual CPUs (tfmulti fit, MLP, "
                       "synthetic data, global batch 256, steps_per_execution 16), interleaved "
                       "in one process",
        **DEVICES,
        "examples_per_second": r,
        **{f"virtual_devices_{n}_vs_1": summary(v) for n, v in ratios.items()},
        "ceiling": "1.0: virtual CPU devices share the same 2 cores (1 device already uses "
                   "both through intra-op threads); more replicas add work (all-reduce, "
                   "smaller matmuls), never compute",
    }


def plot_suite(name: str, r: dict, ax) -> bool:
    """Draws one of this module's suites on `ax`; False if `name` is not one."""
    if name == "baseline":
        s, t = r["baseline_speedup"], r["time_to_accuracy_speedup"]
        if t:
            ax.boxplot([r["time_to_accuracy_seed"], r["time_to_accuracy_tfmulti"]],
                       tick_labels=["seed 000", "tfmulti defaults"])
            ax.set_ylabel(f"seconds to test accuracy {r['target_accuracy']}")
        ax.set_title(f"Baseline: time to {r['target_accuracy']} "
                     + (f"{t['median']:.1f}x faster" if t else "not reached")
                     + f"; batch 32: {s['median']:.2f}x examples/s", fontsize=9)
    elif name == "overhead":
        ax.plot([x * 1e3 for x in r["fit_seconds_per_step"]], "o-", label="tfmulti fit")
        ax.plot([x * 1e3 for x in r["loop_seconds_per_step"]], "s-", label="custom loop")
        ax.set_xlabel("block (interleaved)")
        ax.set_ylabel("ms per step")
        s = r["overhead_ratio"]
        ax.set_title(f"Overhead: fit / loop {s['median']:.3f} "
                     f"[{s['min']:.3f}-{s['max']:.3f}]", fontsize=9)
        ax.legend(fontsize=8)
    elif name == "streaming":
        parts = {"input alone": r["input_seconds_per_step"],
                 "compute alone": r["compute_seconds_per_step"],
                 "together (fit)": r["fit_seconds_per_step"]}
        ax.bar(list(parts), [statistics.median(v) * 1e3 for v in parts.values()])
        ax.set_ylabel("ms per step (median)")
        s = r["streaming_ratio"]
        ax.set_title(f"Streaming: together / max = {s['median']:.3f} "
                     f"[{s['min']:.3f}-{s['max']:.3f}]", fontsize=9)
    else:
        return False
    return True
