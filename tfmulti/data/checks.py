"""A run's data checked before the first epoch, so that a user's data error
is one line naming the split, the value and what was expected, instead of
a TensorFlow traceback mid-training (or a model trained on garbage):

* `check_tfrecord_files`: the TFRecord files a `tf.data` pipeline of the
  user's reads (`tf.data.TFRecordDataset`, directly or inside an
  `interleave`/`flat_map` over file names), checked like
  `tfmulti.data.from_files` checks its own (`tfmulti.data.tfrecord`);
* `check_splits`: the first examples of each split read (a reading error
  named), their labels numbers, and the test split shaped like the training
  split (of files, only a few of this worker's own TFRecord files are read:
  a reader of the user's is left alone);
* `check_model_fits`: the labels within the model's classes (for the
  sparse categorical cross-entropy, tfmulti's default for class ids),
  one-hot labels shaped like the model's output, a binary classifier's
  labels 0 to 1, and text features only for a model with text inputs.

Each reads at most the first `SAMPLE` examples of a split.

Example:
    >>> import numpy as np
    >>> from tfmulti.data import checks
    >>> from tfmulti.data.sources import as_dataset
    >>> train = as_dataset((np.zeros((8, 3)), np.arange(8)))
    >>> test = as_dataset((np.zeros((8, 4)), np.arange(8)))
    >>> checks.check_splits(train, test)  # doctest: +ELLIPSIS
    Traceback (most recent call last):
    ...
    ValueError: the test split's features have shape (4,) per example, the training ...
"""

from __future__ import annotations

import os
import re

import numpy as np
import tensorflow as tf

from tfmulti.data import tfrecord
from tfmulti.data.loaders import LoaderSource
from tfmulti.data.sources import FileSource
from tfmulti.runtime import roles

__all__ = ["SAMPLE", "check_model_fits", "check_splits", "check_tfrecord_files",
           "data_loss_error", "first_examples", "first_inputs", "one_hot_width",
           "tfrecord_files"]

SAMPLE = 256
"""Examples read from the start of each split by the checks."""
_READERS = ("TFRecordDataset", "TFRecordDatasetV2")
_MAX_NAMES = 100000
_PART_NAMES = ("features", "labels", "sample weights")
_SPARSE_LOSSES = ("sparse_categorical_crossentropy", "SparseCategoricalCrossentropy")
_ONE_HOT_LOSSES = ("categorical_crossentropy", "CategoricalCrossentropy")
_BINARY_LOSSES = ("binary_crossentropy", "BinaryCrossentropy")


# ----------------------------------------------------------------------------- TFRecord files


def _names(dataset) -> list[str]:
    """The strings of a small, finite dataset of scalar strings (file names)."""
    spec = dataset.element_spec
    if not (isinstance(spec, tf.TensorSpec) and spec.dtype == tf.string
            and spec.shape.rank in (0, 1)):
        return []
    if int(dataset.cardinality()) == tf.data.INFINITE_CARDINALITY:
        return []
    names = []
    for value in dataset.take(_MAX_NAMES):
        flat = np.asarray(value).reshape(-1)
        names.extend(v.decode("utf-8", "replace") for v in flat)
    return names


def _compression(value) -> str | None:
    if value is None:
        return ""
    if isinstance(value, bytes):
        value = value.decode()
    if isinstance(value, str):
        value = value.upper()
        return value if value in tfrecord.COMPRESSIONS else None
    static = tf.get_static_value(value)
    return None if static is None else _compression(static)


def _reader_compressions(function) -> list[str | None]:
    """The compression of each TFRecord reader a traced function (and the
    functions it calls) creates: None where it is not a constant."""
    graph = function.graph.as_graph_def()
    found = []
    for nodes in [graph.node, *(f.node_def for f in graph.library.function)]:
        by_name = {n.name: n for n in nodes}
        for node in nodes:
            if node.op not in _READERS:
                continue
            source = by_name.get(node.input[1].split(":")[0].lstrip("^")) \
                if len(node.input) > 1 else None
            if source is None or source.op != "Const":
                found.append(None)
                continue
            value = tf.make_ndarray(source.attr["value"].tensor)
            found.append(_compression(value.reshape(-1)[0] if value.size else b""))
    return found


