"""baseline: seed 000's program as written vs tfmulti, on Fashion-MNIST.

Each side runs in its own process with 2 virtual CPUs configured first.

The seed side is the seed's program as written, in plain Keras (it
deliberately uses none of tfmulti's training code): `MirroredStrategy()`
with its default devices, the MLP built in scope, `adam`, `model.fit` on
NumPy arrays with batch 32 and steps_per_execution 1, evaluated after each
epoch (`validation_data`).

Figures, each taken within a repeat:

* baseline_speedup: training examples/s of tfmulti at the seed's batch 32
  (`build_run`: `data.distribute`, `compile_model(steps_per_execution=K)`
  with the fused Adam, K = --baseline_steps_per_execution) over the seed's
  (Keras' Adam) in its epoch 2 (goal >= 1.8x). tfmulti's figure is one full
  epoch of steps after a warm-up third of an epoch.
* time_to_accuracy_speedup: wall time until the test accuracy first reaches
  0.87, seed / tfmulti's defaults (`TTA_CONFIG`: global batch 256, sqrt
  learning-rate scaling, steps per execution auto, cached and prefetched
  input), each evaluated on the whole test split after every epoch, the
  evaluation counted (goal >= 4x). A repeat where either side does not reach
  the target is left out of this figure, with a warning.
"""

from __future__ import annotations

import statistics
import time

from tfmulti.utils import checks
from benchmarks import _harness
from tfmulti.config.train_config import TrainConfig

__all__ = ["BATCH", "MAX_EPOCHS", "TARGET_ACCURACY", "TOY", "TTA_CONFIG", "TTA_TFMULTI", "check",
           "plot", "run", "seed_worker", "summarize", "tfmulti_worker"]

TARGET_ACCURACY = 0.87
BATCH = 32
"""Seed 000's batch size."""
_TRAIN_EXAMPLES = 60000
TTA_CONFIG = TrainConfig(distribution="auto", dataset="fashion_mnist", model="mlp",
                         global_batch_size=256, learning_rate=1e-3, lr_scaling="sqrt",
                         base_batch_size=256, warmup_epochs=0.0, steps_per_execution="auto")
"""tfmulti's side of the time-to-accuracy race: TrainConfig's defaults (global
batch 256; Adam 1e-3 tuned for base batch 256, so sqrt scaling keeps it and no
warmup is needed), its default steps per execution ("auto": 26 of the 234 steps
per epoch per call), and data.distribute's streaming (cache, prefetch to the
devices), under the "auto" distribution (MirroredStrategy, 2 replicas)."""
TTA_TFMULTI = {name: getattr(TTA_CONFIG, name)
               for name in ("global_batch_size", "learning_rate", "lr_scaling",
                            "base_batch_size", "warmup_epochs", "steps_per_execution")}
"""The race's settings as recorded in the JSON (`tfmulti_tta_config`)."""
MAX_EPOCHS = {"seed": 8, "tfmulti": 12}
TOY = {"target_accuracy": 1.01, "max_epochs": {"seed": 2, "tfmulti": 1},
       "train_examples": 960, "test_examples": 320, "steps_per_epoch": 6,
       "steps_per_execution": 2}
"""The toy size (`_harness.toy`: the end-to-end test): a target no run reaches (the
race runs its epochs, the JSON records the accuracy it reached), the seed's 2 epochs
(its throughput is epoch 2's) on 960 training and 320 test examples, tfmulti's race
of 1 epoch and its batch-32 throughput over epochs of 6 steps (thirds of 2, 2 per
call), reading only the examples of those steps; both sides in one process
(`_harness.run_workers`); overrides `steps_per_execution`."""


def _sizes() -> dict:
    """The real sizes, or `TOY` at toy size (`_harness.toy`)."""
    return _harness.toy_sized({"target_accuracy": TARGET_ACCURACY, "max_epochs": MAX_EPOCHS,
                               "train_examples": None, "test_examples": None,
                               "steps_per_epoch": None}, TOY)


def _fashion_mnist_arrays(split: str, count: int | None = None):
    """Seed 000's `fashion_mnist.load_data()` and `/ 255.0`: the same IDX files
    (the Debian package's), else the prepared TFDS data; its first `count`
    examples (default: all), kept before the division (the same arrays as
    dividing all and keeping those, without converting the whole split to
    floats for a toy run)."""
    import tfmulti.data
    from tfmulti.data import catalog

    folder, _ = tfmulti.data.find_fashion_mnist_idx()
    if folder is not None:
        images, labels = (tfmulti.data.read_idx(folder / name)
                          for name in catalog.FASHION_MNIST_FILES[split])
        return images[:count] / 255.0, labels[:count]
    dataset = tfmulti.data.load("fashion_mnist", split)
    if count is not None:
        dataset = dataset.take(count)
    images, labels = next(iter(dataset.batch(100_000).as_numpy_iterator()))
    return images.reshape(-1, 28, 28), labels


