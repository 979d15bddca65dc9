"""A run's model compiled: what its author compiled it with, what the
configuration gives, and tfmulti's defaults for the rest.

A model function may return its model compiled, as Keras programs do: a
loss and a loss weight per output, metrics per output, weighted metrics, an
optimizer of its own. The run keeps all of it. For each of `optimizer`,
`learning_rate`, `loss`, `metrics`, `weighted_metrics` and `loss_weights`:
the configuration's value where it gives one (it replaces the author's, and
one line says so), else the author's, else tfmulti's default (Adam at 1e-3;
each output's loss and accuracy from its task and the layer that makes it,
`tfmulti.models.heads`). tfmulti's own settings apply on top of either:
steps per call, gradient accumulation, the learning-rate scaling and warmup,
XLA.

A model whose class has a `compile` of its own that does not take Keras'
arguments (a GAN's `compile(d_optimizer, g_optimizer, loss_fn)`) cannot be
compiled again: it is kept as its author compiled it, with tfmulti's steps
per call; a setting that would need compiling it again is refused in one
line.

Example:
    >>> import keras
    >>> from tfmulti.config.train_config import TrainConfig
    >>> from tfmulti.training import compiling
    >>> model = keras.Sequential([keras.Input((4,)), keras.layers.Dense(1)])
    >>> model.compile(keras.optimizers.SGD(0.05), loss="mae")
    >>> compiling.compile_for_run(model, TrainConfig(model="my:build"), strategy=None,
    ...                           loss=None, task="regression", one_hot_labels=False,
    ...                           global_batch_size=32, steps_per_epoch=8,
    ...                           steps_per_execution=4)  # doctest: +ELLIPSIS
    tfmulti: training the model as your model function compiled it (SGD, loss mae)
    >>> type(model.optimizer).__name__, model.loss, model.steps_per_execution
    ('SGD', 'mae', 4)
"""

from __future__ import annotations

import contextlib

import keras

from tfmulti.config.train_config import TrainConfig
from tfmulti.models import builders as models
from tfmulti.models import heads

__all__ = ["REPLACEABLE", "compile_for_run", "source_model"]

REPLACEABLE = ("optimizer", "learning_rate", "loss", "metrics", "weighted_metrics",
               "loss_weights")
"""The configuration fields that replace what the model's author compiled it with."""


def source_model(model):
    """The user's model: a pipeline's is the model it was made from."""
    given = getattr(model, "given", None)
    return given if isinstance(given, keras.Model) else model


def compile_for_run(model, config: TrainConfig, *, strategy, loss, task, one_hot_labels,
                    global_batch_size: int, steps_per_epoch: int,
                    steps_per_execution: int) -> None:
    """Compiles a run's `model` (see the module doc).

    Args:
        model: the run's model (a `PipelineModel` for pipeline and hybrid).
        config: the run's configuration.
        strategy: the strategy it was built under (None: the current one).
        loss: the configuration's loss, its hooks resolved (None: not given).
        task, one_hot_labels: the data's, for the defaults (per output for a
            model with several).
        global_batch_size: examples per update (for the learning-rate scaling).
        steps_per_epoch, steps_per_execution: the run's.

    Raises:
        ValueError: a setting the model cannot take (a learning rate given
            with an optimizer object; for a model with its own `compile`,
            any setting that needs compiling it again), or what
            `tfmulti.models.builders.compile_model` refuses.
    """
    authored = None if config.builtin_model else heads.authored_compile(source_model(model))
    if authored is not None and authored.own_compile:
        _keep_own_compile(model, config, authored, steps_per_execution)
        return
    optimizer, learning_rate = _optimizer(config, authored, strategy)
    if (authored is not None and optimizer is authored.optimizer
            and source_model(model) is not model):
        # A pipeline's optimizer holds its stages' variables (a hybrid's replicas'
        # copies too), in the stages' order: it is a copy, and the user's model,
        # which the run saves, keeps the author's, given the trained state for its
        # own variables in its own order when saved (`give_optimizer_state`), as
        # Keras loads it back.
        optimizer = type(optimizer).from_config(optimizer.get_config())
    if loss is None and authored is not None:
        loss = authored.loss
    metrics = config.metrics if config.metrics is not None else (
        authored.metrics if authored is not None else None)
    # tfmulti's defaults where neither the configuration nor the author gave them,
    # made under the strategy's scope (a metric's variables are the replicas' and
    # workers' to aggregate only if made there).
    with strategy.scope() if strategy is not None else contextlib.nullcontext():
        if loss is None and task is not None and not models.trains_by_own_step(model):
            loss = heads.default_loss(task, model, one_hot=one_hot_labels)
        if metrics is None and authored is None and task is not None:
            metrics = heads.default_metrics(task, model, one_hot=one_hot_labels)
    chosen = _by_output(model, {
        "loss": loss, "metrics": metrics,
        "weighted_metrics": _first(config.weighted_metrics, authored, "weighted_metrics"),
        "loss_weights": _first(config.loss_weights, authored, "loss_weights")})
    if authored is not None:
        given = [name for name in REPLACEABLE if getattr(config, name) is not None]
        replaced = f"; {_listed(given, '')} given here replace{'s' if len(given) == 1 else ''} " \
                   "its own" if given else ""
        print(f"tfmulti: training the model as your model function compiled it "
              f"({authored.describe()}){replaced}", flush=True)
    models.compile_model(
        model, task=None, strategy=strategy, optimizer=optimizer, learning_rate=learning_rate,
        **chosen,
        lr_scaling=config.lr_scaling, global_batch_size=global_batch_size,
        base_batch_size=config.base_batch_size, warmup_epochs=config.warmup_epochs,
        steps_per_epoch=steps_per_epoch, steps_per_execution=steps_per_execution,
        accumulate_steps=config.accumulate_steps, jit_compile=config.jit_compile,
        run_eagerly=bool(authored and authored.run_eagerly))


