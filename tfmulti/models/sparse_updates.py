"""Lazy (sparse) optimizer updates: an embedding table's rows updated only
where the step touched them, in the table and in the optimizer's slots.

An `Embedding`'s gradient is rows (`tf.IndexedSlices`: the ids of the batch
and one gradient row each). Keras 3's Adam turns it dense (`gradient - m`),
so every step updates all rows of the table and of both moments: on a table of
1M rows of which a batch touches 2,000, nearly all of the step. `lazy` makes
an optimizer update, for such a gradient, only the rows it names (their
occurrences summed first, as `keras_fixes.combined_rows` does), and for any
other gradient keep its own update (Keras', or tfmulti's fused Adam).

What differs from the dense update, by optimizer (`LAZY_RULES`), is what
happens to the rows a step did not touch: the dense rules move them (their
moments decay and keep pushing the row), the lazy ones leave them, with their
slots, as they were (TF 1's LazyAdam, TorchRec's fused sparse optimizers):

* SGD without momentum, Adagrad: the same numbers (an untouched row's
  gradient is zero: no change either way).
* SGD with momentum (and Nesterov): a touched row's velocity
  `v = momentum * v - lr * g`, the row moved by it; an untouched row keeps
  its velocity and does not move.
* Adam (and AMSGrad), AdamW: a touched row's moments and step as Adam's, with
  the bias correction of the optimizer's global step; weight decay (AdamW's,
  or any optimizer's `weight_decay`) on the touched rows only.
* RMSprop (with momentum, centered): a touched row's velocity, average and
  momentum as RMSprop's; an untouched row keeps them.

Where every row is touched every step the lazy update equals the dense one.
The optimizer stays the Keras class it is (an instance attribute, as `fuse`):
a saved model loads with plain Keras and its optimizer updates densely there.

Example:
    >>> import keras, numpy as np
    >>> from tfmulti.models import sparse_updates
    >>> opt = sparse_updates.lazy(keras.optimizers.Adam(0.1))
    >>> table = keras.Variable(np.ones((4, 2), np.float32))
    >>> import tensorflow as tf
    >>> opt.apply([tf.IndexedSlices(tf.ones((1, 2)), tf.constant([2]), tf.constant([4, 2]))],
    ...           [table])
    >>> [round(float(r[0]), 3) for r in table.numpy()]  # only row 2 moved
    [1.0, 1.0, 0.9, 1.0]
"""

from __future__ import annotations

import types

import keras
import tensorflow as tf

from tfmulti.runtime.keras_fixes import combined_rows

__all__ = ["LAZY_RULES", "dense_tables", "is_lazy", "lazy", "lazy_rule_for", "row_tables",
           "sparse_variables"]

_LAZY = "_tfmulti_lazy_update"
_SPARSE = "_tfmulti_sparse_variables"


def _rows(variable, indices):
    return tf.gather(_tf(variable), indices)


def _tf(variable):
    """The TensorFlow variable to read rows of and scatter into: under a
    strategy, the copy of the device being updated (a distributed variable
    read whole would copy the table on every step)."""
    variable = variable.value if isinstance(variable, keras.Variable) else variable
    local = getattr(variable, "_get_on_device_or_primary", None)
    return local() if local is not None else variable


def _put(variable, indices, values) -> None:
    _tf(variable).scatter_update(tf.IndexedSlices(values, indices))


def _decay_rows(opt, variable, indices, rows, lr):
    """`rows` of `variable` after the optimizer's weight decay (touched rows only)."""
    if opt.weight_decay is None or not opt._use_weight_decay_dense(variable):  # noqa: SLF001
        return rows
    return rows - rows * tf.cast(opt.weight_decay, rows.dtype) * lr


