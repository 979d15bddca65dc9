"""Input data: named datasets, the user's own data, and streaming to the replicas.

* `catalog`: TFDS datasets prepared offline, Fashion-MNIST from the Debian
  package's IDX files, synthetic data (`load`, `dataset_info`);
* `sources`: data in the forms users have: NumPy arrays, dicts of arrays,
  pandas DataFrames (`as_dataset`), and files bigger than memory
  (`from_files`);
* `loaders`: Python loaders as Keras' `fit` takes them: a
  `keras.utils.PyDataset`, generators and other iterables (`from_loader`);
* `streaming`: global batches sharded over workers and streamed to every
  replica ahead of the step (`distribute`).
* `text`: `tfmulti_text`, byte-level language modelling prepared offline from
  the Python standard library's sources, and its unigram baseline;
* `tfrecord` and `checks`: a run's data checked before the first epoch:
  TFRecord framing (a damaged file named with the byte offset), the first
  examples of each split against each other and against the model.

Batch sizes are always **global**: 256 on 4 replicas is 64 per replica.

Example:
    >>> import numpy as np
    >>> import tfmulti
    >>> strategy = tfmulti.get_strategy("one_device")
    >>> x = np.random.default_rng(0).random((1024, 8), dtype=np.float32)
    >>> dist = tfmulti.data.distribute((x, x.sum(axis=1)), strategy, global_batch_size=128)
    >>> dist.steps_per_epoch
    8
"""

from __future__ import annotations

from tfmulti.data.catalog import (DataNotFoundError, check_prepared_files, dataset_info,
                                  default_data_dir, find_fashion_mnist_idx, load,
                                  prepare_fashion_mnist, read_idx, synthetic,
                                  synthetic_regression)
from tfmulti.data.sources import FileSource, as_dataset, from_files
from tfmulti.data.loaders import LoaderSource, as_source as from_loader
from tfmulti.data import text  # registers tfmulti_text with `load`
from tfmulti.data.streaming import (DistributedInput, distribute, input_pipeline,
                                    per_replica_batch_size, steps_per_epoch)

__all__ = ["DataNotFoundError", "DistributedInput", "FileSource", "LoaderSource", "as_dataset",
           "check_prepared_files", "dataset_info", "default_data_dir", "distribute",
           "find_fashion_mnist_idx", "from_files", "from_loader", "input_pipeline", "load",
           "per_replica_batch_size", "prepare_fashion_mnist", "read_idx", "steps_per_epoch",
           "synthetic", "synthetic_regression", "text"]
