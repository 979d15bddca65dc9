"""own: the user's own model and data cost what tfmulti's built-in ones cost.

Two measurements (issue 18's benchmark).

**Own model vs built-in** (`model_worker`, one process, one device): the
same network, the built-in MLP (Flatten, Dense(512, relu), Dropout, Dense(10)),
trained through `fit` as `tfmulti.training.run.build_run` sets it up, once as
`TrainConfig(model="mlp", dataset="synthetic")` and once as the user's own
functions, `model="benchmarks.own:user_mlp"` (the same network written with
Keras' functional API) and `dataset="benchmarks.own:user_data"` (the same
examples, returned as NumPy arrays), as `--model=M:F --dataset=M:F` would
name them. Both start from the same initial weights (recorded). Epochs of
about `epoch_seconds` (steps calibrated on the built-in path, the same for
both) alternate, each pair in the other order than the last (A B, B A,
A B, ...: drift and going second hit both alike); each is a `fit` of a
warm-up epoch and a timed one, so both sides start every timed epoch alike.
own_vs_builtin: a repeat's own seconds per step over its built-in ones (its
`pairs_per_repeat` pairs summed); goal <= 1.03.

**Files vs examples across 2 pinned workers** (`train_worker` under
`tfmulti launch --pin_cpus`, one core per worker): TFRecord files written
once (`write_worker`: `num_files` files of `examples_per_file` examples,
each a 28 x 28 float32 image as raw bytes and its label, about 3.2 kB a
record), read through `tfmulti.data.from_files` and trained on by the MLP
(`build_run` with a dataset function returning the file source), at the same
per-worker batch: (a) 1 worker on 1 core, (b) 2 workers sharding by
examples (each reads every file and keeps its share of each global batch),
(c) 2 workers sharding by files (each reads only its own). Files are never
cached, so every epoch reads them again. Each worker writes its own JSON
(the launcher prefixes their output): the seconds per step of each epoch,
and the bytes it read (`/proc/self/io` `rchar`: every byte passed to
`read()`) in each pass over its files, counted from one pass's first file
opening to the next's (`_bytes_per_pass`; its reader logs every file it
opens), beside the bytes those files hold. Per pass, not per epoch: the
input reads up to two passes ahead of the step. A round launches (a), (b)
and (c) in turn, `epochs` epochs each, the first a warm-up; epoch i of (b)
and (c) pairs with epoch i of (a); rounds repeat as the repeats need.

Figures: bytes_per_worker_ratio, the bytes a worker reads per pass by files
over by examples (goal about 0.5: half the bytes); scaling_examples and
scaling_files, 2-worker / 1-worker examples/s; files_vs_examples_scaling,
scaling_files / scaling_examples (goal >= 0.95: reading by files keeps the
scaling); the ceiling is 2x on 2 cores, with `hardware_ceiling` measured in
each round.
"""

from __future__ import annotations

import dataclasses
import json
import math
import os
import statistics
import tempfile
import time

from tfmulti.utils import checks
from benchmarks import _harness, cpus
from tfmulti.config.train_config import TrainConfig, resolve_steps_per_execution

__all__ = ["IMAGE_SHAPE", "MODEL_SETTINGS", "TOY", "USER_DATA", "USER_MODEL", "check",
           "model_worker", "parse_record", "plot", "run", "summarize", "train_worker",
           "user_data", "user_mlp", "write_worker"]

USER_MODEL = "benchmarks.own:user_mlp"
"""The user's model function, named as `--model=package.module:function`."""
USER_DATA = "benchmarks.own:user_data"
"""The user's dataset function, named as `--dataset=package.module:function`."""
MODEL_SETTINGS = {"global_batch_size": 256, "steps_per_execution": 16,
                  "num_examples": 16384, "pairs_per_repeat": 2}
"""The own-model measurement's settings, also recorded in the suite's JSON."""
TOY = {"model": {"global_batch_size": 32, "steps_per_execution": 1, "num_examples": 256,
                 "pairs_per_repeat": 1},
       "epoch_seconds": 0.1, "num_files": 2, "examples_per_file": 32, "per_worker_batch": 16,
       "epochs": 2}
