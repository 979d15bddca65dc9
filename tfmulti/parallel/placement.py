"""Layer variables made on the device that holds them, owned by the user's
layer objects.

TensorFlow places a variable where it is created. A pipeline decides its
stages only after it knows the layers' shapes and costs, so unbuilt layers
are first built without values (`deferred_variables`: Keras' stateless
scope records each variable's shape and initializer, no memory), then each
variable is given its value on its stage's device (`place`). A variable that
already has a value elsewhere moves there: a new TensorFlow variable on the
stage's device holding the same value, owned by the same Keras variable, so
every reference to the layer (and to the variable) sees the moved one.

A layer that places its own variables says so with a true attribute
`places_own_variables`; its variables are left where it made them (its
`build` makes them under `outside_symbolic_pass()`, each under its device).
Tensor-parallel layers (`tfmulti.parallel.tensor_layers`) are placed by
the pipeline instead, each shard on its device of the stage's group
(`stage_placement`, which says where each of a stage's variables goes).

Example:
    >>> import keras, tfmulti
    >>> _ = tfmulti.configure_virtual_devices(2)
    >>> from tfmulti.parallel import placement
    >>> dense = keras.layers.Dense(3)
    >>> with placement.deferred_variables() as deferred:
    ...     dense.build((None, 4))
    >>> dense.kernel.value is None or deferred.pending(dense.kernel)
    True
    >>> placement.place(dense.weights, "/CPU:1", deferred)
    >>> dense.kernel.value.device[-5:]
    'CPU:1'
"""

from __future__ import annotations

import contextlib

import keras
import tensorflow as tf
from keras.src.backend.common import global_state

from tfmulti.runtime import devices as devices_lib
from tfmulti.parallel.tensor_layers import TensorParallelLayer

__all__ = ["Deferred", "deferred_variables", "outside_symbolic_pass", "place", "self_placed",
           "stage_placement"]

_PENDING = "uninitialized_variables"  # Keras' list of variables made without a value


class Deferred:
    """Variables made without a value inside `deferred_variables`, and the
    values their layers assigned while being built (kept by Keras'
    stateless scope instead of being written)."""

    def __init__(self, scope):
        self._scope = scope
        self._pending: dict[int, object] = {}

    def _add(self, variables) -> None:
        for v in variables:
            self._pending[id(v)] = v

    def pending(self, variable) -> bool:
        """Whether `variable` was made here and has no value yet."""
        return id(variable) in self._pending

    def remaining(self) -> list:
        """The variables still without a value."""
        return list(self._pending.values())

    def _value_of(self, variable):
        """(initial value or None for its initializer) and forget it."""
        del self._pending[id(variable)]
        return self._scope.get_current_value(variable)


@contextlib.contextmanager
def deferred_variables():
    """Keras variables made inside get a shape and an initializer but no
    value (no memory); `place` gives them their value on a device.

    Yields:
        A `Deferred`; every variable made inside is pending until `place`d.
    """
    pending = global_state.get_global_attribute(_PENDING, [], set_to_default=True)
    start = len(pending)
    scope = keras.StatelessScope(initialize_variables=False)
    deferred = Deferred(scope)
    try:
        with scope:
            yield deferred
    finally:
        # Taken out of Keras' own list, which an enclosing stateless scope
        # would initialize on the default device when it ends.
        deferred._add(pending[start:])
        del pending[start:]


@contextlib.contextmanager
def outside_symbolic_pass():
    """Runs eagerly and statefully, also when Keras builds a model from
    symbolic inputs (`fit`'s first batch is traced in a stateless scope, in
    a scratch graph, where variables would get no value)."""
    stateless = global_state.get_global_attribute("stateless_scope")
    symbolic = global_state.get_global_attribute("symbolic_scope")
    global_state.set_global_attribute("stateless_scope", None)
    global_state.set_global_attribute("symbolic_scope", None)
    try:
        with tf.init_scope():
            yield
    finally:
        global_state.set_global_attribute("stateless_scope", stateless)
        global_state.set_global_attribute("symbolic_scope", symbolic)


def place(variables, device: str, deferred: Deferred | None = None, values=None) -> None:
    """Gives each variable its value on `device`.

    A pending variable (made in `deferred`) gets, in order of preference,
    the matching entry of `values`, the value its layer assigned while being
    built, or its initializer's draw; a variable with a value on another
    device moves there with its value (or takes the entry of `values`).

    Args:
        variables: Keras variables.
        device: a device name ("/CPU:1", "GPU:0", a full name).
        deferred: where pending variables were made, if anywhere.
        values: optional initial values, one per variable (None entries: keep
            the variable's own value).
    """
    target = devices_lib.canonical_device_name(device)
    variables = list(variables)
    values = list(values) if values is not None else [None] * len(variables)
    with tf.device(device):
        for variable, value in zip(variables, values):
            if deferred is not None and deferred.pending(variable):
                assigned = deferred._value_of(variable)
                value = value if value is not None else assigned
                if value is None:
                    variable._deferred_initialize()
                else:
                    variable._initialize(_on_device(value, variable))
                    variable._initializer = None
                continue
            if value is None and devices_lib.canonical_device_name(
                    variable.value.device) == target:
                continue
            # The same Keras variable, now holding a TensorFlow variable on
            # `device`: the layer, the user's references and the optimizer
            # (which keys its slots by the Keras variable) all follow.
            variable._initialize(_on_device(variable.value if value is None else value, variable))


def _on_device(value, variable):
    """A copy of `value` in the variable's dtype, made on the current device."""
    return tf.identity(tf.cast(tf.convert_to_tensor(value), variable.dtype))


def self_placed(model) -> set[int]:
    """ids of the variables of `model`'s layers that place their own
    (`places_own_variables`), which `place` must not be given."""
    ids: set[int] = set()
    for layer in model._flatten_layers():
        if getattr(layer, "places_own_variables", False):
            ids.update(id(v) for v in layer.variables)
    return ids


def stage_placement(layers, group) -> list[tuple[str, list]]:
    """Where a pipeline stage's variables go when the stage runs on a group
    of T devices, and the stage's tensor-parallel layers pointed at them.

    Shard i of every tensor-parallel layer goes to group[i]; everything else
    (whole layers, unsplit biases, random-seed state) to group[0], the
    stage's home. With one device, everything goes there. Other layers that
    place their own variables (`places_own_variables`) keep them where
    they are.

    Args:
        layers: the stage's layers (each variable is placed once).
        group: T device names (the stage's devices).

    Returns:
        [(device, variables)], one entry per device of `group`.

    Raises:
        ValueError: tensor-parallel layers split over other than T devices.
    """
    group = [devices_lib.canonical_device_name(d) for d in group]
    placed = {d: [] for d in group}
    seen = set()
    for layer in layers:
        sharded = isinstance(layer, TensorParallelLayer)
        if sharded:
            layer.retarget(group)
        elif getattr(layer, "places_own_variables", False):
            continue
        for variable in layer.variables:
            if id(variable) in seen:
                continue
            seen.add(id(variable))
            shard = layer.shard_of(variable) if sharded else None
            placed[group[shard or 0]].append(variable)
    return list(placed.items())
