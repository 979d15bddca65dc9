"""Tensor (intra-layer) parallelism by manual device placement, after
Megatron-LM (Shoeybi et al. 2019), as Keras layers: this module holds the
layers, their base `TensorParallelLayer` and `run_on_device`; a whole
transformer is split with them by `tfmulti.parallel.tensor_split`, and a
pipeline stage's shards are placed by
`tfmulti.parallel.placement.stage_placement`.

One layer's weights are split over T devices; each device holds 1/T of the
split weights (and, once the optimizer is built with
`tfmulti.models.optimizers.build_on_variable_devices`, 1/T of their optimizer
slots) and runs its share of the forward and of the backward pass:

* `ColumnParallelDense`: the kernel split by output columns. Every device
  multiplies the whole input by its columns; the output stays split (a list
  of T tensors, one per device) unless `gather_output=True`.
* `RowParallelDense`: the kernel split by input rows. Each device multiplies
  its slice of the input (the split output of a `ColumnParallelDense`, or a
  slice of a whole input) by its rows; the partial results are summed once.
* `ParallelMultiHeadAttention`: the heads split over the devices, the query,
  key and value projections column-parallel, the output projection
  row-parallel; the same call as `keras.layers.MultiHeadAttention`.

A column-parallel layer followed by a row-parallel one (an MLP, or attention
followed by its output projection) communicates twice per step, as in
Megatron-LM: the forward sums the partial outputs once, the backward sums the
input's partial gradients once. Both sums, and anything else that is not
split (a bias added after the sum, a gathered output), run on the first of
the layer's devices, its *home*.

Each device's share runs under a custom gradient whose backward runs on that
device as well: left to itself, a `tf.GradientTape` puts every gradient op on
the device active when `gradient()` is called. XLA stays off for these layers
(`supports_jit = False`): it would compile the placed graph as one cluster.

Keras creates optimizer slots inside the traced training step, on the default
device; call `tfmulti.models.optimizers.build_on_variable_devices(model.optimizer,
model.trainable_variables)` after `compile` to keep each shard's slots with
it (`PipelineModel` does so itself).

Example:
    >>> import keras, numpy as np, tfmulti
    >>> _ = tfmulti.configure_virtual_devices(2)
    >>> from tfmulti.parallel import ColumnParallelDense, RowParallelDense
    >>> inputs = keras.Input((8,))
    >>> hidden = ColumnParallelDense(16, ["CPU:0", "CPU:1"], activation="relu")(inputs)
    >>> outputs = RowParallelDense(4, ["CPU:0", "CPU:1"])(hidden)
    >>> model = keras.Model(inputs, outputs)
    >>> model.predict(np.ones((2, 8)), verbose=0).shape
    (2, 4)
    >>> sorted({v.value.device[-5:] for v in model.layers[1].weights})
    ['CPU:0', 'CPU:1']
"""

from __future__ import annotations

import keras
import numpy as np
import tensorflow as tf
from keras.src import backend as keras_backend
from keras.src.initializers.random_initializers import compute_fans

from tfmulti.utils import checks
from tfmulti.runtime import devices as devices_lib

__all__ = ["ColumnParallelDense", "ParallelMultiHeadAttention", "RowParallelDense",
           "TensorParallelLayer", "run_on_device", "shard_devices"]

# Initializers that draw every element independently of the shape: a shard
# drawn with them is distributed as the same slice of a whole kernel.
_ELEMENTWISE_INITIALIZERS = (keras.initializers.Zeros, keras.initializers.Ones,
                             keras.initializers.Constant, keras.initializers.RandomNormal,
                             keras.initializers.RandomUniform,
                             keras.initializers.TruncatedNormal)


