"""Keras 3 `fit` under a plain MultiWorkerMirroredStrategy, with a chosen set of
tfmulti's fixes (`tfmulti.runtime.keras_fixes`), to show which upstream bug
each fix covers; then models that train on one device with code of their own
(a `train_step`, a `test_step`, no `call`), with all the fixes.

    tfmulti launch --num_workers 2 -- python keras_upstream.py MODE [MODE ...]

Each MODE (in this order; "none" first, before any fix is installed) fits on
one shared strategy and prints `MODE: fit ok` or `MODE: fit failed: ERROR`:

    none       no fix (keras-team/keras#20585: the symbolic build)
    build      the fixes installed (`apply_keras_fixes`), then "logged scalars
               under MultiWorkerMirroredStrategy" undone
               (tensorflow/tensorflow#72388)
    all        the fixes
    own_steps  the fixes, and each of `OWN_STEPS` (keras-io's GAN, ...) fits:
               one line `own_steps: NAME ok {JSON}` (its logs, and its
               weights to compare between the workers) or `own_steps: NAME
               failed: ERROR`

The failures of "none" and "build" are raised while Keras builds its
functions, before any collective runs, so the cluster stays usable for the
next mode. The models are also trained in-process, by
tests/unit/test_keras_fixes.py.
"""

import json
import os
import sys

os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")
sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))))

import keras  # noqa: E402
import numpy as np  # noqa: E402
import tensorflow as tf  # noqa: E402

from tests.corpus.gan import GAN  # noqa: E402  (keras-io's, as the corpus has it)
from tfmulti.runtime import keras_fixes  # noqa: E402

MODES = ("none", "build", "all", "own_steps")


def set_fixes(mode: str, strategy) -> None:
    from keras.src.backend.tensorflow import trainer

    if mode == "none":
        assert not keras_fixes.active_fixes(), \
            "mode 'none' must come first, before any fix is installed"
        return
    active = keras_fixes.apply_keras_fixes(strategy)  # idempotent
    assert {"fit under MultiWorkerMirroredStrategy",
            "logged scalars under MultiWorkerMirroredStrategy"} <= set(active), active
    patched = getattr(set_fixes, "patched", None) or trainer.reduce_per_replica
    set_fixes.patched = patched
    # "build": undo the logged scalars' fix only; the others: back in place.
    trainer.reduce_per_replica = patched.__wrapped__ if mode == "build" else patched


def sharded(dataset: tf.data.Dataset) -> tf.data.Dataset:
    """`dataset`, its batches split between the workers (a dataset from
    tensors has no files to shard by)."""
    options = tf.data.Options()
    options.experimental_distribute.auto_shard_policy = \
        tf.data.experimental.AutoShardPolicy.DATA
    return dataset.with_options(options)


def fit(strategy) -> None:
    with strategy.scope():
        model = keras.Sequential([keras.Input((4,)), keras.layers.Dense(3)])
        model.compile(optimizer="sgd", metrics=["accuracy"],
                      loss=keras.losses.SparseCategoricalCrossentropy(from_logits=True))
    rng = np.random.default_rng(0)
    ds = tf.data.Dataset.from_tensor_slices(
        (rng.random((32, 4), dtype=np.float32), rng.integers(0, 3, 32))).batch(8)
    model.fit(sharded(ds), epochs=1, verbose=0)


# --------------------------------------------------------------------------
# Models that train on one device with code of their own, as the keras-io
# guides write them, at a tiny size.

LATENT = 8


def gan(steps_per_execution: int = 1, inputs: bool = True) -> GAN:
    """keras-io's GAN on 16x16x1 images, compiled as the guide compiles it;
    its networks of Dense layers (the guide's convolutions take several
    times longer to trace, and change nothing here), without `keras.Input`
    if not `inputs` (then built by the GAN's first `train_step`)."""
    layers = keras.layers

    def sequential(input_shape, *stack, name):
        return keras.Sequential([keras.Input(input_shape), *stack] if inputs else list(stack),
                                name=name)

    discriminator = sequential(
        (16, 16, 1), layers.Flatten(), layers.Dense(4), layers.LeakyReLU(negative_slope=0.2),
        layers.Dense(1), name="discriminator")
    generator = sequential(
        (LATENT,), layers.Dense(16 * 16, activation="sigmoid"), layers.Reshape((16, 16, 1)),
        name="generator")
    model = GAN(discriminator=discriminator, generator=generator, latent_dim=LATENT)
    model.compile(d_optimizer=keras.optimizers.Adam(learning_rate=0.0003),
                  g_optimizer=keras.optimizers.Adam(learning_rate=0.0003),
                  loss_fn=keras.losses.BinaryCrossentropy(from_logits=True))
    model.steps_per_execution = steps_per_execution  # the guide's compile takes none
    return model


def images(num: int = 32) -> tf.data.Dataset:
    """Images as the GAN's guide gives them: no labels, batches of 16."""
    x = np.random.default_rng(0).random((num, 16, 16, 1), dtype=np.float32)
    return tf.data.Dataset.from_tensor_slices(x).batch(16)