def seed_worker(seed: int, target_accuracy: float = TARGET_ACCURACY,
                max_epochs: int = MAX_EPOCHS["seed"], train_examples: int | None = None,
                test_examples: int | None = None) -> dict:
    """Seed 000's program as written, with a per-epoch evaluation, until 0.87.

    Plain Keras, `MirroredStrategy()` with its default devices (2 virtual
    CPUs), the MLP built in scope, `adam`, `fit` on NumPy arrays with batch 32
    and `validation_data` (evaluated after each epoch, batch 32). The clock
    starts when the model is built (the arrays are already in memory) and
    stops at the end of the first evaluation reaching 0.87. Also returns the
    training-only examples/s of epoch 2 (the baseline throughput).
    `train_examples` and `test_examples` (default: all) keep the first ones
    of each split (a toy run).
    """
    import tfmulti

    tfmulti.configure_virtual_devices(2)
    import keras
    import tensorflow as tf

    from benchmarks.fixtures import TimeToAccuracy

    train_images, train_labels = _fashion_mnist_arrays("train", train_examples)
    test_images, test_labels = _fashion_mnist_arrays("test", test_examples)
    keras.utils.set_random_seed(seed)
    race = TimeToAccuracy(target_accuracy)
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
    model.fit(train_images, train_labels, batch_size=BATCH,
              epochs=max_epochs, validation_data=(test_images, test_labels),
              verbose=0, callbacks=[race.callback(lambda logs: logs["val_accuracy"])])
    return {"side": "seed", **race.result(len(train_images)),
            "num_replicas": strategy.num_replicas_in_sync,
            "devices": list(strategy.extended.worker_devices)}


def tfmulti_worker(seed: int, steps_per_execution: int,
                   target_accuracy: float = TARGET_ACCURACY,
                   max_epochs: int = MAX_EPOCHS["tfmulti"], steps_per_epoch: int | None = None,
                   test_examples: int | None = None) -> dict:
    """tfmulti's side of the baseline, in one process: first the race, then the
    throughput at seed 000's batch.

    Race: `TTA_CONFIG` (with `seed`) until the test accuracy reaches 0.87,
    evaluated after each epoch on the whole test split (cached in memory
    after its first read, as the seed holds its arrays). The dataset's files
    are opened once before the clock starts (as the seed's arrays are read
    before its clock starts); the clock then covers `build_run` (strategy,
    input pipelines, model, compile), so reading and caching the data are
    inside the race.

    Throughput: batch 32 on the same 2 replicas (`build_run` of the
    "mirrored" distribution, steps_per_execution=K), training examples/s
    over a full epoch's steps after a warm-up third of an epoch (K must
    divide 1875 / 3 = 625).

    `steps_per_epoch` (default: a pass over the data) caps the epochs of both
    parts and `test_examples` (default: all) the evaluation (a toy run); with
    `steps_per_epoch`, only the training examples the race's epochs take are
    read (`_harness.first_examples`).
    """
    import tfmulti

    tfmulti.configure_virtual_devices(2)
    from tfmulti import data
    from tfmulti.training import run as runs
    from benchmarks.fixtures import TimeToAccuracy
    from tfmulti.insight import timing

    config = TTA_CONFIG.replace(seed=seed, steps_per_epoch=steps_per_epoch)
    for split in ("train", "test"):  # the TFDS import and metadata, outside the race
        data.load(config.dataset, split)
    if steps_per_epoch is not None:
        config = config.replace(dataset=_harness.first_examples(
            config.dataset, steps_per_epoch * config.global_batch_size, test_examples))
    race = TimeToAccuracy(target_accuracy)
    race.start()
    run = runs.build_run(config)
    test_data = run.test_data if test_examples is None else run.test_data.take(test_examples)
    test_input = data.distribute(test_data, run.strategy, config.global_batch_size,
                                 training=False, cache=True)
    model = run.model

    def test_accuracy(logs):
        return model.evaluate(**test_input.evaluate_kwargs(), verbose=0,
                              return_dict=True)["accuracy"]

    model.fit(**run.train_input.fit_kwargs(), epochs=max_epochs, verbose=0,
              callbacks=[race.callback(test_accuracy)])
    result = {"side": "tfmulti",
              **race.result(run.steps_per_epoch * config.global_batch_size),
              "num_replicas": run.num_replicas, **TTA_TFMULTI,
              "steps_per_execution": model.steps_per_execution}

    run = runs.build_run(TrainConfig(distribution="mirrored", dataset=config.dataset,
                                     model=config.model, global_batch_size=BATCH, seed=0,
                                     steps_per_execution=steps_per_execution,
                                     steps_per_epoch=steps_per_epoch))
    # A warm-up third of an epoch, then three thirds: one full epoch of steps,
    # its reshuffle included, timed.
    third = run.steps_per_epoch // 3
    seconds = statistics.mean(timing.time_fit(run.model, run.train_input, third, epochs=4))
    result["examples_per_second_batch_32"] = BATCH / seconds
    result["steps_per_execution_batch_32"] = steps_per_execution
    return result


