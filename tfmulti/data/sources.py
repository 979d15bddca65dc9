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

from tfmulti.data import tfrecord
from tfmulti.utils import human

__all__ = ["DAMAGED", "FileSource", "READERS", "as_dataset", "from_files", "is_in_memory"]

DAMAGED = ("error", "skip")
"""What a damaged TFRecord file means to `from_files`: refuse it, or skip its damaged end."""

READERS = {"tfrecord": tf.data.TFRecordDataset, "text": tf.data.TextLineDataset}
"""Readers by name: a function from a file name (a string tensor) to its records."""


def _is_pandas(value) -> bool:
    return type(value).__module__.split(".")[0] == "pandas"


def _array(value, what: str) -> np.ndarray:
    if _is_pandas(value):
        if hasattr(value, "columns"):  # a DataFrame: name the columns that are not numbers
            mixed = [str(c) for c in value.columns
                     if getattr(value[c].dtype, "kind", "O") not in "biufc"]
            if mixed:
                raise ValueError(f"{what} has columns of text or mixed types {mixed[:5]}; "
                                 "convert them to numbers (e.g. with pandas.factorize) or "
                                 "drop them.")
        value = value.to_numpy()
    array = np.asarray(value)
    if array.dtype == np.float64:
        array = array.astype(np.float32)
    if what == "labels" and array.dtype.kind in "USO" and array.size:
        raise ValueError(f"labels are text or objects (e.g. {str(array.flat[0])[:40]!r}); "
                         "Keras losses need numbers: convert them to class ids 0..K-1 first (e.g. "
                         "numpy.unique(labels, return_inverse=True)).")
    if array.dtype.kind == "c":
        raise ValueError(f"{what} holds complex numbers; Keras layers take real numbers: "
                         "put the real and imaginary parts in columns of their own.")
    if array.dtype == object:
        raise ValueError(f"{what} has values of mixed types (NumPy dtype object); convert "
                         "them to numbers or strings first.")
    _check_finite(array, what)
    return array


