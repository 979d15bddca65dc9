# Source: keras-team/keras-io guides/custom_train_step_in_tensorflow.py
#         (commit b4108fbfe9f0cbad37f4f3c2bc5e4db0dd8bd2b6, Keras 3 as published:
#         `import keras`, keras.random with a SeedGenerator, `optimizer.apply`),
#         "Wrapping up: an end-to-end GAN example". The discriminator, the generator and
#         the GAN class of the source (same layers, arguments, signatures), compiled as
#         the source compiles it; MNIST replaced by synthetic 28x28x1 images.
"""End-to-end GAN: a subclassed `keras.Model` with NO `call`, its own
`compile(self, d_optimizer, g_optimizer, loss_fn)` (which calls
`super().compile()` with no arguments), its own `train_step` (two tapes, two
optimizers, both applied with `optimizer.apply`) and `metrics` of two
trackers (`d_loss`, `g_loss`); its logs have no `loss`. It trains on images
without labels and has no test split.

`build()` returns the model compiled as the source compiles it (two
`Adam(learning_rate=0.0003)` and `BinaryCrossentropy(from_logits=True)`),
making fresh optimizers on each call: a user gives tfmulti a compiled model
(`COMPILE = None`), since tfmulti cannot call a compile whose arguments are
the author's own.

Synthetic data: a bright band at one of 10 row positions over faint noise,
values in [0, 1] (the generator ends in a sigmoid); 128 images (the source
trains on 100 batches of MNIST; 2 epochs here are 8 steps).
"""

from __future__ import annotations

import keras
import numpy as np
import tensorflow as tf
from keras import layers

from tests.corpus.synthetic import band_images

latent_dim = 128
COMPILE = None  # build() compiles, with the author's own compile signature
# Logs that are a Keras `Loss` object's value inside a replica: under N replicas Keras
# scales that value by 1/N (so that the summed gradients are the global batch's mean;
# `keras.src.losses.loss.scale_loss_for_distribution`), and the train step logs it as
# it is, so a run on N replicas logs 1/N of the one-device figure.
REPLICA_SCALED_LOGS = ("d_loss", "g_loss")
FIT = dict(batch_size=32, epochs=2)
CHAIN = False  # a subclassed model with no call: not a chain of layers


def discriminator_model():
    return keras.Sequential(
        [
            keras.Input(shape=(28, 28, 1)),
            layers.Conv2D(64, (3, 3), strides=(2, 2), padding="same"),
            layers.LeakyReLU(negative_slope=0.2),
            layers.Conv2D(128, (3, 3), strides=(2, 2), padding="same"),
            layers.LeakyReLU(negative_slope=0.2),
            layers.GlobalMaxPooling2D(),
            layers.Dense(1),
        ],
        name="discriminator",
    )


def generator_model():
    return keras.Sequential(
        [
            keras.Input(shape=(latent_dim,)),
            layers.Dense(7 * 7 * 128),  # 128 coefficients per cell of a 7x7 map
            layers.LeakyReLU(negative_slope=0.2),
            layers.Reshape((7, 7, 128)),
            layers.Conv2DTranspose(128, (4, 4), strides=(2, 2), padding="same"),
            layers.LeakyReLU(negative_slope=0.2),
            layers.Conv2DTranspose(128, (4, 4), strides=(2, 2), padding="same"),
            layers.LeakyReLU(negative_slope=0.2),
            layers.Conv2D(1, (7, 7), padding="same", activation="sigmoid"),
        ],
        name="generator",
    )


class GAN(keras.Model):
    def __init__(self, discriminator, generator, latent_dim):
        super().__init__()
        self.discriminator = discriminator
        self.generator = generator
        self.latent_dim = latent_dim
        self.d_loss_tracker = keras.metrics.Mean(name="d_loss")
        self.g_loss_tracker = keras.metrics.Mean(name="g_loss")
        self.seed_generator = keras.random.SeedGenerator(1337)

    @property
    def metrics(self):
        return [self.d_loss_tracker, self.g_loss_tracker]

    def compile(self, d_optimizer, g_optimizer, loss_fn):
        super().compile()
        self.d_optimizer = d_optimizer
        self.g_optimizer = g_optimizer
        self.loss_fn = loss_fn

    def train_step(self, real_images):
        if isinstance(real_images, tuple):
            real_images = real_images[0]
        batch_size = tf.shape(real_images)[0]
        # fake images from random points of the latent space, next to the real ones
        random_latent_vectors = keras.random.normal(
            shape=(batch_size, self.latent_dim), seed=self.seed_generator)
        generated_images = self.generator(random_latent_vectors)
        combined_images = tf.concat([generated_images, real_images], axis=0)
        # 1 for fake, 0 for real, with a little noise on the labels
        labels = tf.concat([tf.ones((batch_size, 1)), tf.zeros((batch_size, 1))], axis=0)
        labels += 0.05 * keras.random.uniform(tf.shape(labels), seed=self.seed_generator)

        with tf.GradientTape() as tape:  # the discriminator's step
            predictions = self.discriminator(combined_images)
            d_loss = self.loss_fn(labels, predictions)
        grads = tape.gradient(d_loss, self.discriminator.trainable_weights)
        self.d_optimizer.apply(grads, self.discriminator.trainable_weights)

        random_latent_vectors = keras.random.normal(
            shape=(batch_size, self.latent_dim), seed=self.seed_generator)
        misleading_labels = tf.zeros((batch_size, 1))  # "all real"

        with tf.GradientTape() as tape:  # the generator's step; the discriminator stays
            predictions = self.discriminator(self.generator(random_latent_vectors))
            g_loss = self.loss_fn(misleading_labels, predictions)
        grads = tape.gradient(g_loss, self.generator.trainable_weights)
        self.g_optimizer.apply(grads, self.generator.trainable_weights)

        self.d_loss_tracker.update_state(d_loss)
        self.g_loss_tracker.update_state(g_loss)
        return {"d_loss": self.d_loss_tracker.result(),
                "g_loss": self.g_loss_tracker.result()}


def build():
    """The source's GAN, compiled as the source compiles it (fresh optimizers)."""
    gan = GAN(discriminator=discriminator_model(), generator=generator_model(),
              latent_dim=latent_dim)
    gan.compile(
        d_optimizer=keras.optimizers.Adam(learning_rate=0.0003),
        g_optimizer=keras.optimizers.Adam(learning_rate=0.0003),
        loss_fn=keras.losses.BinaryCrossentropy(from_logits=True),
    )
    return gan


def data(seed=0):
    """Images only, as the source trains: no labels and no test split."""
    rng = np.random.default_rng(seed)
    return {"train": tf.data.Dataset.from_tensor_slices(band_images(128, rng)), "test": None}
