"""What the corpus tests share: each program trained by plain Keras on one
device, as its source trains it (the reference), tfmulti's configuration of
the same program, and the comparison of the two.

Why a tfmulti run differs from the reference at all, and the tolerances
that follow (`assert_close`):
- batch order: tfmulti shuffles each epoch with its own seeded stream
  (`tfmulti.data.distribute`); Keras' `fit` shuffles with another one. The
  two runs see the same examples in other orders, so their weights follow
  different paths from the same initial weights (same seed). A
  `keras.utils.PyDataset` (the segmentation's loader) is trained by Keras
  batch by batch, its batches in a shuffled order; tfmulti shuffles the batch
  order too, then splits the batches into examples and mixes neighbouring
  ones into its global batches, and its Python augmentation (random flips)
  draws in the order the batches are read;
- replica reductions: 2 replicas (or 2 workers) each compute the gradient of
  half the global batch and sum them: the same gradient up to float
  rounding order;
- per-replica statistics and randomness: BatchNormalization normalizes each
  replica's slice with that slice's own mean and variance (Keras does not
  synchronize them), and Dropout draws its masks per replica;
- the pipeline splits each batch into micro-batches whose gradients are
  summed: the same update up to rounding, but its random streams differ.
After 2 short epochs the models are two samples of one training process, so
their test figures agree only up to a margin: the test loss within
`LOSS_ABS + LOSS_REL x` the reference's, the test accuracy within
`ACCURACY_MARGIN` of it, and above chance (the majority class's share).

What `assert_close` compares, by the shape of the program:
- one output: the test loss, and the test accuracy where compiled with it;
- a regression (`LOSS_OF_THE_MEAN` in the program: the recommenders'
  ratings): no accuracy and no chance, so the test loss, above the lowest its
  labels allow, must also be at most `BEAT_THE_MEAN` of the loss of
  answering the training labels' mean, above the same; and
  the program's `LOSS_ABS`, where set, replaces the margin's absolute part
  (a rating's squared error is ~0.05, under the classifiers' 0.15);
- several outputs (labels a dict by output name): the total test loss and
  each output's (`test_priority_loss`, as Keras' logs name them), and each
  output's accuracy where compiled with one (`test_department_accuracy`,
  above that output's chance);
- `class_weight` in `FIT`: also the last epoch's training loss, within a
  factor `WEIGHTED_LOSS_FACTOR` of the reference's (the source's weights,
  1 / count, make it ~1/1,000 of an unweighted loss, and it varied by a
  factor of up to 2.1 over five batch orders, as a few misclassified examples
  of the rare class weigh 13 times the others: a run that drops the weights
  reports a loss ~300 times larger), and the test recall where compiled with
  it, within `ACCURACY_MARGIN` (what the weights are for: finding the rare
  class);
- `COMPARE_TRAIN_LOSS` in the program (the segmentation U-Net): also the
  last epoch's training loss, within the loss margin of the reference's and
  below the chance loss (`chance_loss`: the entropy of the test labels' class
  shares, the loss of answering them whatever the image). Most of its 15
  BatchNormalization layers take inputs of variance near 0.01 at first, while
  their moving variances start at 1 (momentum 0.99): its inference-mode
  figures lag the training for hundreds of steps (the source trains 15 epochs
  of ~200), so after 2 short epochs the test loss of plain Keras and of
  tfmulti alike is 0.6-0.8, near the chance loss of 0.92, whatever the batch
  order, while the training loss (batch statistics) is 0.45-0.55: the test
  loss still bounds a run, the training loss tells that it learned;
- no test split (the VAE, the GAN): the last epoch's training losses. With a
  `loss` in the logs (the VAE), that loss, which must also be below the
  reference's first epoch; without (the GAN: `d_loss`, `g_loss`), each of the
  reference's logs must be in the run's metrics (`train_d_loss`) and finite,
  and within the loss margin of the reference's, once multiplied by the
  replicas where the program logs a Keras loss object's value as it is
  (`REPLICA_SCALED_LOGS`: Keras scales that value by 1/N on N replicas).
"""

from __future__ import annotations

import importlib
import inspect
import os
import sys

import numpy as np

REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
if REPO not in sys.path:  # the corpus is imported as tests.corpus.NAME, also by workers
    sys.path.insert(0, REPO)

from tests.corpus import PROGRAMS  # noqa: E402

