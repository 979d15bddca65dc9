"""Any user's built Keras model split over T devices: `split_layers` finds
the layers that split by Megatron-LM's scheme, at any depth, and returns the
model with their tensor-parallel forms (`tfmulti.parallel.tensor_layers`) in
their place, with their weights:

* every `keras.layers.MultiHeadAttention` on (batch, length, features)
  inputs, by heads (`ParallelMultiHeadAttention`);
* every MLP block: a `Dense` d -> f with an element-wise Keras activation
  followed by a `Dense` f -> d (next in a `keras.Sequential`, or the one
  layer that reads it in a functional graph), by columns then rows
  (`ColumnParallelDense`, `RowParallelDense`);

in the model's graph, in nested Sequential and functional models, and in
the attributes of the user's own layers (a `TransformerBlock` holding
`self.att` and `self.ffn`), lists and dicts of layers included.

Only public Keras is used. A built layer cannot take new sub-layers (Keras
locks its state), so a user's layer that holds a split layer is made anew,
from its class and its constructor's arguments (`get_config()`, which Keras
records for any layer), its attributes pointed at the split layers and at
the given sub-layers; the functional graph is rebuilt by
`keras.models.clone_model`. The old layers are not in the new model: its
weights are those of the unsplit model, each split weight once. (The
sub-layers the constructor made stay listed by Keras, unused, unbuilt and
without weights.) `join_layers` goes back, each tensor-parallel layer joined
with its current weights; `split_for_pipeline` is what
`tfmulti train --tensor_parallel=T --model=module:function` calls.

Example:
    >>> import keras, tfmulti
    >>> _ = tfmulti.configure_virtual_devices(2)
    >>> from tfmulti.parallel import split_layers
    >>> inputs = keras.Input((8, 16))
    >>> x = keras.layers.MultiHeadAttention(num_heads=2, key_dim=8, name="att")(inputs, inputs)
    >>> model = keras.Model(inputs, keras.layers.GlobalAveragePooling1D()(x))
    >>> split = split_layers(model, ["CPU:0", "CPU:1"])
    tfmulti: split over 2 devices: att (MultiHeadAttention, 2 heads)
    >>> [type(layer).__name__ for layer in split.layers]
    ['InputLayer', 'ParallelMultiHeadAttention', 'GlobalAveragePooling1D']
"""

from __future__ import annotations

import functools
import inspect

import keras

from tfmulti.parallel import placement
from tfmulti.utils import human
from tfmulti.parallel.pipeline import choose_devices
from tfmulti.parallel.tensor_layers import (ColumnParallelDense, ParallelMultiHeadAttention,
                                            RowParallelDense, TensorParallelLayer,
                                            shard_devices)

__all__ = ["join_layers", "split_for_pipeline", "split_layers"]

# Activations that mix a row's columns: a column-split Dense cannot apply them.
_MIXING_ACTIVATIONS = ("softmax", "log_softmax")
_WHAT_SPLITS = ("a MultiHeadAttention, or an MLP block (a Dense d->f with an element-wise "
                "Keras activation followed by a Dense f->d, in a Sequential or a functional "
                "graph)")


def split_layers(model: keras.Model, devices, *, print_fn=None) -> keras.Model:
    """The model with its splittable layers split over `devices`, with
    their weights (see the module docstring for what splits).

    The layers with nothing to split are the given model's own objects
    (shared, with their weights; training the new model trains them); a
    user's layer that holds split layers is a new instance of its class
    with the same constructor arguments and name, whose attributes point at
    the split layers and the given model's sub-layers. It holds its split
    weights on their devices and the rest on devices[0], and says so
    (`places_own_variables`, which a `PipelineModel` leaves where they
    are). The new model is not compiled: compile it, then call
    `tfmulti.models.optimizers.build_on_variable_devices(model.optimizer,
    model.trainable_variables)` to keep each shard's optimizer slots on its
    device (`PipelineModel` does so itself).

    Args:
        model: a built Functional or Sequential `keras.Model`.
        devices (Sequence[str]): T device names, shard i on devices[i]; T must divide the
            heads of every attention and the width f of every MLP block.
        print_fn (Callable[[str], object] | None): called with one line naming the layers split
            (Keras' `summary` convention); default: `print`.

    Returns:
        A new model of the same inputs and outputs.

    Raises:
        ValueError: not a built Functional or Sequential model, nothing to
            split, a layer T does not split (heads or width, options the
            tensor-parallel layers do not take), or a user's layer that
            cannot be made again from its constructor's arguments; each
            message names the layer.
    """
    return _rebuild(model, _Splitter(shard_devices(devices)), print_fn)


