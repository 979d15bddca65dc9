# Source: keras-team/keras-io examples/generative/vae.py (commit
#         cca4efba8e0b8514ae3817931696294039b3bfc9 read; its Keras 3 form, as keras.io
#         publishes it now: keras.ops and a SeedGenerator in the Sampling layer).
# The model of the source (encoder, decoder, the VAE's own train_step); MNIST replaced by
# synthetic 28x28x1 images.
"""Variational AutoEncoder: a convolutional encoder to a 2-d latent space,
a `Sampling` layer, a transposed-convolution decoder with a sigmoid, and a
subclassed `keras.Model` with its own `train_step` (reconstruction + KL
loss, its own metric trackers), compiled with only an optimizer and trained
on images without labels.

Synthetic data: a bright band at one of 10 row positions over faint noise.
"""

from __future__ import annotations

import keras
import numpy as np
import tensorflow as tf
from keras import layers, ops

from tests.corpus.synthetic import band_images

latent_dim = 2
COMPILE = dict(optimizer="adam")
FIT = dict(batch_size=32, epochs=2)
CHAIN = False  # a subclassed model with its own train_step: not a chain of layers


class Sampling(layers.Layer):
    """Uses (z_mean, z_log_var) to sample z."""

    def __init__(self, **kwargs):
        super().__init__(**kwargs)
        self.seed_generator = keras.random.SeedGenerator(1337)

    def call(self, inputs):
        z_mean, z_log_var = inputs
        epsilon = keras.random.normal(shape=ops.shape(z_mean), seed=self.seed_generator)
        return z_mean + ops.exp(0.5 * z_log_var) * epsilon


def encoder_model():
    encoder_inputs = keras.Input(shape=(28, 28, 1))
    x = encoder_inputs
    for filters in (32, 64):
        x = layers.Conv2D(filters, 3, activation="relu", strides=2, padding="same")(x)
    x = layers.Dense(16, activation="relu")(layers.Flatten()(x))
    z_mean = layers.Dense(latent_dim, name="z_mean")(x)
    z_log_var = layers.Dense(latent_dim, name="z_log_var")(x)
    z = Sampling()([z_mean, z_log_var])
    return keras.Model(encoder_inputs, [z_mean, z_log_var, z], name="encoder")


def decoder_model():
    latent_inputs = keras.Input(shape=(latent_dim,))
    x = layers.Dense(7 * 7 * 64, activation="relu")(latent_inputs)
    x = layers.Reshape((7, 7, 64))(x)
    for filters in (64, 32):
        x = layers.Conv2DTranspose(filters, 3, activation="relu", strides=2, padding="same")(x)
    decoder_outputs = layers.Conv2DTranspose(1, 3, activation="sigmoid", padding="same")(x)
    return keras.Model(latent_inputs, decoder_outputs, name="decoder")


class VAE(keras.Model):
    def __init__(self, encoder, decoder, **kwargs):
        super().__init__(**kwargs)
        self.encoder = encoder
        self.decoder = decoder
        self.total_loss_tracker = keras.metrics.Mean(name="total_loss")
        self.reconstruction_loss_tracker = keras.metrics.Mean(name="reconstruction_loss")
        self.kl_loss_tracker = keras.metrics.Mean(name="kl_loss")

    @property
    def metrics(self):
        return [self.total_loss_tracker, self.reconstruction_loss_tracker,
                self.kl_loss_tracker]

    def train_step(self, data):
        with tf.GradientTape() as tape:
            z_mean, z_log_var, z = self.encoder(data)
            reconstruction = self.decoder(z)
            reconstruction_loss = ops.mean(ops.sum(
                keras.losses.binary_crossentropy(data, reconstruction), axis=(1, 2)))
            kl_loss = -0.5 * (1 + z_log_var - ops.square(z_mean) - ops.exp(z_log_var))
            kl_loss = ops.mean(ops.sum(kl_loss, axis=1))
            total_loss = reconstruction_loss + kl_loss
        grads = tape.gradient(total_loss, self.trainable_weights)
        self.optimizer.apply_gradients(zip(grads, self.trainable_weights))
        self.total_loss_tracker.update_state(total_loss)
        self.reconstruction_loss_tracker.update_state(reconstruction_loss)
        self.kl_loss_tracker.update_state(kl_loss)
        return {"loss": self.total_loss_tracker.result(),
                "reconstruction_loss": self.reconstruction_loss_tracker.result(),
                "kl_loss": self.kl_loss_tracker.result()}

    def call(self, x):
        z_mean, z_log_var, z = self.encoder(x)
        return self.decoder(z)


def build():
    return VAE(encoder_model(), decoder_model())


def data(seed=0):
    """Images only, as the source trains: no labels and no test split (the
    source never evaluates; its model has no loss for `evaluate`)."""
    rng = np.random.default_rng(seed)
    return {"train": tf.data.Dataset.from_tensor_slices(band_images(512, rng)), "test": None}
