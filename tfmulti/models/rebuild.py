"""Whether a model saved as `.keras` would load back: each of the user's
layers rebuilt from its config. A run saves the whole model (`model.keras`),
or, when Keras could not load that file back, the weights (`model.weights.h5`).

A `.keras` file holds each layer's config, and loading it calls the layer
class's `from_config`, which for a layer of the user's without `**kwargs` (as
many published examples are written: `__init__(self, maxlen, vocab_size,
embed_dim)`) fails on the `name`, `trainable` and `dtype` every config
carries, while saving succeeds. `rebuild_problem` finds such a layer before
training, cheaply: it serializes each of the user's layers and rebuilds it
from that config, unbuilt (no weights made); a run then says at its start
that it will save the weights only, and why, and saves them at its end
instead of a model.keras that would not load. Loading the weights needs the
model built again by the same code (the user's model function), then
`model.load_weights(path)`.

Example:
    >>> import keras
    >>> from tfmulti.models import rebuild
    >>> class Scale(keras.layers.Layer):
    ...     def __init__(self, factor):  # no **kwargs
    ...         super().__init__()
    ...         self.factor = factor
    ...     def call(self, x):
    ...         return x * self.factor
    >>> inputs = keras.Input((2,))
    >>> model = keras.Model(inputs, Scale(2.0)(keras.layers.Dense(2)(inputs)))
    >>> print(rebuild.rebuild_problem(model))  # doctest: +ELLIPSIS
    layer Scale 'scale...': it cannot be rebuilt from its config (...unexpected keyword argument...)
    >>> plain = keras.Sequential([keras.Input((2,)), keras.layers.Dense(2)])
    >>> print(rebuild.rebuild_problem(plain))
    None
"""

from __future__ import annotations

import random

import keras

__all__ = ["FIX", "cause", "rebuild_problem"]

FIX = ("take **kwargs in its __init__ and pass them to super().__init__(**kwargs), return "
       "its own __init__ arguments from get_config(), and decorate the class with "
       "@keras.saving.register_keras_serializable()")
"""How to make a layer of the user's loadable from a `.keras` file."""

_ENCOUNTERED = "Exception encountered:"


def cause(error: Exception) -> str:
    """The root of a (Keras-wrapped) error, in one line."""
    text = str(error).strip()
    if _ENCOUNTERED in text:  # Keras wraps the class's error, once per level
        text = text.rsplit(_ENCOUNTERED, 1)[1].strip()
    text = " ".join(text.split()) or type(error).__name__
    return text if len(text) <= 200 else text[:197] + "..."


def _own(layer) -> bool:
    """Whether the layer's class is not one of Keras' own (which round-trip)."""
    return not type(layer).__module__.startswith("keras.")


def _layer_problem(layer) -> str | None:
    """Why `layer` cannot be rebuilt from its config, or None."""
    try:
        serialized = keras.saving.serialize_keras_object(layer)
    except Exception as e:  # pylint: disable=broad-except  (the user's get_config)
        return f"its get_config() raises {type(e).__name__} ({cause(e)})"
    if not isinstance(serialized, dict):
        return None
    # Rebuilt unbuilt: without the build and compile configs no weights are made.
    serialized = {k: v for k, v in serialized.items()
                  if k not in ("build_config", "compile_config")}
    # Its own class, as in the process that loads it with the user's module imported.
    own = {name: type(layer) for name in (serialized.get("class_name"),
                                          serialized.get("registered_name")) if name}
    try:
        keras.saving.deserialize_keras_object(serialized, custom_objects=own)
    except Exception as e:  # pylint: disable=broad-except  (the user's __init__/from_config)
        return f"it cannot be rebuilt from its config ({cause(e)})"
    return None


def rebuild_problem(model) -> str | None:
    """Why `model` saved as `.keras` would not load back, or None when it
    would, as far as its configs tell: the first of the user's layers (classes
    not Keras' own, nested ones included) whose `get_config` raises or whose
    class cannot be rebuilt from its config (the other such classes named
    after it), else a model whose config cannot be written.

    Cheap: each such layer is rebuilt unbuilt (no weights made); Python's
    random state, which Keras draws layers' default seeds from, is left as it
    was.

    Args:
        model: a Keras model or layer, or a list of layers (a pipeline's stack).

    Returns:
        One line naming the layer (class and name) and the cause, or None.
    """
    layers = list(model) if isinstance(model, (list, tuple)) else [model]
    state = random.getstate()
    try:
        found, seen = [], set()
        for top in layers:
            for layer in top._flatten_layers(include_self=True, recursive=True):
                if id(layer) in seen or not _own(layer):
                    continue
                seen.add(id(layer))
                problem = _layer_problem(layer)
                if problem is not None:
                    found.append((layer, problem))
        if found:
            layer, problem = found[0]
            others = sorted({type(l).__name__ for l, _ in found[1:]} - {type(layer).__name__})
            also = f" (also {', '.join(others)})" if others else ""
            return f"layer {type(layer).__name__} {layer.name!r}{also}: {problem}"
        for top in layers:
            try:
                keras.saving.serialize_keras_object(top)
            except Exception as e:  # pylint: disable=broad-except
                return (f"the config of {top.name!r} cannot be written "
                        f"({type(e).__name__}: {cause(e)})")
        return None
    finally:
        random.setstate(state)
