"""The data a `TrainConfig` names: a named dataset (TFDS, synthetic, the
byte-level text), or what the user's dataset function returns, unbatched,
with what it says about the model it feeds (`RunData`).

Example:
    >>> from tfmulti.config.train_config import TrainConfig
    >>> from tfmulti.data.from_config import load_data
    >>> run_data = load_data(TrainConfig(dataset="synthetic", num_examples=256))
    >>> run_data.input_shape, run_data.task, run_data.num_classes
    ((28, 28, 1), 'classification', 10)
"""

from __future__ import annotations

import dataclasses

import numpy as np
import tensorflow as tf

from tfmulti.config import user_functions as hooks
from tfmulti.config.train_config import TRANSFORMER, TrainConfig
from tfmulti.data import catalog, checks, loaders, text
from tfmulti.data.sources import FileSource, as_dataset
from tfmulti.data.validation import hold_out
from tfmulti.runtime import roles

__all__ = ["RunData", "dataset_metrics", "features_spec", "is_text_dataset", "load_data"]


@dataclasses.dataclass
class RunData:
    """A run's data, unbatched, and what it says about the model it feeds.

    Attributes:
        train, test: `tf.data.Dataset`s, or `tfmulti.data.FileSource`s; `test`
            is None when the data has no test split (nothing is evaluated).
        input_shape: the per-example feature shape (a dict of shapes for dict
            features).
        task: "classification" or "regression" (None: the user's loss decides);
            a dataset function's labels that are integers or one-hot rows
            are a classification's, others a regression's, unless it says.
            For labels of several parts (a model with several outputs), a
            task per part: a dict by output name, or a list.
        num_classes: classes of a classification dataset when known (given,
            the width of one-hot labels, or read from integer labels when a
            model asks for it), else None.
        samples: the first examples of each split, by split name, once the
            checks have read them (`tfmulti.data.checks`), else None.
        validation: the validation split (held out by `validation_split`, or
            the dataset function's "validation"), else None.
    """

    train: object
    test: object
    input_shape: object
    task: str | dict | list | None
    num_classes: int | None = None
    samples: dict | None = dataclasses.field(default=None, repr=False, compare=False)
    validation: object = None

    @property
    def info(self) -> dict:
        """The input shape, classes and task."""
        return {"input_shape": self.input_shape, "num_classes": self.num_classes,
                "task": self.task}

    def classes(self) -> int:
        """`num_classes`, when unknown: the width of one-hot labels, else read
        from the integer training labels (one pass).

        Raises:
            ValueError: the labels are neither one-hot nor integers, or the
                data is not (features, labels).
        """
        if self.num_classes is None:
            self.num_classes = self.one_hot_width() or _count_classes(self.train)
        return self.num_classes

    def one_hot_width(self) -> int | None:
        """The width of the training labels when they are one-hot rows
        (`tfmulti.data.checks.one_hot_width`), else None."""
        return checks.one_hot_width(_labels_spec(_spec_of(self.train)),
                                    (self.samples or {}).get("training"))

    def label_parts(self) -> list[tuple] | None:
        """For labels of several parts (a dict by output name, or a tuple: a
        model with several outputs), each part's (key: its name, or its
        position; its per-example `tf.TensorSpec`; its first values as
        (None, label) examples, for `tfmulti.data.checks.one_hot_width`);
        None for labels of one tensor."""
        return _label_parts(self.train, (self.samples or {}).get("training", []))

    def one_hot_labels(self, output_shape=None) -> bool:
        """Whether a classifier's labels are one-hot rows: shaped per example
        like the model's output (`output_shape`, batch axis first) with 2 or
        more columns, or else (not class ids of that output either) rows of
        0s and a single 1 (`one_hot_width`)."""
        if self.task != "classification":
            return False
        labels = _labels_spec(_spec_of(self.train))
        if output_shape and isinstance(labels, tf.TensorSpec) and labels.shape.rank is not None:
            output, shape = tuple(output_shape)[1:], tuple(labels.shape)
            if output and (_alike(shape, output[:-1]) or _alike(shape, output[:-1] + (1,))):
                return False  # class ids, one per output row
            if output and output[-1] and output[-1] >= 2 and _alike(shape, output):
                return True
        return self.one_hot_width() is not None


def _alike(shape: tuple, other: tuple) -> bool:
    """Same rank, and equal sizes where both are known."""
    return len(shape) == len(other) and all(
        a is None or b is None or a == b for a, b in zip(shape, other))


def _spec_of(source):
    return source.element_spec  # a file source's without reading (or checking) its files


def _shape(spec):
    if isinstance(spec, dict):
        return {k: tuple(v.shape) for k, v in spec.items()}
    return tuple(spec.shape)


def features_spec(source):
    """The element spec of the features of `source` (a dataset or file source)."""
    spec = _spec_of(source)
    return spec[0] if isinstance(spec, tuple) else spec


def _labels_spec(spec):
    return spec[1] if isinstance(spec, tuple) and len(spec) >= 2 else None