def run_on_device(device: str, fn, *args):
    """`fn(*args)` on `device`, with its backward pass on `device` too.

    A `tf.GradientTape` places gradient ops on whatever device is active when
    `gradient()` is called; this runs `fn` under a tape of its own and gives
    it a custom gradient that differentiates that tape under `device`. The
    gradients flow to the float tensors among `args` and to the trainable
    variables `fn` reads; tensors `fn` only closes over (masks) get none. A
    tensor passed more than once (self-attention's query, key and value) is
    one input: its gradient counts each use once.

    Args:
        device: where `fn`'s forward and backward ops run.
        fn: a function of `args` returning a tensor or a list/tuple of tensors.
        *args: tensors.

    Returns:
        What `fn` returns.

    Example:
        >>> import tensorflow as tf
        >>> from tfmulti.parallel.tensor_layers import run_on_device
        >>> x = tf.constant([1.0, 2.0])
        >>> with tf.GradientTape() as tape:
        ...     tape.watch(x)
        ...     y = run_on_device("CPU:0", lambda t: tf.reduce_sum(t * t), x)
        >>> tape.gradient(y, x).numpy().tolist()
        [2.0, 4.0]
    """
    distinct = []
    for x in args:
        if not any(x is d for d in distinct):
            distinct.append(x)
    positions = [next(j for j, d in enumerate(distinct) if d is x) for x in args]

    @tf.custom_gradient
    def placed(*inputs):
        with tf.device(device):
            tape = tf.GradientTape()
            with tape:
                for x in inputs:
                    if x.dtype.is_floating:
                        tape.watch(x)
                outputs = fn(*(inputs[j] for j in positions))

        def gradient(*upstream, variables=None):
            variables = list(variables or [])
            flat = tf.nest.flatten(outputs)
            upstream = [tf.zeros_like(o) if g is None else g for o, g in zip(flat, upstream)]
            wanted = [x for x in inputs if x.dtype.is_floating]
            differentiable = [v for v in variables if v.trainable and v.dtype.is_floating]
            with tf.device(device):
                grads = tape.gradient(flat, wanted + differentiable, output_gradients=upstream,
                                      unconnected_gradients=tf.UnconnectedGradients.ZERO)
            by_input = iter(grads[:len(wanted)])
            by_variable = dict(zip(map(id, differentiable), grads[len(wanted):]))
            input_grads = [next(by_input) if x.dtype.is_floating else None for x in inputs]
            return input_grads, [by_variable.get(id(v)) for v in variables]

        return outputs, gradient

    with tf.device(device):
        return placed(*distinct)


def _replicate(x, count: int, device: str) -> list:
    """`count` copies of `x` (one per shard); their gradients are summed on
    `device` (the backward of Megatron-LM's copy to the parallel region)."""
    if count == 1:
        return [x]
    return list(run_on_device(device, lambda t: [tf.identity(t) for _ in range(count)], x))


def shard_devices(devices) -> list[str]:
    """The T devices a tensor-parallel layer (or model) is split over, as
    full names, shard i on the i-th.

    Raises:
        ValueError: not a list of device names, or unknown or repeated devices.
    """
    if isinstance(devices, (str, bytes)) or devices is None:
        raise ValueError(f"`devices` must be a list of device names, one per shard, got "
                         f"{devices!r}; e.g. devices=['CPU:0', 'CPU:1'].")
    return devices_lib.resolve_devices(list(devices))


def _share(name: str, size: int, parts: int) -> int:
    if size % parts:
        raise ValueError(
            f"`{name}` ({size}) must be divisible by the number of devices ({parts}) to split "
            f"evenly; use a multiple of {parts} or {_divisors(size)} devices.")
    return size // parts


def _divisors(n: int) -> str:
    return "/".join(str(d) for d in range(1, n + 1) if n % d == 0 and d <= 16)


def _shard_initializer(initializer, full_shape, shard_shape, index: int):
    """An initializer that draws a shard as the same slice of a kernel of
    `full_shape` would be distributed: VarianceScaling (Glorot, He, LeCun)
    with its scale adjusted to the whole kernel's fans; element-wise ones as
    they are. A seeded initializer draws each shard with seed + index (the
    same seed would give every shard the same values).

    Raises:
        ValueError: an initializer whose values depend on the whole shape
            (Orthogonal, Identity).
    """
    initializer = keras.initializers.get(initializer)
    config = initializer.get_config()
    if isinstance(initializer, keras.initializers.VarianceScaling):
        def fan(shape):
            fan_in, fan_out = compute_fans(shape, input_axes=initializer.input_axes,
                                           output_axes=initializer.output_axes)
            return max(1.0, {"fan_in": fan_in, "fan_out": fan_out,
                             "fan_avg": (fan_in + fan_out) / 2}[initializer.mode])

        cls = keras.initializers.VarianceScaling
        config = {"scale": initializer.scale * fan(shard_shape) / fan(full_shape),
                  "mode": initializer.mode, "distribution": initializer.distribution,
                  "input_axes": initializer.input_axes, "output_axes": initializer.output_axes,
                  "seed": config.get("seed")}
    elif isinstance(initializer, _ELEMENTWISE_INITIALIZERS):
        cls = initializer.__class__
    else:
        raise ValueError(
            f"initializer {initializer.__class__.__name__} depends on the whole kernel's shape "
            f"and cannot draw a shard alone; build the unsplit layer and split it with "
            f"`from_layer(layer, devices)`, or use a variance-scaling or element-wise "
            f"initializer.")
    # An unseeded Keras initializer draws a seed when it is made and then
    # repeats its values for a shape: every shard gets an instance of its own.
    if isinstance(config.get("seed"), int):
        config["seed"] = config["seed"] + index
    return cls.from_config(config)