def tfrecord_files(dataset: tf.data.Dataset) -> list[tuple[str, str]]:
    """The local TFRecord files `dataset` reads, with their compression, where
    its pipeline names them: `tf.data.TFRecordDataset(names)`, or an
    `interleave`/`flat_map` that makes a TFRecord reader from each name of a
    dataset of names (`Dataset.from_tensor_slices(names)`, `list_files`).
    Files it cannot tell (a reader of compression unknown until run, names
    computed in the pipeline) are left out.

    It reads `tf.data`'s own attributes (each dataset's inputs, a reader's
    file names, a map's traced function), which TensorFlow does not promise
    to keep: where they change, fewer files (or none) are found and checked."""
    found, seen, stack = [], set(), [dataset]
    while stack:
        ds = stack.pop()
        if id(ds) in seen or not hasattr(ds, "_inputs"):
            continue
        seen.add(id(ds))
        names_ds, compressions = None, []
        if hasattr(ds, "_filenames") and hasattr(ds, "_compression_type"):
            names_ds, compressions = ds._filenames, [_compression(ds._compression_type)]
        else:
            wrapper = getattr(ds, "_map_func", None)
            inputs = ds._inputs()
            if wrapper is not None and len(inputs) == 1 and hasattr(wrapper, "function"):
                compressions = _reader_compressions(wrapper.function)
                names_ds = inputs[0] if compressions else None
        kinds = set(compressions)
        if names_ds is not None and len(kinds) == 1 and None not in kinds:
            kind = kinds.pop()
            found.extend((name, kind) for name in _names(names_ds) if os.path.isfile(name))
        stack.extend(ds._inputs())
    return list(dict.fromkeys(found))


def check_tfrecord_files(dataset: tf.data.Dataset, what: str) -> None:
    """Refuses a damaged TFRecord file among those `dataset` reads
    (`tfrecord_files`), naming it, the byte offset and the fix.

    Args:
        dataset: the user's pipeline.
        what: the data it is, for the message ("the dataset function's train data").

    Raises:
        ValueError: a damaged file (cut off, overwritten, not TFRecord).
        OSError: a file cannot be read.
    """
    for path, compression in tfrecord_files(dataset):
        found = tfrecord.scan(path, compression)
        if not found.ok:
            raise ValueError(
                f"{what} reads a damaged TFRecord file: {found.describe()}; TensorFlow would "
                "stop mid-epoch or drop the rest unseen; replace the file, or read the files "
                "with tfmulti.data.from_files(..., damaged='skip') to train on the whole "
                "records only.")


def _plain_tfrecord_files(source) -> list[str]:
    if isinstance(source, FileSource):
        return list(source.files) if source.tfrecord_compression == "" else []
    if isinstance(source, tf.data.Dataset):
        return [path for path, kind in tfrecord_files(source) if kind == ""]
    return []


def data_loss_error(error: Exception, *sources) -> ValueError:
    """The one-line error for a `tf.errors.DataLossError` raised while the
    data is read (a record changed after the checks before training, e.g. a
    flipped bit in its payload): TensorFlow names the byte offset, not the
    file; this finds the file among the plain TFRecord files `sources` read
    (file sources, the user's datasets) whose record at that offset fails.

    Args:
        error: the DataLossError.
        sources: the run's data (train, test; None ignored).
    """
    message = " ".join(str(getattr(error, "message", error)).split())
    found = re.search(r"(?:corrupted|truncated) record at (\d+)", message)
    if found:
        offset = int(found.group(1))
        for source in sources:
            for path in _plain_tfrecord_files(source):
                try:
                    damage = tfrecord.record_fails_at(path, offset)
                except OSError:
                    continue
                if damage:
                    return ValueError(
                        f"{path} is damaged at byte offset {offset}: {damage}; replace the "
                        "file (it changed after the checks before training, or inside a "
                        "record, where they do not look).")
    return ValueError(f"a data file is damaged: {message[:300]} (TensorFlow names no file); "
                      "check the data's files, e.g. by reading each with "
                      "tf.data.TFRecordDataset.")


# ----------------------------------------------------------------------------- first examples


