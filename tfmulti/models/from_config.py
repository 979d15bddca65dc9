"""The model a `TrainConfig` names, unpartitioned: a built-in builder's, the
transformer, or the user's model function's, given the data it is for.

Example:
    >>> from tfmulti.config.train_config import TrainConfig
    >>> from tfmulti.data.from_config import load_data
    >>> from tfmulti.models.from_config import build_model_for
    >>> config = TrainConfig(dataset="synthetic", num_examples=256)
    >>> build_model_for(config, load_data(config)).name
    'mlp'
"""

from __future__ import annotations

import contextlib

import keras

from tfmulti.config import user_functions as hooks
from tfmulti.config.train_config import TRANSFORMER, TrainConfig
from tfmulti.models import builders as models
from tfmulti.models import transformer

__all__ = ["build_model_for", "transformer_sizes"]


def transformer_sizes(config: TrainConfig) -> dict:
    return dict(seq_len=config.seq_len, d_model=config.d_model, num_heads=config.num_heads,
                num_layers=config.num_layers, dropout=config.dropout)


def _num_classes(run_data, fn) -> int | None:
    """The classes to pass a model function that takes `num_classes`: the
    data's (given by the dataset function, or the width of one-hot labels);
    else, for classification, counted from the integer labels unless the
    function has a default of its own (then None: it keeps it); None for
    other tasks."""
    if run_data.task != "classification":
        return None
    known = run_data.num_classes or run_data.one_hot_width()
    if known is not None or hooks.has_default(fn, "num_classes"):
        return known
    return run_data.classes()


def build_model_for(config: TrainConfig, run_data, strategy=None) -> keras.Model:
    """The run's model, unpartitioned: a built-in builder's, or the user's
    model function's, built under `strategy`'s scope (none: the current one).

    Raises:
        ValueError: a model function that cannot be found, asks for an
            argument tfmulti does not offer, or returns no Keras model.
    """
    if config.model == TRANSFORMER:
        with strategy.scope() if strategy is not None else contextlib.nullcontext():
            return transformer.build_transformer(seed=config.seed, **transformer_sizes(config))
    if config.builtin_model:
        return models.build_model(
            config.model, strategy=strategy, input_shape=run_data.input_shape,
            num_classes=run_data.classes() if run_data.task == "classification" else 1,
            dropout=config.dropout, seed=config.seed)
    fn = hooks.resolve(config.model, "model")
    offered = {"input_shape": run_data.input_shape, "dropout": config.dropout,
               "seed": config.seed}
    wanted = hooks.parameters(fn)
    if wanted is None or "num_classes" in wanted:
        classes = _num_classes(run_data, fn)
        if classes is not None or wanted is not None and not hooks.has_default(fn, "num_classes"):
            offered["num_classes"] = classes  # never None over the function's own default
    if config.seed is not None:
        keras.utils.set_random_seed(config.seed)
    with strategy.scope() if strategy is not None else contextlib.nullcontext():
        model = hooks.call(fn, offered, "model")
    if not isinstance(model, keras.Model):
        raise ValueError(f"the model function {config.model_name} returned "
                         f"{type(model).__name__}; expected a keras.Model (functional, "
                         "Sequential or subclassed).")
    return model
