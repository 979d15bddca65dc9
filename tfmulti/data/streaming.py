"""Distribution of a dataset to the replicas of a strategy, with
prefetch-to-device streaming (`distribute`).

Batch sizes are always **global**: a global batch of 256 on 4 replicas gives
each replica 64 examples per step.

Last partial batch: for training (`training=True`) each epoch uses the
largest multiple of the global batch that fits in the (shuffled) data, so all
replicas always get full, equal batches and every used example is seen exactly
once per epoch; the remaining `num_examples % global_batch_size` examples
(different ones each epoch when shuffling) wait for a later epoch. For
evaluation (`training=False`) every example is used once; the last global
batch may be partial, and replicas beyond its end get empty batches, which
Keras' metrics count correctly.

Several workers (`MultiWorkerMirroredStrategy`) split the input one of three
ways (`sharding`):

* "examples": every worker reads all the data, shuffles it with the same
  seed, forms the same global batches and keeps its contiguous share of
  each. Exact: the union of the replicas' batches is the global batch one
  device would see, for any data. The cost: every worker reads (and
  decodes) everything, N times the input work for N workers.
* "files": each worker reads only its own files (`tfmulti.data.from_files`;
  file i goes to worker i mod N), shuffles its own examples and contributes
  global_batch_size / N examples to every step. Each worker reads 1/N of the
  bytes, so data larger than one host's memory or bandwidth trains. The
  global batches are drawn from the workers' own files, so they differ from
  one device's (the same examples per epoch, grouped differently): results
  agree statistically, not bit for bit. Every worker trains the same number
  of steps: the smallest share's, so with uneven files the larger shares
  leave examples out of an epoch (different ones each epoch).

* "batches": as "files", for a Python loader (`tfmulti.data.loaders`): each
  worker reads its own batches of a PyDataset (a contiguous range of its
  indices), or the generator a dataset function made for it.

"auto" (the default) reads files by worker when the data is a set of at
least as many files as workers, batches by worker for a PyDataset of at least
as many batches as workers or a loader made per worker, else by examples.

Data of unknown size (files, a filtered dataset): the epoch length is
`steps_per_epoch` when given, else counted once by reading the data (each
worker its own files), before training starts.

Example:
    >>> import tfmulti
    >>> strategy = tfmulti.get_strategy("one_device")
    >>> train = tfmulti.data.load("synthetic", split="train", num_examples=1024)
    >>> dist = tfmulti.data.distribute(train, strategy, global_batch_size=128, seed=0)
    >>> dist.steps_per_epoch, dist.sharding
    (8, 'examples')
"""

from __future__ import annotations

import dataclasses
from typing import Callable

import numpy as np
import tensorflow as tf

from tfmulti.utils import checks
from tfmulti.utils import human
from tfmulti.runtime import roles
from tfmulti.config.train_config import SHARDINGS, data_service_target
from tfmulti.data import service
from tfmulti.data.loaders import LoaderSource, as_source, is_loader
from tfmulti.data.sources import FileSource, as_dataset

__all__ = ["CACHE_LIMIT_BYTES", "DistributedInput", "SHARDINGS", "distribute",
           "element_bytes", "input_pipeline", "per_replica_batch_size", "steps_per_epoch"]

CACHE_LIMIT_BYTES = 2 << 30
"""The largest training set `cache="auto"` keeps in memory (bytes, estimated
from the element shapes); larger or unknown sizes are read anew each epoch."""
_SHUFFLE_BUFFER_BYTES = 256 << 20
_SHUFFLE_BUFFER_MAX = 60000
_SHUFFLE_BUFFER_UNKNOWN = 10000
_COUNT_TIMEOUT_S = 3600.0
_OWN = ("files", "batches")
"""Shardings where each input pipeline reads its own share (its files, its batches)."""


