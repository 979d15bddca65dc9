"""A run's validation split: the last fraction of the training examples held
out, as Keras' `validation_split` holds out the last samples of arrays, or
the split a dataset function returns beside "train" and "test".

Keras splits arrays only; here any data of known size splits the same way
(`take` and `skip` on the unbatched examples, before the input pipeline
shuffles them), so NumPy arrays, tf.data datasets and the named datasets
all can. Files (`tfmulti.data.from_files`) cannot: their size is unknown
until they are read, and the held-out part would cut across the files the
workers read.

Example:
    >>> import numpy as np
    >>> from tfmulti.data.validation import hold_out
    >>> train, validation = hold_out((np.arange(10.0), np.arange(10)), 0.2)
    >>> int(train.cardinality()), [int(y) for _, y in validation]
    (8, [8, 9])
"""

from __future__ import annotations

import math

import tensorflow as tf

from tfmulti.data.loaders import LoaderSource
from tfmulti.data.sources import FileSource, as_dataset

__all__ = ["hold_out"]

_INSTEAD = ("return a 'validation' split from the dataset function instead (e.g. "
            "tfmulti.data.from_files(other files), or a PyDataset of other examples)")


def hold_out(source, fraction: float) -> tuple[tf.data.Dataset, tf.data.Dataset]:
    """Splits `fraction` of the examples off the end of `source`: (the rest,
    the held-out last examples), each in the order of `source`. As Keras, the
    held-out count is what `floor(n * (1 - fraction))` leaves.

    Args:
        source: unbatched data of known size: a `tf.data.Dataset`, or what
            `tfmulti.data.as_dataset` takes (arrays, dicts of arrays).
        fraction: in (0, 1).

    Raises:
        ValueError: files or data of unknown size (saying why), or a split
            that leaves either part empty.
    """
    if isinstance(source, LoaderSource):
        raise ValueError(
            f"`validation_split` ({fraction}) holds out the last examples of the training "
            f"data, but the training data is {source.describe()}, read batch by batch (Keras "
            f"takes validation_split for arrays only); {_INSTEAD}.")
    if isinstance(source, FileSource):
        raise ValueError(
            f"`validation_split` ({fraction}) holds out the last examples of the training "
            f"data, but the training data are files ({source!r}): their number of examples is "
            f"unknown until they are read, and the held-out part would cut across the files "
            f"the workers read; {_INSTEAD}.")
    dataset = source if isinstance(source, tf.data.Dataset) else as_dataset(source)
    size = int(dataset.cardinality())
    if size < 0:
        known = "infinite" if size == tf.data.INFINITE_CARDINALITY else "unknown"
        raise ValueError(
            f"`validation_split` ({fraction}) holds out the last examples of the training "
            f"data, but its size is {known} (a generator, filter or repeat), so there are no "
            f"last ones; pass data of known size (arrays, or a dataset with "
            f".apply(tf.data.experimental.assert_cardinality(n))) or {_INSTEAD}.")
    keep = int(math.floor(size * (1.0 - fraction)))
    if keep == 0 or keep == size:
        raise ValueError(
            f"`validation_split` ({fraction}) of {size} training examples leaves "
            f"{'no training' if keep == 0 else 'no validation'} examples; use a "
            f"{'smaller' if keep == 0 else 'larger'} fraction or more data.")
    return dataset.take(keep), dataset.skip(keep)