class TensorParallelLayer:
    """The base of the tensor-parallel layers: the devices their weights are
    split over, the home device, which shard a variable is, and pointing
    the layer at other devices. `isinstance(layer, TensorParallelLayer)`
    tells a split layer from a whole one."""

    def _place(self, devices) -> None:
        self._devices = shard_devices(devices)
        self._shard_index = []  # (variable, shard) of every split weight
        self.supports_jit = False  # XLA would collapse the placement

    @property
    def devices(self) -> list[str]:
        """The devices the weights are split over, shard i on devices[i]."""
        return list(self._devices)

    @property
    def home(self) -> str:
        """Where the unsplit work (sums, gathers, unsplit biases) runs: devices[0]."""
        return self._devices[0]

    @property
    def tensor_parallel(self) -> int:
        """T, the number of shards."""
        return len(self._devices)

    def _shard_weight(self, name, index, full_shape, shard_shape, initializer, regularizer):
        with tf.device(self._devices[index]):
            variable = self.add_weight(
                name=f"{name}_{index}", shape=shard_shape,
                initializer=_shard_initializer(initializer, full_shape, shard_shape, index),
                regularizer=regularizer)
        self._shard_index.append((variable, index))
        return variable

    def shard_of(self, variable) -> int | None:
        """The shard (device index) a variable of this layer belongs to, or
        None for an unsplit one (held on the home device)."""
        return next((i for v, i in self._shard_index if v is variable), None)

    def retarget(self, devices) -> None:
        """Points the layer at other devices (T of them, shard i on
        devices[i]) for its next calls; moving its variables there is the
        caller's (`PipelineModel` moves them with their values, see
        `tfmulti.parallel.placement.stage_placement`).

        Raises:
            ValueError: not T devices, or unknown or repeated devices.
        """
        devices = shard_devices(devices)
        if len(devices) != self.tensor_parallel:
            raise ValueError(f"layer {self.name!r} is split over {self.tensor_parallel} devices; "
                             f"got {len(devices)} ({devices}).")
        self._devices = devices


def _dense_config(layer) -> dict:
    if not isinstance(layer, keras.layers.Dense) or not layer.built:
        raise ValueError(f"from_layer takes a built keras.layers.Dense, got {layer!r}; "
                         "build it (call it once, or layer.build(input_shape)) first.")
    config = layer.get_config()
    unsupported = {k: config.get(k) for k in ("kernel_constraint", "bias_constraint",
                                              "lora_rank") if config.get(k)}
    if unsupported:
        raise ValueError(f"from_layer does not split {layer.name!r}'s {unsupported}; drop "
                         f"{'/'.join(unsupported)} from the Dense layer.")
    return {k: config[k] for k in ("units", "activation", "use_bias", "kernel_initializer",
                                   "bias_initializer", "kernel_regularizer",
                                   "bias_regularizer", "name", "dtype", "trainable")}