def join_layers(model: keras.Model, *, print_fn=None) -> keras.Model:
    """The unsplit form of a model from `split_layers`: each tensor-parallel
    layer joined again (`to_layer()`, with its current weights, on the
    current device), made as `split_layers` makes the split form; for
    saving, serving or comparing with the given model.

    Args:
        model: a built Functional or Sequential `keras.Model` holding
            tensor-parallel layers, at any depth.
        print_fn (Callable[[str], object] | None): called with one line naming the layers joined;
            default: `print`.

    Returns:
        A new model of the same inputs and outputs, of plain Keras layers
        where the given one has tensor-parallel ones.

    Raises:
        ValueError: as `split_layers`, or no tensor-parallel layer.

    Example:
        >>> import keras, numpy as np, tfmulti
        >>> from tfmulti.parallel import join_layers, split_layers
        >>> inputs = keras.Input((4, 8))
        >>> model = keras.Model(inputs, keras.layers.MultiHeadAttention(2, 4)(inputs, inputs))
        >>> split = split_layers(model, ["CPU:0", "CPU:1"], print_fn=lambda line: None)
        >>> joined = join_layers(split, print_fn=lambda line: None)
        >>> type(joined.layers[1]).__name__
        'MultiHeadAttention'
        >>> all(np.array_equal(a, b) for a, b in zip(joined.get_weights(), model.get_weights()))
        True
    """
    return _rebuild(model, _Splitter(None, join=True), print_fn)


def _rebuild(model, splitter, print_fn):
    """The model with `splitter`'s replacements, once it is checked."""
    if not isinstance(model, keras.Model) or not model.built or not (
            isinstance(model, keras.Sequential) or _is_functional(model)):
        raise ValueError(
            f"{'join_layers' if splitter.join else 'split_layers'} takes a built Functional "
            f"or Sequential keras.Model, got "
            f"{type(model).__name__} {getattr(model, 'name', model)!r}"
            f"{'' if getattr(model, 'built', True) else ' (not built)'}; build the model with "
            f"keras.Input(...) or call it once, and subclass keras.layers.Layer rather than "
            f"keras.Model for your blocks.")
    result = splitter.split(model, None)
    if result is None and splitter.join:
        raise ValueError(f"model {model.name!r} holds no tensor-parallel layer to join; it is "
                         f"already plain.")
    if result is None:
        raise ValueError(f"model {model.name!r} has no layer split_layers can split over "
                         f"{len(splitter.devices)} devices; it splits {_WHAT_SPLITS}, at any "
                         f"depth. Train this model unsplit (tensor_parallel=1).")
    splitter.copy_own_weights()
    if not splitter.join:
        splitter.place_own_variables()
    done = (f"joined {human.count(len(splitter.split_names), 'layer')}" if splitter.join else
            f"split over {len(splitter.devices)} devices")
    (print_fn or print)(f"tfmulti: {done}: {', '.join(splitter.split_names)}")
    return result


def _is_functional(model) -> bool:
    """A model built from inputs and outputs (`keras.Model(inputs, outputs)`);
    a subclassed one has no `inputs`."""
    return bool(getattr(model, "inputs", None)) and not isinstance(model, keras.Sequential)


def _keras_layer(layer) -> bool:
    """A layer of Keras itself (looked into only when it is a model)."""
    return type(layer).__module__.startswith(("keras.", "keras_hub.", "keras_nlp."))


