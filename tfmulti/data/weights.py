"""Class weights as Keras' `fit(class_weight=...)` applies them, in the
input pipeline: each training example gets the weight of its class as its
sample weight, before the data is batched and distributed, so that every
path (one device, mirrored, several workers, the pipeline, a resumed run)
trains on the same weighted examples.

The class of an example is read as Keras reads it from a batch (keras/src/
trainers/data_adapters/tf_dataset_adapter.py, `make_class_weight_map_fn`):
a class id; the position of the largest value of one-hot rows; a single
column rounded. A class missing from the weights weighs 1. As in Keras,
class weights and sample weights of the data's own do not go together, and
a model with several outputs takes sample weights per output instead.

"balanced" weighs each class n / (k x n_c) (n examples, k classes present,
n_c of class c), as scikit-learn's `compute_class_weight("balanced")`: the
classes then count alike in the loss.

Example:
    >>> import numpy as np
    >>> from tfmulti.data import weights
    >>> from tfmulti.data.sources import as_dataset
    >>> data = as_dataset((np.zeros((4, 2), "float32"), np.array([0, 0, 0, 1])))
    >>> weights.balanced_class_weights(data)
    tfmulti: read the labels once for class_weight 'balanced': class 0 3, class 1 1 of 4 examples
    {0: 0.6666666666666666, 1: 2.0}
    >>> [float(w) for _, _, w in weights.with_class_weights(data, {1: 5.0})]
    [1.0, 1.0, 1.0, 5.0]
"""

from __future__ import annotations

import dataclasses

import numpy as np
import tensorflow as tf

from tfmulti.data.sources import FileSource

__all__ = ["balanced_class_weights", "check_class_weights", "with_class_weights"]


def check_class_weights(source, what: str = "training") -> None:
    """Refuses data that class weights cannot weigh, before anything is built.

    Raises:
        ValueError: examples without labels, with labels of several parts (a
            model with several outputs), labels that are not numbers, or
            examples that carry sample weights already.
    """
    spec = source.element_spec
    if not isinstance(spec, tuple) or len(spec) < 2:
        raise ValueError(f"`class_weight` weighs examples by their labels, and the {what} "
                         "split has none; give (features, labels) examples, or leave "
                         "class_weight out.")
    if len(spec) > 2:
        raise ValueError(f"`class_weight` and the sample weights the {what} split carries do "
                         "not go together (Keras refuses them together too); multiply the "
                         "class weights into the sample weights, or leave one out.")
    labels = spec[1]
    if not isinstance(labels, tf.TensorSpec):
        raise ValueError("`class_weight` weighs a model with one output, as Keras' does, and "
                         f"the {what} split's labels have several parts; give each output's "
                         "sample weights with the data instead ((features, labels, weights), "
                         "weights a dict by output name).")
    if not (labels.dtype.is_integer or labels.dtype.is_floating or labels.dtype == tf.bool):
        raise ValueError(f"`class_weight` needs class ids or one-hot rows as labels, and the "
                         f"{what} split's are {labels.dtype.name}.")


def _class_of(y):
    """The class id of one example's label, as Keras reads it from a batch."""
    batch = tf.expand_dims(y, 0)
    if batch.shape.rank >= 2:
        classes = tf.__internal__.smart_cond.smart_cond(
            tf.shape(batch)[-1] > 1,
            lambda: tf.argmax(batch, axis=-1, output_type=tf.int32),
            lambda: tf.cast(tf.round(tf.squeeze(batch, axis=-1)), tf.int32))
    else:
        classes = tf.cast(tf.round(tf.cast(batch, tf.float64)), tf.int32)
    return classes[0]


def with_class_weights(source, class_weight: dict):
    """`source` (a dataset or file source of (features, labels) examples)
    whose examples carry their class's weight: (features, labels, weight).

    Raises:
        ValueError: as `check_class_weights`.
    """
    check_class_weights(source)
    table = tf.constant([float(class_weight.get(c, 1.0))
                         for c in range(max(class_weight) + 1)], tf.float32)

    @tf.autograph.experimental.do_not_convert
    def add(x, y):
        index = _class_of(y)
        # A class beyond the weights given weighs 1, as Keras' `.get(c, 1.0)`.
        weight = tf.where(index < tf.size(table),
                          tf.gather(table, tf.minimum(index, tf.size(table) - 1)), 1.0)
        return x, y, weight

    if isinstance(source, FileSource):  # files, or a Python loader's examples (parse_fn None)
        parse = source.parse_fn
        return dataclasses.replace(
            source, parse_fn=lambda *record: add(*(parse(*record) if parse else record)))
    return source.map(add, num_parallel_calls=tf.data.AUTOTUNE, deterministic=True)


def balanced_class_weights(source) -> dict:
    """Each class's weight n / (k x n_c), counted from `source`'s labels (one
    pass), as scikit-learn's "balanced"; one line says what was counted.

    Raises:
        ValueError: as `check_class_weights`, or no examples.
    """
    check_class_weights(source)
    dataset = source.dataset() if isinstance(source, FileSource) else source
    classes = dataset.map(tf.autograph.experimental.do_not_convert(lambda x, y: _class_of(y)),
                          num_parallel_calls=tf.data.AUTOTUNE).batch(65536)
    counts = np.zeros(0, np.int64)
    for batch in classes.as_numpy_iterator():
        if batch.size and batch.min() < 0:
            raise ValueError(f"`class_weight` takes class ids 0, 1, ..., and the training "
                             f"labels hold class {int(batch.min())}; fix the labels.")
        found = np.bincount(batch)
        counts = np.pad(counts, (0, max(0, len(found) - len(counts))))
        counts[:len(found)] += found
    if counts.sum() == 0:
        raise ValueError("`class_weight` 'balanced' counts the training labels, and the "
                         "training split has no examples.")
    present = np.flatnonzero(counts)
    n, k = int(counts.sum()), len(present)
    weights = {int(c): n / (k * int(counts[c])) for c in present}
    print(f"tfmulti: read the labels once for class_weight 'balanced': "
          f"{', '.join(f'class {c} {int(counts[c])}' for c in present)} of {n} examples",
          flush=True)
    return weights
