"""Portable checkpoint keys: each variable by its place in the model, not its
position in `model.variables`.

A model variable's key is its layer's index in the model's layer stack, the
layer's class, and the variable's index and name within that layer:
`1.Dense/0.kernel`. It names the same weight whatever the replica count (a
mirrored variable is one variable), the placement (a PipelineModel lists its
stack through `checkpoint_layers()`, the same layers as its `to_sequential()`)
and the names Keras gave the layers (`dense_7` in a process that built other
models first). An optimizer slot is keyed by its variable's key and the slot's
name (`1.Dense/0.kernel/momentum`); other optimizer variables by name
(`iteration`). Each key maps to the variables holding that value: one, or one
per replica of a hybrid pipeline (saved once, restored into each).

    >>> import keras
    >>> from tfmulti.training.backup import _keys
    >>> model = keras.Sequential([keras.Input((3,)), keras.layers.Dense(2)])
    >>> model.compile(keras.optimizers.Adam(), "mse")
    >>> model.optimizer.build(model.trainable_variables)
    >>> list(_keys.model_variables(model))
    ['0.Dense/0.kernel', '0.Dense/1.bias']
    >>> list(_keys.optimizer_variables(model.optimizer, _keys.model_variables(model)))[:4]
    ['iteration', 'learning_rate', '0.Dense/0.kernel/momentum', '0.Dense/0.kernel/velocity']
"""

from __future__ import annotations

import re

from tfmulti.parallel import zero

__all__ = ["escape", "metric_variables", "model_variables", "optimizer_variables", "unescape"]


def _stacks(model) -> list[list]:
    """The model's layers, once per replica (a hybrid pipeline has several)."""
    layers = getattr(model, "checkpoint_layers", None)
    return layers() if callable(layers) else [list(model.layers)]


def _stack_keys(layers) -> list[tuple[str, object]]:
    keys, seen = [], set()
    for i, layer in enumerate(layers):
        for j, variable in enumerate(layer.variables):
            if id(variable) not in seen:  # a variable shared by two layers: the first
                seen.add(id(variable))
                keys.append((f"{i}.{type(layer).__name__}/{j}.{variable.name}", variable))
    return keys


def model_variables(model) -> dict[str, list]:
    """Key -> the model's variables holding it (replica 0's first).

    Raises:
        ValueError: the replicas of a pipeline do not hold the same variables.
    """
    stacks = [_stack_keys(layers) for layers in _stacks(model)]
    first = [key for key, _ in stacks[0]]
    keyed: dict[str, list] = {key: [] for key in first}
    for r, stack in enumerate(stacks):
        if [key for key, _ in stack] != first:
            raise ValueError(f"replica {r} of {model.name!r} holds other variables than "
                             f"replica 0; its layers must be copies of replica 0's.")
        for key, variable in stack:
            keyed[key].append(variable)
    covered = {id(v) for variables in keyed.values() for v in variables}
    # Variables of the model's own (a subclassed model's add_weight), in order.
    own = [v for v in model.variables if id(v) not in covered]
    for j, variable in enumerate(own):
        keyed[f"model/{j}.{variable.name}"] = [variable]
    return keyed


def optimizer_variables(optimizer, model_keys: dict[str, list]) -> dict[str, list]:
    """Key -> the optimizer's variables holding it: a slot by its model variable's key
    and its own name (Keras 3 names a slot `<variable path with _>_<slot>`), other
    variables by name (`iteration`, `learning_rate`)."""
    references = {variable.path.replace("/", "_") + "_": key
                  for key, variables in model_keys.items() for variable in variables}
    keyed: dict[str, list] = {}
    for variable in optimizer.variables:
        name = variable.name
        key = name
        for cut in [m.end() for m in re.finditer("_", name)][::-1]:  # the longest prefix
            if name[:cut] in references:
                key = f"{references[name[:cut]]}/{name[cut:]}"
                break
        if key == name:  # not a slot: one variable per name
            n = 1
            while key in keyed:
                n += 1
                key = f"{name}#{n}"
        keyed.setdefault(key, []).append(variable)
    # A sharded optimizer's slots (tfmulti.parallel.zero), whole, under the keys
    # the unsharded optimizer's would have.
    key_of = {_identity(v): key for key, variables in model_keys.items() for v in variables}
    for variable, name, slot in zero.whole_slots(optimizer):
        keyed[f"{key_of[_identity(variable)]}/{name}"] = [slot]
    return keyed


def _identity(variable) -> int:
    """The id of what holds `variable`'s value: a Keras variable's TensorFlow
    variable; a sharded parameter's own (its value is gathered afresh at each
    read: a collective, and another tensor each time)."""
    if isinstance(variable, zero.ShardedParameter):
        return id(variable)
    return id(getattr(variable, "value", variable))


def metric_variables(model) -> dict[str, list]:
    """Key -> the metric variables (the running totals of the epoch under way)."""
    return {f"{i}.{metric.name}/{j}.{variable.name}": [variable]
            for i, metric in enumerate(model.metrics)
            for j, variable in enumerate(metric.variables)}


def escape(key: str) -> str:
    """The key as TensorFlow writes a dict key in a checkpoint's names."""
    return key.replace(".", "..").replace("/", ".S")


def unescape(name: str) -> str:
    return re.sub(r"\.(\.|S)", lambda m: "." if m.group(1) == "." else "/", name)