def _files_to_sample(source: FileSource, role) -> tuple[str, ...] | None:
    """The files whose first examples the checks read: a few of this worker's
    own, for tfmulti's TFRecord reader only (a reader of the user's may do
    anything, even count its openings); None: none."""
    if source.tfrecord_compression is None or role is None:
        return None
    files = source.files
    if role.num_workers > 1 and len(files) >= role.num_workers:
        files = source.shard(role.worker_index, role.num_workers)
    return files[:source.cycle_length]


def first_examples(source, split: str, count: int = SAMPLE, files=None) -> list:
    """The first `count` examples of `source` (a dataset, or `files` of a
    file source), as NumPy structures.

    Raises:
        ValueError: reading them failed (a damaged or unreadable file, a
            parse function that does not fit the records, ...): the message
            names the split and TensorFlow's reason.
    """
    dataset = source.dataset(files) if isinstance(source, FileSource) else source
    head = dataset.take(count)
    try:
        if _fixed_shapes(head.element_spec):
            # Examples of one shape read as one batch, then split: the same
            # examples; read one at a time they cost 80 ms a split here (0.3 ms
            # each), in every run. Where the batch fails, they are read one at
            # a time below (whose error, if any, is the data's).
            try:
                return [tf.nest.map_structure(lambda column, i=i: np.asarray(column[i]), batch)
                        for batch in head.batch(count).as_numpy_iterator()
                        for i in range(len(tf.nest.flatten(batch)[0]))]
            except tf.errors.DataLossError:
                raise
            except tf.errors.OpError:
                pass
        return [tf.nest.map_structure(np.asarray, e) for e in head.as_numpy_iterator()]
    except tf.errors.DataLossError as e:
        raise data_loss_error(e, source) from None
    except tf.errors.OpError as e:
        reason = " ".join(str(e.message).split())[:300]
        raise ValueError(f"reading the first examples of the {split} split failed: "
                         f"{reason}; check the data (and its parse function) before "
                         "training.") from None


def first_inputs(source, preprocess=None, count: int = 2):
    """The model's inputs for the first `count` training examples of `source`
    (a dataset, a file source or a loader), as one batch: their features, or
    what `preprocess` (a model's own preparation of a batch,
    `tfmulti.models.own_fit`) makes of the examples.

    Raises:
        ValueError: reading them failed (see `first_examples`), or the
            examples' features differ in shape, naming the part and the shapes.
    """
    if isinstance(source, LoaderSource):
        examples = source.first_examples(count)
    else:
        examples = first_examples(source, "training", count)
    parts = [e if isinstance(e, tuple) else (e,) for e in examples]
    for name, shapes in _shapes([(p[0],) for p in parts]).items():
        if len(shapes) > 1:
            raise ValueError(f"the training split's {name} differ in shape between examples "
                             f"({', '.join(map(str, sorted(shapes)))}); the sizes of a model that "
                             "leaves them open are taken from the data, so give the examples "
                             "one shape (pad them), or give the model's inputs concrete sizes.")
    batch = tuple(tf.nest.map_structure(lambda *column: np.stack(column), *[
        p[i] for p in parts]) for i in range(len(parts[0])))
    if preprocess is None:
        return batch[0]
    import keras

    return keras.utils.unpack_x_y_sample_weight(preprocess(*batch))[0]


def _fixed_shapes(spec) -> bool:
    """Whether every example of a dataset with element spec `spec` has the same
    shapes (dense tensors, every dimension known): batching them changes none."""
    return all(isinstance(s, tf.TensorSpec) and s.shape.is_fully_defined()
               and s.dtype not in (tf.variant, tf.resource) for s in tf.nest.flatten(spec))


def _leaves(example) -> list[tuple[str, np.ndarray]]:
    """(name, value) of each tensor of an example: features (by key), labels,
    sample weights."""
    parts = example if isinstance(example, tuple) else (example,)
    out = []
    for part, name in zip(parts, _PART_NAMES):
        if isinstance(part, dict):
            out.extend((f"{name}[{k!r}]", np.asarray(v)) for k, v in sorted(part.items()))
        else:
            for path, value in _flat(part, name):
                out.append((path, value))
    return out


def _flat(value, name):
    if isinstance(value, (tuple, list)):
        for i, v in enumerate(value):
            yield from _flat(v, f"{name}[{i}]")
    elif isinstance(value, dict):
        for k, v in sorted(value.items()):
            yield from _flat(v, f"{name}[{k!r}]")
    else:
        yield name, np.asarray(value)


