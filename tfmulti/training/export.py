"""SavedModel export for serving: a trained model, from any strategy or a
pipeline, as a TensorFlow SavedModel that loads and predicts on one device
(`tf.saved_model.load(path).serve(x)`, `keras.layers.TFSMLayer(path,
call_endpoint="serve")`, TensorFlow Serving's `serving_default`).

The model is first made a plain one-device Keras model: a PipelineModel (or
a hybrid) becomes its unpartitioned model (`to_sequential()`), and a model
whose variables a strategy holds (mirrored, multi-worker) is copied through a
`.keras` file into ordinary variables. The SavedModel is written into a
temporary directory next to `path` and renamed into place, so `path` never
holds a partial export; an existing `path` is refused unless `overwrite`.

Example:
    >>> import os, tempfile
    >>> import numpy as np, tensorflow as tf, keras
    >>> from tfmulti.training import export
    >>> model = keras.Sequential([keras.Input((4,)), keras.layers.Dense(2)])
    >>> path = export.saved_model(model, os.path.join(tempfile.mkdtemp(), "serving"))
    >>> x = np.ones((3, 4), np.float32)
    >>> loaded = tf.saved_model.load(path)  # keep it: it owns the variables
    >>> served = loaded.serve(x).numpy()
    >>> bool(np.allclose(served, model.predict(x, verbose=0), atol=1e-6))
    True

`tfmulti export --model_dir DIR --output DIR` does the same for a run's
`DIR/model.keras`.
"""

from __future__ import annotations

import os
import shutil
import tempfile

import keras
import tensorflow as tf

from tfmulti.config import user_functions
from tfmulti.runtime import strategy as strategy_lib

__all__ = ["from_model_dir", "import_model_module", "saved_model"]

MODEL_FILE = "model.keras"


def _one_device_model(model, scratch: str):
    """`model` as a plain Keras model whose variables live on one device."""
    if callable(getattr(model, "to_sequential", None)):  # a PipelineModel, a hybrid
        return model.to_sequential()
    if getattr(model, "_distribute_strategy", None) is None:
        return model
    copy = os.path.join(scratch, MODEL_FILE)
    model.save(copy)
    return keras.saving.load_model(copy, compile=False)


def saved_model(model, path: str, *, overwrite: bool = False,
                strategy: tf.distribute.Strategy | None = None) -> str | None:
    """Writes `model` to `path` as a SavedModel for serving, atomically.

    In a multi-worker cluster every worker calls it (copying the model may
    read variables with collectives); the chief writes `path`, the others a
    private temporary directory they remove.

    Args:
        model: a built Keras model (functional, Sequential or subclassed; under
            any strategy) or a PipelineModel.
        path: the SavedModel directory to create.
        overwrite: replace an existing `path` (default: refuse).
        strategy: whose cluster resolver says who the chief is; default: the
            model's (`model.distribute_strategy`).

    Returns:
        `path` on the chief, None on other workers.

    Raises:
        ValueError: `path` exists (and not `overwrite`) or is not writable, or the
            model is not built.
        RuntimeError: called inside a strategy's scope (the copy would be made
            there); call it outside `strategy.scope()`.
    """
    if not path:
        raise ValueError("`path` must be a directory path for the SavedModel, got an empty "
                         "value.")
    if tf.distribute.has_strategy():
        raise RuntimeError("export.saved_model copies the model onto one device; call it "
                           "outside `strategy.scope()`.")
    if not model.built:
        raise ValueError(f"model {model.name!r} is not built; call it on a batch (or fit it) "
                         "before exporting.")
    role = strategy_lib.cluster_role(strategy or model.distribute_strategy)
    path = os.path.abspath(path)
    parent = os.path.dirname(path)
    if role.is_chief:
        if os.path.lexists(path) and not overwrite:
            raise ValueError(f"{path} exists; pass another output directory, or set "
                             "`overwrite` to replace it.")
        try:
            os.makedirs(parent, exist_ok=True)
            staging = tempfile.mkdtemp(dir=parent, prefix=f".{os.path.basename(path)}.tmp-")
        except OSError as e:
            raise ValueError(f"cannot write the SavedModel next to {path} ({e.strerror}); pass "
                             "an output directory this process can write.") from e
    else:
        staging = tempfile.mkdtemp(prefix="tfmulti-export-")
    try:
        plain = _one_device_model(model, staging)
        exported = os.path.join(staging, "saved_model")
        plain.export(exported, format="tf_saved_model", verbose=False)
        if not role.is_chief:
            return None
        if os.path.lexists(path):  # overwrite: the old one moves aside, then goes
            old = os.path.join(staging, "replaced")
            os.rename(path, old)
        os.rename(exported, path)
        return path
    finally:
        shutil.rmtree(staging, ignore_errors=True)


def import_model_module(spec: str) -> None:
    """Imports the module of a `--model=package.module[:function]` hook (found on
    `sys.path` or in the current directory, which goes after the standard library:
    `tfmulti.config.user_functions.import_user_module`), so that the custom layers, losses
    and models it registers (`keras.saving.register_keras_serializable`) load.

    Raises:
        ValueError: the module cannot be imported.
    """
    module = spec.partition(":")[0].strip()
    if not module:
        raise ValueError(f"`model` must name a module (package.module[:function]), got "
                         f"{spec!r}.")
    try:
        user_functions.import_user_module(module)
    except ImportError as e:
        raise ValueError(f"`model` {spec!r}: cannot import {module!r} ({e}); pass a module on "
                         "sys.path or in the current directory.") from e


def from_model_dir(model_dir: str, output: str, *, overwrite: bool = False,
                   model_module: str | None = None) -> str:
    """Exports a run's `model_dir/model.keras` (what `recipes/train.py
    --model_dir` writes) as a SavedModel at `output`: `tfmulti export`.

    Args:
        model_dir: the run's output directory.
        output: the SavedModel directory to create.
        overwrite: replace an existing `output`.
        model_module: a module to import first (`import_model_module`), for
            models with custom objects.

    Returns:
        `output`.

    Raises:
        ValueError: no model in `model_dir`, a model that does not load (an
            unregistered custom object), or an `output` that exists.
    """
    if model_module:
        import_model_module(model_module)
    source = os.path.join(model_dir, MODEL_FILE)
    if not os.path.isfile(source):
        raise ValueError(f"`model_dir` {model_dir!r} has no {MODEL_FILE}; pass the directory "
                         "a training run wrote (recipes/train.py --model_dir).")
    try:
        model = keras.saving.load_model(source, compile=False)
    except (TypeError, ValueError) as e:
        first = str(e).strip().splitlines()[0] if str(e).strip() else type(e).__name__
        raise ValueError(f"cannot load {source} ({first[:300]}); if it uses custom layers, "
                         "pass --model=MODULE (the module that registers them).") from e
    return saved_model(model, output, overwrite=overwrite)