"""The toy size (`_harness.toy`: the end-to-end test): `MODEL_SETTINGS` ("model") and
`run`'s options, which it overrides."""
IMAGE_SHAPE = (28, 28, 1)
"""The shape of each example's image in the benchmark's TFRecord files."""
_LAUNCH_TIMEOUT = 900
# The file launches of a round, in order: (workers, sharding).
_LAUNCHES = {"1_worker": (1, "examples"), "2_workers_by_examples": (2, "examples"),
             "2_workers_by_files": (2, "files")}


# ------------------------------------------------------------------ the user's code


def user_mlp(input_shape: tuple, num_classes: int, dropout: float) -> "keras.Model":
    """The user's model function: the built-in MLP's network, written with
    Keras' functional API (Flatten, Dense(512, relu), Dropout, Dense).

    Args:
        input_shape: one example's shape (tfmulti passes the data's).
        num_classes: logits out.
        dropout: the dropout rate.

    Returns:
        The model (tfmulti builds it under the strategy's scope).
    """
    import keras

    inputs = keras.Input(shape=input_shape, name="image")
    h = keras.layers.Flatten()(inputs)
    h = keras.layers.Dense(512, activation="relu")(h)
    h = keras.layers.Dropout(dropout)(h)
    return keras.Model(inputs, keras.layers.Dense(num_classes)(h), name="user_mlp")


def _arrays(dataset) -> tuple:
    """An unbatched dataset's examples as NumPy arrays, one per component."""
    return tuple(t.numpy() for t in next(iter(dataset.batch(int(dataset.cardinality())))))


def user_data(num_examples: int) -> dict:
    """The user's dataset function: the examples `dataset="synthetic"` gives,
    as NumPy arrays (features, labels), with their 10 classes.

    Args:
        num_examples: training examples (tfmulti passes `TrainConfig.num_examples`).

    Returns:
        {"train": (features, labels), "num_classes": 10}; no test split.
    """
    from tfmulti import data

    return {"train": _arrays(data.synthetic("train", num_examples=num_examples)),
            "num_classes": 10}


def parse_record(record: "tf.Tensor") -> tuple:
    """One TFRecord of the benchmark's files (a serialized `tf.train.Example`)
    -> (image of `IMAGE_SHAPE`, float32; label, int64)."""
    import tensorflow as tf

    parsed = tf.io.parse_single_example(record, {
        "image": tf.io.FixedLenFeature([], tf.string),
        "label": tf.io.FixedLenFeature([], tf.int64)})
    image = tf.reshape(tf.io.decode_raw(parsed["image"], tf.float32), IMAGE_SHAPE)
    return image, parsed["label"]


# ------------------------------------------------------------------ workers


def _train_step_ops(run) -> dict:
    """The graph operations of one training step of `run` (`model.train_step`
    traced on its input's batches), counted by type; the model has trained."""
    import collections

    import tensorflow as tf

    spec = run.train_input.dataset.element_spec
    graph = tf.function(run.model.train_step).get_concrete_function(spec).graph
    return dict(sorted(collections.Counter(op.type for op in graph.get_operations()).items()))