def _shapes(examples) -> dict[str, set]:
    shapes: dict[str, set] = {}
    for example in examples:
        for name, value in _leaves(example):
            shapes.setdefault(name, set()).add(value.shape)
    return shapes


def _is_text(value: np.ndarray) -> bool:
    return value.dtype.kind in "USO"


def _first(value: np.ndarray) -> str:
    """The first value of a text tensor, shown short on one line."""
    first = value.reshape(-1)[0] if value.size else b""
    if isinstance(first, bytes):
        first = first.decode("utf-8", "replace")
    return repr(str(first)[:40])


def check_splits(train, test=None, *, samples: dict | None = None, role=None) -> dict:
    """Reads the first examples of each split and refuses labels that are
    text, and a test split whose parts or per-example shapes differ from the
    training split's (where the training examples agree among themselves).

    Args:
        train, test: the splits (datasets or file sources; `test` may be None).
        samples: the first examples already read, by split name (reused).
        role: this process's `tfmulti.runtime.roles.ClusterRole`, for file
            sources: a few of its own TFRecord files are read; None: file
            sources are not read.

    Returns:
        The first examples, by split name ("training", "test"), for
        `check_model_fits`.

    Raises:
        ValueError: one line naming the split, the part and the shapes.
    """
    samples = dict(samples or {})
    for split, source in (("training", train), ("test", test)):
        if source is None or split in samples:
            continue
        if isinstance(source, LoaderSource):  # from what it read to learn its spec
            samples[split] = source.first_examples(SAMPLE)
        elif not isinstance(source, FileSource):
            samples[split] = first_examples(source, split)
        elif (files := _files_to_sample(source, role)) is not None:
            samples[split] = first_examples(source, split, files=files)
    for split, examples in samples.items():
        for name, value in (_leaves(examples[0]) if examples else []):
            if name == "labels" and _is_text(value):
                raise ValueError(f"the {split} split's labels are text (e.g. {_first(value)}); "
                                 "Keras losses need numbers: map them to class ids 0..K-1.")
    if "test" in samples and not samples["test"]:
        raise ValueError("the test split has no examples; give it some, or return no test "
                         "split (None) to train without evaluating.")
    if samples.get("training") and samples.get("test"):
        ours, theirs = _shapes(samples["training"]), _shapes(samples["test"])
        # Sample weights may be given with one split and not the other, as Keras
        # takes them (a weighted training split, a test split evaluated plainly).
        if _unweighted(ours) != _unweighted(theirs):
            raise ValueError(
                f"the test split's examples hold {sorted(_unweighted(theirs))}, the training "
                f"split's {sorted(_unweighted(ours))}; give both splits the same parts "
                "(features, labels; sample weights may be given with either alone).")
        for name, shapes in ours.items():
            if name in theirs and len(shapes) == 1 and theirs[name] != shapes:
                shape = next(iter(shapes))
                other = sorted(theirs[name] - shapes)[0]
                raise ValueError(
                    f"the test split's {name} have shape {other} per example, the training "
                    f"split's {shape}; the model is built for the training shape: give the "
                    "test split the same shape.")
    return samples


def _unweighted(shapes: dict) -> set:
    """The names of an example's parts other than its sample weights."""
    return {name for name in shapes if not name.startswith(_PART_NAMES[2])}


def one_hot_width(labels, examples=None) -> int | None:
    """The width of one-hot labels, else None: labels (`labels`, their
    per-example `tf.TensorSpec`) with a last axis of 2 or more whose rows,
    in the first `examples` (`check_splits`), are all 0s and a single 1;
    without examples (files not read), float labels with such an axis.

    Example:
        >>> import numpy as np, tensorflow as tf
        >>> spec = tf.TensorSpec((3,), tf.float32)
        >>> one_hot_width(spec, [(np.zeros(2), np.eye(3)[i]) for i in range(3)])
        3
        >>> one_hot_width(spec, [(np.zeros(2), np.array([0.2, 0.3, 0.5]))]) is None
        True
    """
    if not isinstance(labels, tf.TensorSpec) or not labels.shape.rank:
        return None
    width = labels.shape[-1]
    if width is None or width < 2:
        return None
    if not examples:
        return width if labels.dtype.is_floating else None
    parts = [np.asarray(e[1]) for e in examples if isinstance(e, tuple) and len(e) >= 2]
    if not parts or any(p.shape[-1:] != (width,) for p in parts):
        return None
    rows = np.concatenate([p.reshape(-1, width) for p in parts])
    if rows.dtype.kind not in "biuf" or not np.isin(rows, (0, 1)).all():
        return None
    return width if (rows.sum(axis=1) == 1).all() else None


