"""embeddings: a two-tower recommendation model's training speed by optimizer
update: SGD, Adam's dense update (Keras' own) and lazy Adam
(`--sparse_updates=lazy`), on one device; SGD and lazy Adam under
MirroredStrategy over 2 virtual CPUs.

The model (`two_tower_model`): a user table and an item table of
`rows` x 32 (1M rows each at full size: 2 x 128 MB), each id's row through a
small MLP tower, the towers' dot product a click's logit; batch 1024 of ids
drawn uniformly (`two_tower_data`). A batch touches at most 2,048 of the 2M
rows. Timed by `fit` in one process, the three optimizers alternating
`cycles` times per repeat (a repeat's figures use the medians).

Then the tables sharded by rows (`--shard_embeddings`) on 2 workers of
`tfmulti launch` (`sharded_tables`): the two towers with Adam trained whole and
sharded, alternating repeat by repeat, each worker's peak RSS read from
outside (`benchmarks.peak_rss`, GNU time's %M), its saving against the ideal
(half of the tables' bytes with Adam's two moments: 6 bytes per table element
on each of 2 workers; goal: 0.6 on every worker), the step time sharded over
whole, and the largest difference between the two runs' weights.

Figures: lazy_over_sgd and dense_over_sgd, examples/s of lazy Adam and of
Adam's dense update over SGD's on one device (goal: lazy >= 0.6);
mirrored_lazy_over_one and mirrored_sgd_over_one, mirrored x 2 over one
device (goal 0.8; the 2 virtual CPUs share the machine's 2 cores);
reduced_bytes_per_replica, what each replica of the mirrored run hands the
all-reduce in a step, counted from a real batch's gradients
(`reduced_bytes`): as rows (the tables' ids and values), as rows with
repeated ids combined, and as dense tensors.

`packed_rows` (run by hand, not a suite figure): keras-io's Deep & Cross
Network of the corpus (`tests/corpus/dcn_criteo.py`, 39 tables) trained
mirrored x 2 by `tfmulti.train`, a fresh process per run, with tfmulti's fix
for tensorflow#53160 (the tables' sparse gradients all-reduced as one pack)
and without it, alternating: each run's seconds and test loss.
"""

from __future__ import annotations

import statistics

from benchmarks import _harness

__all__ = ["SETTINGS", "TOY", "check", "plot", "reduced_bytes", "run", "sharded_tables", "summarize",
           "two_tower_data", "two_tower_model", "worker"]

SETTINGS = {"rows": 1_000_000, "global_batch_size": 1024, "steps": 16, "cycles": 3}
"""The worker's settings, also recorded in the suite's JSON."""
TOY = {"rows": 1000, "global_batch_size": 64, "steps": 2, "cycles": 1}
"""`SETTINGS` at toy size (`_harness.toy`: the end-to-end test)."""
SHARDED = {"num_examples": 4096, "epochs": 2}
"""The 2-worker runs of `sharded_tables` (also the rows and batch of `SETTINGS`)."""
SHARDED_TOY = {"num_examples": 256, "epochs": 2}
WIDTH = 32
_ROWS_ENV = "TFMULTI_BENCH_EMBEDDING_ROWS"


def two_tower_data(num_examples: int | None = None, rows: int | None = None, seed: int = 0):
    """Clicks of (user id, item id) pairs, ids uniform over `rows` (default
    $TFMULTI_BENCH_EMBEDDING_ROWS, else 1M); a click when the ids' parities
    agree (learnable from the rows)."""
    import os

    import numpy as np

    rows = rows or int(os.environ.get(_ROWS_ENV, SETTINGS["rows"]))
    num_examples = num_examples or 16384
    rng = np.random.default_rng(seed)
    users = rng.integers(0, rows, num_examples).astype("int32")
    items = rng.integers(0, rows, num_examples).astype("int32")
    clicks = ((users + items) % 2).astype("float32")
    test = num_examples // 8
    features = {"user": users, "item": items}
    return {"train": (features, clicks),
            "test": ({k: v[:test] for k, v in features.items()}, clicks[:test]),
            "task": "regression"}


