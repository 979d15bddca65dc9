# Source: keras-team/keras-io guides/training_with_built_in_methods.py, "Handling losses
#         and metrics that don't fit the standard signature". Read at commit
#         ad4fc805f5e1a4a4c0bcdd416aa9feac6608fb6c (its tf.keras form: `tf.reduce_sum`) and
#         in its Keras 3 form as keras.io publishes it now (`import keras`, `ops.sum`),
#         stored in the keras-io fork Xcoke919/keras-io at commit
#         67e2c7062095bcae4746153831a1ac547abb9b42. The model and compile of the source;
#         MNIST replaced by synthetic 784-feature vectors.
"""A loss from `add_loss`: a functional MLP on 784 features (`digits`),
Dense(64, relu) `dense_1`, the guide's own `ActivityRegularizationLayer`
(a pass-through layer whose `call` adds `0.1 * sum(inputs)` to the model's
losses with `self.add_loss`; the sum runs over the whole batch, not per
example), Dense(64, relu) `dense_2`, and 10 logits (`predictions`), compiled
with `RMSprop(learning_rate=1e-3)` and
`SparseCategoricalCrossentropy(from_logits=True)`, no metrics. The loss the
logs report (training and test) is the cross-entropy plus the added term.

With the source's coefficient the added term, a sum over the batch, outweighs
the cross-entropy, a mean: its gradient silences `dense_1` (under 0.1 % of its
ReLUs still fire after 20 steps) and the model ends at chance, its test loss
ln 10 plus almost nothing, whatever the data (the guide warns that "the
displayed loss will be much higher"; on MNIST the arithmetic is the same). So
the program checks the added term itself: a run that trained without it
would learn the classes, and its test loss, which counts the term (about 0.1
x the sum of 64 live activations over 32 examples), would be far from ln 10.

Synthetic data: MNIST-like vectors of 784 values in [0, 1] (faint noise) in
which the digit k lights pixels 78k to 78k+77 (0.8 brighter); integer labels
as the source's (floats there, int64 here); 1,024 for training and 256 for
testing.
"""

from __future__ import annotations

import keras
import numpy as np
from keras import layers, ops

NUM_CLASSES = 10
# "rmsprop" is the source's RMSprop(learning_rate=1e-3) (Keras' default rate), named: an
# optimizer made at import would be shared by every model compiled with it.
COMPILE = dict(optimizer="rmsprop",
               loss=keras.losses.SparseCategoricalCrossentropy(from_logits=True))
FIT = dict(batch_size=32, epochs=2)
TFMULTI = dict(optimizer="rmsprop")  # tfmulti's default is adam; its default loss is this one
CHAIN = True


class ActivityRegularizationLayer(layers.Layer):
    def call(self, inputs):
        self.add_loss(ops.sum(inputs) * 0.1)
        return inputs  # a pass-through layer


def build():
    inputs = keras.Input(shape=(784,), name="digits")
    x = layers.Dense(64, activation="relu", name="dense_1")(inputs)
    x = ActivityRegularizationLayer()(x)  # activity regularization, as a layer
    x = layers.Dense(64, activation="relu", name="dense_2")(x)
    outputs = layers.Dense(10, name="predictions")(x)
    return keras.Model(inputs=inputs, outputs=outputs)


def _split(n, rng):
    digits = rng.integers(0, NUM_CLASSES, n)
    x = rng.random((n, 784), dtype=np.float32) * 0.2
    for i, k in enumerate(digits):
        x[i, 78 * k: 78 * k + 78] += 0.8
    return x, digits.astype(np.int64)


def data(seed=0):
    rng = np.random.default_rng(seed)
    return _split(1024, rng), _split(256, rng)
