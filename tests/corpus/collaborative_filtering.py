# Source: keras-team/keras-io examples/structured_data/collaborative_filtering_movielens.py
#         (commit ff6a507b2737777a8845ff9a2f1caf7f53ce3e78), "Collaborative Filtering for
#         Movie Recommendations". The model, compile and fit of the source; the MovieLens
#         "ml-latest-small" download (ratings.csv, read with pandas) replaced by synthetic
#         ratings of the same shapes.
"""Collaborative filtering: `RecommenderNet`, a subclassed `keras.Model` of
four embedding tables (a 50-wide vector and a bias for each of 610 users and
9,724 movies; the vectors `he_normal` with `l2(1e-6)` regularizers), called
on an array of (user, movie) index pairs; a sigmoid of the dot product plus
both biases; `BinaryCrossentropy` on the ratings scaled to [0, 1],
`Adam(learning_rate=0.001)` (tfmulti's defaults but for the loss: `TFMULTI`).

Kept as published, with what it means for a distributed run:
- `tf.tensordot(user_vector, movie_vector, 2)` contracts both axes: one number
  for the whole batch (the sum of every example's dot product), added to each
  example's biases. Each prediction depends on the other examples of its batch,
  so it changes with the batch: on 2 replicas each sums its half. Its test loss
  is the loss of the test split in batches of the run's per-replica size
  (`BATCH_DEPENDENT`: the export is served in those batches to compare);
- the regularizers make both vector tables' gradients dense (they cover every
  row), so `sparse_updates='lazy'` keeps them dense, and says so; the bias
  tables (no regularizer) update lazily.

The source fits 5 epochs of ~90,000 ratings in batches of 64 and validates on
the other 10 %; here 2 epochs of 8,192 in the corpus' batches of 32 (fewer
steps of `Adam(1e-3)` move a bias row too little to learn: with 4,096 and a
flatter popularity the test loss did not beat the mean's), then the test
split of 1,024.

Synthetic data: ratings from 0.5 to 5 in steps of 0.5 (as the CSV's), a
user's and a movie's own offset around 3.5 plus noise; users and movies
drawn with a popularity that falls with their index (as MovieLens': a few
popular movies carry most ratings), so the popular ones recur often enough
for their biases to learn in 2 short epochs.
"""

from __future__ import annotations

import keras
import numpy as np
import tensorflow as tf
from keras import layers

NUM_USERS, NUM_MOVIES = 610, 9724  # ml-latest-small
MIN_RATING, MAX_RATING = 0.5, 5.0
EMBEDDING_SIZE = 50
FIT = dict(batch_size=32, epochs=2)
TFMULTI = dict(loss="binary_crossentropy")  # tfmulti's optimizer default is Adam(1e-3)
CHAIN = False  # a subclassed model
LOSS_OF_THE_MEAN = "bce"  # a regression in [0, 1]: the test loss must beat the mean's
# Its loss is mostly the labels' own entropy (the lowest there is: 0.495 here), so
# the margin around plain Keras' test loss says little; the comparison with the
# mean's says whether it learned: plain Keras' test loss was 0.592 in two batch
# orders, 0.071 above the lowest in an excess of 0.137 for the mean (0.632).
BATCH_DEPENDENT = True  # the tensordot above: a prediction depends on its batch


class RecommenderNet(keras.Model):
    def __init__(self, num_users, num_movies, embedding_size, **kwargs):
        super(RecommenderNet, self).__init__(**kwargs)  # noqa: UP008  (as published)
        self.num_users = num_users
        self.num_movies = num_movies
        self.embedding_size = embedding_size
        self.user_embedding = layers.Embedding(
            num_users,
            embedding_size,
            embeddings_initializer="he_normal",
            embeddings_regularizer=keras.regularizers.l2(1e-6),
        )
        self.user_bias = layers.Embedding(num_users, 1)
        self.movie_embedding = layers.Embedding(
            num_movies,
            embedding_size,
            embeddings_initializer="he_normal",
            embeddings_regularizer=keras.regularizers.l2(1e-6),
        )
        self.movie_bias = layers.Embedding(num_movies, 1)

    def call(self, inputs):
        user_vector = self.user_embedding(inputs[:, 0])
        user_bias = self.user_bias(inputs[:, 0])
        movie_vector = self.movie_embedding(inputs[:, 1])
        movie_bias = self.movie_bias(inputs[:, 1])
        dot_user_movie = tf.tensordot(user_vector, movie_vector, 2)
        # Add all the components (including bias)
        x = dot_user_movie + user_bias + movie_bias
        # The sigmoid activation forces the rating to between 0 and 1
        return tf.nn.sigmoid(x)


def build():
    return RecommenderNet(NUM_USERS, NUM_MOVIES, EMBEDDING_SIZE)


def __getattr__(name):
    """`COMPILE`, the source's compile arguments, made afresh at each access
    (PEP 562: an optimizer made once would be shared by every model)."""
    if name == "COMPILE":
        return dict(loss=tf.keras.losses.BinaryCrossentropy(),
                    optimizer=keras.optimizers.Adam(learning_rate=0.001))
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


def _popular(count: int, n: int, rng) -> np.ndarray:
    """`n` indices from 0 to `count` - 1, index k drawn in proportion to 1 / (k + 1)^1.5."""
    weights = 1.0 / np.arange(1, count + 1) ** 1.5
    return rng.choice(count, size=n, p=weights / weights.sum())


def _ratings(n: int, offsets, rng):
    """(x, y) as the source's: x the (user, movie) index pairs (int64, as pandas
    gives them), y the ratings scaled to [0, 1]."""
    users, movies = _popular(NUM_USERS, n, rng), _popular(NUM_MOVIES, n, rng)
    rating = np.clip(np.round(2 * (3.5 + offsets[0][users] + offsets[1][movies]
                                   + 0.3 * rng.standard_normal(n))) / 2, MIN_RATING, MAX_RATING)
    x = np.stack([users, movies], axis=1).astype(np.int64)
    return x, ((rating - MIN_RATING) / (MAX_RATING - MIN_RATING)).astype(np.float32)


def data(seed=0):
    """(x, y) arrays: 8,192 training and 1,024 test ratings of the same users and movies."""
    rng = np.random.default_rng(seed)
    offsets = (rng.normal(0.0, 1.2, NUM_USERS), rng.normal(0.0, 1.2, NUM_MOVIES))
    return {"train": _ratings(8192, offsets, rng), "test": _ratings(1024, offsets, rng)}
