"""Data in the forms users have: NumPy arrays, dicts of arrays, pandas
DataFrames, `tf.data` datasets, and sets of files bigger than memory.

`as_dataset` turns the in-memory forms into an unbatched `tf.data.Dataset`
(float64 becomes float32, as Keras computes in float32); `from_files` names a
set of files (TFRecord, text lines, or any format with a reader) read lazily,
so that under several workers each worker opens only its own files
(`tfmulti.data.distribute(sharding="files")`).

Example:
    >>> import numpy as np
    >>> from tfmulti.data import sources
    >>> x = {"pixels": np.zeros((6, 4)), "extra": np.ones((6, 2))}
    >>> ds = sources.as_dataset((x, np.arange(6)))
    >>> sorted(ds.element_spec[0]), ds.element_spec[0]["pixels"].dtype.name
    (['extra', 'pixels'], 'float32')
"""

from __future__ import annotations

import dataclasses
import glob
import os
import time
from typing import Callable, Sequence

import numpy as np
import tensorflow as tf

__all__ = ["FileSource", "READERS", "as_dataset", "from_files", "is_in_memory"]

READERS = {"tfrecord": tf.data.TFRecordDataset, "text": tf.data.TextLineDataset}
"""Readers by name: a function from a file name (a string tensor) to its records."""


def _is_pandas(value) -> bool:
    return type(value).__module__.split(".")[0] == "pandas"


def _array(value, what: str) -> np.ndarray:
    if _is_pandas(value):
        value = value.to_numpy()
    array = np.asarray(value)
    if array.dtype == np.float64:
        array = array.astype(np.float32)
    if array.dtype == object:
        raise ValueError(f"{what} has values of mixed types (NumPy dtype object); convert "
                         "them to numbers or strings first.")
    return array


def _columns(value, what: str):
    """An array, or a dict of arrays (a dict or a DataFrame given as columns)."""
    if isinstance(value, dict):
        return {str(k): _array(v, f"{what}[{k!r}]") for k, v in value.items()}
    return _array(value, what)


def is_in_memory(value) -> bool:
    """Whether `value` is a form `as_dataset` converts (arrays, dicts, DataFrames,
    tuples of them)."""
    return (isinstance(value, (np.ndarray, dict, tuple, list)) or _is_pandas(value))


def as_dataset(data, *, label: str | None = None) -> tf.data.Dataset:
    """An unbatched `tf.data.Dataset` of `data`'s examples.

    Args:
        data: a `tf.data.Dataset` (returned as is); a tuple `(features,
            labels)` or `(features, labels, sample_weights)` where features are
            an array, a dict of arrays (one per model input) or a DataFrame
            (one matrix of its columns) and labels an array or Series; a
            single array, dict or DataFrame (features only, or with `label`);
        label: for a DataFrame: the column that holds the labels; the other
            columns become the features matrix.

    Raises:
        ValueError: an unknown form, a missing label column, or parts with
            different numbers of examples.
    """
    if isinstance(data, tf.data.Dataset):
        if label is not None:
            raise ValueError("`label` names a DataFrame column; a tf.data.Dataset already "
                             "has its labels; drop `label`.")
        return data
    if _is_pandas(data) and hasattr(data, "columns"):
        if label is not None:
            if label not in data.columns:
                raise ValueError(f"`label` {label!r} is not a column of the DataFrame; its "
                                 f"columns: {list(data.columns)}.")
            data = (data.drop(columns=[label]), data[label])
        else:
            data = _array(data, "the DataFrame")
    elif label is not None:
        raise ValueError(f"`label` ({label!r}) names a DataFrame column, but the data is a "
                         f"{type(data).__name__}; pass (features, labels) instead.")
    if isinstance(data, list):
        data = tuple(data)
    if isinstance(data, tuple):
        if not 1 <= len(data) <= 3:
            raise ValueError(f"in-memory data is (features, labels[, sample_weights]), got a "
                             f"tuple of {len(data)}.")
        parts = tuple(_columns(p, name) for p, name in
                      zip(data, ("features", "labels", "sample_weights")))
    elif isinstance(data, (dict, np.ndarray)) or _is_pandas(data):
        parts = (_columns(data, "features"),)
    else:
        raise ValueError(
            f"cannot read data of type {type(data).__name__}; pass a tf.data.Dataset, "
            "(features, labels) arrays or dicts of arrays, a pandas DataFrame with `label`, "
            "or tfmulti.data.from_files(...).")
    sizes = {len(a) for p in parts for a in (p.values() if isinstance(p, dict) else [p])}
    if len(sizes) != 1:
        raise ValueError(f"the features and labels have different numbers of examples "
                         f"({sorted(sizes)}); each array needs one row per example.")
    return tf.data.Dataset.from_tensor_slices(parts if len(parts) > 1 else parts[0])


