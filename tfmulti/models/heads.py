"""A model's outputs: the layer that makes each one, the loss and metrics
tfmulti picks from it when none are given, and what the model's author
compiled it with.

A Keras model has one output or several (a dict of outputs by name, or a
list). `output_heads` finds, for each, the layer that makes it (inside nested
models and a `PipelineModel`'s stages) and so its activation; `default_loss`
and `default_metrics` pick each output's from it, as `compile_model` does
when no loss is given. `authored_compile` reads what a model function
compiled its model with, so that a run keeps it.

Example:
    >>> import keras
    >>> from tfmulti.models import heads
    >>> x = keras.Input((4,))
    >>> model = keras.Model(x, {"score": keras.layers.Dense(1, name="score")(x),
    ...                         "kind": keras.layers.Dense(3, activation="softmax",
    ...                                                    name="kind")(x)})
    >>> [(h.key, h.activation) for h in heads.output_heads(model)]
    [('kind', 'softmax'), ('score', None)]
    >>> loss = heads.default_loss({"kind": "classification", "score": "regression"}, model)
    >>> {k: type(v).__name__ for k, v in loss.items()}
    {'kind': 'SparseCategoricalCrossentropy', 'score': 'MeanSquaredError'}
"""

from __future__ import annotations

import dataclasses
import inspect

import keras

from tfmulti.config.train_config import TASKS
from tfmulti.utils import checks

__all__ = ["AuthoredCompile", "Head", "authored_compile", "default_loss", "default_metrics",
           "output_head", "output_heads", "per_output"]

_ACTIVATIONS = ("softmax", "sigmoid")


@dataclasses.dataclass(frozen=True)
class Head:
    """One output of a model.

    Attributes:
        key: its key in the model's outputs: the dict key, or (a list, or one
            output) the name Keras gives it (`model.output_names`).
        activation: "softmax", "sigmoid" or None, of the layer that makes it.
        shape: its shape, batch axis first (None where unknown).
    """

    key: str | None
    activation: str | None
    shape: tuple | None


def _outputs(model):
    try:
        return model.outputs
    except (AttributeError, ValueError, TypeError, RuntimeError):
        return None


def _layer_of(output):
    history = getattr(output, "_keras_history", None)
    return history[0] if history else None


def _activation(op) -> str | None:
    kind = type(op).__name__.lower()  # keras.layers.Softmax, keras.ops.softmax's operation
    name = kind if kind in _ACTIVATIONS else getattr(getattr(op, "activation", None),
                                                        "__name__", None)
    return name if name in _ACTIVATIONS else None


def _head(model, output) -> tuple[str | None, tuple | None]:
    """The activation and shape of `output` of `model` (None: the model's one
    output, or its last layer's for a model without symbolic outputs),
    following the layer that makes it into nested models."""
    op, shape = model, None
    if output is not None:
        op, shape = _layer_of(output), tuple(output.shape)
    for _ in range(64):  # nesting depth; models do not contain themselves
        if not isinstance(op, keras.Model):
            break
        given = getattr(op, "given", None)  # a PipelineModel: the model it was made from
        if isinstance(given, keras.Model):
            op = given
            continue
        found = None
        outputs = _outputs(op)
        if outputs:
            if len(outputs) != 1:
                return None, shape
            shape = tuple(outputs[0].shape)
            found = _layer_of(outputs[0])
        if found is None:
            layers = getattr(op, "layers", None)
            found = layers[-1] if layers else None
        if found is None or found is op:
            break
        op = found
    if op is model:
        return None, shape
    return _activation(op), shape


def _unwrapped(model):
    given = getattr(model, "given", None)
    return given if isinstance(given, keras.Model) else model


