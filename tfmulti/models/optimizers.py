"""Keras 3's Adam with TensorFlow's fused update kernel.

Keras 3's `Adam.update_step` is written in backend-neutral ops: per variable
and step it makes about ten element-wise passes over the weights (two for the
first moment, three for the second, five for the update), each materializing
a temporary. On a CPU that is memory-bound work; on a GPU, ten small kernel
launches per variable. Under `MirroredStrategy` every replica updates its own
copy, so the cost grows with the replicas; at small batches it is a large
part of the step (BENCHMARKS.md, `baseline`).

`tf.keras` (Keras 2) ran the same rule as one fused kernel,
`ResourceApplyAdam` (one pass, no temporaries, on CPUs and GPUs and under
XLA). `fuse` gives a Keras 3 `Adam` that kernel: it stays a
`keras.optimizers.Adam` with the same variables and formula, so checkpoints
and saved models are exactly Keras' (a model saved with it loads with plain
Keras, without tfmulti, and gets Keras' own update).
"""

from __future__ import annotations

import types

import keras
import tensorflow as tf

__all__ = ["build_on_variable_devices", "fuse", "fused_adam", "fused_values", "is_fused"]

_FUSED = "_tfmulti_fused_update"


def fuse(optimizer: keras.optimizers.Adam) -> keras.optimizers.Adam:
    """Makes `optimizer` (a `keras.optimizers.Adam`, or `AdamW`) update each
    variable with TensorFlow's fused Adam kernel; returns it.

    Same results as Keras' update up to float32 rounding: the formula of
    Kingma and Ba with Keras' epsilon placement, `var -= lr_t * m / (sqrt(v)
    + epsilon)`, `lr_t = lr * sqrt(1 - beta_2^t) / (1 - beta_1^t)`. Keras'
    own update still runs where the kernel does not apply: `amsgrad=True`,
    sparse gradients (`tf.IndexedSlices`), a backend other than TensorFlow.

    Raises:
        TypeError: `optimizer` is not an Adam whose update is Keras' own.
    """
    if not isinstance(optimizer, keras.optimizers.Adam) or (
            type(optimizer).update_step is not keras.optimizers.Adam.update_step):
        raise TypeError(
            f"fuse() takes a keras.optimizers.Adam (or AdamW) that keeps Keras' update, got "
            f"{type(optimizer).__name__}; pass optimizer=\"adam\" to compile_model, or "
            f"keras.optimizers.Adam(...).")
    if not is_fused(optimizer):
        # An instance attribute, not a subclass: the optimizer serializes as
        # the Keras class it is, so saved models load without tfmulti.
        optimizer.update_step = types.MethodType(_fused_update_step, optimizer)
        setattr(optimizer, _FUSED, True)
    return optimizer


def build_on_variable_devices(optimizer, variables) -> None:
    """Builds `optimizer` for `variables` now, each slot on its variable's device.

    Keras builds an optimizer lazily, inside the traced training step, where
    the variables' placement is lost: every slot lands on the default
    device. For weights placed by hand (pipeline stages, tensor-parallel
    shards) that would put all the optimizer state on one device; building
    here, eagerly and under each variable's device, keeps a shard's slots
    with its weights. Does nothing when the optimizer is already built.

    Args:
        optimizer: a Keras optimizer (a `LossScaleOptimizer`'s inner one is
            built).
        variables: the trainable variables it will update.

    Example:
        >>> import keras, tensorflow as tf, tfmulti
        >>> _ = tfmulti.configure_virtual_devices(2)
        >>> with tf.device("CPU:1"):
        ...     weight = keras.Variable(tf.zeros((3,)))
        >>> adam = keras.optimizers.Adam()
        >>> build_on_variable_devices(adam, [weight])
        >>> sorted({v.value.device[-5:] for v in adam.variables if len(v.shape)})
        ['CPU:1']
    """
    inner = getattr(optimizer, "inner_optimizer", optimizer)
    if inner is None or inner.built:
        return
    create = inner.add_variable_from_reference

    def add_variable_from_reference(reference_variable, *args, **kwargs):
        with tf.device(reference_variable.value.device):
            return create(reference_variable, *args, **kwargs)

    inner.add_variable_from_reference = add_variable_from_reference
    try:
        optimizer.build(list(variables))
    finally:
        del inner.add_variable_from_reference  # back to the class method


def is_fused(optimizer) -> bool:
    """Whether `fuse` was applied to `optimizer`."""
    return getattr(optimizer, _FUSED, False)


def fused_adam(learning_rate=1e-3, **kwargs) -> keras.optimizers.Adam:
    """`keras.optimizers.Adam(learning_rate, **kwargs)`, fused (see `fuse`)."""
    return fuse(keras.optimizers.Adam(learning_rate, **kwargs))


def fused_values(optimizer, gradient, m, v, value, learning_rate):
    """One step of a fused `optimizer` on values instead of variables: the new
    (m, v, value), by the fused kernel's arithmetic in TensorFlow's element-wise
    ops, in its order (bit for bit the kernel's on a CPU, measured). For an
    update that has no variable to apply the kernel to: a shard of one
    (`tfmulti.parallel.zero`)."""
    dtype = value.dtype
    step = tf.cast(optimizer.iterations + 1, dtype)
    beta_1, beta_2 = tf.cast(optimizer.beta_1, dtype), tf.cast(optimizer.beta_2, dtype)
    alpha = (tf.cast(learning_rate, dtype) * tf.sqrt(1 - tf.pow(beta_2, step))
             / (1 - tf.pow(beta_1, step)))
    gradient = tf.cast(gradient, dtype)
    m = m + (gradient - m) * (1 - beta_1)
    v = v + (tf.square(gradient) - v) * (1 - beta_2)
    return m, v, value - (m * alpha) / (tf.sqrt(v) + tf.cast(optimizer.epsilon, dtype))


def _fused_update_step(self, gradient, variable, learning_rate):
    if (self.amsgrad or isinstance(gradient, tf.IndexedSlices)
            or keras.backend.backend() != "tensorflow"):
        return keras.optimizers.Adam.update_step(self, gradient, variable, learning_rate)
    var = variable.value if isinstance(variable, keras.Variable) else variable
    index = self._get_variable_index(variable)
    m, v = self._momentums[index].value, self._velocities[index].value
    dtype = var.dtype
    step = tf.cast(self.iterations + 1, dtype)
    beta_1 = tf.cast(self.beta_1, dtype)
    beta_2 = tf.cast(self.beta_2, dtype)
    # Under tf.distribute this runs inside `extended.update`, once per device:
    # `var` is that device's component, and the slots' `.handle` resolves to
    # theirs.
    tf.raw_ops.ResourceApplyAdam(
        var=var.handle, m=m.handle, v=v.handle,
        beta1_power=tf.pow(beta_1, step), beta2_power=tf.pow(beta_2, step),
        lr=tf.cast(learning_rate, dtype), beta1=beta_1, beta2=beta_2,
        epsilon=tf.cast(self.epsilon, dtype), grad=tf.cast(gradient, dtype),
        use_locking=False)