GLOBAL_BATCH = 32  # the sources' batch size (32), or theirs cut down (128)
EPOCHS = 2
SEED = 0
LOSS_ABS, LOSS_REL = 0.15, 0.3
ACCURACY_MARGIN = 0.15
ABOVE_CHANCE = 0.1
WEIGHTED_LOSS_FACTOR = 3.0

__all__ = ["PROGRAMS", "as_arrays", "assert_close", "chance", "chance_loss", "config_kwargs",
           "held_out", "input_shape", "is_py_dataset", "load", "loss_of_the_mean", "reference",
           "splits"]


def load(name: str):
    """The corpus module `name`."""
    return importlib.import_module(f"tests.corpus.{name}")


def splits(name: str) -> tuple:
    """Program `name`'s (train, test) splits as its data function returns
    them (test None where it has none)."""
    result = load(name).data(seed=SEED)
    return (result["train"], result.get("test")) if isinstance(result, dict) else result


def config_kwargs(name: str, **overrides) -> dict:
    """`TrainConfig` arguments that train program `name` as its source does
    (its hooks, the corpus' batch, epochs and seed, its validation split)."""
    module = load(name)
    kwargs = dict(model=f"tests.corpus.{name}:build", dataset=f"tests.corpus.{name}:data",
                  global_batch_size=GLOBAL_BATCH, epochs=EPOCHS, seed=SEED, verbose=0)
    if "validation_split" in module.FIT:
        kwargs["validation_split"] = module.FIT["validation_split"]
    kwargs.update(getattr(module, "TFMULTI", {}), **overrides)
    return kwargs


def _stack(values):
    """Rows of a dataset as one array, or a dict of arrays for dict rows."""
    if isinstance(values[0], dict):
        return {k: np.stack([v[k] for v in values]) for k in values[0]}
    return np.stack(values)


def is_py_dataset(split) -> bool:
    """Whether a split is a `keras.utils.PyDataset` (batches read in Python)."""
    import keras

    return isinstance(split, keras.utils.PyDataset)


def as_arrays(split):
    """A split as (features, labels) of NumPy values (each a dict for dict
    data: features by input name, labels by output name; labels None for a
    dataset of features alone): a PyDataset's batches concatenated in their
    order, a dataset's rows stacked, arrays as they are."""
    import tensorflow as tf

    if is_py_dataset(split):
        features, labels = zip(*(split[i] for i in range(len(split))))
        return np.concatenate(features), np.concatenate(labels)
    if isinstance(split, tf.data.Dataset):
        rows = list(split.as_numpy_iterator())
        if not isinstance(rows[0], tuple):  # features alone (a dict, images, texts)
            return _stack(rows), None
        features, labels = zip(*rows)
        return _stack(features), _stack(labels)
    return split


def held_out(name: str):
    """The test split as NumPy values (`as_arrays`), or None when the
    program has no test split."""
    test = splits(name)[1]
    return None if test is None else as_arrays(test)


def _class_shares(name: str, output: str | None) -> np.ndarray:
    """The share of each class among the test split's labels (of output
    `output`, for a program whose labels are a dict by output): of every
    pixel's label, for per-pixel labels.

    Raises:
        ValueError: the program has no test split, or its labels are a dict by
            output and `output` is not one of them.
    """
    split = held_out(name)
    if split is None:
        raise ValueError(f"{name} has no test split, so no chance accuracy or loss; "
                         "compare its training losses instead.")
    labels = split[1]
    if isinstance(labels, dict):
        if output not in labels:
            raise ValueError(f"{name} has several outputs ({', '.join(sorted(labels))}); "
                             f"got output={output!r}: name one of them.")
        labels = labels[output]
    labels = np.asarray(labels)
    one_hot = labels.ndim > 1 and labels.shape[-1] > 1
    ids = (labels.argmax(axis=-1) if one_hot else labels).reshape(-1).astype(np.int64)
    return np.bincount(ids) / ids.size


def chance(name: str, output: str | None = None) -> float:
    """The accuracy of always answering the test split's most common class
    (of output `output`, for a program whose labels are a dict by output).

    Raises:
        ValueError: as `_class_shares`.
    """
    return float(_class_shares(name, output).max())


def chance_loss(name: str, output: str | None = None) -> float:
    """The cross-entropy of always answering the test split's class shares
    (their entropy): the lowest loss of a classifier that learned nothing
    from the features.

    Raises:
        ValueError: as `_class_shares`.
    """
    shares = _class_shares(name, output)
    shares = shares[shares > 0]
    return float(-(shares * np.log(shares)).sum())