class _ParallelDense(TensorParallelLayer, keras.layers.Layer):
    """A Dense layer split over devices: the arguments, config and unsplit
    form the column- and row-parallel ones share."""

    _own_config: tuple = ()  # the subclass's arguments that Dense does not take

    def __init__(self, units, devices, activation, use_bias, kernel_initializer,
                 bias_initializer, kernel_regularizer, bias_regularizer, **kwargs):
        super().__init__(**kwargs)
        self.units = checks.positive_int("units", units)
        self._place(devices)
        self.activation = keras.activations.get(activation)
        self.use_bias = bool(use_bias)
        self.kernel_initializer = keras.initializers.get(kernel_initializer)
        self.bias_initializer = keras.initializers.get(bias_initializer)
        self.kernel_regularizer = keras.regularizers.get(kernel_regularizer)
        self.bias_regularizer = keras.regularizers.get(bias_regularizer)

    def get_config(self):
        return {**super().get_config(), "units": self.units, "devices": self.devices,
                "activation": keras.activations.serialize(self.activation),
                "use_bias": self.use_bias,
                "kernel_initializer": keras.initializers.serialize(self.kernel_initializer),
                "bias_initializer": keras.initializers.serialize(self.bias_initializer),
                "kernel_regularizer": keras.regularizers.serialize(self.kernel_regularizer),
                "bias_regularizer": keras.regularizers.serialize(self.bias_regularizer),
                **{name: getattr(self, name) for name in self._own_config}}

    def _unsplit(self, kernel, bias) -> keras.layers.Dense:
        config = {k: v for k, v in self.get_config().items()
                  if k not in ("devices", *self._own_config)}
        dense = keras.layers.Dense.from_config(config)
        dense.build((None, kernel.shape[0]))
        dense.kernel.assign(kernel)
        if self.use_bias:
            dense.bias.assign(bias)
        return dense


def _numpy(variables, axis=0):
    return np.concatenate([keras.ops.convert_to_numpy(v) for v in variables], axis=axis)


@keras.saving.register_keras_serializable(package="tfmulti")
class ColumnParallelDense(_ParallelDense):
    """A `Dense` layer whose kernel (and bias) is split by output columns
    over `devices`: device i computes `activation(x @ kernel_i + bias_i)`,
    units / T of the outputs.

    Args:
        units: output units (all shards together); a multiple of T.
        devices (Sequence[str]): T device names, shard i on devices[i].
        activation (str | Callable | None): applied by each shard to its outputs
            (element-wise).
        use_bias: whether each shard adds its slice of a bias.
        gather_output: concatenate the shards' outputs on the home device
            into one tensor; by default (False) the output stays split, a
            list of T tensors, one per device, for a `RowParallelDense` (or
            `input_is_parallel` layer) to take.
        kernel_initializer (str | keras.initializers.Initializer): as
            `keras.layers.Dense`'s; a shard is drawn as the same slice of a
            whole kernel would be.
        bias_initializer (str | keras.initializers.Initializer): as
            `keras.layers.Dense`'s, likewise.
        kernel_regularizer (str | keras.regularizers.Regularizer | None): as
            `keras.layers.Dense`'s (summed over the shards, the whole kernel's
            penalty for L1/L2).
        bias_regularizer (str | keras.regularizers.Regularizer | None): as
            `keras.layers.Dense`'s, likewise.
        **kwargs (Any): `keras.layers.Layer` arguments (name, dtype, trainable).

    Raises:
        ValueError: `units` not a multiple of T, unknown or repeated devices,
            or an initializer that depends on the whole shape (Orthogonal).
    """

    _own_config = ("gather_output",)

    def __init__(self, units: int, devices, activation=None, use_bias: bool = True,
                 gather_output: bool = False, kernel_initializer="glorot_uniform",
                 bias_initializer="zeros", kernel_regularizer=None, bias_regularizer=None,
                 **kwargs):
        super().__init__(units, devices, activation, use_bias, kernel_initializer,
                         bias_initializer, kernel_regularizer, bias_regularizer, **kwargs)
        self._shard_units = _share("units", units, len(self._devices))
        self.gather_output = bool(gather_output)

    def build(self, input_shape):
        in_dim = int(input_shape[-1])
        n, T = self._shard_units, self.tensor_parallel
        self.kernels = [self._shard_weight("kernel", i, (in_dim, self.units), (in_dim, n),
                                           self.kernel_initializer, self.kernel_regularizer)
                        for i in range(T)]
        self.biases = [self._shard_weight("bias", i, (self.units,), (n,), self.bias_initializer,
                                          self.bias_regularizer)
                       for i in range(T)] if self.use_bias else []

    def _shard(self, i):
        def forward(x):
            y = keras.ops.matmul(x, self.kernels[i])
            if self.use_bias:
                y = keras.ops.add(y, self.biases[i])
            return self.activation(y) if self.activation is not None else y
        return forward

    def call(self, inputs):
        copies = _replicate(inputs, self.tensor_parallel, self.home)
        outputs = [run_on_device(d, self._shard(i), copies[i]) for i, d in enumerate(self._devices)]
        if self.gather_output:
            return run_on_device(self.home, lambda *parts: keras.ops.concatenate(parts, -1),
                                 *outputs)
        return outputs

    def compute_output_shape(self, input_shape):
        if self.gather_output:
            return (*input_shape[:-1], self.units)
        return [(*input_shape[:-1], self._shard_units) for _ in self._devices]

    @classmethod
    def from_layer(cls, layer: keras.layers.Dense, devices, *,
                   gather_output: bool = False) -> "ColumnParallelDense":
        """The column-parallel form of a built `Dense`, with its weights.

        Args:
            layer: a built `keras.layers.Dense` (left as it is).
            devices (Sequence[str]): T device names.
            gather_output: as in the constructor.

        Raises:
            ValueError: not a built Dense, or units not a multiple of T.
        """
        split = cls(devices=devices, gather_output=gather_output, **_dense_config(layer))
        split.build((None, int(layer.kernel.shape[0])))
        n = split._shard_units
        kernel = keras.ops.convert_to_numpy(layer.kernel)
        bias = keras.ops.convert_to_numpy(layer.bias) if split.use_bias else None
        for i in range(split.tensor_parallel):
            split.kernels[i].assign(kernel[:, i * n:(i + 1) * n])
            if split.use_bias:
                split.biases[i].assign(bias[i * n:(i + 1) * n])
        return split

    def to_layer(self) -> keras.layers.Dense:
        """The unsplit `Dense` with the current weights (built on the current device)."""
        return self._unsplit(_numpy(self.kernels, axis=1),
                             _numpy(self.biases) if self.use_bias else None)


