"""Input pipelines: tensorflow-datasets sources, synthetic data, and
distribution to the replicas with prefetch-to-device streaming.

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

Offline use: nothing here downloads unless `download=True` is passed.
Fashion-MNIST is prepared from the original IDX files of the Debian package
`dataset-fashion-mnist` into a TFDS dataset the first time it is needed.

Example:
    >>> import tfmulti
    >>> strategy = tfmulti.get_strategy("one_device")
    >>> train = tfmulti.data.load("synthetic", split="train", num_examples=1024)
    >>> dist = tfmulti.data.distribute(train, strategy, global_batch_size=128, seed=0)
    >>> dist.steps_per_epoch
    8
"""

from __future__ import annotations

import dataclasses
import gzip
import os
from pathlib import Path
from typing import Callable

import numpy as np
import tensorflow as tf

from tfmulti import _checks, text_data

__all__ = ["DataNotFoundError", "DistributedInput", "dataset_info", "default_data_dir",
           "distribute", "load", "per_replica_batch_size", "prepare_fashion_mnist", "read_idx",
           "steps_per_epoch", "synthetic", "synthetic_regression"]

FASHION_MNIST_IDX_DIRS = ("/usr/share/datasets/fashion-mnist",)
FASHION_MNIST_FILES = {
    "train": ("train-images-idx3-ubyte.gz", "train-labels-idx1-ubyte.gz"),
    "test": ("t10k-images-idx3-ubyte.gz", "t10k-labels-idx1-ubyte.gz"),
}
FASHION_MNIST_CLASSES = (
    "T-shirt/top", "Trouser", "Pullover", "Dress", "Coat",
    "Sandal", "Shirt", "Sneaker", "Bag", "Ankle boot",
)
SYNTHETIC_NAMES = ("synthetic", "synthetic_regression")


class DataNotFoundError(FileNotFoundError):
    """A dataset is neither prepared nor obtainable without a download."""


# --------------------------------------------------------------------------
# Sources
# --------------------------------------------------------------------------

def default_data_dir() -> str:
    """Where TFDS datasets live: $TFDS_DATA_DIR, else ~/tensorflow_datasets."""
    return os.environ.get("TFDS_DATA_DIR") or os.path.join(
        os.path.expanduser("~"), "tensorflow_datasets"
    )


def read_idx(path: str | os.PathLike) -> np.ndarray:
    """Reads an IDX file (optionally gzip-compressed) into a uint8 array.

    Raises:
        ValueError: the file is not an unsigned-byte IDX file or is truncated.
    """
    path = Path(path)
    opener = gzip.open if path.suffix == ".gz" else open
    with opener(path, "rb") as f:
        raw = f.read()
    if len(raw) < 4 or raw[0] != 0 or raw[1] != 0 or raw[2] != 0x08:
        raise ValueError(f"{path} is not an unsigned-byte IDX file.")
    ndim = raw[3]
    dims = tuple(int.from_bytes(raw[4 + 4 * i: 8 + 4 * i], "big") for i in range(ndim))
    offset = 4 + 4 * ndim
    expected = int(np.prod(dims))
    if len(raw) - offset != expected:
        raise ValueError(
            f"{path} is truncated or corrupt: header says {dims} "
            f"({expected} bytes), found {len(raw) - offset} bytes."
        )
    return np.frombuffer(raw, dtype=np.uint8, offset=offset).reshape(dims)


def find_fashion_mnist_idx(source_dir: str | None = None) -> tuple[Path | None, list[str]]:
    """Finds a folder holding the four Fashion-MNIST IDX files: `source_dir`
    if given, else $TFMULTI_FASHION_MNIST_DIR and the Debian package's folder.

    Returns:
        (folder or None, the folders tried).
    """
    if source_dir:  # an explicit folder is the only one tried
        candidates = [str(source_dir)]
    else:
        candidates = [os.environ.get("TFMULTI_FASHION_MNIST_DIR"), *FASHION_MNIST_IDX_DIRS]
        candidates = [c for c in candidates if c]
    names = [n for pair in FASHION_MNIST_FILES.values() for n in pair]
    for folder in candidates:
        if all((Path(folder) / n).is_file() for n in names):
            return Path(folder), candidates
    return None, candidates