def input_shape(train) -> tuple:
    """The shape of one example's features in the training split `train`
    (a dataset, a PyDataset or (features, labels) arrays)."""
    import tensorflow as tf

    if isinstance(train, tf.data.Dataset):
        return tuple(train.element_spec[0].shape)
    features = train[0][0] if is_py_dataset(train) else train[0]  # of batch 0, or of all
    return tuple(features.shape[1:])


def reference(name: str, callbacks=(), order_seed: int = SEED) -> dict:
    """Program `name` trained by plain Keras on one device, as its source
    trains it (its compile and fit arguments, EPOCHS epochs), from the same
    seed: {"test_loss", and each other figure `evaluate` returns, as
    "test_NAME" ("test_accuracy" when compiled with it; "test_priority_loss"
    for an output of several), "history": fit's history}. A program whose
    `COMPILE` is None is trained as its model function compiled it; a split
    that is a `keras.utils.PyDataset` is given to `fit` and `evaluate` as it
    is (its own batches), as its source gives it.

    Args:
        name: the program.
        callbacks: Keras callbacks for `fit`.
        order_seed: the seed of the batch order (the weights' is SEED): another
            one trains a second sample of the same process, as a tfmulti run
            is, which is how the tolerances are checked.
    """
    import keras
    import tensorflow as tf

    module = load(name)
    train, test = splits(name)
    offered = {"seed": SEED}
    wanted = inspect.signature(module.build).parameters
    if "input_shape" in wanted:
        offered["input_shape"] = input_shape(train)
    keras.utils.set_random_seed(SEED)
    model = module.build(**{k: v for k, v in offered.items() if k in wanted})
    if module.COMPILE is not None:  # else the model function compiled it
        model.compile(**module.COMPILE)
    fit = {**module.FIT, "epochs": EPOCHS}  # class_weight, validation_split as the source's
    batch_size = fit.pop("batch_size")
    if order_seed != SEED:  # Keras shuffles arrays with TensorFlow's global seed,
        keras.utils.set_random_seed(order_seed)  # a PyDataset's batches with Python's
    if is_py_dataset(train):  # its own batches, in a new order every epoch
        history = model.fit(train, shuffle=True, verbose=0, callbacks=list(callbacks), **fit)
    elif isinstance(train, tf.data.Dataset):
        n = int(train.cardinality())
        history = model.fit(train.shuffle(n, seed=order_seed).batch(batch_size), verbose=0,
                            callbacks=list(callbacks), **fit)
    else:
        history = model.fit(*train, batch_size=batch_size, shuffle=True, verbose=0,
                            callbacks=list(callbacks), **fit)
    out = {"history": history.history}
    if test is not None:
        if is_py_dataset(test):
            results = model.evaluate(test, verbose=0, return_dict=True)
        elif isinstance(test, tf.data.Dataset):
            results = model.evaluate(test.batch(batch_size), verbose=0, return_dict=True)
        else:
            results = model.evaluate(*test, batch_size=batch_size, verbose=0,
                                     return_dict=True)
        out.update({f"test_{k}": float(v) for k, v in results.items()})
    return out


def _within_loss_margin(got: float, want: float, loss_abs: float = LOSS_ABS) -> bool:
    return abs(got - want) <= loss_abs + LOSS_REL * abs(want)


BEAT_THE_MEAN = 0.8
"""A regression program's test loss, less the lowest loss its labels allow, must
be at most this share of the same excess of the loss of answering every test
example the training labels' mean (`loss_of_the_mean`)."""


def loss_of_the_mean(name: str) -> tuple[float, float]:
    """(the test loss of answering the training labels' mean, the lowest test
    loss there is), with the loss the program names in `LOSS_OF_THE_MEAN`:
    "mse" (lowest 0), or "bce" for labels in [0, 1] under a binary
    cross-entropy (lowest: the labels' own entropy, of answering each label
    exactly). The first is what a model that learned nothing from the
    features scores.

    Raises:
        ValueError: the program names no such loss.
    """
    kind = getattr(load(name), "LOSS_OF_THE_MEAN", None)
    train, test = splits(name)
    mean = float(np.mean(as_arrays(train)[1]))
    labels = np.asarray(as_arrays(test)[1], np.float64)
    if kind == "mse":
        return float(np.mean((labels - mean) ** 2)), 0.0
    if kind == "bce":
        y = labels.clip(1e-7, 1 - 1e-7)
        return (float(-np.mean(labels * np.log(mean) + (1 - labels) * np.log(1 - mean))),
                float(-np.mean(y * np.log(y) + (1 - y) * np.log(1 - y))))
    raise ValueError(f"{name}: LOSS_OF_THE_MEAN={kind!r}; give 'mse' or 'bce'.")