class _Splitter:
    """One `split_layers` (or `join_layers`) call: the layers split (joined)
    and the user's layers made anew."""

    def __init__(self, devices, join: bool = False):
        self.devices = devices
        self.join = join  # join split layers (`to_layer`) instead of splitting
        self.split_names: list[str] = []
        self._remade: list[tuple] = []  # (old layer, new layer, its orphaned sub-layers, path)
        self._done: dict[int, object] = {}  # a layer held twice is split once

    def split(self, layer, path: str):
        """The layer's split (joined) form, or None when nothing in it splits (joins)."""
        if id(layer) not in self._done:
            self._done[id(layer)] = self._split(layer, path)
        return self._done[id(layer)]

    def _split(self, layer, path: str):
        if isinstance(layer, TensorParallelLayer):
            if not self.join:
                return None
            self.split_names.append(f"{path} ({type(layer).__name__})")
            return layer.to_layer()
        if isinstance(layer, keras.layers.MultiHeadAttention) and not self.join:
            split = self._call(ParallelMultiHeadAttention.from_layer, path, layer, self.devices)
            self.split_names.append(f"{path} (MultiHeadAttention, {layer.num_heads} heads)")
            return split
        if isinstance(layer, keras.Sequential):
            return self._sequential(layer, path)
        if isinstance(layer, keras.Model):
            if _is_functional(layer):
                return self._functional(layer, path)
            return self._user_layer(layer, path)
        if _keras_layer(layer):
            return None
        return self._user_layer(layer, path)

    def _call(self, fn, path, *args, **kwargs):
        try:
            return fn(*args, **kwargs)
        except ValueError as error:
            raise ValueError(f"layer {path}: {_one_line(error)}") from None

    # ----------------------------------------------------------------- models

    def _functional(self, model, path):
        prefix = "" if path is None else f"{path}."
        replaced = {}
        if not self.join:
            # keras.models.clone_model passes a layer's outputs on one by
            # one, not as the list a ColumnParallelDense gives: the pair
            # exchanges the whole hidden tensor (gathered, then split again).
            for up, down in _mlp_blocks_of_graph(model):
                replaced.update(self._mlp(up, down, prefix, gather=True))
        for layer in model.layers:
            if id(layer) in replaced:
                continue
            split = self.split(layer, f"{prefix}{layer.name}")
            if split is not None:
                replaced[id(layer)] = split
        if not replaced:
            return None
        return keras.models.clone_model(
            model, clone_function=lambda layer: replaced.get(id(layer), layer))

    def _sequential(self, model, path):
        prefix = "" if path is None else f"{path}."
        old = list(model.layers)
        new, changed, i = [], False, 0
        while i < len(old):
            pair = old[i:i + 2]
            if not self.join and len(pair) == 2 and _mlp_block(*pair):
                new += list(self._mlp(*pair, prefix).values())
                changed, i = True, i + 2
                continue
            split = self.split(old[i], f"{prefix}{old[i].name}")
            new.append(old[i] if split is None else split)
            changed, i = changed or split is not None, i + 1
        if not changed:
            return None
        inputs = []
        if model.built and getattr(model, "inputs", None):
            spec = model.inputs[0]
            inputs = [keras.Input(batch_shape=tuple(spec.shape), dtype=spec.dtype)]
        return keras.Sequential(inputs + new, name=model.name, trainable=model.trainable)

    def _mlp(self, up, down, prefix, gather: bool = False) -> dict:
        """{id: split layer} of an MLP block's two Dense layers."""
        column = self._call(ColumnParallelDense.from_layer, f"{prefix}{up.name}", up,
                            self.devices, gather_output=gather)
        row = self._call(RowParallelDense.from_layer, f"{prefix}{down.name}", down, self.devices,
                         input_is_parallel=not gather)
        d, f = up.kernel.shape
        self.split_names.append(f"{prefix}{up.name}+{down.name} (Dense {d}->{f} + Dense "
                                f"{f}->{d})")
        return {id(up): column, id(down): row}

    # ------------------------------------------------------------- user layers

    def _user_layer(self, layer, path):
        children, replaced = _children(layer), {}
        for name, value in children.items():
            new_value = self._split_value(value, f"{path}.{name}")
            if new_value is not None:
                replaced[name] = new_value
        if not replaced:
            return None
        new = self._remake(layer, path)
        # The sub-layers its constructor made are left unused (Keras keeps
        # them listed, unbuilt): marked built, they hold no weights and Keras
        # does not take the new layer for half-built.
        orphans = [v for value in _children(new).values() for v in _flat(value)]
        for orphan in orphans:
            orphan.built = True
        for name, value in children.items():
            setattr(new, name, replaced.get(name, value))
        self._remade.append((layer, new, orphans, path))
        return new

    def _split_value(self, value, path):
        if isinstance(value, keras.layers.Layer):
            return self.split(value, path)
        if isinstance(value, dict):
            split = {k: self.split(v, f"{path}[{k!r}]") if isinstance(v, keras.layers.Layer)
                     else None for k, v in value.items()}
            return None if all(s is None for s in split.values()) else \
                {k: v if split[k] is None else split[k] for k, v in value.items()}
        split = [self.split(v, f"{path}[{i}]") if isinstance(v, keras.layers.Layer) else None
                 for i, v in enumerate(value)]
        if all(s is None for s in split):
            return None
        return type(value)(v if s is None else s for v, s in zip(value, split)) \
            if isinstance(value, tuple) else [v if s is None else s for v, s in zip(value, split)]

    def _remake(self, layer, path):
        """A new, unbuilt instance of the layer's class, with its constructor's
        arguments (`get_config()`) and its name."""
        cls = type(layer)
        fix = (f"give {cls.__name__} a get_config() that returns its constructor's arguments "
               f"and an __init__ that takes them (or **kwargs), or split its layers yourself "
               f"with ParallelMultiHeadAttention/ColumnParallelDense/RowParallelDense"
               f".from_layer")
        try:
            config = layer.get_config()
        except NotImplementedError as error:
            raise ValueError(f"layer {path} ({cls.__name__}) holds layers to split and must be "
                             f"made again, but its get_config() fails "
                             f"({_first_sentence(error)}); "
                             f"{fix}.") from None
        parameters = inspect.signature(cls.__init__).parameters.values()
        if not any(p.kind is inspect.Parameter.VAR_KEYWORD for p in parameters):
            names = {p.name for p in parameters}
            config = {k: v for k, v in config.items() if k in names}
        try:
            new = cls(**config)
        except Exception as error:  # the user's constructor: any failure
            raise ValueError(f"layer {path} ({cls.__name__}) holds layers to split and must be "
                             f"made again, but {cls.__name__}(**{config}) fails "
                             f"({type(error).__name__}: {_first_sentence(error)}); "
                             f"{fix}.") from None
        new.name = layer.name
        new.trainable = layer.trainable
        return new

    def place_own_variables(self) -> None:
        """Each remade layer of the model holds its split weights on their
        devices and the rest on the first, and says so (`places_own_variables`,
        which `PipelineModel` leaves where they are)."""
        for _, new, orphans, _ in self._remade:
            split = {id(w) for layer in _tensor_parallel_layers(new) for w in layer.weights}
            placement.place([w for w in new.weights if id(w) not in split], self.devices[0])
            new.places_own_variables = True

    def copy_own_weights(self) -> None:
        """The weights a remade layer holds itself (made by its own `build`,
        not by its sub-layers): the given layer's values."""
        for old, new, orphans, path in self._remade:
            old_own = _own_weights(old, _children(old).values())
            new_own = _own_weights(new, [*_children(new).values(), orphans])
            if [tuple(w.shape) for w in old_own] != [tuple(w.shape) for w in new_own]:
                raise ValueError(
                    f"layer {path} ({type(old).__name__}) made again holds weights of its own "
                    f"{[w.path for w in new_own]} that do not match the given layer's "
                    f"{[w.path for w in old_own]}; split its layers yourself with "
                    f"ParallelMultiHeadAttention/ColumnParallelDense/RowParallelDense"
                    f".from_layer.")
            for source, target in zip(old_own, new_own):
                target.assign(source)


