"""Offline byte-level language-modelling data: the TFDS dataset
`tfmulti_text`, prepared from the Python standard library's own sources.

Every machine with Python has megabytes of real text: the standard library's
`.py` files. `prepare` writes them, like Fashion-MNIST from its Debian
package (`tfmulti.data.prepare_fashion_mnist`, under the same per-dataset
lock), as a registered TFDS dataset in the TFDS layout
(`<data_dir>/tfmulti_text/seq256/1.0.0`):

* the corpus: the `.py` files under the standard library folder (the running
  Python's, `default_source_dir()`, or `source_dir`), without test folders
  (`test`, `tests`, `idle_test`), installed packages or files over 200 KB,
  taken in the order of a hash of their relative path until 4 MiB
  (`corpus_files`): a fixed, spread-out choice for a given Python;
* the splits, by file: a file is in "validation" when the hash of its
  relative path falls in the first 10 of 100 buckets, else in "train" (each
  split keeps at least one file); each split's files are concatenated in
  path order;
* the examples: windows of `sequence_length` + 1 bytes, one every
  `sequence_length` bytes, so every byte after the first is a target once:
  `inputs` = window[:-1], `targets` = window[1:], int32 in 0..255 once
  loaded (stored as uint8). Configurations `seq64` ... `seq1024`, default
  `seq256` (`tfmulti_text/seq128` names another).

`tfmulti.data.load("tfmulti_text")` and `load` read it offline, preparing it
on first use; `tfmulti prepare-data --dataset tfmulti_text` prepares it.
Online, `load` also serves any TFDS dataset with a text feature as the same
byte windows, e.g. `load("tiny_shakespeare", download=True)`.

`unigram_baseline` is the cross-entropy, in nats per byte, of the training
bytes' frequencies on the validation bytes: what a model that ignores
context scores; a language model must do better.

Example:
    >>> from tfmulti.data import text
    >>> inputs, targets = text.byte_windows(b"abcdefg", 3)
    >>> inputs.tolist(), targets.tolist()
    ([[97, 98, 99], [100, 101, 102]], [[98, 99, 100], [101, 102, 103]])
    >>> f"{text.unigram_cross_entropy([3, 1], [1, 1], smoothing=0):.4f}"
    '0.8370'
"""

from __future__ import annotations

import contextlib
import functools
import hashlib
import json
import os
import sysconfig
from pathlib import Path

import numpy as np

from tfmulti.data import _tfds
from tfmulti.utils import atomic
from tfmulti.utils import checks
from tfmulti.utils import human
from tfmulti.data.catalog import LOADERS, preparation_lock, check_prepared_files, default_data_dir

__all__ = ["DEFAULT_SEQUENCE_LENGTH", "NAME", "SEQUENCE_LENGTHS", "byte_counts", "byte_windows",
           "corpus_files", "default_source_dir", "load", "prepare", "text_windows",
           "unigram_baseline", "unigram_cross_entropy"]

NAME = "tfmulti_text"
"""The TFDS name of the dataset."""
SEQUENCE_LENGTHS = (64, 128, 256, 512, 1024)
"""The sequence lengths prepared on request (configurations `seq64`, ...)."""
DEFAULT_SEQUENCE_LENGTH = 256
MAX_CORPUS_BYTES = 4 * 2**20
MAX_FILE_BYTES = 200_000
VALIDATION_BUCKETS = 10  # of 100
SKIPPED_FOLDERS = frozenset({"test", "tests", "idle_test", "site-packages", "dist-packages",
                             "__pycache__"})
SPLITS = ("train", "validation")
BYTE_COUNTS_FILE = "tfmulti-byte-counts.json"
"""The splits' byte counts, kept in the prepared dataset's folder (`unigram_baseline`)."""


def default_source_dir() -> str:
    """The running Python's standard library folder (e.g. /usr/lib/python3.11)."""
    return sysconfig.get_paths()["stdlib"]


def _hash(relative: str) -> str:
    return hashlib.sha1(relative.encode()).hexdigest()