class Lazy(keras.Model):
    """Subclassed, its layers made in `__init__`, no `keras.Input`: built by
    the first batch."""

    def __init__(self):
        super().__init__()
        self.hidden = keras.layers.Dense(8, activation="relu")
        self.out = keras.layers.Dense(2)

    def call(self, inputs):
        return self.out(self.hidden(inputs))


class ActivityRegularizationLayer(keras.layers.Layer):
    """keras-io guides/training_with_built_in_methods.py ("Handling losses
    and metrics that don't fit the standard signature"), its rate an argument."""

    def __init__(self, rate=0.1, **kwargs):
        super().__init__(**kwargs)
        self.rate = rate

    def call(self, inputs):
        self.add_loss(keras.ops.sum(inputs) * self.rate)
        return inputs  # Pass-through layer.


def with_add_loss(rate: float = 0.1) -> keras.Model:
    inputs = keras.Input((4,))
    x = keras.layers.Dense(8, activation="relu")(inputs)
    x = ActivityRegularizationLayer(rate)(x)
    return keras.Model(inputs, keras.layers.Dense(2)(x))


class OwnLogs(keras.Model):
    """A `train_step` that returns values that are not metrics (the loss as a
    plain tensor, a Python float, a tensor of 2 values) and a `test_step` of
    its own."""

    def train_step(self, data):
        x, y = data
        with tf.GradientTape() as tape:
            loss = self.loss_fn(y, self(x, training=True))
        grads = tape.gradient(loss, self.trainable_variables)
        self.optimizer.apply(grads, self.trainable_variables)
        return {"loss": loss, "rate": 0.5,
                "bias": tf.convert_to_tensor(self.trainable_variables[-1])}

    def test_step(self, data):
        x, y = data
        error = tf.abs(y - self(x, training=False))
        return {"mae": tf.reduce_mean(error), "rows": tf.cast(tf.shape(x)[0], tf.float32)}


def own_logs() -> OwnLogs:
    inputs = keras.Input((4,))
    model = OwnLogs(inputs, keras.layers.Dense(2)(keras.layers.Dense(8, activation="relu")(inputs)))
    model.loss_fn = keras.losses.MeanSquaredError()
    return model


def regression(num: int = 32) -> tf.data.Dataset:
    """(x, y) batches of 16: y is two sums of x."""
    x = np.random.default_rng(0).random((num, 4), dtype=np.float32)
    y = np.stack([x.sum(axis=1), x[:, :2].sum(axis=1)], axis=1)
    return tf.data.Dataset.from_tensor_slices((x, y)).batch(16)


def mixed_float16() -> keras.Model:
    """A regression model in mixed_float16 (Keras wraps its optimizer in a
    `LossScaleOptimizer` at compile), as the mixed precision guide builds one:
    the output layer in float32."""
    previous = keras.mixed_precision.global_policy()
    keras.mixed_precision.set_global_policy("mixed_float16")
    try:
        return keras.Sequential([keras.Input((4,)), keras.layers.Dense(8, activation="relu"),
                                 keras.layers.Dense(2, dtype="float32")])
    finally:
        keras.mixed_precision.set_global_policy(previous)


def overflowing() -> tf.data.Dataset:
    """`regression()` with one outlier, the last row of the first batch (the
    second replica's or worker's share): the scaled gradient of its error
    overflows float16 there, in that share only."""
    x = np.random.default_rng(0).random((32, 4), dtype=np.float32)
    x[15, 3] = 1000.0
    y = np.stack([x.sum(axis=1), x[:, :2].sum(axis=1)], axis=1)
    return tf.data.Dataset.from_tensor_slices((x, y)).batch(16)


def train(make, data: tf.data.Dataset) -> dict:
    """Makes (`make()`), compiles and fits a model of `OWN_STEPS` under the
    current strategy's scope (seeded), for 2 epochs; evaluates the one with a
    `test_step`. Returns its logs and weights (and a GAN's optimizers'
    variables)."""
    keras.utils.set_random_seed(0)
    model = make()
    if not isinstance(model, GAN):
        model.compile(keras.optimizers.SGD(0.05), "mse")
    history = model.fit(data, epochs=2, verbose=0).history
    result = {"history": {k: np.asarray(v).tolist() for k, v in history.items()},
              "weights": np.concatenate([np.ravel(w) for w in model.get_weights()]).tolist()}
    if hasattr(model.optimizer, "dynamic_scale"):  # mixed_float16's: the steps it skipped
        result["loss_scale"] = float(model.optimizer.dynamic_scale.numpy())
    if isinstance(model, OwnLogs):
        result["evaluate"] = model.evaluate(data, verbose=0, return_dict=True)
    if isinstance(model, GAN):  # the shapes of each optimizer's variables, in order
        result["optimizer_variables"] = {
            name: [list(v.shape) for v in getattr(model, name).variables]
            for name in ("optimizer", "d_optimizer", "g_optimizer")}
    return result