def two_tower_model(rows: int | None = None):
    """The two towers over tables of `rows` x 32 each (default as the data's)."""
    import os

    import keras

    rows = rows or int(os.environ.get(_ROWS_ENV, SETTINGS["rows"]))
    user = keras.Input((), dtype="int32", name="user")
    item = keras.Input((), dtype="int32", name="item")

    def tower(ids, name):
        x = keras.layers.Embedding(rows, WIDTH, name=f"{name}_table")(ids)
        x = keras.layers.Dense(64, activation="relu", name=f"{name}_hidden")(x)
        return keras.layers.Dense(WIDTH, name=f"{name}_out")(x)

    logit = keras.layers.Dot(axes=1)([tower(user, "user"), tower(item, "item")])
    model = keras.Model({"user": user, "item": item}, logit)
    model.compile(loss=keras.losses.BinaryCrossentropy(from_logits=True))
    return model


def reduced_bytes(run) -> dict:
    """The bytes each replica hands the all-reduce in one step, counted from
    the gradients of a real batch of `run` (a mirrored run): "rows", as Keras
    hands them (a table's gradient an `IndexedSlices`: a row of values and an
    id per lookup, repeats included; the other gradients dense); "rows_combined",
    the same with each table's repeated ids summed first (one row per distinct
    id); "dense", every gradient as a dense tensor (the table whole)."""
    import tensorflow as tf

    model, strategy = run.model, run.strategy
    features, labels = next(iter(run.train_input.dataset))

    def step(x, y):
        with tf.GradientTape() as tape:
            loss = model.compute_loss(x=x, y=y, y_pred=model(x, training=True))
        grads = tape.gradient(loss, model.trainable_variables)
        rows = combined = dense = 0
        for g, v in zip(grads, model.trainable_variables, strict=True):
            dense += int(v.value.shape.num_elements()) * v.value.dtype.size
            if isinstance(g, tf.IndexedSlices):
                width = g.values.dtype.size * int(g.values.shape[1:].num_elements())
                ids = int(tf.size(g.indices))
                distinct = int(tf.size(tf.unique(g.indices)[0]))
                rows += ids * (width + g.indices.dtype.size)
                combined += distinct * (width + g.indices.dtype.size)
            else:
                size = int(tf.size(g)) * g.dtype.size
                rows, combined = rows + size, combined + size
        return tf.constant([rows, combined, dense], tf.int64)

    counted = strategy.experimental_local_results(strategy.run(step, args=(features, labels)))
    first = [int(n) for n in counted[0].numpy()]
    return dict(zip(("rows", "rows_combined", "dense"), first, strict=True))


def worker(repeats: int, rows: int, global_batch_size: int, steps: int, cycles: int) -> dict:
    """Examples/s of `fit` on one device with SGD, dense Adam and lazy Adam."""
    import os

    os.environ[_ROWS_ENV] = str(rows)
    import tfmulti
    from tfmulti.config.train_config import TrainConfig
    from tfmulti.insight import timing
    from tfmulti.training import run as runs

    tfmulti.configure_virtual_devices(2)
    variants = {"sgd": ("sgd", "dense", None), "adam_dense": ("adam", "dense", None),
                "adam_lazy": ("adam", "lazy", None),
                "mirrored_sgd": ("sgd", "dense", ("CPU:0", "CPU:1")),
                "mirrored_adam_lazy": ("adam", "lazy", ("CPU:0", "CPU:1"))}
    built = {}
    for name, (optimizer, updates, devices) in variants.items():
        config = TrainConfig(
            model="benchmarks.embeddings:two_tower_model",
            dataset="benchmarks.embeddings:two_tower_data", optimizer=optimizer,
            sparse_updates=updates, global_batch_size=global_batch_size,
            steps_per_execution=1, seed=0, learning_rate=0.01,
            distribution="mirrored" if devices else "one_device", devices=devices)
        run = runs.build_run(config)
        timing.time_fit(run.model, run.train_input, 2, epochs=2)  # builds and traces
        built[name] = run
    out = {name: [] for name in variants}
    for _ in range(repeats):
        seconds = {name: [] for name in variants}
        for _ in range(cycles):
            for name, run in built.items():
                seconds[name].append(statistics.median(
                    timing.time_fit(run.model, run.train_input, steps, epochs=2)))
        for name in variants:
            out[name].append(global_batch_size / statistics.median(seconds[name]))
    return {"examples_per_second": out,
            "reduced_bytes_per_replica": reduced_bytes(built["mirrored_adam_lazy"])}