@keras.saving.register_keras_serializable(package="tfmulti")
class RowParallelDense(_ParallelDense):
    """A `Dense` layer whose kernel is split by input rows over `devices`:
    device i computes `x_i @ kernel_i` for its slice x_i of the input; the
    partial results are summed once, on the home device, which then adds the
    (unsplit) bias and applies the activation.

    Args:
        units: output units.
        devices (Sequence[str]): T device names, shard i on devices[i].
        use_bias: add a bias after the sum (held on the home device).
        input_is_parallel: the input is already split, a list of T tensors
            (a `ColumnParallelDense`'s output; slice i used on device i);
            False: one tensor, split into T slices of its last axis (a
            multiple of T).
        activation (str | Callable | None): applied after the sum, on the home
            device.
        kernel_initializer (str | keras.initializers.Initializer): as
            `keras.layers.Dense`'s.
        bias_initializer (str | keras.initializers.Initializer): as
            `keras.layers.Dense`'s.
        kernel_regularizer (str | keras.regularizers.Regularizer | None): as
            `keras.layers.Dense`'s.
        bias_regularizer (str | keras.regularizers.Regularizer | None): as
            `keras.layers.Dense`'s.
        **kwargs (Any): `keras.layers.Layer` arguments (name, dtype, trainable).

    Raises:
        ValueError: unknown or repeated devices, an input that does not
            split into T slices, or an initializer that depends on the whole
            shape.
    """

    _own_config = ("input_is_parallel",)

    def __init__(self, units: int, devices, use_bias: bool = True,
                 input_is_parallel: bool = True, activation=None,
                 kernel_initializer="glorot_uniform", bias_initializer="zeros",
                 kernel_regularizer=None, bias_regularizer=None, **kwargs):
        super().__init__(units, devices, activation, use_bias, kernel_initializer,
                         bias_initializer, kernel_regularizer, bias_regularizer, **kwargs)
        self.input_is_parallel = bool(input_is_parallel)

    def _input_dims(self, input_shape) -> list[int]:
        T = self.tensor_parallel
        if not self.input_is_parallel:
            return [_share("the input's last dimension", int(input_shape[-1]), T)] * T
        shapes = list(input_shape) if isinstance(input_shape, (list, tuple)) and \
            input_shape and isinstance(input_shape[0], (list, tuple)) else None
        if shapes is None or len(shapes) != T:
            raise ValueError(
                f"RowParallelDense with input_is_parallel=True takes a list of {T} tensors (the "
                f"split output of a ColumnParallelDense over the same devices), got input "
                f"shape {input_shape}; pass input_is_parallel=False for one whole tensor.")
        return [int(s[-1]) for s in shapes]

    def build(self, input_shape):
        dims = self._input_dims(input_shape)
        full = (sum(dims), self.units)
        self.kernels = [self._shard_weight("kernel", i, full, (d, self.units),
                                           self.kernel_initializer, self.kernel_regularizer)
                        for i, d in enumerate(dims)]
        self.bias = None
        if self.use_bias:
            with tf.device(self.home):
                self.bias = self.add_weight(name="bias", shape=(self.units,),
                                            initializer=self.bias_initializer,
                                            regularizer=self.bias_regularizer)

    def _finish(self, *partials):
        y = tf.add_n(partials)
        if self.use_bias:
            y = keras.ops.add(y, self.bias)
        return self.activation(y) if self.activation is not None else y

    def call(self, inputs):
        T = self.tensor_parallel
        if self.input_is_parallel:
            parts = list(inputs)
        else:
            n = inputs.shape[-1] // T
            parts = list(run_on_device(
                self.home, lambda x: [x[..., i * n:(i + 1) * n] for i in range(T)], inputs)) \
                if T > 1 else [inputs]
        partials = [run_on_device(d, lambda x, k=self.kernels[i]: keras.ops.matmul(x, k),
                                  parts[i]) for i, d in enumerate(self._devices)]
        return run_on_device(self.home, self._finish, *partials)

    def compute_output_shape(self, input_shape):
        first = input_shape[0] if self.input_is_parallel else input_shape
        return (*first[:-1], self.units)

    @classmethod
    def from_layer(cls, layer: keras.layers.Dense, devices, *,
                   input_is_parallel: bool = True) -> "RowParallelDense":
        """The row-parallel form of a built `Dense`, with its weights.

        Args:
            layer: a built `keras.layers.Dense` (left as it is).
            devices (Sequence[str]): T device names; the input rows (a multiple of T) split
                evenly.
            input_is_parallel: as in the constructor.

        Raises:
            ValueError: not a built Dense, or input rows not a multiple of T.
        """
        split = cls(devices=devices, input_is_parallel=input_is_parallel, **_dense_config(layer))
        rows = int(layer.kernel.shape[0])
        n = _share("the Dense layer's input dimension", rows, split.tensor_parallel)
        split.build([(None, n)] * split.tensor_parallel if input_is_parallel else (None, rows))
        kernel = keras.ops.convert_to_numpy(layer.kernel)
        for i in range(split.tensor_parallel):
            split.kernels[i].assign(kernel[i * n:(i + 1) * n])
        if split.use_bias:
            split.bias.assign(keras.ops.convert_to_numpy(layer.bias))
        return split

    def to_layer(self) -> keras.layers.Dense:
        """The unsplit `Dense` with the current weights (built on the current device)."""
        return self._unsplit(_numpy(self.kernels),
                             keras.ops.convert_to_numpy(self.bias) if self.use_bias else None)


