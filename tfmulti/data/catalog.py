"""Named datasets: TFDS datasets (prepared offline), Fashion-MNIST from the
Debian package's IDX files, and synthetic data.

Offline use: nothing here downloads unless `download=True` is passed.
Fashion-MNIST is prepared from the original IDX files of the Debian package
`dataset-fashion-mnist` into a TFDS dataset the first time it is needed
(under a file lock, so workers preparing it at once do not race). Prepared
TFRecord data is checked against its recorded size when loaded, so a
truncated file fails at once, naming the files and the fix, not mid-epoch.

Example:
    >>> from tfmulti.data import catalog
    >>> train = catalog.load("synthetic", split="train", num_examples=1024)
    >>> int(train.cardinality()), catalog.dataset_info("synthetic")["task"]
    (1024, 'classification')
"""

from __future__ import annotations

import contextlib
import fcntl
import gzip
import logging
import os
from pathlib import Path

import numpy as np
import tensorflow as tf

from tfmulti.data import _tfds
from tfmulti.utils import checks

__all__ = ["DataNotFoundError", "check_prepared_files", "dataset_info", "default_data_dir", "find_fashion_mnist_idx",
           "load", "prepare_fashion_mnist", "read_idx", "synthetic", "synthetic_regression"]

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
LOADERS: dict = {}
"""Datasets other modules of this package make (`tfmulti.data.text`): the
name before any "/config" -> loader(name, split, data_dir, source_dir)."""


class DataNotFoundError(FileNotFoundError):
    """A dataset is neither prepared nor obtainable without a download, or its
    prepared files are damaged."""

# TFRecord frames each record with a length (8 bytes) and two CRCs (4 + 4).
_TFRECORD_FRAME_BYTES = 16


@contextlib.contextmanager
def preparation_lock(data_dir: str, name: str):
    """An exclusive lock per dataset and data dir, held while preparing it:
    processes that prepare the same dataset at once (the workers of a cluster
    on first use) take turns, and the later ones find it prepared."""
    os.makedirs(data_dir, exist_ok=True)
    with open(os.path.join(data_dir, f".{name}.tfmulti-lock"), "a") as f:
        fcntl.flock(f, fcntl.LOCK_EX)
        try:
            yield
        finally:
            fcntl.flock(f, fcntl.LOCK_UN)


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
    tfds = _tfds.module()

    data_dir = data_dir or default_data_dir()
    folder, tried = find_fashion_mnist_idx(source_dir)
    if folder is None:
        raise DataNotFoundError(
            "Fashion-MNIST IDX files not found in "
            f"{tried}; install them with `apt-get install dataset-fashion-mnist` "
            "or pass the folder holding "
            f"{list(FASHION_MNIST_FILES['train'] + FASHION_MNIST_FILES['test'])}."
        )
    with preparation_lock(data_dir, "fashion_mnist"):
        builder = _fashion_mnist_builder_cls()(data_dir=data_dir, source_dir=str(folder))
        if not builder.is_prepared():
            builder.download_and_prepare(
                download_config=tfds.download.DownloadConfig(try_download_gcs=False)
            )
    return data_dir


def _fashion_mnist_builder_cls():
    """TFDS builder reading the local IDX files (not registered: TFDS's own
    `fashion_mnist` builder keeps the name and reads the prepared data)."""
    tfds = _tfds.module()

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
    tfds = _tfds.module()

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


def check_prepared_files(name: str, split: str, data_dir: str) -> None:
    """Checks that the TFRecord files of a prepared TFDS split have the size
    its metadata records (a truncated or cut-off file fails here, at once,
    instead of mid-epoch with a DataLossError).

    Raises:
        DataNotFoundError: a file is missing or its size differs; the message
            names the files and how to prepare the data again.
    """
    tfds = _tfds.module()

    builder = tfds.builder(name, data_dir=data_dir)
    if builder.info.file_format != tfds.core.FileFormat.TFRECORD:
        return  # other formats frame records differently; TFDS checks them when read
    base = split.split("[")[0].split("+")
    for part in (p.strip() for p in base):
        if part not in builder.info.splits:
            continue  # no recorded split (TFDS's mock data, a split function): nothing to check
        info = builder.info.splits[part]
        expected = int(info.num_bytes) + _TFRECORD_FRAME_BYTES * int(info.num_examples)
        paths = [str(p) for p in info.filepaths]
        missing = [p for p in paths if not os.path.exists(p)]
        found = sum(os.path.getsize(p) for p in paths if p not in missing)
        if missing or found != expected:
            what = (f"missing {missing}" if missing else
                    f"{found:,} bytes where its metadata records {expected:,}")
            raise DataNotFoundError(
                f"the prepared {name!r} data in {builder.data_dir} is damaged ({part} split: "
                f"{what}); delete that folder and prepare it again"
                + (" (`tfmulti prepare-data`)."
                   if name.partition("/")[0] in ("fashion_mnist", *LOADERS) else
                   " (`tfds build` with internet access, or download=True)."))


@contextlib.contextmanager
def _tfds_warnings_off():
    """TFDS's warnings (absl logging) off: looking for prepared data that is not
    there warns "Variant folder ... has no dataset_info.json" before the answer."""
    logger = logging.getLogger("absl")
    level = logger.level
    logger.setLevel(logging.ERROR)
    try:
        yield
    finally:
        logger.setLevel(level)


@tf.autograph.experimental.do_not_convert  # no control flow to convert
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
        * "tfmulti_text" (`tfmulti.data.text`): byte-level language
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
    checks.positive_int("num_examples", num_examples, none_ok=True)
    if name in SYNTHETIC_NAMES:
        maker = synthetic if name == "synthetic" else synthetic_regression
        kwargs = {"num_examples": num_examples} if num_examples else {}
        return maker(split, **kwargs)
    if num_examples is not None:
        raise ValueError(f"`num_examples` applies to synthetic data only, not {name!r}.")
    loader = LOADERS.get(name.partition("/")[0])
    if loader is not None:  # e.g. tfmulti_text, prepared on first use
        return loader(name, split, data_dir or default_data_dir(), source_dir)
    tfds = _tfds.module()

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
        with _tfds_warnings_off():  # a missing folder is our one line, not TFDS's warning
            dataset = _load(False)
    except (AssertionError, KeyError):  # TFDS: "could not find data in ...", or a version
        pass  # folder without its metadata ("`splits` is empty")
    else:
        check_prepared_files(name, split, data_dir)
        return dataset
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