def check() -> None:
    """The suite has no options: nothing to check."""


def run(repeats: int) -> dict:
    """Runs the suite; returns its JSON record."""
    settings, start, r = _harness.run_sized_worker("embeddings", repeats, SETTINGS, TOY)
    rates = r["examples_per_second"]
    lazy = [a / b for a, b in zip(rates["adam_lazy"], rates["sgd"])]
    dense = [a / b for a, b in zip(rates["adam_dense"], rates["sgd"])]
    mirrored_lazy = [a / b for a, b in zip(rates["mirrored_adam_lazy"], rates["adam_lazy"])]
    mirrored_sgd = [a / b for a, b in zip(rates["mirrored_sgd"], rates["sgd"])]
    reduced = r["reduced_bytes_per_replica"]
    tables = sharded_tables(settings["rows"], settings["global_batch_size"], repeats)
    _harness.report("embeddings", start, [
        f"examples/s: SGD {rates['sgd'][i]:,.0f}, Adam dense {rates['adam_dense'][i]:,.0f}, "
        f"Adam lazy {rates['adam_lazy'][i]:,.0f}: lazy / SGD {lazy[i]:.2f}, dense / SGD "
        f"{dense[i]:.2f}; mirrored x 2 / one device: lazy Adam {mirrored_lazy[i]:.2f}, SGD "
        f"{mirrored_sgd[i]:.2f}" for i in range(repeats)])
    return {
        "description": f"a two-tower model, 2 tables of {settings['rows']:,} x {WIDTH}, batch "
                       f"{settings['global_batch_size']}; fit's examples/s with SGD, Adam's "
                       "dense update and lazy Adam (sparse_updates='lazy') on one device, SGD "
                       "and lazy Adam under MirroredStrategy over 2 virtual CPUs",
        **settings, "toy": _harness.toy(), "examples_per_second": rates,
        "lazy_over_sgd": _harness.summary(lazy), "dense_over_sgd": _harness.summary(dense),
        "mirrored_lazy_over_one": _harness.summary(mirrored_lazy),
        "mirrored_sgd_over_one": _harness.summary(mirrored_sgd),
        "reduced_bytes_per_replica": reduced, "sharded_tables": tables,
        "goal": 0.6, "mirrored_goal": 0.8,
    }


def sharded_tables(rows: int, global_batch_size: int, repeats: int) -> dict:
    """The two towers (tables of `rows`) trained with Adam by 2 workers
    (`memory.launch_measured`), the tables whole and sharded by rows
    (`--shard_embeddings`), the order alternating repeat by repeat: each
    worker's peak RSS (median of the repeats), its saving over the ideal, the
    step time sharded / whole, the largest difference of the first repeat's
    weights, and both ways under one per-worker cap (`_tables_cap`)."""
    import shutil
    import tempfile

    from benchmarks import memory

    settings = _harness.toy_sized(SHARDED, SHARDED_TOY)
    flags = ["--model=benchmarks.embeddings:two_tower_model",
             "--dataset=benchmarks.embeddings:two_tower_data",
             f"--num_examples={settings['num_examples']}",
             f"--global_batch_size={global_batch_size}", f"--epochs={settings['epochs']}",
             "--optimizer=adam", "--seed=3"]
    runs: dict[str, list[dict]] = {"whole": [], "sharded": []}
    difference = None
    with tempfile.TemporaryDirectory(prefix="tfmulti-tables-") as folder:
        for repeat in range(repeats):
            for name in ("whole", "sharded")[::1 if repeat % 2 == 0 else -1]:
                run = memory.launch_measured(
                    flags + (["--shard_embeddings"] if name == "sharded" else []),
                    f"{folder}/{name}{repeat}", env={_ROWS_ENV: str(rows)})
                if run["returncode"] != 0 or None in run["peak_rss_bytes"]:
                    raise RuntimeError(f"embeddings suite: {name} tables on 2 workers failed "
                                       f"({run['returncode']}):\n{run['output']}")
                runs[name].append(run)
            if repeat == 0:
                difference = _largest_difference(f"{folder}/whole0/model.keras",
                                                 f"{folder}/sharded0/model.keras")
            for name in runs:  # (the models' files: 768 MB each at full size)
                shutil.rmtree(f"{folder}/{name}{repeat}", ignore_errors=True)
        anon = {name: statistics.median(max(r["peak_anon_bytes"]) for r in runs[name])
                for name in runs}
        cap = _tables_cap(flags, anon, rows, folder)
    ideal = (memory.NUM_WORKERS - 1) / memory.NUM_WORKERS * 2 * rows * WIDTH * 3 * 4
    by_worker = []
    for w in range(memory.NUM_WORKERS):
        whole = statistics.median(r["peak_rss_bytes"][w] for r in runs["whole"])
        sharded = statistics.median(r["peak_rss_bytes"][w] for r in runs["sharded"])
        by_worker.append({"whole_peak_rss_bytes": int(whole),
                          "sharded_peak_rss_bytes": int(sharded),
                          "fraction_of_ideal": (whole - sharded) / ideal})
    return {
        **settings, "ideal_saving_bytes": int(ideal), "workers": by_worker,
        "peak_rss_bytes": {name: [r["peak_rss_bytes"] for r in runs[name]] for name in runs},
        "step_ratio": _harness.summary([
            memory.step_seconds(s["metrics"]) / memory.step_seconds(w["metrics"])
            for s, w in zip(runs["sharded"], runs["whole"], strict=True)]),
        "largest_weight_difference": difference, "goal": 0.6, "cap": cap,
    }