def corpus_files(source_dir: str | None = None,
                 max_bytes: int = MAX_CORPUS_BYTES) -> dict[str, list[str]]:
    """The corpus' files per split, as paths relative to `source_dir`, sorted.

    Args:
        source_dir: the folder of `.py` files; default: `default_source_dir()`.
        max_bytes: the corpus' size cap.

    Returns:
        {"train": [...], "validation": [...]}: disjoint, each non-empty.

    Raises:
        FileNotFoundError: the folder does not exist.
        ValueError: it holds fewer than 2 usable `.py` files.
    """
    checks.positive_int("max_bytes", max_bytes)
    root = Path(source_dir or default_source_dir())
    if not root.is_dir():
        raise FileNotFoundError(
            f"source folder {str(root)!r} does not exist; pass the folder of .py files "
            "(default: the Python standard library).")
    sizes = {}
    for folder, dirs, files in os.walk(root):
        dirs[:] = sorted(d for d in dirs if d not in SKIPPED_FOLDERS)
        for name in files:
            path = Path(folder) / name
            if name.endswith(".py") and path.is_file() and not path.is_symlink():
                size = path.stat().st_size
                if 0 < size <= MAX_FILE_BYTES:
                    sizes[path.relative_to(root).as_posix()] = size
    chosen, total = [], 0
    for relative in sorted(sizes, key=_hash):
        if total + sizes[relative] <= max_bytes:
            chosen.append(relative)
            total += sizes[relative]
    if len(chosen) < 2:
        raise ValueError(
            f"{str(root)!r} holds {human.count(len(chosen), 'usable .py file')} (at most "
            f"{MAX_FILE_BYTES} bytes each, {max_bytes} in all, outside test folders); "
            "a train and a validation split need at least 2.")
    validation = [r for r in chosen if int(_hash(r)[:8], 16) % 100 < VALIDATION_BUCKETS]
    if not validation or len(validation) == len(chosen):
        validation = [min(chosen, key=_hash)]
    train = sorted(set(chosen) - set(validation))
    return {"train": train, "validation": sorted(validation)}


def byte_windows(stream: bytes, sequence_length: int) -> tuple[np.ndarray, np.ndarray]:
    """(inputs, targets): windows of `sequence_length` + 1 bytes, one every
    `sequence_length` bytes; inputs = window[:-1], targets = window[1:], as
    uint8 arrays of shape (windows, sequence_length). A tail shorter than a
    window is dropped."""
    checks.positive_int("sequence_length", sequence_length)
    data = np.frombuffer(stream, dtype=np.uint8)
    count = max(len(data) - 1, 0) // sequence_length
    index = np.arange(count)[:, None] * sequence_length + np.arange(sequence_length + 1)
    windows = data[index] if count else np.zeros((0, sequence_length + 1), np.uint8)
    return windows[:, :-1], windows[:, 1:]


def _config_name(sequence_length: int) -> str:
    if sequence_length not in SEQUENCE_LENGTHS:
        raise ValueError(
            f"`sequence_length` ({sequence_length!r}) must be one of {list(SEQUENCE_LENGTHS)}.")
    return f"seq{sequence_length}"


@functools.cache
def _builder_cls():
    """The TFDS builder of `tfmulti_text` (registered under that name when
    first made, so `tfds.load` finds the prepared data)."""
    tfds = _tfds.module()

    class TextConfig(tfds.core.BuilderConfig):
        def __init__(self, *, sequence_length: int):
            super().__init__(name=_config_name(sequence_length),
                             description=f"windows of {sequence_length} bytes")
            self.sequence_length = sequence_length

    class TfmultiText(tfds.core.GeneratorBasedBuilder):
        VERSION = tfds.core.Version("1.0.0")
        BUILDER_CONFIGS = [TextConfig(sequence_length=n) for n in SEQUENCE_LENGTHS]
        DEFAULT_BUILDER_CONFIG_NAME = _config_name(DEFAULT_SEQUENCE_LENGTH)

        def __init__(self, *, source_dir: str | None = None, **kwargs):
            self._source_dir = source_dir or default_source_dir()
            super().__init__(**kwargs)

        def _info(self):
            length = self.builder_config.sequence_length
            window = tfds.features.Tensor(shape=(length,), dtype=np.uint8)
            return self.dataset_info_from_configs(
                description="Byte-level language modelling on the Python standard library's "
                            "sources, prepared by tfmulti (tfmulti.data.text).",
                features=tfds.features.FeaturesDict({"inputs": window, "targets": window}),
                supervised_keys=("inputs", "targets"))

        def _split_generators(self, dl_manager):
            files = corpus_files(self._source_dir)
            return {split: self._generate_examples(files[split]) for split in SPLITS}

        def _generate_examples(self, relatives):
            root = Path(self._source_dir)
            stream = b"".join((root / r).read_bytes() for r in relatives)
            inputs, targets = byte_windows(stream, self.builder_config.sequence_length)
            for i in range(len(inputs)):
                yield i, {"inputs": inputs[i], "targets": targets[i]}

    return TfmultiText