@dataclasses.dataclass(frozen=True)
class DistributedInput:
    """A dataset distributed over a strategy's replicas, ready for `model.fit`.

    Attributes:
        dataset: the `tf.distribute.DistributedDataset`.
        global_batch_size: examples per step over all replicas.
        per_replica_batch_size: examples per step on each replica.
        num_replicas: replicas in sync.
        steps_per_epoch: global steps in one pass over the data, or None if
            the size is unknown (evaluation of data of unknown size).
        repeat: True when the dataset repeats (pass `steps_per_epoch` to fit).
        sharding: how workers split the input: "examples" or "files".
        num_examples: the data's size when known without reading it (None
            for files and other data of unknown size: `steps_per_epoch` was
            given or counted).
    """

    dataset: object
    global_batch_size: int
    per_replica_batch_size: int
    num_replicas: int
    steps_per_epoch: int | None
    repeat: bool
    sharding: str = "examples"
    num_examples: int | None = None

    def evaluate_kwargs(self) -> dict:
        """Keyword arguments for `model.evaluate`/`predict`: `x` and `steps`."""
        return {"x": self.dataset, "steps": self.steps_per_epoch}

    def fit_kwargs(self) -> dict:
        """Keyword arguments for `model.fit`: `x` and `steps_per_epoch`."""
        return {
            "x": self.dataset,
            "steps_per_epoch": self.steps_per_epoch if self.repeat else None,
            "shuffle": False,  # the pipeline shuffles; Keras would only warn
        }


def per_replica_batch_size(global_batch_size: int, num_replicas: int) -> int:
    """global / replicas, or a ValueError naming both numbers."""
    checks.positive_int("global_batch_size", global_batch_size)
    if global_batch_size % num_replicas:
        lower = max(num_replicas, global_batch_size - global_batch_size % num_replicas)
        raise ValueError(
            f"`global_batch_size` ({global_batch_size}) must be divisible by the "
            f"number of replicas ({num_replicas}); use a multiple of {num_replicas}, "
            f"e.g. {lower} or {lower + num_replicas}."
        )
    return global_batch_size // num_replicas


def element_bytes(spec) -> int | None:
    """Bytes of one element of `spec` (a dataset's element_spec), or None when
    a shape is not fully known or a dtype has no fixed size (strings)."""
    total = 0
    for s in tf.nest.flatten(spec):
        if not isinstance(s, tf.TensorSpec) or not s.shape.is_fully_defined() \
                or s.dtype == tf.string:
            return None
        total += s.shape.num_elements() * s.dtype.size
    return total