_PACKED_RUN = """
import json, sys, time
import tfmulti
from tfmulti.runtime import keras_fixes
from tests.corpus import harness
tfmulti.configure_virtual_devices(2)
if sys.argv[1] == "unpacked":  # the fix left out: apply_keras_fixes installs a no-op in its place
    keras_fixes._PACKED_ROWS = keras_fixes._Fix("left out", "-", "", ())
    keras_fixes._patch_packed_rows = lambda: None
start = time.perf_counter()
config = tfmulti.TrainConfig(distribution="mirrored", devices=("CPU:0", "CPU:1"),
                             model_dir=sys.argv[2], **harness.config_kwargs("dcn_criteo"))
metrics = tfmulti.train(config)
print(json.dumps({"seconds": time.perf_counter() - start, "test_loss": metrics["test_loss"]}))
"""


def _alternating_processes(script: str, modes: tuple[str, ...], repeats: int,
                           timeout: float) -> dict[str, list]:
    """`script` (a `python -c` program printing one JSON line last) run once
    per mode and repeat, each in a fresh process, the modes alternating, its
    mode as its first argument and a temporary folder as its second:
    {mode: [each run's JSON]}."""
    import json
    import subprocess
    import sys
    import tempfile

    out: dict[str, list] = {mode: [] for mode in modes}
    for _ in range(repeats):
        for mode, runs in out.items():
            with tempfile.TemporaryDirectory() as folder:
                result = subprocess.run([sys.executable, "-c", script, mode, folder + "/run"],
                                        capture_output=True, text=True, timeout=timeout,
                                        check=True)
            runs.append(json.loads(result.stdout.strip().splitlines()[-1]))
    return out


def packed_rows(repeats: int = 2) -> dict:
    """The corpus' DCN (39 tables) trained mirrored x 2 with the sparse
    gradients packed and not (`_PACKED_RUN`), alternating, each in a fresh
    process: {"packed" | "unpacked": {"seconds": [...], "test_loss": [...],
    "median_seconds": ...}}. Run from the repository's root:
    `PYTHONPATH=. python -c "from benchmarks import embeddings as e; print(e.packed_rows(2))"`."""
    out = {}
    for mode, runs in _alternating_processes(_PACKED_RUN, ("packed", "unpacked"), repeats,
                                             900).items():
        seconds = [round(run["seconds"], 1) for run in runs]
        out[mode] = {"seconds": seconds, "test_loss": [run["test_loss"] for run in runs],
                     "median_seconds": statistics.median(seconds)}
    return out