def prepare(data_dir: str | None = None, source_dir: str | None = None,
            sequence_length: int = DEFAULT_SEQUENCE_LENGTH) -> str:
    """Writes `tfmulti_text` (one sequence length) into `data_dir`; does
    nothing if it is prepared.

    Args:
        data_dir: the TFDS data dir; default: `tfmulti.data.default_data_dir()`.
        source_dir: the folder of `.py` files (see `corpus_files`).
        sequence_length: one of `SEQUENCE_LENGTHS`.

    Returns:
        The prepared dataset's folder (`<data_dir>/tfmulti_text/seqN/1.0.0`).

    Raises:
        FileNotFoundError, ValueError: see `corpus_files`; a sequence length
            not in `SEQUENCE_LENGTHS`.
    """
    tfds = _tfds.module()

    data_dir = data_dir or default_data_dir()
    builder = _builder_cls()(data_dir=data_dir, source_dir=source_dir,
                             config=_config_name(sequence_length))
    if not builder.is_prepared():
        with preparation_lock(data_dir, NAME):  # other processes may prepare it at once
            builder = _builder_cls()(data_dir=data_dir, source_dir=source_dir,
                                     config=_config_name(sequence_length))
            if not builder.is_prepared():
                builder.download_and_prepare(
                    download_config=tfds.download.DownloadConfig(try_download_gcs=False))
    return str(builder.data_dir)


def _own(name: str) -> int | None:
    """The sequence length `name` asks of `tfmulti_text`, or None for another dataset."""
    base, _, config = name.partition("/")
    if base != NAME:
        return None
    if not config:
        return DEFAULT_SEQUENCE_LENGTH
    if not (config.startswith("seq") and config[3:].isdigit()):
        raise ValueError(f"unknown configuration {name!r}; use {NAME}/seqN with N in "
                         f"{list(SEQUENCE_LENGTHS)}.")
    length = int(config[3:])
    _config_name(length)
    return length


def text_windows(dataset, sequence_length: int = DEFAULT_SEQUENCE_LENGTH, text_key="text"):
    """A TFDS text dataset (elements with a string feature `text_key`) as
    (inputs, targets) byte windows, int32, as `byte_windows` cuts them from
    each element's text."""
    import tensorflow as tf

    checks.positive_int("sequence_length", sequence_length)

    @tf.autograph.experimental.do_not_convert  # no control flow to convert
    def windows(element):
        data = tf.cast(tf.io.decode_raw(element[text_key], tf.uint8), tf.int32)
        count = tf.maximum(tf.size(data) - 1, 0) // sequence_length
        index = (tf.range(count)[:, None] * sequence_length
                 + tf.range(sequence_length + 1)[None, :])
        cut = tf.gather(data, index)
        return tf.data.Dataset.from_tensor_slices((cut[:, :-1], cut[:, 1:]))

    return dataset.flat_map(windows)


def load(name: str = NAME, split: str = "train", data_dir: str | None = None,
         download: bool = False, source_dir: str | None = None,
         sequence_length: int | None = None, text_key: str = "text"):
    """Byte-level language-modelling examples: unbatched (inputs, targets),
    int32 vectors of `sequence_length` bytes (targets: inputs shifted by one).

    Args:
        name: "tfmulti_text" (or "tfmulti_text/seqN"): prepared offline on
            first use from the standard library's sources; any other TFDS
            dataset with a string feature `text_key` (e.g.
            "tiny_shakespeare") is read, or downloaded with `download=True`,
            and cut into windows by `text_windows`.
        split: a TFDS split ("train", "validation", "train[:10%]", ...).
        data_dir: the TFDS data dir (default: `tfmulti.data.default_data_dir()`).
        download: allow a TFDS download (of another dataset; ours is made
            here).
        source_dir: `tfmulti_text`'s folder of `.py` files.
        sequence_length: bytes per example; default 256, or the one `name`
            gives.
        text_key: another dataset's text feature.

    Raises:
        ValueError: an unknown sequence length or configuration.
    """
    import tensorflow as tf
    tfds = _tfds.module()

    own = _own(name)
    data_dir = data_dir or default_data_dir()
    read = tfds.ReadConfig(try_autocache=False)
    if own is None:
        dataset = tfds.load(name, split=split, data_dir=data_dir, download=download,
                            shuffle_files=False, read_config=read)
        return text_windows(dataset, sequence_length or DEFAULT_SEQUENCE_LENGTH, text_key)
    length = sequence_length or own
    if name != NAME and sequence_length is not None and sequence_length != own:
        raise ValueError(f"{name!r} has sequence length {own}, not {sequence_length}.")
    prepare(data_dir, source_dir, length)
    check_prepared_files(f"{NAME}/{_config_name(length)}", split, data_dir)
    dataset = _builder_cls()(data_dir=data_dir, config=_config_name(length)).as_dataset(
        split=split, shuffle_files=False, as_supervised=True, read_config=read)
    return dataset.map(tf.autograph.experimental.do_not_convert(
        lambda x, y: (tf.cast(x, tf.int32), tf.cast(y, tf.int32))),
        num_parallel_calls=tf.data.AUTOTUNE)