def _adam(opt, g, indices, variable, lr):
    dtype = variable.dtype
    t = tf.cast(opt.iterations + 1, dtype)
    alpha = lr * tf.sqrt(1 - tf.pow(tf.cast(opt.beta_2, dtype), t)) / (
        1 - tf.pow(tf.cast(opt.beta_1, dtype), t))
    index = opt._get_variable_index(variable)  # pylint: disable=protected-access
    m_slot, v_slot = opt._momentums[index], opt._velocities[index]  # pylint: disable=protected-access
    m = _rows(m_slot, indices)
    v = _rows(v_slot, indices)
    m = m + (g - m) * (1 - opt.beta_1)
    v = v + (tf.square(g) - v) * (1 - opt.beta_2)
    _put(m_slot, indices, m)
    _put(v_slot, indices, v)
    if opt.amsgrad:
        hat_slot = opt._velocity_hats[index]  # pylint: disable=protected-access
        v = tf.maximum(_rows(hat_slot, indices), v)
        _put(hat_slot, indices, v)
    rows = _decay_rows(opt, variable, indices, _rows(variable, indices), lr)
    _put(variable, indices, rows - m * alpha / (tf.sqrt(v) + opt.epsilon))


def _sgd(opt, g, indices, variable, lr):
    rows = _decay_rows(opt, variable, indices, _rows(variable, indices), lr)
    if opt.momentum == 0:
        _put(variable, indices, rows - g * lr)
        return
    momentum = tf.cast(opt.momentum, variable.dtype)
    slot = opt.momentums[opt._get_variable_index(variable)]  # pylint: disable=protected-access
    m = _rows(slot, indices) * momentum - g * lr
    _put(slot, indices, m)
    _put(variable, indices, rows + (m * momentum - g * lr if opt.nesterov else m))


def _adagrad(opt, g, indices, variable, lr):
    slot = opt._accumulators[opt._get_variable_index(variable)]  # pylint: disable=protected-access
    accumulator = _rows(slot, indices) + tf.square(g)
    _put(slot, indices, accumulator)
    rows = _decay_rows(opt, variable, indices, _rows(variable, indices), lr)
    _put(variable, indices, rows - lr * g / tf.sqrt(accumulator + opt.epsilon))


def _rmsprop(opt, g, indices, variable, lr):
    index = opt._get_variable_index(variable)  # pylint: disable=protected-access
    rho = opt.rho
    v_slot = opt._velocities[index]  # pylint: disable=protected-access
    velocity = rho * _rows(v_slot, indices) + (1 - rho) * tf.square(g)
    _put(v_slot, indices, velocity)
    if opt.centered:
        a_slot = opt._average_gradients[index]  # pylint: disable=protected-access
        average = rho * _rows(a_slot, indices) + (1 - rho) * g
        _put(a_slot, indices, average)
        denominator = velocity - tf.square(average) + opt.epsilon
    else:
        denominator = velocity + opt.epsilon
    increment = lr * g / tf.sqrt(denominator)
    rows = _decay_rows(opt, variable, indices, _rows(variable, indices), lr)
    if opt.momentum > 0:
        m_slot = opt._momentums[index]  # pylint: disable=protected-access
        momentum = opt.momentum * _rows(m_slot, indices) + increment
        _put(m_slot, indices, momentum)
        increment = momentum
    _put(variable, indices, rows - increment)


LAZY_RULES = {keras.optimizers.Adam: _adam, keras.optimizers.SGD: _sgd,
              keras.optimizers.Adagrad: _adagrad, keras.optimizers.RMSprop: _rmsprop}
"""The optimizers `lazy` takes (and their subclasses that keep the class's
update: AdamW is an Adam), with their lazy rule."""


def lazy_rule_for(optimizer):
    """The lazy rule `lazy` would give `optimizer` (a function), or None when it
    takes none (another optimizer, or one whose update is its own)."""
    for cls, rule in LAZY_RULES.items():
        if isinstance(optimizer, cls) and type(optimizer).update_step is cls.update_step:
            return rule
    return None


def _why_dense(layer) -> list[str]:
    """What makes an `Embedding`'s table update densely under a lazy optimizer."""
    return [what for what, value in (("embeddings_regularizer", layer.embeddings_regularizer),
                                     ("embeddings_constraint", layer.embeddings_constraint))
            if value is not None]


def _tables(model) -> list:
    return [layer for layer in model._flatten_layers(include_self=False)  # pylint: disable=protected-access
            if isinstance(layer, keras.layers.Embedding)]