def output_heads(model) -> list[Head]:
    """Each output of `model`, in the order of `model.outputs` (a dict's in its
    keys' sorted order, as Keras flattens it); one `Head` (key None) for a
    model whose outputs are not known before it is called (subclassed) or a
    `PipelineModel` of a stack."""
    source = _unwrapped(model)
    outputs = _outputs(source)
    if not outputs or len(outputs) == 1:
        activation, shape = _head(model, None)
        key = getattr(source, "output_names", [None])[0] if outputs else None
        return [Head(key, activation, shape)]
    struct = getattr(source, "_outputs_struct", None)
    keys = sorted(struct) if isinstance(struct, dict) else list(source.output_names)
    return [Head(key, *_head(source, output)) for key, output in zip(keys, outputs)]


def output_head(model) -> tuple[str | None, tuple | None]:
    """The activation ("softmax", "sigmoid" or None) of the layer that makes
    `model`'s one output, and that output's shape (None where unknown;
    (None, None) for a model with several outputs: `output_heads`).

    The layer is found where the output is made, inside nested models (a
    `Sequential` of models, a `PipelineModel`'s last stage), so a model
    ending in `Dense(..., activation="softmax")`, `keras.layers.Softmax()`,
    `keras.layers.Activation("sigmoid")` or `keras.ops.softmax` says so
    wherever it is trained. A subclassed model without symbolic outputs: its
    last layer."""
    found = output_heads(model)
    if len(found) != 1:
        return None, None
    return found[0].activation, found[0].shape


def per_output(value, heads: list[Head], name: str = "value") -> list:
    """`value` (one for all outputs, a dict by key, or a list by position)
    as a list in the order of `heads`.

    Raises:
        ValueError: a dict naming what is no output of these, or a list of
            another length (the message names the argument `name`).
    """
    keys = [h.key for h in heads]
    if isinstance(value, dict):
        unknown = sorted(set(value) - set(keys))
        if unknown:
            verb = "is" if len(unknown) == 1 else "are"
            raise ValueError(f"`{name}` names {unknown}, which {verb} no output of the model; "
                             f"its outputs are {keys}.")
        return [value.get(key) for key in keys]
    if isinstance(value, (list, tuple)):
        if len(value) != len(heads):
            raise ValueError(f"`{name}` gives {len(value)} values for the model's {len(heads)} "
                             f"output{'s' if len(heads) > 1 else ''} {keys}; give one each (in "
                             "their order), or a dict by output name.")
        return list(value)
    return [value] * len(heads)


def _structured(values: list, heads: list[Head]):
    """One value per head: a single value for one output, else a dict by key."""
    if len(heads) == 1:
        return values[0]
    return {h.key: v for h, v in zip(heads, values)}


def _one_loss(task: str, head: Head, one_hot: bool):
    checks.one_of("task", task, TASKS)
    if task == "regression":
        return keras.losses.MeanSquaredError()
    if head.activation == "sigmoid":
        return keras.losses.BinaryCrossentropy()
    kind = keras.losses.CategoricalCrossentropy if one_hot else \
        keras.losses.SparseCategoricalCrossentropy
    return kind(from_logits=head.activation != "softmax")


def _one_metrics(task: str, head: Head, one_hot: bool) -> list:
    checks.one_of("task", task, TASKS)
    if task == "regression":
        return [keras.metrics.MeanAbsoluteError(name="mae")]
    if head.activation == "sigmoid":
        return [keras.metrics.BinaryAccuracy(name="accuracy")]
    if one_hot:
        return [keras.metrics.CategoricalAccuracy(name="accuracy")]
    return [keras.metrics.SparseCategoricalAccuracy(name="accuracy")]


def default_loss(task, model: keras.Model | None = None, *, one_hot=False):
    """The loss tfmulti uses for `task` when none is given, chosen from the
    layer that makes `model`'s output (looked for inside nested models and a
    `PipelineModel`'s stages, `output_heads`): for "classification", the
    binary cross-entropy on probabilities for a sigmoid output, else the
    categorical cross-entropy for `one_hot` labels or the sparse one for
    class ids, on probabilities after a softmax, else on logits. Mean
    squared error for "regression".

    For a model with several outputs, `task` and `one_hot` may be given per
    output (a dict by output key, or a list in output order); the result is
    a dict of losses by output key.
    """
    found = output_heads(model) if model is not None else [Head(None, None, None)]
    tasks, hots = per_output(task, found, "task"), per_output(one_hot, found, "one_hot")
    return _structured([_one_loss(t, h, o) for t, h, o in zip(tasks, found, hots)], found)