def prepare_fashion_mnist(data_dir: str | None = None, source_dir: str | None = None) -> str:
    """Writes Fashion-MNIST from its IDX files as the TFDS dataset `fashion_mnist`.

    The result is the same layout TFDS's own builder produces
    (`<data_dir>/fashion_mnist/3.0.1`), so `tfds.load("fashion_mnist",
    data_dir=data_dir)` reads it too. Does nothing if already prepared.

    Returns:
        The data dir.

    Raises:
        DataNotFoundError: no folder with the IDX files was found.
    """
    import tensorflow_datasets as tfds

    data_dir = data_dir or default_data_dir()
    folder, tried = find_fashion_mnist_idx(source_dir)
    if folder is None:
        raise DataNotFoundError(
            "Fashion-MNIST IDX files not found in "
            f"{tried}; install them with `apt-get install dataset-fashion-mnist` "
            "or pass the folder holding "
            f"{list(FASHION_MNIST_FILES['train'] + FASHION_MNIST_FILES['test'])}."
        )
    builder = _fashion_mnist_builder_cls()(data_dir=data_dir, source_dir=str(folder))
    if not builder.is_prepared():
        builder.download_and_prepare(
            download_config=tfds.download.DownloadConfig(try_download_gcs=False)
        )
    return data_dir


def _fashion_mnist_builder_cls():
    """TFDS builder reading the local IDX files (not registered: TFDS's own
    `fashion_mnist` builder keeps the name and reads the prepared data)."""
    import tensorflow_datasets as tfds

    class FashionMnistFromIdx(tfds.core.GeneratorBasedBuilder, skip_registration=True):
        name = "fashion_mnist"
        VERSION = tfds.core.Version("3.0.1")

        def __init__(self, *, source_dir: str, **kwargs):
            self._source_dir = Path(source_dir)
            super().__init__(**kwargs)

        def _info(self):
            return self.dataset_info_from_configs(
                description="Fashion-MNIST, prepared by tfmulti from the original IDX files.",
                features=tfds.features.FeaturesDict({
                    "image": tfds.features.Image(shape=(28, 28, 1)),
                    "label": tfds.features.ClassLabel(names=list(FASHION_MNIST_CLASSES)),
                }),
                supervised_keys=("image", "label"),
                homepage="https://github.com/zalandoresearch/fashion-mnist",
            )

        def _split_generators(self, dl_manager):
            return {split: self._generate_examples(split) for split in FASHION_MNIST_FILES}

        def _generate_examples(self, split):
            image_file, label_file = FASHION_MNIST_FILES[split]
            images = read_idx(self._source_dir / image_file)
            labels = read_idx(self._source_dir / label_file)
            if len(images) != len(labels):
                raise ValueError(
                    f"{split}: {len(images)} images but {len(labels)} labels in "
                    f"{self._source_dir}."
                )
            for i, (image, label) in enumerate(zip(images, labels)):
                yield i, {"image": image[..., None], "label": int(label)}

    return FashionMnistFromIdx


def synthetic(
    split: str = "train",
    num_examples: int = 60000,
    shape=(28, 28, 1),
    num_classes: int = 10,
    seed: int = 0,
) -> tf.data.Dataset:
    """Learnable synthetic classification data: float32 features in [0, 1),
    int64 labels from a fixed random linear teacher. Same seed, same data;
    "train" and "test" differ."""
    rng = np.random.default_rng([seed, _split_index(split)])
    teacher = np.random.default_rng(seed).standard_normal((int(np.prod(shape)), num_classes))
    x = rng.random((num_examples, *shape), dtype=np.float32)
    logits = (x.reshape(num_examples, -1) - 0.5) @ teacher
    y = np.argmax(logits, axis=1).astype(np.int64)
    return tf.data.Dataset.from_tensor_slices((x, y))


def synthetic_regression(
    split: str = "train",
    num_examples: int = 8192,
    num_features: int = 1024,
    seed: int = 0,
) -> tf.data.Dataset:
    """Synthetic regression data (1024 features by default): y = x.w + noise."""
    rng = np.random.default_rng([seed, _split_index(split)])
    w = np.random.default_rng(seed).standard_normal((num_features, 1)).astype(np.float32)
    x = rng.standard_normal((num_examples, num_features), dtype=np.float32)
    y = (x @ w / np.sqrt(num_features)
         + 0.1 * rng.standard_normal((num_examples, 1), dtype=np.float32)).astype(np.float32)
    return tf.data.Dataset.from_tensor_slices((x, y))