def assert_close(name: str, metrics: dict, ref: dict, what: str) -> str:
    """Asserts that a tfmulti run's `metrics` (its metrics.json: "train_NAME"
    for the last epoch's logs, "test_NAME" for the test split's) agree with
    the reference `ref` within the tolerances above; returns the line that
    compares them."""
    if "test_loss" not in ref:
        return _assert_close_without_test_split(name, metrics, ref, what)
    got, want = metrics["test_loss"], ref["test_loss"]
    line = f"{name} {what}: test_loss {got:.4f} vs plain Keras {want:.4f}"
    module = load(name)
    assert _within_loss_margin(got, want, getattr(module, "LOSS_ABS", LOSS_ABS)), line
    if getattr(module, "LOSS_OF_THE_MEAN", None):  # a regression: no accuracy, no chance
        mean, lowest = loss_of_the_mean(name)
        line += f" (the mean's {mean:.4f}, the lowest {lowest:.4f})"
        assert got - lowest <= BEAT_THE_MEAN * (mean - lowest), line
    outputs = _outputs(name)
    for output in outputs:  # each output's loss, for a program with several
        key = f"test_{output}_loss"
        got, want = metrics[key], ref[key]
        line += f", {key[5:]} {got:.4f} vs {want:.4f}"
        assert _within_loss_margin(got, want), line
    for output in outputs or [None]:  # each output's accuracy, where compiled with one
        key = f"test_{output}_accuracy" if output else "test_accuracy"
        if key not in ref:
            continue
        acc, ref_acc, floor = metrics[key], ref[key], chance(name, output)
        line += f", {key[5:]} {acc:.3f} vs {ref_acc:.3f} (chance {floor:.3f})"
        assert abs(acc - ref_acc) <= ACCURACY_MARGIN, line
        assert acc >= floor + ABOVE_CHANCE, line
    if "class_weight" in load(name).FIT:
        got, want = metrics["train_loss"], ref["history"]["loss"][-1]
        line += f", weighted train_loss {got:.3g} vs {want:.3g}"
        assert want / WEIGHTED_LOSS_FACTOR <= got <= want * WEIGHTED_LOSS_FACTOR, line
        if "test_recall" in ref:
            got, want = metrics["test_recall"], ref["test_recall"]
            line += f", recall {got:.3f} vs {want:.3f}"
            assert abs(got - want) <= ACCURACY_MARGIN, line
    if getattr(load(name), "COMPARE_TRAIN_LOSS", False):
        got, want, floor = metrics["train_loss"], ref["history"]["loss"][-1], chance_loss(name)
        line += f", train_loss {got:.4f} vs {want:.4f} (chance {floor:.4f})"
        assert _within_loss_margin(got, want), line
        assert got < floor, line
    return line


def _outputs(name: str) -> list[str]:
    """The output names of a program whose labels are a dict by output, else []."""
    split = held_out(name)
    return sorted(split[1]) if split is not None and isinstance(split[1], dict) else []


def _assert_close_without_test_split(name: str, metrics: dict, ref: dict, what: str) -> str:
    history = ref["history"]
    if "loss" in history:  # the VAE: its training loss, which must have fallen
        got, want, first = metrics["train_loss"], history["loss"][-1], history["loss"][0]
        line = f"{name} {what}: train_loss {got:.4f} vs plain Keras {want:.4f}"
        assert got < first, f"{line}: not below plain Keras' first epoch ({first:.4f})"
        assert _within_loss_margin(got, want), line
        return line
    # the GAN: its own logs (d_loss, g_loss), none of which need fall; those a
    # Keras loss object computes are logged at 1/N on N replicas (REPLICA_SCALED_LOGS)
    line = f"{name} {what}:"
    scaled = getattr(load(name), "REPLICA_SCALED_LOGS", ())
    for log in sorted(history):
        key, want = f"train_{log}", history[log][-1]
        assert key in metrics, f"{line} no {key} in the run's metrics ({sorted(metrics)})"
        got = metrics[key] * (metrics.get("num_replicas", 1) if log in scaled else 1)
        line += f" {key} {got:.4f} vs plain Keras {want:.4f},"
        assert np.isfinite(got) and np.isfinite(want), line
        assert _within_loss_margin(got, want), line
    return line.rstrip(",")
