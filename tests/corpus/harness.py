"""What the corpus tests share: each program trained by plain Keras on one
device, as its source trains it (the reference), tfmulti's configuration of
the same program, and the comparison of the two.

Why a tfmulti run differs from the reference at all, and the tolerances
that follow (`assert_close`):
- batch order: tfmulti shuffles each epoch with its own seeded stream
  (`tfmulti.data.distribute`); Keras' `fit` shuffles with another one. The
  two runs see the same examples in other orders, so their weights follow
  different paths from the same initial weights (same seed);
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

__all__ = ["PROGRAMS", "assert_close", "chance", "config_kwargs", "load", "reference",
           "held_out"]


def load(name: str):
    """The corpus module `name`."""
    return importlib.import_module(f"tests.corpus.{name}")


def _splits(module):
    result = module.data(seed=SEED)
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


def held_out(name: str):
    """The test split as (features, labels) of NumPy values (features a dict
    for dict data), or None when the program has no test split."""
    import tensorflow as tf

    test = _splits(load(name))[1]
    if test is None:
        return None
    if isinstance(test, tf.data.Dataset):
        rows = list(test.as_numpy_iterator())
        if isinstance(rows[0], dict):
            return {k: np.stack([r[k] for r in rows]) for k in rows[0]}, None
        features, labels = zip(*rows)
        if isinstance(features[0], dict):
            features = {k: np.stack([f[k] for f in features]) for k in features[0]}
        else:
            features = np.stack(features)
        return features, np.stack(labels)
    return test


def chance(name: str) -> float:
    """The accuracy of always answering the test split's most common class."""
    _, labels = held_out(name)
    labels = np.asarray(labels)
    ids = labels.argmax(axis=-1) if labels.ndim > 1 else labels.reshape(-1)
    return float(np.bincount(ids.astype(np.int64)).max() / len(ids))


def reference(name: str, callbacks=()) -> dict:
    """Program `name` trained by plain Keras on one device, as its source
    trains it (its compile and fit arguments, EPOCHS epochs), from the same
    seed: {"test_loss", "test_accuracy" (when compiled with it),
    "history": fit's history}.

    Args:
        name: the program.
        callbacks: Keras callbacks for `fit`.
    """
    import keras
    import tensorflow as tf

    module = load(name)
    train, test = _splits(module)
    offered = {"seed": SEED}
    if "input_shape" in inspect.signature(module.build).parameters:
        spec = train.element_spec if isinstance(train, tf.data.Dataset) else None
        offered["input_shape"] = (tuple(spec[0].shape) if spec is not None
                                  else train[0].shape[1:])
    keras.utils.set_random_seed(SEED)
    wanted = inspect.signature(module.build).parameters
    model = module.build(**{k: v for k, v in offered.items() if k in wanted})
    model.compile(**module.COMPILE)
    fit = {**module.FIT, "epochs": EPOCHS}
    batch_size = fit.pop("batch_size")
    if isinstance(train, tf.data.Dataset):
        n = int(train.cardinality())
        history = model.fit(train.shuffle(n, seed=SEED).batch(batch_size), verbose=0,
                            callbacks=list(callbacks), **fit)
    else:
        history = model.fit(*train, batch_size=batch_size, shuffle=True, verbose=0,
                            callbacks=list(callbacks), **fit)
    out = {"history": history.history}
    if test is not None:
        if isinstance(test, tf.data.Dataset):
            results = model.evaluate(test.batch(batch_size), verbose=0, return_dict=True)
        else:
            results = model.evaluate(*test, batch_size=batch_size, verbose=0,
                                     return_dict=True)
        out.update({f"test_{k}": float(v) for k, v in results.items()})
    return out


def assert_close(name: str, metrics: dict, ref: dict, what: str) -> str:
    """Asserts that a tfmulti run's `metrics` agree with the reference `ref`
    within the tolerances above; returns the line that compares them."""
    if "test_loss" not in ref:  # no test split (the VAE): the last epoch's training loss
        got, want = metrics["train_loss"], ref["history"]["loss"][-1]
        first = ref["history"]["loss"][0]
        line = f"{name} {what}: train_loss {got:.4f} vs plain Keras {want:.4f}"
        assert got < first, f"{line}: not below plain Keras' first epoch ({first:.4f})"
    else:
        got, want = metrics["test_loss"], ref["test_loss"]
        line = f"{name} {what}: test_loss {got:.4f} vs plain Keras {want:.4f}"
    assert abs(got - want) <= LOSS_ABS + LOSS_REL * want, line
    if "test_accuracy" in ref:
        acc, ref_acc, floor = metrics["test_accuracy"], ref["test_accuracy"], chance(name)
        line += f", test_accuracy {acc:.3f} vs {ref_acc:.3f} (chance {floor:.3f})"
        assert abs(acc - ref_acc) <= ACCURACY_MARGIN, line
        assert acc >= floor + ABOVE_CHANCE, line
    return line