def _model_output(model) -> tuple | None:
    """The shape of the model's one output, or None (several, or not known)."""
    try:
        outputs = model.outputs
    except (AttributeError, ValueError, TypeError, RuntimeError):
        return None
    if not outputs or len(outputs) != 1:
        return None
    return tuple(outputs[0].shape)


def _fits_ids(label_shape: tuple, output: tuple) -> bool:
    """Whether labels of `label_shape` per example are class ids for `output`
    (one id per output row: the output's shape without batch and classes,
    with or without a trailing 1)."""
    rows = output[1:-1]
    for want in (rows, rows + (1,)):
        if len(label_shape) == len(want) and all(
                w is None or w == g for w, g in zip(want, label_shape)):
            return True
    return False


def _check_one_hot(what: str, shape: tuple, output: tuple | None) -> None:
    """One-hot labels of `shape` per example fit the model's `output`."""
    if output is None or len(shape) == len(output) - 1 and all(
            o is None or o == g for o, g in zip(output[1:], shape)):
        return
    raise ValueError(
        f"the {what}'s labels have shape {shape} per example, but the categorical "
        f"cross-entropy takes one-hot rows shaped like the model's output {output}; give the "
        f"model {shape[-1] if shape else 'as many'} outputs (a model function that takes "
        "`num_classes` gets the labels' width), or labels of shape "
        f"{tuple(output[1:])}.")


def _check_binary(what: str, labels: np.ndarray) -> None:
    """Labels for the binary cross-entropy (a sigmoid output) are 0 to 1."""
    outside = labels[(labels < 0) | (labels > 1)]
    if outside.size:
        raise ValueError(
            f"the {what} holds label {outside[0]:g}, but the model ends in a sigmoid "
            "(a binary or multi-label classifier), which takes labels 0 to 1; for "
            f"{int(labels.max()) + 1} classes end the model in one output per class (e.g. "
            f"Dense({int(labels.max()) + 1}, activation='softmax')), or fix the labels.")


def _text_inputs(model) -> bool | None:
    try:
        inputs = model.inputs
    except (AttributeError, ValueError, TypeError, RuntimeError):
        return None
    if not inputs:
        return None
    return any(str(getattr(i, "dtype", "")) in ("string", "tf.string") for i in inputs)


def check_model_fits(run_data, model, *, samples: dict | None = None,
                     output_shape: tuple | None = None) -> None:
    """Refuses data the model cannot train on, before the first epoch: for
    a classifier, with the sparse categorical cross-entropy (tfmulti's
    default for class ids), labels outside the model's classes (its output
    units, else `run_data.num_classes`); with the categorical one (one-hot
    labels), labels not shaped like the output; with the binary one, labels
    outside 0 to 1; text features for a model without text inputs. A model
    with several outputs: each output's labels (a dict by output name, or a
    tuple) against its loss and shape.

    Args:
        run_data: the run's `tfmulti.data.from_config.RunData`.
        model: the compiled model.
        samples: the first examples by split (`check_splits`; read when not given).
        output_shape: the shape of the model's output, where `model.outputs`
            does not tell it (a `PipelineModel`:
            `tfmulti.models.builders.output_head`).

    Raises:
        ValueError: one line naming the split, the value and the expected range.
    """
    role = roles.cluster_role(getattr(model, "distribute_strategy", None))
    samples = check_splits(run_data.train, run_data.test, role=role,
                           samples=samples if samples is not None else run_data.samples)
    run_data.samples = samples
    text_ok = _text_inputs(model)
    for split, examples in samples.items():
        for name, value in (_leaves(examples[0]) if examples else []):
            if name.startswith("features") and _is_text(value) and text_ok is False:
                raise ValueError(f"the {split} split's {name} are text (e.g. {_first(value)}), but "
                                 "the model's inputs take numbers; encode them first (or "
                                 "give the model a string input, e.g. with TextVectorization).")
    for key, loss, output, task in _outputs_to_check(run_data, model, output_shape):
        for split, examples in samples.items():
            labels = [e[1] if key is None else _part(e[1], key) for e in examples
                      if isinstance(e, tuple) and len(e) >= 2]
            if labels and all(v is not None for v in labels):
                what = f"{split} split" if key is None else f"{split} split's {key!r} output"
                _check_labels(what, [np.asarray(v) for v in labels], loss, output,
                              run_data.num_classes if key is None else None, task)