def model_worker(repeats: int, global_batch_size: int, steps_per_execution: int,
                 num_examples: int, pairs_per_repeat: int, seconds: float) -> dict:
    """`fit` of the built-in MLP and of the user's functions, alternating.

    Args:
        repeats: figures to return; each sums `pairs_per_repeat` pairs.
        global_batch_size, steps_per_execution, num_examples: the runs'.
        pairs_per_repeat: pairs of timed epochs (one per side) per repeat.
        seconds: about how long each timed epoch runs.

    Returns:
        Seconds per step of every timed epoch of each side, each repeat's
        ratio, the steps per epoch, and what shows the two do the same work
        (parameters, initial weights, the training step's graph operations).
    """
    import numpy as np

    from tfmulti.training import run as runs
    from tfmulti.insight import timing

    k = steps_per_execution
    builtin_config = TrainConfig(distribution="one_device", model="mlp", dataset="synthetic",
                                 num_examples=num_examples, global_batch_size=global_batch_size,
                                 steps_per_execution=k, seed=0)
    builtin = runs.build_run(builtin_config)
    own = runs.build_run(builtin_config.replace(model=USER_MODEL, dataset=USER_DATA))
    weights = builtin.model.get_weights(), own.model.get_weights()
    same_weights = len(weights[0]) == len(weights[1]) and all(
        a.shape == b.shape and np.array_equal(a, b) for a, b in zip(*weights))
    estimate = timing.time_fit(builtin.model, builtin.train_input, 2 * k, epochs=2)[0]
    timing.time_fit(own.model, own.train_input, 2 * k, epochs=2)  # traces
    steps = timing.steps_for(seconds, estimate, k)
    sides = [(builtin, []), (own, [])]
    for pair in range(repeats * pairs_per_repeat):
        for side, seconds_per_step in sides[::-1] if pair % 2 else sides:  # A B, B A, ...
            seconds_per_step.append(timing.time_fit(side.model, side.train_input, steps)[0])
    (_, builtin_s), (_, own_s) = sides
    ops = {"builtin": _train_step_ops(builtin), "own": _train_step_ops(own)}
    n = pairs_per_repeat
    ratios = [sum(own_s[n * r:n * (r + 1)]) / sum(builtin_s[n * r:n * (r + 1)])
              for r in range(repeats)]
    return {"builtin_seconds_per_step": builtin_s, "own_seconds_per_step": own_s,
            "ratios": ratios, "steps_per_epoch": steps,
            "params": {"builtin": builtin.model.count_params(), "own": own.model.count_params()},
            "same_initial_weights": bool(same_weights), "train_step_ops": ops}


def write_worker(folder: str, num_files: int, examples_per_file: int) -> dict:
    """Writes `num_files` TFRecord files of `examples_per_file` synthetic
    examples each (image as raw float32 bytes, label) to `folder`.

    Args:
        folder: where (created if missing); the files are
            part-III-of-NNN.tfrecord.
        num_files: how many files.
        examples_per_file: examples in each.

    Returns:
        {"files": their paths, "bytes": their sizes}.
    """
    import tensorflow as tf

    from tfmulti import data

    images, labels = _arrays(data.synthetic(
        "train", num_examples=num_files * examples_per_file, shape=IMAGE_SHAPE))
    os.makedirs(folder, exist_ok=True)
    paths = []
    for f in range(num_files):
        path = os.path.join(folder, f"part-{f:03d}-of-{num_files:03d}.tfrecord")
        with tf.io.TFRecordWriter(path) as writer:
            for i in range(f * examples_per_file, (f + 1) * examples_per_file):
                writer.write(tf.train.Example(features=tf.train.Features(feature={
                    "image": tf.train.Feature(bytes_list=tf.train.BytesList(
                        value=[images[i].tobytes()])),
                    "label": tf.train.Feature(int64_list=tf.train.Int64List(
                        value=[int(labels[i])])),
                })).SerializeToString())
        paths.append(path)
    return {"files": paths, "bytes": [os.path.getsize(p) for p in paths]}


def _rchar() -> int:
    """Bytes this process has passed to read() so far (`/proc/self/io`)."""
    with open("/proc/self/io") as f:
        for line in f:
            if line.startswith("rchar:"):
                return int(line.split()[1])
    raise RuntimeError("/proc/self/io has no rchar line; the files part of the own suite "
                       "needs Linux.")


def _bytes_per_pass(opened: list[tuple[str, int]], files_per_pass: int) -> list[int]:
    """Bytes read from the start of each pass over the files to the start of
    the next, from (file, rchar) at each opening.

    A pass opens each of its files once, and the next pass (a new iterator of
    the repeated dataset) opens none before this one has read them all (its
    shuffle buffer takes the whole pass), so every `files_per_pass`
    consecutive openings are one pass. Not epochs: the pipeline reads up to
    two passes ahead of the step, so an epoch's window holds 0 to 2 passes.

    Raises:
        RuntimeError: the openings do not form such passes.
    """
    passes = [opened[i:i + files_per_pass] for i in range(0, len(opened), files_per_pass)]
    for k, group in enumerate(passes):
        if len({name for name, _ in group}) != len(group):
            raise RuntimeError(f"pass {k} of the own suite's input opened a file twice "
                               f"({[name for name, _ in group]}); cannot tell its passes apart.")
    starts = [min(rchar for _, rchar in group) for group in passes]
    return [b - a for a, b in zip(starts, starts[1:])]


