"""Variables made on the device that holds them (tfmulti.parallel.placement):
deferred creation, placing, moving with the value, builds that assign, and
Keras' symbolic build."""

from __future__ import annotations

import keras
import numpy as np
import tensorflow as tf
from keras.src.backend.common import global_state

from tfmulti.parallel import placement


def _device(variable) -> str:
    return variable.value.device[-5:]


def test_deferred_variables_get_their_value_on_the_device_they_are_placed_on():
    dense = keras.layers.Dense(3, kernel_initializer="ones")
    with placement.deferred_variables() as deferred:
        dense.build((None, 4))
    assert dense.built and dense.count_params() == 15
    assert all(deferred.pending(v) for v in dense.weights)
    # Keras' own list no longer holds them: an enclosing stateless scope will
    # not give them values on the default device.
    assert not any(v is dense.kernel
                   for v in global_state.get_global_attribute("uninitialized_variables", []))
    placement.place(dense.weights, "/CPU:2", deferred)
    assert [_device(v) for v in dense.weights] == ["CPU:2", "CPU:2"]
    np.testing.assert_array_equal(dense.kernel.numpy(), np.ones((4, 3)))
    assert deferred.remaining() == []


def test_a_variable_moves_with_its_value_and_stays_the_same_object():
    dense = keras.layers.Dense(3)
    dense.build((None, 4))
    kernel, value = dense.kernel, dense.kernel.numpy()
    placement.place(dense.weights, "/CPU:1")
    assert dense.kernel is kernel and _device(kernel) == "CPU:1"
    np.testing.assert_array_equal(kernel.numpy(), value)
    placement.place(dense.weights, "/CPU:1", values=[np.zeros((4, 3)), None])
    np.testing.assert_array_equal(kernel.numpy(), np.zeros((4, 3)))
    np.testing.assert_allclose(dense(np.ones((1, 4), "float32")), dense.bias.numpy()[None])


class _AssignsInBuild(keras.layers.Layer):
    def build(self, input_shape):
        self.w = self.add_weight(shape=(2,), initializer="zeros")
        self.w.assign([3.0, 4.0])


def test_a_value_assigned_while_building_is_kept():
    layer = _AssignsInBuild()
    with placement.deferred_variables() as deferred:
        layer.build((None, 2))
    placement.place(layer.weights, "/CPU:3", deferred)
    np.testing.assert_array_equal(layer.w.numpy(), [3.0, 4.0])
    assert _device(layer.w) == "CPU:3"


def test_outside_symbolic_pass_makes_real_variables():
    dense = keras.layers.Dense(2)
    with keras.StatelessScope():  # as when Keras builds a model from symbolic inputs
        with placement.outside_symbolic_pass(), tf.device("/CPU:1"):
            dense.build((None, 3))
        assert dense.kernel._value is not None and _device(dense.kernel) == "CPU:1"