def mirrored_cost(rows: int = SETTINGS["rows"], steps_per_execution: int = 1,
                  cross_device_ops: str = "auto", repeats: int = 3) -> dict:
    """Where mirrored x 2 loses to one device on the two towers: examples/s of
    SGD and lazy Adam, one device and mirrored over 2 virtual CPUs, with tables
    of `rows`, `steps_per_execution` steps per call and the mirrored gradients
    reduced by `cross_device_ops`; the medians of `repeats` epochs of 32 steps
    each, alternating, in this process (make it a fresh one):
    {"examples_per_second": {"one_sgd" ...}, "mirrored_over_one": {"sgd", "lazy"}}.
    Run from the repository's root: `PYTHONPATH=. python -c "from benchmarks
    import embeddings as e; print(e.mirrored_cost(1000))"`."""
    import os

    os.environ[_ROWS_ENV] = str(rows)
    import tfmulti
    from tfmulti.config.train_config import TrainConfig
    from tfmulti.insight import timing
    from tfmulti.training import run as runs

    tfmulti.configure_virtual_devices(2)
    built = {}
    for where, devices in (("one", None), ("mirrored", ("CPU:0", "CPU:1"))):
        for optimizer, updates in (("sgd", "dense"), ("lazy", "lazy")):
            config = TrainConfig(
                model="benchmarks.embeddings:two_tower_model",
                dataset="benchmarks.embeddings:two_tower_data",
                optimizer="sgd" if optimizer == "sgd" else "adam", sparse_updates=updates,
                global_batch_size=SETTINGS["global_batch_size"],
                steps_per_execution=steps_per_execution, cross_device_ops=cross_device_ops,
                seed=0, learning_rate=0.01,
                distribution="mirrored" if devices else "one_device", devices=devices)
            run = runs.build_run(config)
            timing.time_fit(run.model, run.train_input, steps_per_execution, epochs=2)
            built[f"{where}_{optimizer}"] = run
    seconds: dict = {name: [] for name in built}
    for _ in range(repeats):
        for name, run in built.items():
            seconds[name] += timing.time_fit(run.model, run.train_input, 32, epochs=2)
    rates = {name: round(SETTINGS["global_batch_size"] / statistics.median(s))
             for name, s in seconds.items()}
    return {"rows": rows, "steps_per_execution": steps_per_execution,
            "cross_device_ops": cross_device_ops, "examples_per_second": rates,
            "mirrored_over_one": {k: round(rates[f"mirrored_{k}"] / rates[f"one_{k}"], 2)
                                  for k in ("sgd", "lazy")}}


_TABLE_READ_RUN = """
import json, sys
from tfmulti.runtime import keras_fixes
from benchmarks import embeddings
if sys.argv[1] == "whole":  # the fix left out: apply_keras_fixes installs a no-op in its place
    keras_fixes._WHOLE_TABLE_READ = keras_fixes._Fix("left out", "-", "", ())
    keras_fixes._patch_whole_table_reads = lambda: None
print(json.dumps(embeddings.worker(1, **embeddings.SETTINGS)["examples_per_second"]))
"""


def table_reads(repeats: int = 3) -> dict:
    """The suite's one-process figures (`worker`: one repeat of its settings)
    with the lookups gathering rows from the tables and reading them whole
    (the fix for keras-core#229 left out, `_TABLE_READ_RUN`), alternating,
    each in a fresh process: {"rows" | "whole": {variant: [examples/s, ...]},
    "median": {mode: {variant: ...}}}. Run from the repository's root:
    `PYTHONPATH=. python -c "from benchmarks import embeddings as e; print(e.table_reads(3))"`."""
    out: dict = {mode: {} for mode in ("rows", "whole")}
    runs = _alternating_processes(_TABLE_READ_RUN, tuple(out), repeats, 1200)
    for mode, record in out.items():
        for run in runs[mode]:
            for variant, rates in run.items():
                record.setdefault(variant, []).extend(round(r) for r in rates)
    out["median"] = {mode: {variant: statistics.median(rates) for variant, rates in record.items()}
                     for mode, record in out.items()}
    return out


