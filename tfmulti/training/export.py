"""SavedModel export for serving: a trained model, from any strategy or a
pipeline, as a TensorFlow SavedModel that loads and predicts on one device
(`tf.saved_model.load(path).serve(x)`, `keras.layers.TFSMLayer(path,
call_endpoint="serve")`, TensorFlow Serving's `serving_default`).

The model is first made a plain one-device Keras model: a PipelineModel (or
a hybrid) becomes its unpartitioned model (`to_model()`), and a model
whose variables a strategy holds (mirrored, multi-worker) is copied through a
`.keras` file into ordinary variables. The signature's inputs are named as the
model's `keras.Input`s (`input_names`), whichever distribution trained it.
The SavedModel is written into a temporary directory next to `path` and
renamed into place, so `path` never holds a partial export; an existing
`path` is refused unless `overwrite`.

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
`DIR/model.keras` (`from_model_dir`): a model Keras cannot rebuild from the
file is named in one line with what its class lacks, or built again by the
run's model function, which is given the saved weights (`rebuild`).
"""

from __future__ import annotations

import dataclasses
import inspect
import json
import os
import re
import shutil
import tempfile
import types
import zipfile

import keras
import tensorflow as tf

from tfmulti.config import user_functions
from tfmulti.config.train_config import TrainConfig
from tfmulti.models.rebuild import FIX, cause
from tfmulti.runtime import strategy as strategy_lib

__all__ = ["from_model_dir", "import_model_module", "input_names", "rebuild", "saved_model",
           "user_objects"]

MODEL_FILE = "model.keras"
WEIGHTS_FILE = "model.weights.h5"
"""What a run whose model cannot be saved whole writes instead of `MODEL_FILE`."""


def _one_device_model(model, scratch: str):
    """`model` as a plain Keras model whose variables live on one device."""
    if callable(getattr(model, "to_model", None)):  # a PipelineModel, a hybrid
        return model.to_model()
    if getattr(model, "_distribute_strategy", None) is None:
        return model
    copy = os.path.join(scratch, MODEL_FILE)
    model.save(copy)
    return keras.saving.load_model(copy, compile=False)


_KERAS_INPUT_NAME = re.compile(r"(input_layer|keras_tensor)(_\d+)?")
"""The names Keras gives an unnamed `keras.Input` (its layer's, its tensor's)."""


def input_names(model) -> list[str]:
    """The names of a functional or Sequential model's inputs as its SavedModel
    signature gives them: each `keras.Input(name=...)`'s own name; an unnamed
    Input's the name Keras gives it in a fresh process ("input_layer",
    "input_layer_1", ... by position among the unnamed ones), whichever copy of
    the model (a strategy's, a pipeline's, one loaded from a file) is exported.

    Example:
        >>> import keras
        >>> from tfmulti.training import export
        >>> pixels, extra = keras.Input((4,), name="pixels"), keras.Input((2,))
        >>> out = keras.layers.Dense(1)(keras.layers.Concatenate()([pixels, extra]))
        >>> export.input_names(keras.Model([pixels, extra], out))
        ['pixels', 'input_layer']
    """
    names, unnamed = [], 0
    for tensor in model.inputs:
        history = getattr(tensor, "_keras_history", None)
        layer_name = getattr(history[0], "name", tensor.name) if history else tensor.name
        if _KERAS_INPUT_NAME.fullmatch(layer_name) or _KERAS_INPUT_NAME.fullmatch(tensor.name):
            layer_name = "input_layer" + (f"_{unnamed}" if unnamed else "")
            unnamed += 1
        names.append(layer_name)
    return names


def _input_signature(model):
    """The serving signature of a functional or Sequential model, its inputs
    named by `input_names`; of a subclassed model `rebuild` built, its data's;
    None for another subclassed model (Keras traces it)."""
    structure = getattr(model, "_inputs_struct", None)
    if not isinstance(model, keras.Sequential) and structure is None:
        return getattr(model, _SERVING_SIGNATURE, None)
    names = dict(zip((id(t) for t in model.inputs), input_names(model)))

    def spec(tensor):
        return tf.TensorSpec((None, *tensor.shape[1:]), tensor.dtype, name=names[id(tensor)])

    if isinstance(model, keras.Sequential):
        return [spec(t) for t in model.inputs]
    return [keras.tree.map_structure(spec, structure)]