def _one_line(error) -> str:
    return " ".join(str(error).split())


def _first_sentence(error) -> str:
    """The first sentence of an error from elsewhere (Keras' are long)."""
    return _one_line(error).split(". ")[0].rstrip(".")


def _tensor_parallel_layers(layer) -> list:
    """The tensor-parallel layers in a layer's attributes, at any depth."""
    found, stack, seen = [], [layer], set()
    while stack:
        current = stack.pop()
        if id(current) in seen:
            continue
        seen.add(id(current))
        if isinstance(current, TensorParallelLayer):
            found.append(current)
        elif isinstance(current, keras.Model) and getattr(current, "inputs", None):
            stack.extend(current.layers)
        elif not _keras_layer(current):
            stack.extend(v for value in _children(current).values() for v in _flat(value))
    return found


@functools.cache
def _base_attributes() -> frozenset:
    """The attributes Keras itself gives every layer."""
    return frozenset(vars(keras.layers.Layer()))


def _children(layer) -> dict:
    """A user's layer's attributes that hold layers (or lists, tuples, dicts
    of them): its own, not those Keras keeps (nor TensorFlow's `_self_*`)."""
    found = {}
    for name, value in vars(layer).items():
        if name in _base_attributes() or name.startswith("_self_"):
            continue
        values = (list(value.values()) if isinstance(value, dict) else
                  list(value) if isinstance(value, (list, tuple)) else [value])
        if values and any(isinstance(v, keras.layers.Layer) for v in values):
            found[name] = value
    return found