def _tables_cap(flags: list[str], anon: dict, rows: int, folder: str) -> dict:
    """The tables whole and sharded on 2 workers under one cap per worker,
    halfway between the two ways' peaks of anonymous memory (`anon`: the
    larger worker's, median; as the memory suite's cap, `memory._cap`);
    none at toy size. {"limit_bytes", "whole"/"sharded": {"returncode",
    "oom_kills"}}."""
    from benchmarks import memory, peak_rss

    why = peak_rss.limit_unavailable() or (
        "toy size, where the peaks are close" if _harness.toy() else None)
    if why or not all(anon.values()):
        return {"skipped": why or "the anonymous memory of the workers could not be read"}
    limit = int(anon["whole"] + anon["sharded"]) // 2
    out: dict = {"limit_bytes": limit}
    for name in ("whole", "sharded"):
        run = memory.launch_measured(
            flags + (["--shard_embeddings"] if name == "sharded" else []),
            f"{folder}/{name}_capped", env={_ROWS_ENV: str(rows)}, limit_bytes=limit)
        out[name] = {"returncode": run["returncode"], "oom_kills": run["oom_kills"]}
        if run["returncode"] not in (0, 128 + 9) or (run["returncode"] and not run["oom_kills"]):
            out[name]["output"] = run["output"]  # neither trained nor killed for memory
    return out


def _largest_difference(a: str, b: str) -> float:
    """The largest absolute difference between the weights of two saved models."""
    import keras
    import numpy as np

    first, second = (keras.saving.load_model(path, compile=False).get_weights()
                     for path in (a, b))
    return max(float(np.max(np.abs(x - y))) for x, y in zip(first, second, strict=True))


def _reduced_line(reduced: dict) -> str:
    return (f"bytes each replica hands the all-reduce per step: {reduced['rows']:,} as rows "
            f"({reduced['rows_combined']:,} with repeated ids combined), against "
            f"{reduced['dense']:,} dense ({reduced['dense'] / reduced['rows']:,.0f}x)")


def summarize(r: dict) -> list[str]:
    """The suite's headline lines."""
    fmt = _harness.fmt
    return [f"embeddings: lazy Adam / SGD {fmt(r['lazy_over_sgd'])} (goal >= {r['goal']}); "
            f"Adam's dense update / SGD {fmt(r['dense_over_sgd'])}; mirrored x 2 / one device: "
            f"lazy Adam {fmt(r['mirrored_lazy_over_one'])}, SGD "
            f"{fmt(r['mirrored_sgd_over_one'])} (goal >= {r['mirrored_goal']})",
            f"embeddings: {_reduced_line(r['reduced_bytes_per_replica'])}",
            f"embeddings: {_tables_line(r['sharded_tables'])}"]


def _tables_line(t: dict) -> str:
    peaks = "; ".join(
        f"worker {w}: {s['whole_peak_rss_bytes'] / 2**20:,.0f} -> "
        f"{s['sharded_peak_rss_bytes'] / 2**20:,.0f} MiB, {s['fraction_of_ideal']:.2f} of the "
        f"ideal saving" for w, s in enumerate(t["workers"]))
    cap = t.get("cap", {"skipped": "not measured"})
    capped = f"no cap: {cap['skipped']}" if "skipped" in cap else (
        f"under a cap of {cap['limit_bytes'] / 2**20:,.0f} MiB per worker: " + ", ".join(
            f"{name} exits {cap[name]['returncode']} ({cap[name]['oom_kills']} killed for "
            f"memory)" for name in ("whole", "sharded")))
    return (f"shard_embeddings on 2 workers, peak RSS whole -> sharded: {peaks} (goal >= "
            f"{t['goal']}); step {_harness.fmt(t['step_ratio'], 'x', 3)} of whole; weights "
            f"within {t['largest_weight_difference']:.1e}; {capped}")


def plot(r: dict, ax) -> None:
    """Median examples/s of each optimizer update."""
    rates = r["examples_per_second"]
    names = {"sgd": "SGD", "adam_dense": "Adam dense", "adam_lazy": "Adam lazy",
             "mirrored_sgd": "SGD x2", "mirrored_adam_lazy": "lazy x2"}
    ax.bar(list(names.values()), [statistics.median(rates[k]) for k in names])
    ax.set_ylabel("examples/s (median)")
    s = r["lazy_over_sgd"]
    ax.set_title(f"Embeddings: lazy Adam / SGD = {s['median']:.2f} "
                 f"[{s['min']:.2f}-{s['max']:.2f}]", fontsize=9)