def _count_classes(source) -> int:
    labels = _labels_spec(_spec_of(source))
    if labels is None or not isinstance(labels, tf.TensorSpec) or not labels.dtype.is_integer:
        raise ValueError("the model asks for `num_classes`, but the labels are not integer "
                         "class ids; return 'num_classes' from the dataset function.")
    ds = source.dataset() if isinstance(source, FileSource) else source
    top = ds.map(tf.autograph.experimental.do_not_convert(
        lambda x, y, *w: tf.reduce_max(tf.cast(y, tf.int64)))).reduce(np.int64(-1), tf.maximum)
    print(f"tfmulti: read the labels once: {int(top) + 1} classes (return 'num_classes' "
          "from the dataset function to skip this)", flush=True)
    return int(top) + 1


def _as_source(value, what: str, role: roles.ClusterRole | None = None,
               per_worker: bool = False):
    """A dataset function's split as a source: datasets and file sources as
    they are, Python loaders as `LoaderSource`s (`per_worker`: made for this
    worker), in-memory data as a dataset."""
    if isinstance(value, tf.data.Dataset):
        checks.check_tfrecord_files(value, f"the dataset function's {what} data")
    if isinstance(value, loaders.LoaderSource):  # tfmulti.data.from_loader(...)
        return value.for_worker(role or roles.ClusterRole(), per_worker)
    if value is None or isinstance(value, (tf.data.Dataset, FileSource)):
        return value
    try:
        if loaders.is_loader(value):
            source = loaders.as_source(value, own_share=per_worker, role=role,
                                       what=f"the dataset function's {what} data")
            if what == "validation" and source.kind == "generator":
                raise ValueError(f"{source.describe()} is read once, and the validation "
                                 "split is read every epoch; return the generator function "
                                 "(not its generator) or a PyDataset.")
            return source
        return as_dataset(value)
    except ValueError as e:
        raise ValueError(f"the dataset function's {what} data: {e}") from None


def _user_data(config: TrainConfig, data_dir: str, role: roles.ClusterRole) -> RunData:
    fn = hooks.resolve(config.dataset, "dataset")
    per_worker = "worker_index" in (hooks.parameters(fn) or ())
    result = hooks.call(fn, {"seed": config.seed, "data_dir": data_dir,
                             "num_examples": config.num_examples,
                             "worker_index": role.worker_index,
                             "num_workers": role.num_workers}, "dataset")
    name = config.dataset_name
    if isinstance(result, dict):
        unknown = set(result) - {"train", "test", "validation", "num_classes", "task"}
        if "train" not in result or unknown:
            raise ValueError(
                f"the dataset function {name} returned a dict with keys {sorted(result)}; "
                "expected 'train' and optionally 'test', 'validation', 'num_classes', 'task'.")
        train, test = result["train"], result.get("test")
        validation = _as_source(result.get("validation"), "validation", role)
        num_classes, task = result.get("num_classes"), result.get("task")
    elif isinstance(result, tuple) and len(result) == 2:
        (train, test), num_classes, task, validation = result, None, None, None
    else:
        raise ValueError(
            f"the dataset function {name} returned {type(result).__name__}"
            + (f" of {len(result)}" if isinstance(result, tuple) else "")
            + "; expected (train, test) (each a tf.data.Dataset, (features, labels) arrays, "
            "tfmulti.data.from_files(...), a keras.utils.PyDataset or a generator; test may be "
            "None) or a dict with 'train' and 'test'.")
    given = type(train).__name__
    train, test = _as_source(train, "train", role, per_worker), _as_source(test, "test", role)
    if train is None:
        raise ValueError(f"the dataset function {name} returned no training data.")
    if per_worker and not isinstance(train, loaders.LoaderSource):
        raise ValueError(
            f"the dataset function {name} takes worker_index, so its training data is taken as "
            f"that worker's share, which tfmulti reads from a generator or a PyDataset only, and "
            f"it returned a {given}; return the whole data (tfmulti gives each worker its "
            "share) without the worker_index parameter, or a generator of the worker's share.")
    spec = _spec_of(train)
    features = spec[0] if isinstance(spec, tuple) else spec
    labels = _labels_spec(spec)
    samples = checks.check_splits(train, test)  # before anything trains or counts
    examples = samples.get("training")
    if task is None:
        task = config.builtin_task
    if task is None and isinstance(labels, tf.TensorSpec):
        # One-hot rows seen in the first examples (files not read: float labels
        # stay a regression's, unless the function says 'task').
        task = _task_of(labels, examples)
    elif task is None and isinstance(labels, (dict, tuple, list)):  # a task per output
        parts = _label_parts(train, examples or [])
        tasks = [_task_of(spec, part) for _, spec, part in parts]
        task = ({key: t for (key, _, _), t in zip(parts, tasks)} if isinstance(labels, dict)
                else tasks)
    if task == "classification" and num_classes is None:
        # the labels' width (class ids: counted if a model asks)
        num_classes = checks.one_hot_width(labels, examples)
    return RunData(train, test, _shape(features), task, num_classes, samples, validation)


