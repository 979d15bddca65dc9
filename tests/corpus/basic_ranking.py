# Source: keras-team/keras-io examples/keras_rs/basic_ranking.py
#         (commit 7728ac05e40150ded3c4cb5c636e7292a53685a4), "Basic ranking: rank movies
#         using a two tower model". The model, compile and fit of the source (its Keras 3
#         code, written for any backend; run here on TensorFlow's); the TFDS MovieLens 100k
#         download replaced by synthetic ratings of the same shapes.
"""A recommendation ranking model: a user id and a movie id (a dict of two
integer inputs), each looked up in its own embedding table (943 + 1 users,
1,682 + 1 movies: ids start at 1, as the source's), the two 32-wide rows
concatenated into Dense(256, relu), Dense(64, relu), Dense(1); a subclassed
`keras.Model`, compiled by its author with `MeanSquaredError`, the
`RootMeanSquaredError` metric and `Adagrad(learning_rate=0.1)`; the labels
are ratings scaled to [0, 1], `(rating - 1) / 4`.

The source fits 5 epochs of 80,000 ratings in batches of 1,000; here 2
epochs of 4,096 in the corpus' batches of 32. Adagrad's lazy update equals its
dense one (an untouched row's gradient is zero), so `sparse_updates='lazy'`
must train this program as plain Keras does.

Synthetic data: ratings from 1 to 5 (integers, as MovieLens 100k's), each
the rounded sum of a user's and a movie's own offset around 3.5 plus noise;
users and movies drawn with a popularity that falls with their id (MovieLens'
few popular movies carry most ratings), so the popular ones recur often
enough in 2 short epochs for their rows to learn their offset.
"""

from __future__ import annotations

import keras
import numpy as np
import tensorflow as tf

NUM_USERS, NUM_MOVIES = 943, 1682  # MovieLens 100k
COMPILE = None  # build() compiles, as the source does
FIT = dict(batch_size=32, epochs=2)
CHAIN = False  # a subclassed model: two tables, then the MLP
LOSS_OF_THE_MEAN = "mse"  # a regression: the test loss must beat the training labels' mean
LOSS_ABS = 0.01
"""The loss margin's absolute part (harness.assert_close): plain Keras' test loss
was 0.043 and 0.046 in two batch orders, answering the mean 0.075."""


class RankingModel(keras.Model):
    """The source's model: a table per id, their rows concatenated, an MLP."""

    def __init__(self, num_users, num_candidates, embedding_dimension=32, **kwargs):
        super().__init__(**kwargs)
        self.user_embedding = keras.layers.Embedding(num_users, embedding_dimension)
        self.candidate_embedding = keras.layers.Embedding(num_candidates, embedding_dimension)
        self.ratings = keras.Sequential(
            [
                keras.layers.Dense(256, activation="relu"),
                keras.layers.Dense(64, activation="relu"),
                keras.layers.Dense(1),
            ]
        )

    def call(self, inputs):
        user_id, movie_id = inputs["user_id"], inputs["movie_id"]
        user_embeddings = self.user_embedding(user_id)
        candidate_embeddings = self.candidate_embedding(movie_id)
        return self.ratings(
            keras.ops.concatenate([user_embeddings, candidate_embeddings], axis=1)
        )


def build():
    model = RankingModel(NUM_USERS + 1, NUM_MOVIES + 1)
    model.compile(
        loss=keras.losses.MeanSquaredError(),
        metrics=[keras.metrics.RootMeanSquaredError()],
        optimizer=keras.optimizers.Adagrad(learning_rate=0.1),
    )
    return model


def _popular(count: int, n: int, rng) -> np.ndarray:
    """`n` ids from 1 to `count`, id k drawn in proportion to 1 / k^0.8."""
    weights = 1.0 / np.arange(1, count + 1) ** 0.8
    return rng.choice(np.arange(1, count + 1), size=n, p=weights / weights.sum())


def _ratings(n: int, offsets, rng) -> tf.data.Dataset:
    users, movies = _popular(NUM_USERS, n, rng), _popular(NUM_MOVIES, n, rng)
    user_offset, movie_offset = offsets
    rating = np.clip(np.rint(3.5 + user_offset[users] + movie_offset[movies]
                             + 0.3 * rng.standard_normal(n)), 1, 5)
    features = {"user_id": users.astype(np.int32), "movie_id": movies.astype(np.int32)}
    return tf.data.Dataset.from_tensor_slices((features, ((rating - 1.0) / 4.0)
                                               .astype(np.float32)))


def data(seed=0):
    """Unbatched ({"user_id", "movie_id"}, scaled rating) datasets: 4,096
    training and 1,024 test ratings, of the same users and movies."""
    rng = np.random.default_rng(seed)
    offsets = (rng.normal(0.0, 0.8, NUM_USERS + 1), rng.normal(0.0, 0.8, NUM_MOVIES + 1))
    return {"train": _ratings(4096, offsets, rng), "test": _ratings(1024, offsets, rng)}