def _first(value, authored, name: str):
    return value if value is not None else getattr(authored, name, None)


def _listed(names: list[str], quote: str = "`") -> str:
    return " and ".join(", ".join(f"{quote}{n}{quote}" for n in names).rsplit(", ", 1))


def _by_output(model, values: dict) -> dict:
    """The per-output values checked against the model's outputs (a dict's
    names; a list of losses or loss weights, one per output); loss weights
    given for some outputs only: 1 for the others.

    Raises:
        ValueError: a name that is no output of the model, or a list of
            another length.
    """
    found = heads.output_heads(model)
    for name, value in values.items():
        # (A plain list of metrics is every output's, not one per output.)
        if isinstance(value, dict) or (isinstance(value, list) and
                                       name in ("loss", "loss_weights")):
            given = heads.per_output(value, found, name)
            if name == "loss_weights" and isinstance(value, dict):
                values[name] = {h.key: 1.0 if w is None else w for h, w in zip(found, given)}
    return values


def _optimizer(config: TrainConfig, authored, strategy):
    """(optimizer, learning rate for `compile_model`): the configuration's,
    else the author's (re-made with the configuration's learning rate where
    one is given), else Adam."""
    if config.optimizer is not None:
        return config.optimizer, config.learning_rate
    if authored is None or authored.optimizer is None:
        return "adam", config.learning_rate
    optimizer = authored.optimizer
    if config.learning_rate is not None:
        with strategy.scope() if strategy is not None else contextlib.nullcontext():
            optimizer = type(optimizer).from_config(
                {**optimizer.get_config(), "learning_rate": config.learning_rate})
    return optimizer, None


def _keep_own_compile(model, config: TrainConfig, authored, steps_per_execution: int) -> None:
    """A model compiled by a `compile` of its own: kept, with tfmulti's steps
    per call and XLA setting.

    Raises:
        ValueError: a setting that would need compiling it again.
    """
    refused = [name for name in (*REPLACEABLE, "class_weight") if getattr(config, name) is not None]
    refused += [name for name, default in (("lr_scaling", "none"), ("warmup_epochs", 0.0),
                                           ("accumulate_steps", 1))
                if getattr(config, name) != default]
    if refused:
        kind = type(source_model(model)).__name__
        raise ValueError(
            f"your model {kind} is compiled by its own compile() (its optimizers and loss are "
            f"its own), which tfmulti keeps as it is and cannot compile again; leave out "
            f"{_listed(refused)}, or set them in your model function's compile call.")
    print(f"tfmulti: training the model as your model function compiled it (its own "
          f"{type(source_model(model)).__name__}.compile())", flush=True)
    model.steps_per_execution = steps_per_execution
    if config.jit_compile:
        model.jit_compile = True
    model.train_function = model.test_function = model.predict_function = None