def default_metrics(task, model: keras.Model | None = None, *, one_hot=False):
    """Accuracy for "classification" (of the kind `default_loss` picks: binary,
    one-hot or class ids), mean absolute error for "regression": a list, or
    for a model with several outputs a dict of lists by output key (`task`
    and `one_hot` as `default_loss` takes them)."""
    found = output_heads(model) if model is not None else [Head(None, None, None)]
    tasks, hots = per_output(task, found, "task"), per_output(one_hot, found, "one_hot")
    return _structured([_one_metrics(t, h, o) for t, h, o in zip(tasks, found, hots)], found)


@dataclasses.dataclass(frozen=True)
class AuthoredCompile:
    """What a model's author compiled it with (`authored_compile`).

    Attributes:
        optimizer: the optimizer object (a `LossScaleOptimizer`'s inner one).
        loss, loss_weights, metrics, weighted_metrics: as given to `compile`
            (None where not given).
        run_eagerly: as given to `compile`.
        own_compile: the model's class has a `compile` of its own that does
            not take Keras' arguments (a GAN's `compile(d_optimizer,
            g_optimizer, loss_fn)`): it cannot be compiled again, only kept.
    """

    optimizer: object
    loss: object = None
    loss_weights: object = None
    metrics: object = None
    weighted_metrics: object = None
    run_eagerly: bool = False
    own_compile: bool = False

    def describe(self) -> str:
        """Its optimizer and loss in words, for messages."""
        if self.own_compile:
            return "its own compile()"
        parts = [type(self.optimizer).__name__] if self.optimizer is not None else []
        if self.loss is not None:
            parts.append(f"loss {_named(self.loss)}")
        if self.loss_weights is not None:
            parts.append(f"loss_weights {_named(self.loss_weights)}")
        if self.metrics is not None:
            parts.append(f"metrics {_named(self.metrics)}")
        if self.weighted_metrics is not None:
            parts.append(f"weighted_metrics {_named(self.weighted_metrics)}")
        return ", ".join(parts)


def _named(value):
    if isinstance(value, dict):
        return "{" + ", ".join(f"{k}: {_named(v)}" for k, v in value.items()) + "}"
    if isinstance(value, (list, tuple)):
        return "[" + ", ".join(_named(v) for v in value) + "]"
    if isinstance(value, (str, int, float)):
        return str(value)
    return getattr(value, "__name__", None) or type(value).__name__


def _takes_keras_arguments(method) -> bool:
    try:
        parameters = inspect.signature(method).parameters
    except (TypeError, ValueError):
        return False
    kinds = {p.kind for p in parameters.values()}
    return inspect.Parameter.VAR_KEYWORD in kinds or {"optimizer", "loss"} <= set(parameters)


def authored_compile(model) -> AuthoredCompile | None:
    """What `model` was compiled with before tfmulti got it (by the user's
    model function), or None for a model not compiled."""
    if not getattr(model, "compiled", False):
        return None
    own = type(model).compile is not keras.Model.compile and not _takes_keras_arguments(
        model.compile)
    config = dict(getattr(getattr(model, "_compile_config", None), "config", None) or {})
    optimizer = config.get("optimizer", getattr(model, "optimizer", None))
    optimizer = getattr(optimizer, "inner_optimizer", optimizer)
    return AuthoredCompile(
        optimizer=optimizer, loss=config.get("loss"), loss_weights=config.get("loss_weights"),
        metrics=config.get("metrics"), weighted_metrics=config.get("weighted_metrics"),
        run_eagerly=bool(config.get("run_eagerly")), own_compile=own)