def own_step(name: str) -> dict:
    """`train` of model `name` of `OWN_STEPS` on its data."""
    make, data = OWN_STEPS[name]
    return train(make, data())


OWN_STEPS = {  # name: (the model, its data)
    "gan": (gan, images),
    "gan_2_steps_per_call": (lambda: gan(steps_per_execution=2), images),
    "gan_built_by_its_first_step": (lambda: gan(inputs=False), images),
    "lazy": (Lazy, regression),
    "add_loss": (with_add_loss, regression),
    "own_logs": (own_logs, regression),
    "mixed_float16_overflow": (mixed_float16, overflowing),
}


def own_steps(strategy) -> None:
    for name, (make, data) in OWN_STEPS.items():
        try:
            with strategy.scope():
                result = train(make, sharded(data()))
        except Exception as e:  # whatever the model's failure
            print(f"own_steps: {name} failed: {type(e).__name__}: {e}".replace("\n", " | "),
                  flush=True)
        else:
            print(f"own_steps: {name} ok {json.dumps(result)}", flush=True)


def embedding_runs(optimizer: str, strategy=None):
    """An `Embedding` (its gradient as rows, ids repeated within each batch and
    across the replicas) trained under `strategy`, and the same table trained
    through a one-hot product (its gradient dense) on one device, from the same
    weights: both tables after 3 steps (`strategy` None: no strategy)."""
    import contextlib

    class OneHot(keras.layers.Layer):  # the same lookup, its gradient dense
        def build(self, shape):
            self.embeddings = self.add_weight(shape=(10, 3), initializer="uniform")

        def call(self, ids):
            return tf.matmul(tf.one_hot(ids, 10), self.embeddings)

    def build(layer):
        keras.utils.set_random_seed(0)
        model = keras.Sequential([keras.Input((4,), dtype="int32"), layer,
                                  keras.layers.Flatten(), keras.layers.Dense(1)])
        model.compile(keras.optimizers.get({"class_name": optimizer,
                                            "config": {"learning_rate": 0.1}}), "mse")
        return model

    rng = np.random.default_rng(0)
    x = rng.integers(0, 10, size=(64, 4))  # 256 ids of 10 rows: every row repeats
    y = rng.normal(size=(64, 1)).astype("float32")
    dense = build(OneHot())
    with strategy.scope() if strategy is not None else contextlib.nullcontext():
        rows = build(keras.layers.Embedding(10, 3))
    rows.set_weights(dense.get_weights())
    for model in (dense, rows):
        model.fit(x, y, batch_size=64, epochs=3, shuffle=False, verbose=0)
    return rows.get_weights()[0], dense.get_weights()[0]


def main(modes: list[str]) -> None:
    unknown = [m for m in modes if m not in MODES]
    if unknown or not modes:
        sys.exit(f"usage: keras_upstream.py MODE [MODE ...], MODE in {list(MODES)}; "
                 f"got {modes}")
    strategy = tf.distribute.MultiWorkerMirroredStrategy()
    for mode in modes:
        set_fixes(mode, strategy)
        if mode == "own_steps":
            own_steps(strategy)
            continue
        try:
            fit(strategy)
        except Exception as e:  # the upstream bugs raise several types
            print(f"{mode}: fit failed: {type(e).__name__}: {e}".replace("\n", " | "),
                  flush=True)
        else:
            print(f"{mode}: fit ok", flush=True)


if __name__ == "__main__":
    main(sys.argv[1:])


def added_loss_runs(strategy=None) -> list[float]:
    """A model whose call assigns a mean-aggregated variable (as BatchNormalization's
    statistics are with tfmulti's fix for tensorflow#46488: under 2+ replicas, a
    `merge_call` in the forward, where the replicas' threads take turns) and then
    adds a constant loss of 1.0, trained 2 epochs under `strategy` (None: one
    device): its reported losses. On one device, and on each replica, the loss is
    the model's mean squared error plus 1.0."""
    import contextlib

    class Counted(keras.layers.Layer):
        def build(self, shape):
            self.calls = self.add_weight(shape=(), initializer="zeros", trainable=False,
                                         aggregation="mean")

        def call(self, x):
            self.calls.assign(self.calls + 1.0)
            self.add_loss(tf.constant(1.0))
            return x

    keras.utils.set_random_seed(0)
    with strategy.scope() if strategy is not None else contextlib.nullcontext():
        model = keras.Sequential([keras.Input((3,)), Counted(), keras.layers.Dense(1)])
        model.compile(keras.optimizers.SGD(0.1), "mse")
    rng = np.random.default_rng(0)
    x, y = rng.normal(size=(64, 3)).astype("float32"), rng.normal(size=(64, 1)).astype("float32")
    history = model.fit(x, y, batch_size=32, epochs=2, shuffle=False, verbose=0)
    return history.history["loss"]