def dataset_info(name: str, data_dir: str | None = None) -> dict:
    """Input shape, number of classes (None for regression) and task of a dataset.

    For TFDS datasets this reads the prepared dataset's metadata (call `load`
    first so the data is prepared).
    """
    if name == "synthetic":
        return {"input_shape": (28, 28, 1), "num_classes": 10, "task": "classification"}
    if name == "synthetic_regression":
        return {"input_shape": (1024,), "num_classes": None, "task": "regression"}
    import tensorflow_datasets as tfds

    info = tfds.builder(name, data_dir=data_dir or default_data_dir()).info
    image_key, label_key = info.supervised_keys
    label = info.features[label_key]
    num_classes = getattr(label, "num_classes", None)
    return {
        "input_shape": tuple(info.features[image_key].shape),
        "num_classes": num_classes,
        "task": "classification" if num_classes else "regression",
    }


def _split_index(split: str) -> int:
    if split not in ("train", "test"):
        raise ValueError(f"synthetic data has splits 'train' and 'test', got {split!r}.")
    return 0 if split == "train" else 1


def _normalize_image(image, label):
    return tf.cast(image, tf.float32) / 255.0, label


def load(
    name: str,
    split: str = "train",
    data_dir: str | None = None,
    download: bool = False,
    source_dir: str | None = None,
    num_examples: int | None = None,
) -> tf.data.Dataset:
    """Loads a dataset as unbatched `(features, label)` pairs.

    Images come as float32 in [0, 1], shape (H, W, C).

    Sources, in order:
        * "synthetic" / "synthetic_regression": generated (fixed seed).
        * Any TFDS name: prepared data in `data_dir` (default
          `default_data_dir()`).
        * "fashion_mnist" only: the IDX files of the Debian package
          `dataset-fashion-mnist` (or `source_dir`), prepared into `data_dir`.
        * "tfmulti_text" (`tfmulti.text_data`): byte-level language
          modelling on the Python standard library's sources (or
          `source_dir`), prepared into `data_dir`; (inputs, targets) int32.
        * With `download=True` only: a TFDS download (needs the internet;
          offline it hangs for minutes before failing, hence off by default).

    Args:
        name: TFDS dataset name or a synthetic name.
        split: TFDS split string ("train", "test", "train[:10%]", ...).
        data_dir: TFDS data dir.
        download: allow a TFDS download when the data is not prepared.
        source_dir: folder with the Fashion-MNIST IDX files.
        num_examples: synthetic data only: how many examples.

    Raises:
        DataNotFoundError: the data is not available; the message names every
            source tried and how to provide the data.
    """
    _checks.positive_int("num_examples", num_examples, none_ok=True)
    if name in SYNTHETIC_NAMES:
        maker = synthetic if name == "synthetic" else synthetic_regression
        kwargs = {"num_examples": num_examples} if num_examples else {}
        return maker(split, **kwargs)
    if num_examples is not None:
        raise ValueError(f"`num_examples` applies to synthetic data only, not {name!r}.")
    if name.partition("/")[0] == text_data.NAME:  # byte windows, prepared on first use
        return text_data.load(name, split, data_dir, source_dir=source_dir)
    import tensorflow_datasets as tfds

    data_dir = data_dir or default_data_dir()
    tried = [f"prepared TFDS data in {os.path.join(data_dir, name)}"]

    def _load(allow_download: bool):
        ds = tfds.load(
            name, split=split, data_dir=data_dir, as_supervised=True,
            download=allow_download, shuffle_files=False,
            # tfmulti caches itself (after mapping, for training only); TFDS's
            # auto-cache would be voided and warned about by evaluation.
            read_config=tfds.ReadConfig(try_autocache=False),
        )
        return ds.map(_normalize_image, num_parallel_calls=tf.data.AUTOTUNE)

    try:
        return _load(False)
    except AssertionError:  # TFDS: "could not find data in ..."
        pass
    if name == "fashion_mnist":
        folder, folders = find_fashion_mnist_idx(source_dir)
        tried.append(f"Fashion-MNIST IDX files in {folders}")
        if folder is not None:
            prepare_fashion_mnist(data_dir, str(folder))
            return _load(False)
    if download:
        return _load(True)
    hint = (
        "install the Debian package dataset-fashion-mnist (apt-get install "
        "dataset-fashion-mnist), "
        if name == "fashion_mnist" else ""
    )
    raise DataNotFoundError(
        f"dataset {name!r} not found; tried: {'; '.join(tried)}. To provide it: "
        f"{hint}point `data_dir` at prepared TFDS data, or pass "
        "download=True on a machine with internet access."
    )