def train_worker(pattern: str, out_dir: str, num_workers: int, sharding: str,
                 per_worker_batch: int, num_examples: int, steps_per_execution: int,
                 epochs: int) -> dict:
    """One worker of a launch: the MLP trained on the files `pattern`
    (`from_files` + `distribute` through `build_run`), `epochs` epochs, the
    first a warm-up; writes its record to OUT_DIR/worker{I}.json.

    Args:
        pattern: the files (a glob).
        out_dir: where each worker writes its record.
        num_workers: workers in the launch (checked against the cluster).
        sharding: "examples" or "files".
        per_worker_batch: examples per step on each worker.
        num_examples: examples in all the files (an epoch is one pass).
        steps_per_execution: steps per call (dividing the steps per epoch).
        epochs: epochs to train; the first is a warm-up.

    Returns:
        Its record: the seconds per step of each timed epoch; the bytes read
        (rchar) in each pass over its files and what those files hold; the
        files its reader opened.

    Raises:
        RuntimeError: the cluster has another number of workers than
            `num_workers`.
    """
    import tensorflow as tf

    from tfmulti import data
    from tfmulti.runtime import roles
    from tfmulti.training import run as runs
    from tfmulti.utils.atomic import write_json_atomic
    from tfmulti.insight import timing

    opened: list[tuple[str, int]] = []  # (file, rchar) at each file's opening

    def log_name(name):
        opened.append((name.numpy().decode(), _rchar()))
        return name

    def reader(name):
        return tf.data.TFRecordDataset(tf.py_function(log_name, [name], tf.string))

    def files():
        return {"train": data.from_files(pattern, parse_record, reader=reader),
                "num_classes": 10}

    global_batch = per_worker_batch * num_workers
    config = TrainConfig(distribution="multi_worker", model="mlp", dataset=files,
                         global_batch_size=global_batch, input_sharding=sharding,
                         steps_per_epoch=num_examples // global_batch,
                         steps_per_execution=steps_per_execution, seed=0)
    run = runs.build_run(config)
    role = roles.cluster_role(run.strategy)
    if role.num_workers != num_workers:
        raise RuntimeError(f"the own suite's train worker expected {num_workers} workers, "
                           f"the cluster has {role.num_workers}.")
    seconds = timing.time_fit(run.model, run.train_input, run.steps_per_epoch, epochs=epochs)
    names = sorted({name for name, _ in opened})
    record = {
        "worker": role.worker_index, "num_workers": role.num_workers,
        "sharding": run.train_input.sharding, "steps_per_epoch": run.steps_per_epoch,
        "global_batch_size": global_batch, "seconds_per_step": seconds,
        "bytes_read_per_pass": _bytes_per_pass(opened, len(names)),
        "file_bytes_per_pass": sum(os.path.getsize(name) for name in names),
        "files_opened": names,
    }
    write_json_atomic(os.path.join(out_dir, f"worker{role.worker_index}.json"), record)
    return record


# ------------------------------------------------------------------ the suite