def _flat(value) -> list:
    values = value.values() if isinstance(value, dict) else \
        value if isinstance(value, (list, tuple)) else [value]
    return [v for v in values if isinstance(v, keras.layers.Layer)]


def _own_weights(layer, children) -> list:
    held = {id(w) for value in children for child in _flat(value) for w in child.weights}
    return [w for w in layer.weights if id(w) not in held]


def _mlp_blocks_of_graph(model) -> list[tuple]:
    """The MLP blocks of a functional graph: a Dense whose output goes to one
    Dense alone (and is not a model output), each called once."""
    def called_once(layer, attribute):
        try:
            return getattr(layer, attribute)
        except (AttributeError, ValueError):  # called more than once (shared)
            return None

    outputs = {id(t) for t in model.outputs}
    blocks = []
    for up in model.layers:
        if type(up) is not keras.layers.Dense or called_once(up, "output") is None:
            continue
        out = up.output
        readers = [l for l in model.layers if any(
            t is out for t in keras.tree.flatten(_or_empty(called_once(l, "input"))))]
        if id(out) not in outputs and len(readers) == 1 and \
                called_once(readers[0], "output") is not None and _mlp_block(up, readers[0]):
            blocks.append((up, readers[0]))
    return blocks


def _or_empty(value):
    return [] if value is None else value


def _mlp_block(up, down) -> bool:
    """A Dense d -> f with an element-wise activation followed by a Dense f -> d."""
    if not (type(up) is keras.layers.Dense and type(down) is keras.layers.Dense
            and up.built and down.built):
        return False
    d, f = up.kernel.shape
    return tuple(down.kernel.shape) == (f, d) and _element_wise(up.activation)


def _element_wise(activation) -> bool:
    """One of Keras' own activations that acts on each element alone (a
    user's function may mix the columns a split Dense holds apart)."""
    name = getattr(activation, "__name__", None)
    try:
        known = name is not None and keras.activations.get(name) is activation
    except ValueError:
        known = False
    return known and name not in _MIXING_ACTIVATIONS


def split_for_pipeline(model: keras.Model, tensor_parallel: int, devices=None):
    """A user's model split for a one-stage pipeline of T devices
    (`tfmulti train --tensor_parallel=T --model=module:function`):
    `split_layers` over the stage's devices, which it prints.

    Args:
        model: the user's built model.
        tensor_parallel: T.
        devices: the device names given (`TrainConfig.devices`), or None:
            the first T logical GPUs, else CPUs.

    Returns:
        (the split model, the devices to give `PipelineModel`: None when
        none were given, else the stage's).

    Raises:
        ValueError: as `split_layers`, too few devices, or split layers at
            the top of the model's graph (the one-stage pipeline trains
            those held in the user's own layers).
    """
    group = choose_devices(devices, 1, 1, tensor_parallel)
    split = split_layers(model, group)
    on_top = [layer.name for layer in split.layers if isinstance(layer, TensorParallelLayer)]
    if on_top:
        raise ValueError(
            f"`tensor_parallel` ({tensor_parallel}) with your own model splits the layers held "
            f"in your own layers (a TransformerBlock's attention and MLP); {on_top} at the top "
            f"of model {model.name!r}'s graph are not trained split here yet: hold them in a "
            f"layer of your own, or split the model in Python with "
            f"tfmulti.parallel.split_layers.")
    return split, None if devices is None else group[:1]