def _check_serves(model) -> None:
    """Refuses a model without a `call` of its own (a GAN written with its own
    `train_step`): Keras' `call` raises, so there is nothing to serve.

    Raises:
        ValueError: naming the models it holds, which can be exported.
    """
    if type(model).call is not keras.Model.call:
        return
    held = [name for name, value in sorted(vars(model).items())
            if isinstance(value, keras.Model) and not name.startswith("_")]
    example = (f"; export a model it holds ({', '.join(held)}) from Python, e.g. "
               f"tfmulti.training.export.saved_model(model.{held[0]}, OUTPUT)" if held else
               "; give the model a call() to serve")
    raise ValueError(f"model {model.name!r} ({type(model).__name__}) has no call() of its own, "
                     f"so it has nothing to serve{example}.")


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
        ValueError: `path` exists (and not `overwrite`) or is not writable, the
            model is not built, or it has no `call` of its own (nothing to serve).
        RuntimeError: called inside a strategy's scope (the copy would be made
            there); call it outside `strategy.scope()`.
    """
    if not path:
        raise ValueError("`path` must be a directory path for the SavedModel, got an empty "
                         "value.")
    if tf.distribute.has_strategy():
        raise RuntimeError("export.saved_model copies the model onto one device; call it "
                           "outside `strategy.scope()`.")
    _check_serves(model)
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
        plain.export(exported, format="tf_saved_model", verbose=False,
                     input_signature=_input_signature(plain))
        if not role.is_chief:
            return None
        if os.path.lexists(path):  # overwrite: the old one moves aside, then goes
            old = os.path.join(staging, "replaced")
            os.rename(path, old)
        os.rename(exported, path)
        return path
    finally:
        shutil.rmtree(staging, ignore_errors=True)


def import_model_module(spec: str) -> types.ModuleType:
    """Imports the module of a `--model=package.module[:function]` hook (found on
    `sys.path` or in the current directory, which goes after the standard library:
    `tfmulti.config.user_functions.import_user_module`), so that the custom layers, losses
    and models it registers (`keras.saving.register_keras_serializable`) load.

    Returns:
        The module.

    Raises:
        ValueError: the module cannot be imported (or its import raised).
    """
    module = spec.partition(":")[0].strip()
    if not module:
        raise ValueError(f"`model` must name a module (package.module[:function]), got "
                         f"{spec!r}.")
    try:
        return user_functions.import_user_module(module)
    except ImportError as e:
        raise ValueError(f"`model` {spec!r}: cannot import {module!r} ({e}); pass a module on "
                         "sys.path or in the current directory.") from e
    except Exception as e:  # pylint: disable=broad-except  (the user's module raised)
        raise ValueError(f"`model` {spec!r}: importing {module!r} raised "
                         f"{type(e).__name__}: {e}") from e


_KERAS_BASES = (keras.layers.Layer, keras.losses.Loss, keras.metrics.Metric,
                keras.optimizers.Optimizer, keras.initializers.Initializer,
                keras.regularizers.Regularizer, keras.constraints.Constraint,
                keras.optimizers.schedules.LearningRateSchedule)


def user_objects(module: types.ModuleType) -> dict:
    """The Keras classes (layers, models, losses, metrics, ...) and the functions
    that a user's module defines or imports, by name: what a model saved from it may
    name without having registered them (keras-io's layers are not registered)."""
    found = {}
    for name, value in vars(module).items():
        if name.startswith("__"):
            continue
        if isinstance(value, type) and issubclass(value, _KERAS_BASES):
            if not value.__module__.startswith("keras."):
                found[name] = value
        elif inspect.isfunction(value) and value.__module__ == module.__name__:
            found[name] = value
    return found


def _saved_entries(source: str) -> list[dict]:
    """The serialized objects of a `.keras` file's config.json that Keras itself
    does not define (the user's layers, models, losses...), outermost first."""
    try:
        with zipfile.ZipFile(source) as archive:
            config = json.loads(archive.read("config.json"))
    except (OSError, KeyError, ValueError, zipfile.BadZipFile):
        return []
    found, stack = [], [config]
    while stack:
        item = stack.pop(0)
        if isinstance(item, dict):
            module = item.get("module")
            if ("class_name" in item and isinstance(item.get("config"), dict)
                    and isinstance(module, str) and module.split(".")[0] != "keras"):
                found.append(item)
            stack.extend(item.values())
        elif isinstance(item, list):
            stack.extend(item)
    return found


def _rebuild_problem(entry: dict, custom: dict) -> str | None:
    """Why the saved object `entry` cannot be rebuilt (its class not found, or
    its `from_config` failing), or None when it can."""
    class_name = entry["class_name"]
    registered = entry.get("registered_name") or class_name
    cls = (keras.saving.get_registered_object(registered, custom_objects=custom)
           or custom.get(class_name))
    if cls is None:
        return "not found"
    if not isinstance(cls, type) or not hasattr(cls, "from_config"):
        return None
    try:
        with keras.saving.custom_object_scope(custom):
            cls.from_config(dict(entry["config"]))
    except Exception as e:  # pylint: disable=broad-except  (the user's class raised)
        return cause(e)
    return None


def _load_failure(source: str, error: Exception, custom: dict, spec: str | None) -> str:
    """The one line that says why `source` did not load: the user's class that
    Keras cannot find or rebuild (class, name and what to add), else Keras' own
    first line."""
    problems = [(entry, _rebuild_problem(entry, custom)) for entry in _saved_entries(source)]
    missing = [e for e, p in problems if p == "not found"]
    broken = [(e, p) for e, p in problems if p not in (None, "not found")]
    if broken:
        entry, problem = broken[0]
        name = entry.get("name") or entry["config"].get("name")
        others = sorted({e["class_name"] for e, _ in broken[1:]} - {entry["class_name"]})
        also = f"; also {', '.join(others)}" if others else ""
        rebuild = ("" if spec and ":" in spec else
                   f"; or export with --model={entry['module']}:FUNCTION (the run's model "
                   "function), which builds the model again and loads the saved weights into it")
        return (f"cannot load {source}: layer {entry['class_name']} {name!r} (module "
                f"{entry['module']}{also}) cannot be rebuilt from its saved config: {problem}; "
                f"in class {entry['class_name']}, {FIX}{rebuild}.")
    if missing:
        names = sorted({e["class_name"] for e in missing})
        modules = ", ".join(sorted({e["module"] for e in missing}))
        known = (f"the class {names[0]} is not known" if len(names) == 1 else
                 f"the classes {', '.join(names)} are not known")
        it = "it" if len(names) == 1 else "them"
        where = (f"{spec!r} does not define {it}; pass --model=MODULE with the module that "
                 f"does ({modules})" if spec else
                 f"pass --model=MODULE with the module that defines {it} ({modules})")
        return f"cannot load {source}: {known}; {where}."
    text = str(error).strip()
    first = text.splitlines()[0] if text else type(error).__name__
    return (f"cannot load {source} ({first[:300]}); if it uses custom layers, pass "
            "--model=MODULE (the module that defines them).")


def _recorded(model_dir: str) -> dict:
    """What the run recorded about itself: its metrics.json, with its
    configuration (the run file) under "config"; empty where unreadable."""
    from tfmulti.training import outputs

    try:
        with open(os.path.join(model_dir, "metrics.json")) as f:
            metrics = json.load(f)
    except (OSError, ValueError):
        metrics = {}
    record = outputs.read_record(model_dir)
    metrics = metrics if isinstance(metrics, dict) else {}
    return {**metrics, "config": (record.config if record and isinstance(record.config, dict)
                                  else {})}


def _shape(value):
    """A recorded input shape (JSON lists) as Keras takes it (tuples, dicts of tuples)."""
    if isinstance(value, dict):
        return {k: _shape(v) for k, v in value.items()}
    return tuple(value) if isinstance(value, list) else value


# What the run's model function was given, from the run file: the data (its shapes and
# classes), the task, dropout and seed.
_BUILD_FIELDS = ("dataset", "data_dir", "num_examples", "validation_split", "task", "dropout",
                 "seed")


def _built_again(model_dir: str, spec: str, weights: str):
    """The model function `spec` called as the run called it: with the input
    shape and classes metrics.json records, else those of the data its run
    file names (`tfmulti.models.from_config.build_model_for`); and one
    example's input (None: not needed or not recorded): its `tf.TensorSpec`s
    (names, shapes and dtypes) where the run's data is known, else its shape."""
    recorded = _recorded(model_dir)
    run = {k: v for k, v in recorded["config"].items()
           if k in _BUILD_FIELDS and k in {f.name for f in dataclasses.fields(TrainConfig)}}
    fn = user_functions.resolve(spec, "model")
    if recorded.get("input_shape") is not None:
        offered = {"input_shape": _shape(recorded["input_shape"]),
                   "dropout": run.get("dropout", 0.2), "seed": run.get("seed")}
        if recorded.get("num_classes") is not None:
            offered["num_classes"] = recorded["num_classes"]
        return user_functions.call(fn, offered, "model"), offered["input_shape"]
    from tfmulti.data.from_config import load_data
    from tfmulti.models.from_config import build_model_for

    named = isinstance(run.get("dataset"), str)
    config = TrainConfig(**{**run, "model": spec}) if named else None
    wanted = user_functions.parameters(fn)
    if wanted is not None and not {"input_shape", "num_classes"} & wanted:
        model = user_functions.call(fn, {"dropout": run.get("dropout", 0.2),
                                         "seed": run.get("seed")}, "model")
        if getattr(model, "built", True) or not named:
            return model, None
        return model, _example(load_data(config))  # a subclassed model: built on it
    if not named:
        raise ValueError(f"--model {spec!r} takes `input_shape`, which {model_dir} does not "
                         "record (no metrics.json input_shape, no run file naming the data); "
                         "export from Python: build the model, "
                         f"model.load_weights({weights!r}), then "
                         "tfmulti.training.export.saved_model(model, OUTPUT).")
    run_data = load_data(config)
    return build_model_for(config, run_data), _example(run_data)


def _example(run_data):
    """One example's features of `run_data` as `tf.TensorSpec`s (a dict of
    them for dict features): a dataset's own names and dtypes; else the input
    shape."""
    element = getattr(run_data.train, "element_spec", None)
    features = element[0] if isinstance(element, tuple) else element
    if features is None or not all(isinstance(s, tf.TensorSpec)
                                   for s in keras.tree.flatten(features)):
        return run_data.input_shape
    return features


def _zeros(example):
    """A batch of one example of zeros: of `tf.TensorSpec`s (their dtypes; empty
    strings), or of a per-example shape (float32); a dict of them: a dict."""
    import numpy as np

    if isinstance(example, dict):
        return {k: _zeros(v) for k, v in example.items()}
    if isinstance(example, tf.TensorSpec):
        shape = [1, *(d or 1 for d in example.shape)]
        return tf.fill(shape, "") if example.dtype == tf.string else tf.zeros(shape, example.dtype)
    return np.zeros((1, *example), np.float32)


def _serving_signature(example) -> list | None:
    """The serving signature of a model built again on `example`'s specs:
    batches of them, named by their keys; None for a bare shape (Keras traces
    the model with float inputs)."""
    flat = keras.tree.flatten(example) if example is not None else []
    if not flat or not all(isinstance(s, tf.TensorSpec) for s in flat):
        return None
    if isinstance(example, dict):
        return [{k: tf.TensorSpec((None, *s.shape), s.dtype, name=k)
                 for k, s in example.items()}]
    return [keras.tree.map_structure(lambda s: tf.TensorSpec((None, *s.shape), s.dtype),
                                     example)]


_SERVING_SIGNATURE = "_tfmulti_serving_signature"


def rebuild(model_dir: str, spec: str, weights: str) -> keras.Model:
    """The run's model built again by its model function `spec`
    ("module:function"), given what the run gave it (the input shape and
    classes of its data, its dropout and seed: from metrics.json, else from
    the data its run file names), with the weights of `weights` (a
    .weights.h5 file, or a .keras file's). A subclassed model is built on one
    example of zeros of the data's names, shapes and dtypes first, and
    `saved_model` serves it with those (a dict of ids stays a dict of
    integers by name).

    Raises:
        ValueError: the function cannot be called with what the run recorded,
            or the weights do not fit the model it returns.
    """
    model, example = _built_again(model_dir, spec, weights)
    if not isinstance(model, keras.Model):
        raise ValueError(f"--model {spec!r} returned {type(model).__name__}; expected a "
                         "keras.Model.")
    _check_serves(model)
    if not model.built and example is not None:
        model(_zeros(example), training=False)
        setattr(model, _SERVING_SIGNATURE, _serving_signature(example))
    try:
        model.load_weights(weights)
    except (TypeError, ValueError, KeyError, OSError) as e:
        raise ValueError(f"the model --model {spec!r} builds does not take the weights of "
                         f"{weights} ({cause(e)}); pass the model function this run "
                         "trained.") from e
    return model


def from_model_dir(model_dir: str, output: str, *, overwrite: bool = False,
                   model_module: str | None = None) -> str:
    """Exports a run's model (what `tfmulti train --model_dir` writes) as a
    SavedModel at `output`: `tfmulti export`.

    The run's `model.keras` is loaded, with the Keras classes of `model_module`
    known (registered or not). Where that cannot rebuild the model (a custom
    layer without `**kwargs` or `get_config`), or the run saved only
    `model.weights.h5`, a `model_module` of the form "module:function" (the
    run's model function) builds the model again and the saved weights are
    loaded into it (`rebuild`).

    Args:
        model_dir: the run's output directory.
        output: the SavedModel directory to create.
        overwrite: replace an existing `output`.
        model_module: the run's `--model` hook, "module" or "module:function":
            its module is imported first (`import_model_module`), so that the
            models with custom objects load.

    Returns:
        `output`.

    Raises:
        ValueError: no model in `model_dir`, a model that does not load (the
            line names the layer and what it lacks), or an `output` that exists.
    """
    custom = user_objects(import_model_module(model_module)) if model_module else {}
    source = os.path.join(model_dir, MODEL_FILE)
    weights = os.path.join(model_dir, WEIGHTS_FILE)
    function = model_module if model_module and ":" in model_module else None
    if not os.path.isfile(source):
        if os.path.isfile(weights):
            if function is None:
                hook = _recorded(model_dir)["config"].get("model")
                named = (f" ({hook})" if isinstance(hook, str) and ":" in hook else "")
                raise ValueError(f"{model_dir} holds the weights only ({WEIGHTS_FILE}: its "
                                 "model could not be saved whole); pass --model=MODULE:FUNCTION, "
                                 f"the model function the run trained{named}, to build it "
                                 "again.")
            return saved_model(rebuild(model_dir, function, weights), output,
                               overwrite=overwrite)
        raise ValueError(f"`model_dir` {model_dir!r} has no {MODEL_FILE}; pass the directory "
                         "a training run wrote (tfmulti train --model_dir).")
    try:
        model = keras.saving.load_model(source, compile=False, custom_objects=custom)
    except (TypeError, ValueError) as e:
        if function is not None:
            model = rebuild(model_dir, function, source)
        else:
            raise ValueError(_load_failure(source, e, custom, model_module)) from e
    return saved_model(model, output, overwrite=overwrite)