# --------------------------------------------------------------------------
# Distribution
# --------------------------------------------------------------------------

@dataclasses.dataclass(frozen=True)
class DistributedInput:
    """A dataset distributed over a strategy's replicas, ready for `model.fit`.

    Attributes:
        dataset: the `tf.distribute.DistributedDataset`.
        global_batch_size: examples per step over all replicas.
        per_replica_batch_size: examples per step on each replica.
        num_replicas: replicas in sync.
        steps_per_epoch: global steps in one pass over the data, or None if
            the size is unknown.
        repeat: True when the dataset repeats (pass `steps_per_epoch` to fit).
    """

    dataset: object
    global_batch_size: int
    per_replica_batch_size: int
    num_replicas: int
    steps_per_epoch: int | None
    repeat: bool

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
    _checks.positive_int("global_batch_size", global_batch_size)
    if global_batch_size % num_replicas:
        lower = max(num_replicas, global_batch_size - global_batch_size % num_replicas)
        raise ValueError(
            f"`global_batch_size` ({global_batch_size}) must be divisible by the "
            f"number of replicas ({num_replicas}); use a multiple of {num_replicas}, "
            f"e.g. {lower} or {lower + num_replicas}."
        )
    return global_batch_size // num_replicas


def input_pipeline(
    dataset: tf.data.Dataset,
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
) -> tf.data.Dataset:
    """One input pipeline's per-replica batches (see `distribute`).

    Sharding across input pipelines (one per worker under
    MultiWorkerMirroredStrategy) is explicit, not TensorFlow's auto-shard:
    every pipeline reads the (cached) data, shuffles it with the same seed,
    forms the same global batches, and keeps its contiguous share of each
    one. So each example is used exactly once per epoch across all workers,
    every worker runs the same number of steps, and the union of the
    replicas' batches is exactly the global batch a single device would see.
    """
    pipelines, pipeline_id = ctx.num_input_pipelines, ctx.input_pipeline_id
    share = global_batch_size // pipelines
    per_replica = ctx.get_per_replica_batch_size(global_batch_size)
    if map_fn is not None:
        dataset = dataset.map(map_fn, num_parallel_calls=tf.data.AUTOTUNE)
    if cache:
        dataset = dataset.cache()
    if pipelines > 1 and seed is None:
        seed = 0  # all workers must shuffle alike, or examples repeat or go missing

    def keep_share(*batch):
        start = pipeline_id * share
        element = batch if len(batch) > 1 else batch[0]
        return tf.nest.map_structure(lambda t: t[start:start + share], element)

    def split(ds: tf.data.Dataset) -> tf.data.Dataset:
        # This pipeline's share of each global batch, split per replica.
        if pipelines > 1:
            ds = ds.map(keep_share)
        ds = ds.rebatch(per_replica, drop_remainder=training)
        if batch_map_fn is not None:  # after the cache: runs anew every epoch
            ds = ds.map(batch_map_fn, num_parallel_calls=tf.data.AUTOTUNE)
        return ds

    def batches(ds: tf.data.Dataset) -> tf.data.Dataset:
        # Whole global batches (for training only full ones: every replica gets
        # a full batch, and the cache upstream is read to its end, so it is
        # kept).
        return split(ds.batch(global_batch_size, drop_remainder=training))

    if training:
        source = dataset

        def one_iteration(_):
            # Built anew for every iterator, so the shuffle's seed sequence
            # restarts: the same seed gives the same epochs however many
            # iterators were made before (Keras peeks at one to build). A
            # resumed run skips the global batches already trained.
            out = source.shuffle(shuffle_buffer, seed=seed, reshuffle_each_iteration=True)
            out = out.batch(global_batch_size, drop_remainder=True)
            if repeat:
                out = out.repeat()
            if skip_steps:
                out = out.skip(skip_steps)
            return split(out)

        dataset = tf.data.Dataset.range(1).flat_map(one_iteration)
        if repeat:
            # flat_map hides that the data repeats; said explicitly, a
            # distributed iterator's get_next_as_optional (Keras' multi-step
            # loop) skips its per-step partial-batch handling.
            dataset = dataset.apply(
                tf.data.experimental.assert_cardinality(tf.data.INFINITE_CARDINALITY))
    else:
        dataset = batches(dataset)
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