# The projections of `keras.layers.MultiHeadAttention` on (batch, length,
# features) inputs, as its EinsumDense sublayers compute them.
_PROJECT = "abc,cde->abde"   # (B, T, dim) x (dim, heads, head_dim) -> (B, T, heads, head_dim)
_COMBINE = "abcd,cde->abe"   # (B, T, heads, value_dim) x (heads, value_dim, out) -> (B, T, out)
_PROJECTIONS = ("query", "key", "value")


@keras.saving.register_keras_serializable(package="tfmulti")
class ParallelMultiHeadAttention(TensorParallelLayer, keras.layers.MultiHeadAttention):
    """`keras.layers.MultiHeadAttention` with its heads split over `devices`.

    Device i holds num_heads / T heads: their query, key and value
    projections (column-parallel) and their rows of the output projection
    (row-parallel), and computes their attention; the partial outputs are
    summed once on the home device, which adds the output bias. The call is
    Keras': `layer(query, value, key=None, attention_mask=None,
    return_attention_scores=False, training=None, use_causal_mask=False)`,
    Keras masks included.

    Args:
        num_heads: attention heads (all devices together); a multiple of T.
        key_dim: size of each head for query and key.
        devices (Sequence[str]): T device names, heads [i * num_heads / T, ...)
            on devices[i].
        **kwargs (Any): the other `keras.layers.MultiHeadAttention` arguments
            (value_dim, dropout, use_bias, output_shape, kernel and bias
            initializers and regularizers, seed, name, dtype); inputs are
            (batch, length, features).

    Raises:
        ValueError: `num_heads` not a multiple of T, unknown or repeated
            devices, `attention_axes`, `use_gate` or a multi-dimensional
            `output_shape` (not split here), inputs that are not
            (batch, length, features), or an initializer that depends on the
            whole shape.
    """

    def __init__(self, num_heads: int, key_dim: int, devices, **kwargs):
        # Attention over the sequence axis (what Keras resolves None to for
        # 3-D inputs) is the one split here.
        if kwargs.get("attention_axes") in (1, (1,), [1]):
            kwargs["attention_axes"] = None
        unsupported = {k: kwargs[k] for k in ("attention_axes", "use_gate", "kernel_constraint",
                                              "bias_constraint")
                       if kwargs.get(k) not in (None, False)}
        output_shape = kwargs.get("output_shape")
        if output_shape is not None and not isinstance(output_shape, int) and \
                len(tuple(output_shape)) != 1:
            unsupported["output_shape"] = output_shape
        if unsupported:
            raise ValueError(f"ParallelMultiHeadAttention does not split {unsupported}; drop "
                             f"{'/'.join(unsupported)} (attention over the sequence axis, a "
                             f"1-D output projection, no gate or constraints).")
        super().__init__(num_heads, key_dim, **kwargs)
        self._place(devices)
        self._shard_heads = _share("num_heads", num_heads, len(self._devices))

    def build(self, query_shape, value_shape, key_shape=None):
        key_shape = value_shape if key_shape is None else key_shape
        for name, shape in (("query", query_shape), ("value", value_shape), ("key", key_shape)):
            if len(shape) != 3:
                raise ValueError(f"ParallelMultiHeadAttention takes (batch, length, features) "
                                 f"inputs, got {name} shape {tuple(shape)}.")
        self._shapes = (tuple(query_shape), tuple(value_shape), tuple(key_shape))
        N, h = self._num_heads, self._shard_heads
        out = self._output_shape[0] if self._output_shape else int(query_shape[-1])
        head_dims = {"query": self._key_dim, "key": self._key_dim, "value": self._value_dim}
        in_dims = {"query": int(query_shape[-1]), "key": int(key_shape[-1]),
                   "value": int(value_shape[-1])}
        self.shards = []
        for i in range(self.tensor_parallel):
            shard = {}
            for p in _PROJECTIONS:
                shard[p] = self._shard_weight(
                    f"{p}_kernel", i, (in_dims[p], N, head_dims[p]),
                    (in_dims[p], h, head_dims[p]), self._kernel_initializer,
                    self._kernel_regularizer)
                if self._use_bias:
                    shard[p + "_bias"] = self._shard_weight(
                        f"{p}_bias", i, (N, head_dims[p]), (h, head_dims[p]),
                        self._bias_initializer, self._bias_regularizer)
            shard["output"] = self._shard_weight(
                "output_kernel", i, (N, self._value_dim, out), (h, self._value_dim, out),
                self._kernel_initializer, self._kernel_regularizer)
            self.shards.append(shard)
        self.output_bias = None
        if self._use_bias:
            with tf.device(self.home):
                self.output_bias = self.add_weight(
                    name="output_bias", shape=(out,), initializer=self._bias_initializer,
                    regularizer=self._bias_regularizer)
        self._build_attention(4)

    def _heads(self, i, attention_mask, training, return_scores, causal_only):
        weights = self.shards[i]

        def forward(query, value, key):
            projected = {}
            for p, x in (("query", query), ("key", key), ("value", value)):
                y = keras.ops.einsum(_PROJECT, x, weights[p])
                projected[p] = keras.ops.add(y, weights[p + "_bias"]) if self._use_bias else y
            extra = {"use_causal_mask": True} if causal_only else {}
            context, scores = self._compute_attention(
                projected["query"], projected["key"], projected["value"], attention_mask,
                training, return_scores, **extra)
            partial = keras.ops.einsum(_COMBINE, context, weights["output"])
            return (partial, scores) if return_scores else partial
        return forward

    def call(self, query, value, key=None, query_mask=None, value_mask=None, key_mask=None,
             attention_mask=None, return_attention_scores=False, training=None,
             use_causal_mask=False):
        key = value if key is None else key
        query_mask = keras_backend.get_keras_mask(query)
        for x in (query, value, key):
            keras_backend.set_keras_mask(x, None)
        causal_only = (use_causal_mask and query_mask is None and value_mask is None
                       and key_mask is None and attention_mask is None
                       and self._sliding_window is None)
        if not causal_only:
            with tf.device(self.home):
                attention_mask = self._compute_attention_mask(
                    query, value, query_mask=query_mask, value_mask=value_mask,
                    key_mask=key_mask, attention_mask=attention_mask,
                    use_causal_mask=use_causal_mask)
        T = self.tensor_parallel
        # One copy per device of each distinct input (self-attention: one).
        copies = {}
        for x in (query, value, key):
            if id(x) not in copies:
                copies[id(x)] = _replicate(x, T, self.home)
        results = [run_on_device(d, self._heads(i, attention_mask, training,
                                                return_attention_scores, causal_only),
                                 *(copies[id(x)][i] for x in (query, value, key)))
                   for i, d in enumerate(self._devices)]
        partials = [r[0] for r in results] if return_attention_scores else results

        def finish(*parts):
            y = tf.add_n(parts)
            return keras.ops.add(y, self.output_bias) if self._use_bias else y

        output = run_on_device(self.home, finish, *partials)
        if query_mask is not None:
            keras_backend.set_keras_mask(output, query_mask)
        if return_attention_scores:
            with tf.device(self.home):
                scores = keras.ops.concatenate([r[1] for r in results], axis=1)
            return output, scores
        return output

    def get_config(self):
        return {**super().get_config(), "devices": self.devices}

    @classmethod
    def from_layer(cls, layer: keras.layers.MultiHeadAttention,
                   devices) -> "ParallelMultiHeadAttention":
        """The head-parallel form of a built `MultiHeadAttention`, with its weights.

        Args:
            layer: a built `keras.layers.MultiHeadAttention` on
                (batch, length, features) inputs (left as it is).
            devices (Sequence[str]): T device names; `num_heads` a multiple of T.

        Raises:
            ValueError: not a built MultiHeadAttention, heads not a multiple
                of T, or options not split here (see the class).
        """
        if not isinstance(layer, keras.layers.MultiHeadAttention) or not layer.built:
            raise ValueError(f"from_layer takes a built keras.layers.MultiHeadAttention, got "
                             f"{layer!r}; call it once on (batch, length, features) inputs "
                             "first.")
        config = layer.get_config()
        if len(layer.query_dense.kernel.shape) != 3:
            raise ValueError(f"from_layer splits attention over (batch, length, features) "
                             f"inputs; {layer.name!r} was built on other shapes.")
        split = cls(devices=devices, **config)
        shapes = [(None, None, int(getattr(layer, f"{p}_dense").kernel.shape[0]))
                  for p in ("query", "value", "key")]
        split.build(*shapes)
        h = split._shard_heads
        for p in _PROJECTIONS:
            dense = getattr(layer, f"{p}_dense")
            kernel = keras.ops.convert_to_numpy(dense.kernel)
            bias = keras.ops.convert_to_numpy(dense.bias) if split._use_bias else None
            for i, shard in enumerate(split.shards):
                shard[p].assign(kernel[:, i * h:(i + 1) * h])
                if split._use_bias:
                    shard[p + "_bias"].assign(bias[i * h:(i + 1) * h])
        kernel = keras.ops.convert_to_numpy(layer.output_dense.kernel)
        for i, shard in enumerate(split.shards):
            shard["output"].assign(kernel[i * h:(i + 1) * h])
        if split._use_bias:
            split.output_bias.assign(keras.ops.convert_to_numpy(layer.output_dense.bias))
        return split

    def to_layer(self) -> keras.layers.MultiHeadAttention:
        """The unsplit `MultiHeadAttention` with the current weights (built on
        the current device)."""
        config = {k: v for k, v in self.get_config().items() if k != "devices"}
        layer = keras.layers.MultiHeadAttention.from_config(config)
        layer.build(*self._shapes)

        def joined(name, axis):
            return _numpy([shard[name] for shard in self.shards], axis)

        for p in _PROJECTIONS:
            dense = getattr(layer, f"{p}_dense")
            dense.kernel.assign(joined(p, 1))
            if self._use_bias:
                dense.bias.assign(joined(p + "_bias", 0))
        layer.output_dense.kernel.assign(joined("output", 0))
        if self._use_bias:
            layer.output_dense.bias.assign(keras.ops.convert_to_numpy(self.output_bias))
        return layer