def _check_finite(array: np.ndarray, what: str) -> None:
    """Refuses NaN and infinite values, naming the columns (feature indices)
    that hold them and how many: they train into a model of NaN weights."""
    if array.dtype.kind not in "fc" or array.size == 0:
        return
    bad = ~np.isfinite(array)
    if not bad.any():
        return
    rows = bad.reshape(len(array), -1)
    examples = int(rows.any(axis=1).sum())
    if array.ndim == 1:
        where = f"at rows {np.flatnonzero(bad)[:5].tolist()}"
    else:
        per_column = rows.sum(axis=0)
        columns = np.flatnonzero(per_column)
        named = [(f"{c}" if array.ndim == 2 else
                  str(tuple(int(i) for i in np.unravel_index(c, array.shape[1:]))))
                 + f" ({int(per_column[c])})" for c in columns[:5]]
        kind = "column" if array.ndim == 2 else "feature index"
        where = (f"in {kind}{'s' if len(columns) > 1 else ''} {', '.join(named)}"
                 + (f" and {len(columns) - 5} more" if len(columns) > 5 else ""))
    raise ValueError(f"{what}: {human.count(int(bad.sum()), 'NaN or infinite value')} {where}, in "
                     f"{examples} of {len(array)} examples; fill or drop them before training "
                     "(they train into NaN weights).")


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
        data (tf.data.Dataset | tuple | numpy.ndarray | dict | pandas.DataFrame): a
            `tf.data.Dataset` (returned as is); a tuple `(features, labels)` or `(features, labels,
            sample_weights)` where features are an array, a dict of arrays (one per model input) or
            a DataFrame (one matrix of its columns) and labels an array or Series; a single array,
            dict or DataFrame (features only, or with `label`);
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
        tfrecord_compression: for TFRecord files, their compression ("" for
            none, "GZIP", "ZLIB"): their framing is checked before they are
            read (`check`); None: not checked (another format, or a reader
            of the user's).
        damaged: what a damaged TFRecord file means: "error" (the default,
            a ValueError naming the file and the offset) or "skip" (its
            records up to the damage are read, the rest left out, with one
            line per file).
    """

    files: tuple[str, ...]
    parse_fn: Callable | None = None
    reader: Callable[[tf.Tensor], tf.data.Dataset] = tf.data.TFRecordDataset
    cycle_length: int = 4
    tfrecord_compression: str | None = None
    damaged: str = "error"
    _scans: dict = dataclasses.field(default_factory=dict, compare=False, repr=False)

    def shard(self, index: int, count: int) -> tuple[str, ...]:
        """The files of input pipeline `index` of `count`: every count-th file,
        starting at `index` (so sizes differ by at most one file)."""
        return self.files[index::count]

    def check(self, files: Sequence[str] | None = None) -> tuple[tfrecord.Scan, ...]:
        """Checks the framing of the TFRecord `files` (default: all), each once
        (`tfmulti.data.tfrecord.scan`); nothing for files that are not TFRecord.

        Raises:
            ValueError: a file is damaged (cut off, overwritten, not TFRecord)
                and `damaged` is "error"; the message names the file and the
                byte offset.
            OSError: a file cannot be read.
        """
        if self.tfrecord_compression is None:
            return ()
        files = tuple(self.files if files is None else files)
        for path in files:
            if path not in self._scans:
                try:
                    found = tfrecord.scan(path, self.tfrecord_compression)
                except OSError as e:
                    raise OSError(f"cannot read {path} ({e.strerror or e}); check its "
                                  "permissions and that its file system is mounted.") from None
                if not found.ok and self.damaged == "skip":
                    print(f"tfmulti: reading only the whole records of a damaged file "
                          f"(damaged='skip'): {found.describe()}", flush=True)
                self._scans[path] = found
        scans = tuple(self._scans[path] for path in files)
        bad = [found for found in scans if not found.ok]
        if bad and self.damaged != "skip":
            more = f" ({human.count(len(bad) - 1, 'more damaged file')} among the {len(files)})" \
                if len(bad) > 1 else ""
            raise ValueError(
                f"{bad[0].describe()}{more}; TensorFlow would stop mid-epoch or drop the "
                "rest unseen; replace the file, or pass damaged='skip' to "
                "tfmulti.data.from_files to read only the whole records.")
        return scans

    @property
    def element_spec(self):
        """The spec of one example (parsed), without reading the files."""
        names = tf.data.Dataset.from_tensor_slices(list(self.files[:1]))
        ds = names.interleave(self.reader, cycle_length=1)
        return (ds if self.parse_fn is None else ds.map(self.parse_fn)).element_spec

    def records(self, files: Sequence[str] | None = None, *, shuffle: bool = False,
                seed: int | None = None) -> tf.data.Dataset:
        """The raw records of `files` (default: all), interleaved, after
        `check`; with `shuffle`, the file order is drawn anew on every pass."""
        files = tuple(self.files if files is None else files)
        scans = self.check(files)
        if any(not found.ok for found in scans):  # damaged="skip": the whole records only
            names = tf.data.Dataset.from_tensor_slices(
                (list(files), np.array([found.records for found in scans], np.int64)))
            reader = self.reader

            def read(name, count):
                return reader(name).take(count)
        else:
            names = tf.data.Dataset.from_tensor_slices(list(files))
            read = self.reader
        if shuffle:
            names = names.shuffle(len(files), seed=seed, reshuffle_each_iteration=True)
        return names.interleave(read, cycle_length=min(self.cycle_length, len(files)),
                                num_parallel_calls=tf.data.AUTOTUNE, deterministic=True)

    def dataset(self, files: Sequence[str] | None = None, *, shuffle: bool = False,
                seed: int | None = None) -> tf.data.Dataset:
        """The examples of `files` (default: all): records, parsed."""
        records = self.records(files, shuffle=shuffle, seed=seed)
        if self.parse_fn is None:
            return records
        return records.map(self.parse_fn, num_parallel_calls=tf.data.AUTOTUNE)

    def count(self, files: Sequence[str] | None = None, progress: Callable | None = print) -> int:
        """The records in `files` (default: all): from `check` for TFRecord
        files, else counted by reading them once (not parsed)."""
        files = tuple(self.files if files is None else files)
        start = time.monotonic()
        scans = self.check(files)
        if scans:
            count = sum(found.records for found in scans)
        else:
            count = int(self.records(files).reduce(np.int64(0), lambda n, _: n + 1))
        if progress is not None:
            progress(f"tfmulti: counted {human.count(count, 'record')} in "
                     f"{human.count(len(files), 'file')} in "
                     f"{human.duration(time.monotonic() - start)} (pass steps_per_epoch to "
                     "skip this)")
        return count

    def __repr__(self) -> str:
        shown = ", ".join(os.path.basename(f) for f in self.files[:3])
        more = f", ... ({len(self.files)} files)" if len(self.files) > 3 else ""
        return f"FileSource([{shown}{more}], parse_fn={getattr(self.parse_fn, '__name__', None)})"


def from_files(files: str | Sequence[str], parse_fn: Callable | None = None, *,
               reader: str | Callable = "tfrecord", compression: str | None = None,
               cycle_length: int = 4, damaged: str = "error") -> FileSource:
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
        damaged: for TFRecord files, whose framing is checked before they
            are read (`FileSource.check`, cheap: 12 bytes per record):
            "error" (default) refuses a damaged file (cut off, overwritten,
            not TFRecord), naming it and the byte offset; "skip" reads each
            file's whole records up to its damage and leaves the rest out,
            saying so in one line per file.

    Raises:
        ValueError: no file matches, a listed file does not exist, an
            unknown reader or `damaged` value.
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
            raise ValueError(f"`files` lists {human.count(len(missing), 'path')} that "
                             f"{'is not a file' if len(missing) == 1 else 'are not files'}: "
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
    if damaged not in DAMAGED:
        raise ValueError(f"`damaged` must be one of {list(DAMAGED)}, got {damaged!r}.")
    framing = None
    if reader == "tfrecord":
        framing = (compression or "").upper()
        if framing not in tfrecord.COMPRESSIONS:
            raise ValueError(f"`compression` must be 'GZIP' or 'ZLIB' (or None), got "
                             f"{compression!r}.")
    return FileSource(tuple(paths), parse_fn, read, cycle_length, framing, damaged)