def _label_parts(train, examples: list) -> list[tuple] | None:
    """`RunData.label_parts` of the training split `train`, from its first
    `examples`."""
    labels = _labels_spec(_spec_of(train))
    if not isinstance(labels, (dict, tuple, list)):
        return None
    keys = list(labels) if isinstance(labels, dict) else list(range(len(labels)))
    pairs = [e for e in examples if isinstance(e, tuple) and len(e) >= 2]
    return [(key, labels[key], [(None, np.asarray(e[1][key])) for e in pairs]) for key in keys]


def _task_of(labels, examples) -> str | None:
    """"classification" for integer labels or one-hot rows among `examples`
    ((features, labels) pairs), "regression" for other numbers, None for
    labels that are not one tensor."""
    if not isinstance(labels, tf.TensorSpec):
        return None
    one_hot = examples and checks.one_hot_width(labels, examples)
    return "classification" if labels.dtype.is_integer or one_hot else "regression"


def load_data(config: TrainConfig, role: roles.ClusterRole | None = None) -> RunData:
    """The run's train and test data: a named dataset (TFDS, synthetic), or
    what the user's dataset function returns.

    Args:
        config: the run.
        role: this process's place in its cluster, offered to a dataset
            function as `worker_index` and `num_workers` (default: a lone
            process).

    Raises:
        ValueError: a dataset function that cannot be found or returns
            something else than train and test data; a built-in model whose
            task the dataset does not fit.
        tfmulti.data.DataNotFoundError: a named dataset is not available offline.
    """
    data_dir = config.data_dir or catalog.default_data_dir()
    is_text = is_text_dataset(config.dataset)
    if (config.model == TRANSFORMER) != is_text and config.builtin_model \
            and isinstance(config.dataset, str) and ":" not in config.dataset:
        raise ValueError(
            f"`model` {config.model!r} and `dataset` {config.dataset!r} do not fit: the "
            f"transformer reads byte sequences (dataset={text.NAME!r}), the other built-in "
            f"models images or features; use model='transformer' with "
            f"dataset={text.NAME!r}, or another pair.")
    if not isinstance(config.dataset, str) or ":" in config.dataset:
        run_data = _user_data(config, data_dir, role or roles.ClusterRole())
    elif is_text:
        train, test = (text.load(config.dataset, split, data_dir, download=config.download,
                                      sequence_length=config.seq_len)
                       for split in ("train", "validation"))
        run_data = RunData(train, test, (config.seq_len,), "classification", 256)
    else:
        test_examples = config.num_examples and max(config.num_examples // 4, 1)
        train = catalog.load(config.dataset, "train", data_dir=data_dir, download=config.download,
                          num_examples=config.num_examples)
        test = catalog.load(config.dataset, "test", data_dir=data_dir, download=config.download,
                         num_examples=test_examples)
        info = catalog.dataset_info(config.dataset, data_dir)
        run_data = RunData(train, test, info["input_shape"], info["task"], info["num_classes"])
    if config.validation_split:
        if run_data.validation is not None:
            raise ValueError(
                f"`validation_split` ({config.validation_split}) holds out training examples, "
                f"but the dataset function {config.dataset_name} returns a 'validation' split "
                "too; use one of them (validation_split=0, or no 'validation' entry).")
        run_data.train, run_data.validation = hold_out(run_data.train, config.validation_split)
    wanted = config.builtin_task
    if wanted is not None and run_data.task is not None and wanted != run_data.task:
        fix = ("dataset='synthetic_regression'" if wanted == "regression"
               else "model='mlp' or 'cnn'")
        raise ValueError(f"`model` {config.model_name!r} does {wanted} but `dataset` "
                         f"{config.dataset_name!r} is a {run_data.task} dataset; use {fix}.")
    return run_data


def is_text_dataset(dataset) -> bool:
    """Whether `dataset` names tfmulti's byte-level text data (`tfmulti.data.text`)."""
    return isinstance(dataset, str) and dataset.partition("/")[0] == text.NAME


def dataset_metrics(config: TrainConfig, results: dict) -> tuple[dict, str | None]:
    """What a named dataset adds to a run's metrics, and the line that says it:
    for the byte-level text, the test loss against its unigram (byte-frequency)
    baseline; nothing for other data.

    Args:
        config: the run's configuration.
        results: the test split's results (`evaluate`'s dict), with "loss".
    """
    if not is_text_dataset(config.dataset) or "loss" not in results:
        return {}, None
    baseline = text.unigram_baseline(config.data_dir, sequence_length=config.seq_len)
    loss = results["loss"]
    return ({"unigram_baseline": baseline, "test_loss_vs_unigram": loss / baseline},
            f"tfmulti: validation loss {loss:.3f} nats/byte; the unigram (byte-frequency) "
            f"baseline {baseline:.3f}: {100 * (1 - loss / baseline):.0f}% below it")