def _shuffle_buffer(spec, size: int | None) -> int:
    per = element_bytes(spec)
    buffer = (_SHUFFLE_BUFFER_UNKNOWN if not per
              else max(1000, min(_SHUFFLE_BUFFER_MAX, _SHUFFLE_BUFFER_BYTES // per)))
    return min(buffer, size) if size else buffer


def input_pipeline(
    source,
    ctx: tf.distribute.InputContext,
    global_batch_size: int,
    *,
    training: bool,
    seed: int | None,
    shuffle_buffer: int,
    cache: bool,
    map_fn: Callable | None,
    repeat: bool,
    skip_steps: int = 0,
    batch_map_fn: Callable | None = None,
    prefetch: bool = True,
    input_threads: int | None = None,
    sharding: str = "examples",
    epoch_steps: int | None = None,
    data_service: str | None = None,
) -> tf.data.Dataset:
    """One input pipeline's per-replica batches (see `distribute`).

    `source` is a function returning the unbatched dataset, or a
    `FileSource`. Sharding across input pipelines (one per worker under
    MultiWorkerMirroredStrategy) is explicit, never TensorFlow's auto-shard:
    by "examples" (every pipeline reads all the data, shuffles it with the
    same seed, forms the same global batches and keeps its contiguous share
    of each) or by "files" (every pipeline reads its own files and batches its
    share of each step from them). `epoch_steps`: the global steps of one
    pass, for data of unknown size (each pass is cut to it, so every worker
    runs the same steps). `data_service`: a tf.data service's address; the
    pipeline (training only) runs there (`tfmulti.data.service`), the prefetch
    here.
    """
    pipelines, pipeline_id = ctx.num_input_pipelines, ctx.input_pipeline_id
    share = global_batch_size // pipelines
    per_replica = ctx.get_per_replica_batch_size(global_batch_size)
    by_files = sharding in _OWN and pipelines > 1
    if pipelines > 1 and seed is None and not by_files:
        seed = 0  # all workers must shuffle alike, or examples repeat or go missing

    def read() -> tf.data.Dataset:
        if isinstance(source, FileSource):
            files = source.shard(pipeline_id, pipelines) if by_files else None
            examples = source.dataset(files, shuffle=training, seed=seed)
        else:
            examples = source()
        if map_fn is not None:
            examples = examples.map(map_fn, num_parallel_calls=tf.data.AUTOTUNE)
        return examples

    # Files (and a loader's batches) are read in an order drawn anew every
    # epoch: read inside `one_iteration` below, that order restarts with every
    # iterator too, as the examples' shuffle does.
    per_iterator = training and isinstance(source, FileSource) and not cache
    dataset = None if per_iterator else read()
    if cache:
        dataset = dataset.cache()

    # tfmulti's own dataset functions hold no tensor-dependent Python control
    # flow, so autograph's conversion (the source parsed, a module written to
    # TMPDIR and imported) would change nothing: unconverted, a tiny `tfmulti
    # train` spends 1.3 CPU-s after the import instead of 1.9. The user's map
    # functions are converted as before.
    @tf.autograph.experimental.do_not_convert
    def keep_share(*batch):
        start = pipeline_id * share
        element = batch if len(batch) > 1 else batch[0]
        return tf.nest.map_structure(lambda t: t[start:start + share], element)

    def split(ds: tf.data.Dataset) -> tf.data.Dataset:
        # This pipeline's share of each global batch, split per replica.
        if pipelines > 1 and not by_files:
            ds = ds.map(keep_share)
        ds = ds.rebatch(per_replica, drop_remainder=training)
        if batch_map_fn is not None:  # after the cache: runs anew every epoch
            ds = ds.map(batch_map_fn, num_parallel_calls=tf.data.AUTOTUNE)
        return ds

    # Each pipeline batches what it reads: the whole global batch (then keeps
    # its share), or by files its share alone.
    batch = share if by_files else global_batch_size
    if training:
        source_ds = dataset

        @tf.autograph.experimental.do_not_convert
        def one_iteration(_):
            # Built anew for every iterator, so the shuffle's seed sequence
            # restarts: the same seed gives the same epochs however many
            # iterators were made before (Keras peeks at one to build). A
            # resumed run skips the global batches already trained.
            out = (read() if per_iterator else source_ds).shuffle(
                shuffle_buffer, seed=seed, reshuffle_each_iteration=True)
            out = out.batch(batch, drop_remainder=True)
            if epoch_steps is not None:
                out = out.take(epoch_steps)
            if repeat:
                out = out.repeat()
            if skip_steps:
                out = out.skip(skip_steps)
            return split(out)

        dataset = tf.data.Dataset.range(1).flat_map(one_iteration)
        if repeat and data_service is None:  # (the service's reader says it: a service
            # worker without the pipeline's one split serves nothing, and must not fail)
            # flat_map hides that the data repeats; said explicitly, a
            # distributed iterator's get_next_as_optional (Keras' multi-step
            # loop) skips its per-step partial-batch handling.
            dataset = dataset.apply(
                tf.data.experimental.assert_cardinality(tf.data.INFINITE_CARDINALITY))
    else:
        # For training only full batches: every replica gets a full batch, and
        # the cache upstream is read to its end, so it is kept.
        dataset = split(dataset.batch(batch, drop_remainder=False))
        if repeat:
            dataset = dataset.repeat()
    options = tf.data.Options()
    options.deterministic = seed is not None or not training
    options.experimental_distribute.auto_shard_policy = (
        tf.data.experimental.AutoShardPolicy.OFF  # sharded above, explicitly
    )
    if input_threads:
        # A pool of its own, one thread per op: on a CPU host the pipeline then
        # uses at most `input_threads` cores and leaves the rest to the step.
        options.threading.private_threadpool_size = input_threads
        options.threading.max_intra_op_parallelism = 1
    dataset = dataset.with_options(options)
    if data_service is not None and training:
        dataset = service.through_service(dataset, data_service, infinite=repeat)
    return dataset.prefetch(tf.data.AUTOTUNE) if prefetch else dataset


def steps_per_epoch(dataset: tf.data.Dataset, global_batch_size: int,
                    training: bool = True) -> int | None:
    """Global steps in one pass over unbatched `dataset` (what `distribute`
    reports): whole batches for training, the last partial one counted
    otherwise; None when its size is infinite or unknown."""
    size = int(dataset.cardinality())
    if size < 0:
        return None
    return size // global_batch_size if training else -(-size // global_batch_size)


def _choose_sharding(sharding: str, source, workers: int) -> str:
    checks.one_of("sharding", sharding, SHARDINGS)
    if isinstance(source, LoaderSource):
        return _loader_sharding(sharding, source, workers)
    files = len(source.files) if isinstance(source, FileSource) else 0
    if sharding == "batches":
        raise ValueError("`sharding` 'batches' gives each worker its own batches of a Python "
                         "loader (a PyDataset, a generator); use 'examples' or 'files' for "
                         "other data.")
    if sharding == "files":
        if not isinstance(source, FileSource):
            raise ValueError("`sharding` 'files' needs data from tfmulti.data.from_files(...); "
                             "use sharding='examples' for other data.")
        if files < workers:
            raise ValueError(
                f"`sharding` 'files' gives each of the {workers} workers its own files, but "
                f"there are {files}; split the data into at least {workers} files (as many "
                "files of similar size as you can: 10 or more per worker keeps the shares "
                "even), or use sharding='examples' (every worker reads everything).")
        return "files"
    if sharding == "auto" and isinstance(source, FileSource) and workers > 1:
        if files >= workers:
            return "files"
        print(f"tfmulti: {human.count(files, 'file')} for {workers} workers: every worker "
              "reads all of "
              "them (sharding='examples'); split the data into more files to read 1/N each",
              flush=True)
    return "examples"


def _loader_sharding(sharding: str, source: LoaderSource, workers: int) -> str:
    """A Python loader's sharding: "batches" (each worker its own: a
    PyDataset's index range, a stream made for the worker) where it can be
    made, else "examples" (every worker reads it all, keeping its share of
    each global batch: exact where it yields the same in every worker)."""
    if sharding == "files":
        raise ValueError(f"`sharding` 'files' needs data from tfmulti.data.from_files(...); "
                         f"for {source.describe()} use 'batches' or 'examples'.")
    if source.per_worker:
        if sharding == "examples" and workers > 1:
            raise ValueError(f"`sharding` 'examples' has every worker read all the data, but "
                             f"{source.describe()} yields each worker's own share; use "
                             "sharding='batches' or 'auto'.")
        return "batches"
    can = source.kind == "PyDataset" and len(source.files) >= workers
    if sharding == "batches" and workers > 1 and not can:
        raise ValueError(
            f"`sharding` 'batches' gives each of the {workers} workers its own batches, but "
            + (f"{source.describe()} has {len(source.files)}; use sharding='examples'"
               if source.kind == "PyDataset" else
               f"{source.describe()} is one stream; give the dataset function parameters "
               "worker_index and num_workers and yield that worker's share, or use "
               "sharding='examples'") + ".")
    if workers > 1 and sharding != "examples" and not can:
        print(f"tfmulti: every worker reads all of {source.describe()} and keeps its share of "
              "each global batch (sharding='examples'; exact when it yields the same examples "
              "in every worker); to read 1/N each, "
              + ("give it at least as many batches as workers" if source.kind == "PyDataset"
                 else "give the dataset function parameters worker_index and num_workers and "
                 "yield that worker's share"), flush=True)
    return "batches" if can and sharding != "examples" and workers > 1 else "examples"


def _count(source, make, sharding: str, role: roles.ClusterRole) -> int:
    """The examples of one pass: all of them, or (by files) this worker's."""
    if isinstance(source, FileSource):
        files = (source.shard(role.worker_index, role.num_workers) if sharding in _OWN
                 else None)
        return source.count(files)
    data = make()
    count = int(data.reduce(np.int64(0), tf.autograph.experimental.do_not_convert(
        lambda n, *_: n + 1)))
    print(f"tfmulti: counted {count:,} examples of data of unknown size (pass "
          "steps_per_epoch to skip this)", flush=True)
    return count


def _agreed_steps(source, make, sharding: str, role: roles.ClusterRole,
                  global_batch_size: int) -> int:
    """Global steps per epoch that every worker can run: by examples, whole
    global batches of the data; by files, the smallest worker's whole shares."""
    count = _count(source, make, sharding, role)
    if sharding not in _OWN:
        return count // global_batch_size
    share = global_batch_size // role.num_workers
    counts = [int(c) for c in roles.all_gather_text(
        "examples", str(count), role, _COUNT_TIMEOUT_S)]
    steps = min(c // share for c in counts)
    if len({c // share for c in counts}) > 1:
        print(f"tfmulti: the workers' files hold {counts} examples; each epoch trains "
              f"{steps} steps of {share} per worker (the smallest share)", flush=True)
    return steps


def distribute(
    dataset,
    strategy: tf.distribute.Strategy,
    global_batch_size: int,
    *,
    training: bool = True,
    seed: int | None = None,
    shuffle_buffer: int | None = None,
    cache: bool | None = None,
    map_fn: Callable | None = None,
    repeat: bool | None = None,
    prefetch_per_replica: int = 2,
    skip_steps: int = 0,
    batch_map_fn: Callable | None = None,
    prefetch: bool = True,
    input_threads: int | None = None,
    label: str | None = None,
    sharding: str = "auto",
    steps_per_epoch: int | None = None,
    data_service: str | None = None,
) -> DistributedInput:
    """Batches, shards and streams a dataset to the replicas of `strategy`.

    Pipeline per input worker (`input_pipeline`): read (this worker's files,
    or all the data) -> map (parallel, AUTOTUNE) -> cache -> shuffle
    (training) -> batch -> this worker's share (by examples, multi-worker
    only) -> per-replica batches -> batch map -> repeat -> prefetch, then
    `distribute_datasets_from_function` with prefetch-to-device
    (`InputOptions(experimental_fetch_to_device=True)` and a per-replica
    buffer), so the next batch is already on each device when a step starts.

    Args:
        dataset (tf.data.Dataset | tuple | numpy.ndarray | dict | Callable): the data, unbatched: a
            `tf.data.Dataset` (or a function returning one), in-memory data (`(features, labels)`
            arrays, dicts of arrays, a pandas DataFrame with `label`; see
            `tfmulti.data.sources.as_dataset`), files (`tfmulti.data.from_files`), or a
            Python loader as `fit` takes it: a `keras.utils.PyDataset`, a generator
            function or re-iterable object, a generator read once (see
            `tfmulti.data.loaders`; `tfmulti.data.from_loader` to say more).
        strategy: the strategy whose replicas consume the data.
        global_batch_size: examples per step across all replicas.
        training: shuffle and drop the last partial global batch (see module doc).
        seed: shuffle seed; with a seed the order is deterministic.
        shuffle_buffer: shuffle buffer size in examples (training only);
            default: as many as fit in 256 MiB (by the element shapes), at
            most 60,000 and at most the data.
        cache: cache the mapped examples in memory; default: for training
            data of known size up to `CACHE_LIMIT_BYTES` (2 GiB, estimated
            from the element shapes), never for files (evaluation stops
            before the end of the data, which voids a cache).
        map_fn: optional per-example function applied before caching.
        repeat: repeat forever, each pass exactly `steps_per_epoch` steps, so
            Keras shows progress against a known total; fit then needs
            `steps_per_epoch`, which `fit_kwargs()` supplies. Default: True
            for training data (of known or counted size), else False.
        prefetch_per_replica: batches buffered on each device. Where input and
            step cost about the same, a deeper buffer (8-32) absorbs either
            side's stalls (the streaming benchmark uses 32).
        skip_steps: training only: start after this many global batches of the
            repeated stream (a resumed run; see `tfmulti.training.backup`). The order is
            the one an uninterrupted run sees when `seed` is set.
        batch_map_fn: optional function applied to each per-replica batch
            after the cache (in parallel, AUTOTUNE), so it runs again every
            epoch: random augmentation, or any per-batch host work that must
            not be cached.
        prefetch: stream batches ahead of the step (default). False turns
            streaming off, to measure what it buys (`tfmulti diagnose
            --no_prefetch`): no tf.data prefetch, and batches stay on the host
            until the step copies them (buffer of 1).
        input_threads: limit the pipeline to a private pool of this many
            threads, one per op (default: TensorFlow's shared pool, all cores).
            On a CPU host this keeps the input from competing with the step
            for every core.
        label: the label column, for a pandas DataFrame.
        sharding: how several workers split the input: "examples", "files" or
            "auto" (see the module doc).
        steps_per_epoch: for data of unknown size only: the global steps of
            one pass (each pass is cut to it); default: counted once by
            reading the data.
        data_service: training only: the address of a tf.data service
            (grpc://HOST:PORT; `tfmulti data-service`, or
            `tfmulti.data.service.LocalService(...).target`) whose workers run
            each input pipeline, the same batches in the same order
            (`tfmulti.data.service`); the prefetch to the devices stays here.

    Returns:
        A `DistributedInput`.

    Raises:
        ValueError: the global batch is not divisible by the replica count, or
            is larger than the (known or counted) training data; the data
            repeats forever; `sharding="files"` with fewer files than workers
            or without files; `steps_per_epoch` for data of known size.
    """
    num_replicas = strategy.num_replicas_in_sync
    per_replica = per_replica_batch_size(global_batch_size, num_replicas)
    checks.positive_int("prefetch_per_replica", prefetch_per_replica)
    checks.non_negative_int("skip_steps", skip_steps)
    if skip_steps and not training:
        raise ValueError("`skip_steps` applies to training data only; pass training=True "
                         "or skip_steps=0.")
    checks.positive_int("input_threads", input_threads, none_ok=True)
    checks.positive_int("shuffle_buffer", shuffle_buffer, none_ok=True,
                         hint="a number of examples")
    checks.positive_int("steps_per_epoch", steps_per_epoch, none_ok=True)
    if data_service is not None:
        if not training:
            raise ValueError("`data_service` serves training input; evaluate without it.")
        data_service = data_service_target(data_service)
        if data_service.startswith("local"):
            raise ValueError(f"`data_service` {data_service!r}: distribute takes a running "
                             "service's address; start one with tfmulti.data.service."
                             "LocalService(...) and pass its target.")
    role = roles.cluster_role(strategy)
    if is_loader(dataset):
        dataset = as_source(dataset, role=role)
    elif isinstance(dataset, LoaderSource):
        dataset = dataset.for_worker(role)
    if isinstance(dataset, FileSource):
        source, make = dataset, None
        if label is not None:
            raise ValueError("`label` names a DataFrame column; a file source's `parse_fn` "
                             "returns the labels; drop `label`.")
    elif callable(dataset) and not isinstance(dataset, tf.data.Dataset):
        source = make = dataset
    else:
        converted = as_dataset(dataset, label=label)
        source = make = (lambda: converted)
    sharding = _choose_sharding(sharding, source, role.num_workers)
    if isinstance(source, LoaderSource):
        if shuffle_buffer is None:
            # A PyDataset's batches come in a new order every epoch already (mixed
            # here with their neighbours); a stream's order is its own, as in Keras.
            shuffle_buffer = global_batch_size if source.num_batches else 1
        if training and not skip_steps:
            print(f"tfmulti: {source.reading(global_batch_size, per_replica)}", flush=True)
    size = None if make is None else int(make().cardinality())
    if size == tf.data.INFINITE_CARDINALITY:
        raise ValueError("the dataset repeats forever, so an epoch has no end; pass it "
                         "without .repeat() (distribute repeats it), or with .take(n).")
    if size is not None and size < 0:
        size = None
    if size is not None:
        steps = size // global_batch_size if training else -(-size // global_batch_size)
        if steps_per_epoch is not None:
            raise ValueError(f"`steps_per_epoch` is for data of unknown size; this data has "
                             f"{size} examples ({steps} steps per pass); leave it unset.")
    elif steps_per_epoch is not None or not training:
        steps = steps_per_epoch
    else:
        steps = _agreed_steps(source, make, sharding, role, global_batch_size)
    if training and steps == 0:
        what = (f"the number of training examples ({size})" if size is not None
                else "the examples of a worker's share of the files" if sharding == "files"
                else "the number of training examples")
        fits = size - size % num_replicas if size else 0
        raise ValueError(
            f"`global_batch_size` ({global_batch_size}) exceeds {what}; "
            + (f"use at most {fits} (a multiple of the {num_replicas} replicas)." if fits
               else f"the data has fewer examples than the {num_replicas} replicas."
               if size is not None else "use a smaller batch or more data."))
    if repeat is None:
        repeat = training and steps is not None
    spec = None if make is None else make().element_spec
    if map_fn is not None and make is not None:
        spec = make().map(map_fn).element_spec
    if cache is None:
        per = element_bytes(spec) if spec is not None else None
        cache = bool(training and size is not None and per is not None
                     and per * size <= CACHE_LIMIT_BYTES)
    if shuffle_buffer is None:
        shuffle_buffer = _shuffle_buffer(spec, size)
    epoch_steps = steps if (size is None and training) else None  # cut each pass to it

    def input_fn(ctx: tf.distribute.InputContext) -> tf.data.Dataset:
        return input_pipeline(
            source, ctx, global_batch_size, training=training, seed=seed,
            shuffle_buffer=shuffle_buffer, cache=cache, map_fn=map_fn, repeat=repeat,
            batch_map_fn=batch_map_fn, prefetch=prefetch, input_threads=input_threads,
            skip_steps=skip_steps, sharding=sharding, epoch_steps=epoch_steps,
            data_service=data_service)

    dist = strategy.distribute_datasets_from_function(
        input_fn,
        options=tf.distribute.InputOptions(
            experimental_fetch_to_device=prefetch,
            experimental_per_replica_buffer_size=prefetch_per_replica if prefetch else 1,
        ),
    )
    return DistributedInput(
        dataset=dist,
        global_batch_size=global_batch_size,
        per_replica_batch_size=per_replica,
        num_replicas=num_replicas,
        steps_per_epoch=steps,
        repeat=repeat,
        sharding=sharding,
        num_examples=size,
    )