def distribute(
    dataset: tf.data.Dataset | Callable[[], tf.data.Dataset],
    strategy: tf.distribute.Strategy,
    global_batch_size: int,
    *,
    training: bool = True,
    seed: int | None = None,
    shuffle_buffer: int = 60000,
    cache: bool | None = None,
    map_fn: Callable | None = None,
    repeat: bool | None = None,
    prefetch_per_replica: int = 2,
    skip_steps: int = 0,
    batch_map_fn: Callable | None = None,
    prefetch: bool = True,
    input_threads: int | None = None,
) -> DistributedInput:
    """Batches, shards and streams a dataset to the replicas of `strategy`.

    Pipeline per input worker (`input_pipeline`): map (parallel, AUTOTUNE)
    -> cache -> shuffle (training) -> global batch -> this worker's share
    (multi-worker only) -> per-replica batches -> batch map -> repeat ->
    prefetch, then `distribute_datasets_from_function` with prefetch-to-device
    (`InputOptions(experimental_fetch_to_device=True)` and a per-replica
    buffer), so the next batch is already on each device when a step starts.

    Args:
        dataset: an unbatched dataset, or a function returning one.
        strategy: the strategy whose replicas consume the data.
        global_batch_size: examples per step across all replicas.
        training: shuffle and drop the last partial global batch (see module doc).
        seed: shuffle seed; with a seed the order is deterministic.
        shuffle_buffer: shuffle buffer size in examples (training only).
        cache: cache the mapped examples in memory; default: for training
            (evaluation stops before the end of the data, which voids a cache).
        map_fn: optional per-example function applied before caching.
        repeat: repeat forever, each pass exactly `steps_per_epoch` steps, so
            Keras shows progress against a known total; fit then needs
            `steps_per_epoch`, which `fit_kwargs()` supplies. Default: True
            for training data of known size, else False.
        prefetch_per_replica: batches buffered on each device. Where input and
            step cost about the same, a deeper buffer (8-32) absorbs either
            side's stalls (the streaming benchmark uses 32).
        skip_steps: training only: start after this many global batches of the
            repeated stream (a resumed run; see `tfmulti.backup`). The order is
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

    Returns:
        A `DistributedInput`.

    Raises:
        ValueError: the global batch is not divisible by the replica count, or
            is larger than a known dataset size in training.
    """
    num_replicas = strategy.num_replicas_in_sync
    per_replica = per_replica_batch_size(global_batch_size, num_replicas)
    _checks.positive_int("prefetch_per_replica", prefetch_per_replica)
    _checks.non_negative_int("skip_steps", skip_steps)
    if skip_steps and not training:
        raise ValueError("`skip_steps` applies to training data only; pass training=True "
                         "or skip_steps=0.")
    _checks.positive_int("input_threads", input_threads, none_ok=True)
    _checks.positive_int("shuffle_buffer", shuffle_buffer, hint="a number of examples")
    make = dataset if callable(dataset) else (lambda: dataset)
    steps = steps_per_epoch(make(), global_batch_size, training=training)
    if training and steps == 0:
        size = int(make().cardinality())
        fits = size - size % num_replicas
        raise ValueError(
            f"`global_batch_size` ({global_batch_size}) exceeds the number of "
            f"training examples ({size}); "
            + (f"use at most {fits} (a multiple of the {num_replicas} replicas)." if fits
               else f"the data has fewer examples than the {num_replicas} replicas.")
        )

    if repeat is None:
        repeat = training and steps is not None
    if cache is None:
        cache = training

    def input_fn(ctx: tf.distribute.InputContext) -> tf.data.Dataset:
        return input_pipeline(
            make(), ctx, global_batch_size, training=training, seed=seed,
            shuffle_buffer=shuffle_buffer, cache=cache, map_fn=map_fn, repeat=repeat,
            batch_map_fn=batch_map_fn, prefetch=prefetch, input_threads=input_threads,
            skip_steps=skip_steps)

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
    )