def _part(labels, key):
    """One output's part of an example's labels (a dict by name, a tuple by
    position), or None."""
    if isinstance(labels, dict):
        return labels.get(key)
    if isinstance(labels, (tuple, list)) and isinstance(key, int) and key < len(labels):
        return labels[key]
    return None


def _outputs_to_check(run_data, model, output_shape):
    """(labels key: None for one output; the output's loss name; its shape;
    its task) for each output whose labels can be checked."""
    loss = getattr(model, "loss", None)
    task = run_data.task
    if not isinstance(loss, (dict, list, tuple)):
        output = _model_output(model) or (tuple(output_shape) if output_shape else None)
        return [(None, _name_of(loss), output, task)]
    try:
        outputs = list(model.outputs)
        names = list(model.output_names)
    except (AttributeError, ValueError, TypeError, RuntimeError):
        return []
    struct = getattr(model, "_outputs_struct", None)
    keys = sorted(struct) if isinstance(struct, dict) else names
    found = []
    for position, (key, out) in enumerate(zip(keys, outputs)):
        part_loss = loss.get(key) if isinstance(loss, dict) else (
            loss[position] if position < len(loss) else None)
        part_task = task.get(key) if isinstance(task, dict) else (
            task[position] if isinstance(task, list) and position < len(task) else task)
        # Labels of several parts are a dict by output name or a tuple by position.
        label_key = position if isinstance(task, list) else key
        found.append((label_key, _name_of(part_loss), tuple(out.shape), part_task))
    return found


def _name_of(loss) -> str:
    return loss if isinstance(loss, str) else type(loss).__name__


def _check_labels(what: str, labels: list, loss: str, output, num_classes, task) -> None:
    """One output's first labels against its loss and shape (`check_model_fits`)."""
    if task != "classification":
        return
    shape = labels[0].shape
    classes = None
    if loss in _SPARSE_LOSSES:
        classes = (output[-1] if output and output[-1] else None) or num_classes
    if loss in _ONE_HOT_LOSSES:
        _check_one_hot(what, shape, output)
    if loss in _BINARY_LOSSES:
        values = np.concatenate([v.reshape(-1) for v in labels])
        if values.dtype.kind in "iuf":
            _check_binary(what, values)
    if classes is None:
        return
    if output is not None and not _fits_ids(shape, output):
        raise ValueError(
            f"the {what}'s labels have shape {shape} per example, but the sparse "
            f"categorical cross-entropy takes one class id per output row (the model's "
            f"output: {output}); give the labels shape {output[1:-1]}, or use a loss of "
            "your own.")
    values = np.concatenate([v.reshape(-1) for v in labels])
    if values.size == 0 or values.dtype.kind not in "iuf":
        return
    whole = np.round(values) == values
    if not whole.all():
        raise ValueError(
            f"the {what} holds label {values[~whole][0]:g}, not a class id (a whole "
            f"number from 0 to {classes - 1}); fix the labels, or return 'task': "
            "'regression' from the dataset function, or use a loss of your own.")
    low, high = values.min(), values.max()
    if low < 0 or high >= classes:
        fix = ("class ids start at 0: fix the labels" if low < 0 else
               f"fix the labels, or give the model {int(high) + 1} outputs (return "
               "'num_classes' from the dataset function)")
        raise ValueError(
            f"the {what} holds label {low if low < 0 else high:g}, outside the "
            f"model's {classes} classes (0 to {classes - 1}; its first {len(labels)} "
            f"examples' labels run from {low:g} to {high:g}); {fix}.")