@dataclasses.dataclass(frozen=True)
class _Files:
    num_files: int
    examples_per_file: int
    per_worker_batch: int
    epochs: int

    @property
    def num_examples(self) -> int:
        return self.num_files * self.examples_per_file

    @property
    def steps_per_execution(self) -> int:
        """The same for every launch: "auto" of the 2-worker epoch (which
        divides the 1-worker one, twice as long)."""
        return resolve_steps_per_execution("auto", self.num_examples // (2 * self.per_worker_batch))


def _checked(epoch_seconds, num_files, examples_per_file, per_worker_batch, epochs) -> _Files:
    checks.finite_number("epoch_seconds", epoch_seconds, minimum=0.1,
                          hint="seconds per timed epoch of the own-model measurement, e.g. 1.5")
    files = _Files(
        num_files=checks.integer("num_files", num_files, minimum=2,
                                  hint="2 workers need a file each"),
        examples_per_file=checks.positive_int("examples_per_file", examples_per_file),
        per_worker_batch=checks.positive_int("per_worker_batch", per_worker_batch),
        epochs=checks.integer("epochs", epochs, minimum=2,
                               hint="the first epoch of a launch is a warm-up"))
    if files.num_files % 2:
        raise ValueError(f"`num_files` ({files.num_files}) must be even, so that 2 workers "
                         f"reading by files get equal shares; use {files.num_files + 1}.")
    step = 2 * files.per_worker_batch
    if files.num_examples % step:
        unit = step // math.gcd(step, files.num_files)
        raise ValueError(
            f"the files' examples ({files.num_files} x {files.examples_per_file} = "
            f"{files.num_examples}) must be a multiple of 2 x `per_worker_batch` ({step}), "
            "so that 1 and 2 workers train whole passes over the files; use e.g. "
            f"examples_per_file={-(-files.examples_per_file // unit) * unit}.")
    return files


def check(*, epoch_seconds: float = 1.5, num_files: int = 8, examples_per_file: int = 2048,
          per_worker_batch: int = 256, epochs: int = 4) -> None:
    """Checks the options of `run` (before anything runs).

    Raises:
        ValueError: a bad option, an odd number of files, or a worker's share
            of the files smaller than one batch.
    """
    _checked(epoch_seconds, num_files, examples_per_file, per_worker_batch, epochs)


def _launch(files: _Files, pattern: str, out_dir: str, num_workers: int,
            sharding: str) -> list[dict]:
    """One pinned launch of `train_worker`; every worker's record."""
    os.makedirs(out_dir)
    command = _harness.worker_command(
        "own_train", pattern=pattern, out_dir=out_dir, num_workers=num_workers,
        sharding=sharding, per_worker_batch=files.per_worker_batch,
        num_examples=files.num_examples, steps_per_execution=files.steps_per_execution,
        epochs=files.epochs)
    output = _harness.launch_pinned(command, num_workers, timeout=_LAUNCH_TIMEOUT)
    records = []
    for i in range(num_workers):
        path = os.path.join(out_dir, f"worker{i}.json")
        if not os.path.isfile(path):
            raise RuntimeError(f"worker {i} of the own suite's launch wrote no {path}:\n"
                               f"{output[-3000:]}")
        with open(path) as f:
            records.append(json.load(f))
    return records


def _rates(records: list[dict]) -> list[float]:
    """Global examples/s of each timed epoch (the chief's clock; the workers
    step together)."""
    chief = records[0]
    return [chief["global_batch_size"] / s for s in chief["seconds_per_step"]]


def _bytes_per_worker(records: list[dict]) -> tuple[float, float]:
    """Bytes a worker reads per pass over its files (the median of its
    passes; the first may hold start-up reads), and what its files hold; each
    averaged over the workers."""
    return (statistics.mean(statistics.median(r["bytes_read_per_pass"]) for r in records),
            statistics.mean(r["file_bytes_per_pass"] for r in records))


def _model_part(repeats: int, epoch_seconds: float) -> dict:
    """The own-model measurement's record."""
    settings = _harness.toy_sized(MODEL_SETTINGS, TOY["model"])
    start = time.monotonic()
    m = _harness.run_worker("own_model", repeats=repeats, seconds=epoch_seconds, **settings)
    n = settings["pairs_per_repeat"]
    mean = statistics.mean
    _harness.report("own (model)", start, [
        f"built-in {mean(m['builtin_seconds_per_step'][n * i:n * (i + 1)]) * 1e3:.2f} ms/step, "
        f"own {mean(m['own_seconds_per_step'][n * i:n * (i + 1)]) * 1e3:.2f} ms/step, "
        f"ratio {ratio:.3f}" for i, ratio in enumerate(m["ratios"])])
    return {**settings, "epoch_seconds": epoch_seconds,
            "own_model_steps_per_epoch": m["steps_per_epoch"], "params": m["params"],
            "same_initial_weights": m["same_initial_weights"],
            "train_step_ops": m["train_step_ops"],
            "same_train_step": m["train_step_ops"]["builtin"] == m["train_step_ops"]["own"],
            "builtin_seconds_per_step": m["builtin_seconds_per_step"],
            "own_seconds_per_step": m["own_seconds_per_step"],
            "own_vs_builtin": _harness.summary(m["ratios"])}


def _files_part(repeats: int, files: _Files) -> dict:
    """The files vs examples measurement's record."""
    timed = files.epochs - 1
    rounds = -(-repeats // timed)
    rates, read, held = ({name: [] for name in _LAUNCHES} for _ in range(3))
    ceilings, opened = [], {}
    with tempfile.TemporaryDirectory(prefix="benchmark-own-") as tmp:
        start = time.monotonic()
        written = _harness.run_worker("own_write", folder=os.path.join(tmp, "files"),
                                      num_files=files.num_files,
                                      examples_per_file=files.examples_per_file)
        pattern = os.path.join(tmp, "files", "part-*.tfrecord")
        print(f"own: wrote {files.num_files} files, {sum(written['bytes']):,} bytes "
              f"({time.monotonic() - start:.0f} s)", flush=True)
        for round_ in range(rounds):
            start = time.monotonic()
            for name, (workers, sharding) in _LAUNCHES.items():
                records = _launch(files, pattern, os.path.join(tmp, f"{round_}-{name}"),
                                  workers, sharding)
                rates[name] += _rates(records)
                bytes_read, bytes_held = _bytes_per_worker(records)
                read[name].append(bytes_read)
                held[name].append(bytes_held)
                opened[name] = [r["files_opened"] for r in records]
            ceilings.append(cpus.hardware_ceiling(_harness.ceiling_seconds(2.0)))
            one, by_examples, by_files = (rates[name][-timed:] for name in _LAUNCHES)
            print(f"own round {round_ + 1}/{rounds}: 2 vs 1 pinned workers by examples "
                  f"{', '.join(f'{b / a:.2f}x' for a, b in zip(one, by_examples))}; by files "
                  f"{', '.join(f'{c / a:.2f}x' for a, c in zip(one, by_files))}; bytes read "
                  f"per worker, by files / by examples "
                  f"{read['2_workers_by_files'][-1] / read['2_workers_by_examples'][-1]:.3f}; "
                  f"hardware ceiling {ceilings[-1]:.2f}x ({time.monotonic() - start:.0f} s)",
                  flush=True)
    one, by_examples, by_files = rates.values()
    scaling_examples = [b / a for a, b in zip(one, by_examples)]
    scaling_files = [c / a for a, c in zip(one, by_files)]
    summary = _harness.summary

    def files_over_examples(values: dict) -> dict:
        return summary([f / e for e, f in zip(values["2_workers_by_examples"],
                                              values["2_workers_by_files"])])

    return {**dataclasses.asdict(files), "file_bytes": sum(written["bytes"]),
            "files_steps_per_execution": files.steps_per_execution, "rounds": rounds,
            "examples_per_second": rates,
            "bytes_read_per_worker_per_pass": read,
            "file_bytes_per_worker_per_pass": held,
            "files_opened_per_worker": opened,
            "bytes_per_worker_ratio": files_over_examples(read),
            "file_bytes_per_worker_ratio": files_over_examples(held),
            "scaling_examples": summary(scaling_examples),
            "scaling_files": summary(scaling_files),
            "files_vs_examples_scaling": summary(
                [f / e for e, f in zip(scaling_examples, scaling_files)]),
            "hardware_ceiling": summary(ceilings)}


def run(repeats: int, *, epoch_seconds: float = 1.5, num_files: int = 8,
        examples_per_file: int = 2048, per_worker_batch: int = 256, epochs: int = 4) -> dict:
    """Runs the suite; returns its JSON record.

    Args:
        repeats: repeats of each figure: pairs of the own-model measurement,
            timed epochs of the file launches.
        epoch_seconds: about how long each timed epoch of the own-model
            measurement runs.
        num_files: TFRecord files written (even: 2 equal shares by files).
        examples_per_file: examples in each file.
        per_worker_batch: batch per worker of the file launches.
        epochs: epochs per file launch (the first is a warm-up).

    Raises:
        ValueError: fewer than 2 cores, or a bad option (see `check`).
    """
    checks.positive_int("repeats", repeats)
    _checked(epoch_seconds, num_files, examples_per_file, per_worker_batch, epochs)
    if _harness.toy():
        epoch_seconds, num_files, examples_per_file, per_worker_batch, epochs = (
            TOY[k] for k in ("epoch_seconds", "num_files", "examples_per_file",
                             "per_worker_batch", "epochs"))
    files = _checked(epoch_seconds, num_files, examples_per_file, per_worker_batch, epochs)
    cores = len(os.sched_getaffinity(0))
    if cores < 2:
        raise ValueError(f"the own suite needs at least 2 cores for 2 pinned workers, this "
                         f"process may use {cores}.")
    return {
        "description": "own model vs built-in: the MLP through fit, TrainConfig(model='mlp', "
                       f"dataset='synthetic') vs model={USER_MODEL!r}, dataset={USER_DATA!r} "
                       "(the same network, functional; the same examples as NumPy arrays), "
                       "one device, epochs alternating in one process. Files vs examples: "
                       "the MLP on TFRecord files (from_files + distribute) under tfmulti "
                       "launch --pin_cpus, 1 worker on 1 core vs 2 workers on 1 core each "
                       "sharding by examples and by files, same per-worker batch; bytes "
                       "read per pass over a worker's files (/proc/self/io rchar)",
        **_model_part(repeats, epoch_seconds),
        **_files_part(repeats, files), "toy": _harness.toy(),
        "goals": {"own_vs_builtin": 1.03, "bytes_per_worker_ratio": 0.5,
                  "files_vs_examples_scaling": 0.95},
        "ceiling": "own_vs_builtin: 1.0 (the same work). Files: 2x for 2 workers on 2 cores; "
                   "2 single-threaded matmul processes vs 1, measured once per round "
                   "(hardware_ceiling)",
    }


def summarize(r: dict) -> list[str]:
    """The suite's headline lines."""
    fmt, goals = _harness.fmt, r["goals"]
    return [
        f"own: own model function / built-in mlp, fit seconds per step "
        f"{fmt(r['own_vs_builtin'], 'x', 3)} (goal <= {goals['own_vs_builtin']}); same "
        f"initial weights {r['same_initial_weights']}, same training step graph "
        f"{r['same_train_step']} ({sum(r['train_step_ops']['own'].values())} ops)",
        f"own: 2 pinned workers by files / by examples, bytes read per worker "
        f"{fmt(r['bytes_per_worker_ratio'], '', 3)} (goal {goals['bytes_per_worker_ratio']})",
        f"own: 2 vs 1 pinned workers by files {fmt(r['scaling_files'])}, by examples "
        f"{fmt(r['scaling_examples'])}; files / examples "
        f"{fmt(r['files_vs_examples_scaling'], '', 3)} (goal >= "
        f"{goals['files_vs_examples_scaling']}); ceiling 2x, matmul "
        f"{fmt(r['hardware_ceiling'])}",
    ]


def plot(r: dict, ax) -> None:
    """Steady-state examples/s of 1 worker and of 2 by examples and by files."""
    rates = r["examples_per_second"]
    ax.boxplot(list(rates.values()), tick_labels=["1 worker", "2 by examples", "2 by files"])
    ax.set_title(f"Own: own model / built-in {r['own_vs_builtin']['median']:.3f}x\n"
                 f"by files: {r['bytes_per_worker_ratio']['median']:.2f} of the bytes, "
                 f"{r['scaling_files']['median']:.2f}x (by examples "
                 f"{r['scaling_examples']['median']:.2f}x)", fontsize=9)
    ax.set_ylabel("examples / s (steady state)")