def byte_counts(dataset, batch_size: int = 1024) -> np.ndarray:
    """How often each byte value 0..255 is a target in a dataset of
    (inputs, targets) pairs."""
    counts = np.zeros(256, np.int64)
    for _, targets in dataset.batch(batch_size).as_numpy_iterator():
        counts += np.bincount(np.asarray(targets).ravel(), minlength=256)[:256]
    return counts


def unigram_cross_entropy(train_counts, validation_counts, smoothing: float = 1.0) -> float:
    """The cross-entropy, in nats per byte, of the training bytes' frequency
    distribution on the validation bytes: sum_b q(b) * -ln p(b), where q is
    the validation frequencies and p(b) = (train_counts[b] + smoothing) /
    (total + smoothing * K) over the K byte values counted (256 for byte
    counts). `smoothing` (add-one by default) keeps a byte unseen in training
    from costing infinity.

    Raises:
        ValueError: counts of different lengths, negative counts, no
            validation bytes, or a validation byte of probability 0.
    """
    p, q = np.asarray(train_counts, np.float64), np.asarray(validation_counts, np.float64)
    if p.shape != q.shape or p.ndim != 1:
        raise ValueError(f"train and validation counts must be vectors of one length; "
                         f"received shapes {p.shape} and {q.shape}.")
    if (p < 0).any() or (q < 0).any() or smoothing < 0:
        raise ValueError("counts and smoothing must be >= 0.")
    if q.sum() == 0:
        raise ValueError("the validation counts are all 0; there is nothing to score.")
    p = (p + smoothing) / (p.sum() + smoothing * len(p))
    used = q > 0
    if (p[used] == 0).any():
        raise ValueError("a validation byte never occurs in training; pass smoothing > 0.")
    return float(-(q[used] * np.log(p[used])).sum() / q.sum())


def unigram_baseline(data_dir: str | None = None, sequence_length: int = DEFAULT_SEQUENCE_LENGTH,
                     source_dir: str | None = None) -> float:
    """`unigram_cross_entropy` of `tfmulti_text`'s training targets on its
    validation targets, in nats per byte (prepared on first use); a model's
    validation loss (mean cross-entropy per byte, in nats) compares with it
    directly. Reference: ln 256 = 5.545 for uniform guessing.

    The splits' byte counts are kept in the prepared dataset's folder
    (`BYTE_COUNTS_FILE`) once counted: counting reads every example (3.5
    CPU-s at seq64 here), and the prepared data never change. Where the
    folder cannot be written, or is a URL (gs://...), they are counted anew
    each time."""
    folder = prepare(data_dir, source_dir, sequence_length)
    path = os.path.join(folder, BYTE_COUNTS_FILE)
    local = "://" not in folder  # a bucket's folder (gs://...) is not one of this machine's
    counts = _stored_byte_counts(path) if local else None
    if counts is None:
        counts = {split: byte_counts(load(NAME, split, data_dir, source_dir=source_dir,
                                          sequence_length=sequence_length)) for split in SPLITS}
        if local:
            with contextlib.suppress(OSError):  # a read-only data dir: counted again next time
                atomic.write_json_atomic(path, {split: c.tolist() for split, c in counts.items()})
    return unigram_cross_entropy(counts["train"], counts["validation"])


def _stored_byte_counts(path: str) -> dict[str, np.ndarray] | None:
    """The byte counts per split kept at `path`, or None where there are none
    (or they are not 256 counts >= 0 for each split)."""
    try:
        with open(path) as f:
            stored = json.load(f)
        counts = {split: np.asarray(stored[split], np.int64) for split in SPLITS}
    except (OSError, ValueError, TypeError, KeyError):
        return None
    if any(c.shape != (256,) or (c < 0).any() for c in counts.values()):
        return None
    return counts


def _catalog_loader(name: str, split: str, data_dir: str, source_dir: str | None):
    return load(name, split, data_dir, source_dir=source_dir)


LOADERS[NAME] = _catalog_loader  # tfmulti.data.load("tfmulti_text") comes here