def check(*, steps_per_execution: int = 125) -> None:
    """Checks the options of `run` (before anything runs).

    Raises:
        ValueError: `steps_per_execution` does not divide a third of an epoch
            at batch 32.
    """
    checks.positive_int("steps_per_execution", steps_per_execution)
    third = _TRAIN_EXAMPLES // BATCH // 3
    if third % steps_per_execution:
        raise ValueError(f"the baseline suite's steps per execution ({steps_per_execution}; "
                         f"--baseline_steps_per_execution of recipes/benchmark.py) must divide "
                         f"{third}, a third of the {3 * third} steps of an epoch at batch "
                         f"{BATCH}; e.g. 125 or 25.")


def run(repeats: int, steps_per_execution: int = 125) -> dict:
    """Runs the suite; returns its JSON record.

    Args:
        repeats: seed/tfmulti pairs of processes, one after the other.
        steps_per_execution: tfmulti's steps per call at batch 32; must divide
            625 (a third of the 1875 steps of an epoch).
    """
    checks.positive_int("repeats", repeats)
    check(steps_per_execution=steps_per_execution)
    sizes = _sizes()
    target = sizes["target_accuracy"]
    steps_per_execution = sizes.get("steps_per_execution", steps_per_execution)
    seed_rate, ours_rate, speedups = [], [], []
    seed_tta, ours_tta, tta_speedups = [], [], []
    runs = []
    for repeat in range(repeats):
        start = time.monotonic()
        # Up to MAX_EPOCHS["seed"] epochs of about 2 minutes each on a slow CPU.
        # Each side in a process of its own (both in one at toy size).
        seed, race = _harness.run_workers([
            ("seed", dict(seed=repeat, target_accuracy=target,
                          max_epochs=sizes["max_epochs"]["seed"],
                          train_examples=sizes["train_examples"],
                          test_examples=sizes["test_examples"])),
            ("tfmulti", dict(seed=repeat, steps_per_execution=steps_per_execution,
                             target_accuracy=target, max_epochs=sizes["max_epochs"]["tfmulti"],
                             steps_per_epoch=sizes["steps_per_epoch"],
                             test_examples=sizes["test_examples"]))], timeout=2400)
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
            line += (f"; time to {target}: seed {seed_tta[-1]:.1f} s "
                     f"({seed['epochs_to_accuracy']} epochs), tfmulti {ours_tta[-1]:.1f} s "
                     f"({race['epochs_to_accuracy']} epochs), {tta_speedups[-1]:.2f}x")
        else:
            line += (f"; {target} not reached (seed {seed['accuracy_per_epoch']}, "
                     f"tfmulti {race['accuracy_per_epoch']})")
        print(f"{line} ({time.monotonic() - start:.0f} s)", flush=True)
    if len(tta_speedups) < repeats:
        print(f"baseline: WARNING: only {len(tta_speedups)} of {repeats} repeats reached "
              f"{target} on both sides; time_to_accuracy_speedup summarizes those "
              f"(see runs[*].seed/tfmulti.accuracy_per_epoch)", flush=True)
    summary = _harness.summary
    return {
        "description": "seed 000 as written (plain Keras, MirroredStrategy() default devices, "
                       "fit on NumPy, batch 32, steps_per_execution 1, evaluated after each "
                       "epoch) vs tfmulti, each side in its own process with 2 virtual CPUs",
        "global_batch_size": BATCH,
        "steps_per_execution": steps_per_execution,
        "examples_per_second_seed": seed_rate,
        "examples_per_second_tfmulti": ours_rate,
        "examples_per_second_seed_summary": summary(seed_rate),
        "examples_per_second_tfmulti_summary": summary(ours_rate),
        "baseline_speedup": summary(speedups),
        "target_accuracy": target,
        "toy": _harness.toy(),
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


def summarize(r: dict) -> list[str]:
    """The suite's headline lines."""
    a = r["examples_per_second_seed_summary"]
    b = r["examples_per_second_tfmulti_summary"]
    t = r["time_to_accuracy_speedup"]
    return [f"baseline: baseline_speedup {_harness.fmt(r['baseline_speedup'])}; seed "
            f"{a['median']:,.0f} ex/s, tfmulti {b['median']:,.0f} ex/s (medians, "
            f"steps_per_execution {r['steps_per_execution']})",
            f"baseline: time_to_accuracy_speedup {_harness.fmt(t) if t else 'not measured'} "
            f"({r['repeats_reaching_target']} of {len(r['runs'])} repeats reached "
            f"{r['target_accuracy']} on both sides)"]


def plot(r: dict, ax) -> None:
    """Seconds to the target accuracy of each side, over the repeats."""
    s, t = r["baseline_speedup"], r["time_to_accuracy_speedup"]
    if t:
        ax.boxplot([r["time_to_accuracy_seed"], r["time_to_accuracy_tfmulti"]],
                   tick_labels=["seed 000", "tfmulti defaults"])
        ax.set_ylabel(f"seconds to test accuracy {r['target_accuracy']}")
    ax.set_title(f"Baseline: time to {r['target_accuracy']} "
                 + (f"{t['median']:.1f}x faster" if t else "not reached")
                 + f"; batch 32: {s['median']:.2f}x examples/s", fontsize=9)
