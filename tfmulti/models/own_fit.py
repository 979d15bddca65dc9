"""Models whose `fit` prepares its own input: keras-hub's task models.

A keras-hub task (`BertTextClassifier`, `GPT2CausalLM`, ...) overrides `fit`,
`evaluate` and `predict` to turn the data it is given into a `tf.data.Dataset`
and map its preprocessor over it (`preprocess_samples(x, y, sample_weight)`:
raw strings to token ids, labels made from the text for a language model)
before calling Keras' own. A distributed dataset, which tfmulti hands `fit`
under every strategy, is not a form that code takes. tfmulti therefore does
that work itself: the model's `preprocess_samples` is mapped over every
per-replica batch of tfmulti's input pipeline (after this worker's share is
taken, so it runs on the shard each worker reads), and Keras' own `fit`,
`evaluate` and `predict` train and evaluate the model on the result
(`keras_own_methods`). Any model that follows the same protocol (a `fit`
override and a `preprocess_samples` method) is handled the same way; a model
that overrides `fit` for other reasons has its own `fit` called as before.

Example:
    >>> import keras
    >>> class Lower(keras.Sequential):
    ...     def fit(self, *args, **kwargs):
    ...         raise RuntimeError("takes no distributed dataset")
    ...     def preprocess_samples(self, x, y=None, sample_weight=None):
    ...         return keras.utils.pack_x_y_sample_weight(x * 2.0, y, sample_weight)
    >>> model = Lower([keras.Input((1,)), keras.layers.Dense(1)])
    >>> preprocessing(model) is not None
    True
    >>> with keras_own_methods(model):
    ...     model.fit.__func__ is keras.Model.fit
    True
    >>> "fit" in vars(model)
    False
"""

from __future__ import annotations

import contextlib
import types
from typing import Callable

import keras

__all__ = ["describe", "keras_own_methods", "preprocessing"]

_METHODS = ("fit", "evaluate", "predict")


def _overrides(model, name: str) -> bool:
    return getattr(type(model), name, None) is not getattr(keras.Model, name)


def preprocessing(model) -> Callable | None:
    """The function that prepares a batch for `model` (its
    `preprocess_samples`) where `model` overrides `fit` to apply it; None for
    any other model (its input goes to `fit` as it is)."""
    if not isinstance(model, keras.Model) or not _overrides(model, "fit"):
        return None
    preprocess = getattr(model, "preprocess_samples", None)
    return preprocess if callable(preprocess) else None


def describe(model, trainer: str | None = None) -> str | None:
    """One line on what tfmulti does with the model's `fit` override (None
    where it does nothing); `trainer`: what trains it on the prepared batches."""
    if preprocessing(model) is None:
        return None
    attached = getattr(model, "preprocessor", None)
    done = (f"its preprocessor ({type(attached).__name__}) runs in the input pipeline, "
            "on each worker's share of every batch" if attached is not None else
            "it has no preprocessor: its batches go to the model as they are")
    trainer = trainer or "Keras' own fit, evaluate and predict"
    return (f"{type(model).__name__} overrides fit to prepare its own input: {done}; "
            f"{trainer} train it on the distributed batches")


@contextlib.contextmanager
def keras_own_methods(model):
    """Within: `model.fit`, `model.evaluate` and `model.predict` are Keras'
    own (`keras.Model`'s), bound to `model`, where `preprocessing(model)`
    found a `fit` override that prepares its input (the batches given are then
    prepared already); any other model is left as it is. Restored on exit."""
    if preprocessing(model) is None:
        yield model
        return
    bound = [name for name in _METHODS if _overrides(model, name) and name not in vars(model)]
    for name in bound:
        # object.__setattr__: not a tracked attribute of the Keras layer.
        object.__setattr__(model, name, types.MethodType(getattr(keras.Model, name), model))
    try:
        yield model
    finally:
        for name in bound:
            object.__delattr__(model, name)