@dataclasses.dataclass(frozen=True)
class FileSource:
    """A set of files read lazily, one reader per file; see `from_files`.

    Attributes:
        files: the file paths, sorted.
        parse_fn: turns one record into an example (`(features, label)`), or
            None for the raw records.
        reader: file name -> dataset of its records.
        cycle_length: files read at once (interleaved).
    """

    files: tuple[str, ...]
    parse_fn: Callable | None = None
    reader: Callable[[tf.Tensor], tf.data.Dataset] = tf.data.TFRecordDataset
    cycle_length: int = 4

    def shard(self, index: int, count: int) -> tuple[str, ...]:
        """The files of input pipeline `index` of `count`: every count-th file,
        starting at `index` (so sizes differ by at most one file)."""
        return self.files[index::count]

    def records(self, files: Sequence[str] | None = None, *, shuffle: bool = False,
                seed: int | None = None) -> tf.data.Dataset:
        """The raw records of `files` (default: all), interleaved; with `shuffle`,
        the file order is drawn anew on every pass."""
        files = tuple(self.files if files is None else files)
        names = tf.data.Dataset.from_tensor_slices(list(files))
        if shuffle:
            names = names.shuffle(len(files), seed=seed, reshuffle_each_iteration=True)
        return names.interleave(self.reader, cycle_length=min(self.cycle_length, len(files)),
                                num_parallel_calls=tf.data.AUTOTUNE, deterministic=True)

    def dataset(self, files: Sequence[str] | None = None, *, shuffle: bool = False,
                seed: int | None = None) -> tf.data.Dataset:
        """The examples of `files` (default: all): records, parsed."""
        records = self.records(files, shuffle=shuffle, seed=seed)
        if self.parse_fn is None:
            return records
        return records.map(self.parse_fn, num_parallel_calls=tf.data.AUTOTUNE)

    def count(self, files: Sequence[str] | None = None, progress: Callable | None = print) -> int:
        """The records in `files` (default: all), counted by reading them once
        (not parsed)."""
        files = tuple(self.files if files is None else files)
        start = time.monotonic()
        count = int(self.records(files).reduce(np.int64(0), lambda n, _: n + 1))
        if progress is not None:
            progress(f"tfmulti: counted {count:,} records in {len(files)} file(s) in "
                     f"{time.monotonic() - start:.1f} s (pass steps_per_epoch to skip this)")
        return count

    def __repr__(self) -> str:
        shown = ", ".join(os.path.basename(f) for f in self.files[:3])
        more = f", ... ({len(self.files)} files)" if len(self.files) > 3 else ""
        return f"FileSource([{shown}{more}], parse_fn={getattr(self.parse_fn, '__name__', None)})"


def from_files(files: str | Sequence[str], parse_fn: Callable | None = None, *,
               reader: str | Callable = "tfrecord", compression: str | None = None,
               cycle_length: int = 4) -> FileSource:
    """Names a set of files to train from, read lazily (never all in memory).

    Under several workers `tfmulti.data.distribute` gives each worker its own
    files (`sharding="files"`): each reads 1/N of the bytes. The number of
    examples is unknown until read: it is counted once (or given as
    `steps_per_epoch`).

    Args:
        files: a glob pattern ("data/train-*.tfrecord") or a list of paths
            (taken literally, never as patterns).
        parse_fn: record -> example, e.g. a `tf.io.parse_single_example`
            wrapper returning `(features, label)`; None keeps raw records.
        reader: "tfrecord" (default), "text" (one record per line), or a
            function from a file name (a string tensor) to a dataset of its
            records.
        compression: "GZIP" or "ZLIB" for compressed TFRecord or text files.
        cycle_length: files read at once, interleaved.

    Raises:
        ValueError: no file matches, a listed file does not exist, or an
            unknown reader.
    """
    if isinstance(files, (str, os.PathLike)):
        pattern = os.fspath(files)
        paths = sorted(glob.glob(pattern))
        if not paths:
            raise ValueError(f"`files` {pattern!r} matches no file; check the pattern (it is "
                             "a glob, e.g. 'data/train-*.tfrecord') or pass a list of paths.")
    else:
        paths = [os.fspath(f) for f in files]
        if not paths:
            raise ValueError("`files` is empty; pass a glob pattern or a list of paths.")
        missing = [p for p in paths if not os.path.isfile(p)]
        if missing:
            raise ValueError(f"`files` lists {len(missing)} path(s) that are not files: "
                             f"{missing[:3]}{' ...' if len(missing) > 3 else ''}.")
    if isinstance(reader, str):
        if reader not in READERS:
            raise ValueError(f"`reader` must be one of {list(READERS)} or a function from a "
                             f"file name to a dataset, got {reader!r}.")
        base = READERS[reader]
        read = base if compression is None else (
            lambda name: base(name, compression_type=compression))
    elif callable(reader):
        if compression is not None:
            raise ValueError("`compression` applies to the named readers; your `reader` "
                             "function opens the files itself.")
        read = reader
    else:
        raise ValueError(f"`reader` must be a name or a function, got {reader!r}.")
    if not isinstance(cycle_length, int) or isinstance(cycle_length, bool) or cycle_length < 1:
        raise ValueError(f"`cycle_length` must be a positive integer, got {cycle_length!r}.")
    return FileSource(tuple(paths), parse_fn, read, cycle_length)