def row_tables(model) -> list:
    """The `Embedding` layers of `model` whose table a lazy update keeps to the
    rows a step touched (all but `dense_tables`')."""
    return [layer for layer in _tables(model) if not _why_dense(layer)]


def dense_tables(model) -> list[str]:
    """The `Embedding` layers of `model` whose table a lazy update cannot keep
    sparse, each named with why ("users (embeddings_regularizer)"): an
    `embeddings_regularizer` (its gradient, summed with the lookup's, is
    dense: the optimizer then updates every row, as without `lazy`), an
    `embeddings_constraint` (Keras applies it to the whole table after each
    update)."""
    attributes = _attribute_names(model)
    return [f"{attributes.get(id(layer), layer.name)} ({' and '.join(_why_dense(layer))})"
            for layer in _tables(model) if _why_dense(layer)]


def _attribute_names(model) -> dict[int, str]:
    """The layers a subclassed model holds as attributes, by id: the name its
    author knows them by ("user_embedding", "tower.items"), where Keras names
    the layer itself "embedding_3"."""
    names, todo = {}, [(model, "")]
    while todo:
        owner, prefix = todo.pop()
        for attribute, value in sorted(vars(owner).items()):
            if (isinstance(value, keras.layers.Layer) and not attribute.startswith("_")
                    and id(value) not in names):
                names[id(value)] = prefix + attribute
                todo.append((value, f"{prefix}{attribute}."))
    return names


def is_lazy(optimizer) -> bool:
    """Whether `lazy` made `optimizer`'s sparse updates lazy."""
    return bool(getattr(optimizer, _LAZY, False))


def sparse_variables(optimizer) -> set:
    """The keys (`optimizer._var_key`) of the variables whose gradients came
    as rows in the optimizer's last `apply`."""
    return getattr(optimizer, _SPARSE, set())


def lazy(optimizer):
    """Makes `optimizer` update only the rows of a sparse gradient
    (`tf.IndexedSlices`), in the variable and its slots; returns it. Dense
    gradients keep the optimizer's own update (see the module doc).

    Raises:
        TypeError: `optimizer` is none of `LAZY_RULES`' classes, or replaces
            its class's update with one of its own.
    """
    rule = lazy_rule_for(optimizer)
    if rule is None:
        names = ", ".join(cls.__name__ for cls in LAZY_RULES)
        raise TypeError(
            f"sparse_updates='lazy' takes {names} (and AdamW), with their Keras update; "
            f"got {type(optimizer).__name__}; use sparse_updates='dense' for it.")
    if is_lazy(optimizer):
        return optimizer
    dense_update = optimizer.update_step  # Keras', or the fused Adam's
    use_decay = optimizer._use_weight_decay  # pylint: disable=protected-access
    apply = optimizer.apply

    def update_step(self, gradient, variable, learning_rate):
        if not isinstance(gradient, tf.IndexedSlices):
            return dense_update(gradient, variable, learning_rate)
        gradient = combined_rows(gradient)
        lr = tf.cast(learning_rate, variable.dtype)
        return rule(self, tf.cast(gradient.values, variable.dtype), gradient.indices,
                    variable, lr)

    def _use_weight_decay(self, variable):
        # A table's decay is its touched rows' (in the lazy rule), not a dense pass.
        if self._var_key(variable) in sparse_variables(self):  # pylint: disable=protected-access
            return False
        return use_decay(variable)

    def apply_(self, grads, trainable_variables=None):
        if trainable_variables is not None:
            setattr(self, _SPARSE, {
                self._var_key(v) for g, v in zip(grads, trainable_variables)  # pylint: disable=protected-access
                if isinstance(g, tf.IndexedSlices)})
        return apply(grads, trainable_variables)

    optimizer.update_step = types.MethodType(update_step, optimizer)
    optimizer._use_weight_decay = types.MethodType(_use_weight_decay, optimizer)  # pylint: disable=protected-access
    optimizer._use_weight_decay_dense = use_decay  # pylint: disable=protected-access
    optimizer.apply = types.MethodType(apply_, optimizer)
    setattr(optimizer, _LAZY, True)
    return optimizer
