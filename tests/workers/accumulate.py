"""A user's model trained with gradient accumulation through `fit`
(`tfmulti.models.accumulation.accumulate_gradients`) and through the custom loop
(`tfmulti.training.loops`), and the big-batch reference both must equal.

    tfmulti launch --num_workers 2 -- python accumulate.py OUT_DIR MODE [MODE ...]
        # MultiWorkerMirroredStrategy, 2 x 1; MODE "fit" or "loop": the chief
        # writes OUT_DIR/MODE.npz (the trainable weights and the rows the probe
        # layer saw in its last training call); every worker prints `MODE done`

The tests call the same functions in-process (`reference`, `fit`, `loop`):
the model is functional, with dict inputs, a residual connection and an L2
regularizer, trained with a loss of its own and Keras' Adam; no dropout, so
equal batches give equal weights.
"""

import os
import sys

os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")
if __name__ == "__main__":  # the suite's own program: Keras' optional imports at first use
    from tfmulti.utils import deferred_imports

    deferred_imports.install()

import keras  # noqa: E402
import numpy as np  # noqa: E402
import tensorflow as tf  # noqa: E402

GLOBAL_BATCH, ACCUMULATE, EPOCHS, NUM_EXAMPLES = 32, 4, 2, 128
STEPS_PER_EPOCH = NUM_EXAMPLES // GLOBAL_BATCH
STEPS = STEPS_PER_EPOCH * EPOCHS


class RowProbe(keras.layers.Layer):
    """Identity that records how many rows its last training call saw."""

    def build(self, input_shape):
        self.rows = self.add_weight(shape=(), dtype="int32", initializer="zeros",
                                    trainable=False, name="rows")

    def call(self, x, training=False):
        if training:
            self.rows.assign(tf.shape(x)[0])
        return x


def build():
    keras.utils.set_random_seed(0)
    a = keras.Input((6,), name="a")
    b = keras.Input((2,), name="b")
    hidden = keras.layers.Dense(6, activation="tanh",
                                kernel_regularizer=keras.regularizers.L2(1e-3))(a)
    hidden = RowProbe(name="probe")(keras.layers.Add()([hidden, a]))  # the residual
    out = keras.layers.Dense(3)(keras.layers.Concatenate()([hidden, b]))
    return keras.Model({"a": a, "b": b}, out, name="user_model")


def log_cosh(y_true, y_pred):
    """The user's loss: one value per example."""
    return tf.reduce_mean(tf.math.log(tf.cosh(y_pred - y_true)), axis=-1)


def examples() -> tf.data.Dataset:
    rng = np.random.default_rng(0)
    x = {"a": rng.normal(size=(NUM_EXAMPLES, 6)).astype("float32"),
         "b": rng.normal(size=(NUM_EXAMPLES, 2)).astype("float32")}
    y = rng.normal(size=(NUM_EXAMPLES, 3)).astype("float32")
    return tf.data.Dataset.from_tensor_slices((x, y))


def _train_input(strategy, skip_steps: int = 0):
    from tfmulti import data

    return data.distribute(examples(), strategy, GLOBAL_BATCH, seed=1, skip_steps=skip_steps)


def _result(model) -> dict:
    return {"rows": np.array(model.get_layer("probe").rows.numpy()),
            **{f"w{i}": np.array(w) for i, w in enumerate(model.trainable_weights)}}


def fit(strategy, accumulate_steps: int | None, steps_per_execution: int = 1,
        optimizer=None) -> dict:
    """`fit` at GLOBAL_BATCH, with `accumulate_steps` micro-batches per update
    (None: plain Keras)."""
    from tfmulti.models import accumulation

    with strategy.scope():
        model = build()
        model.compile(optimizer or keras.optimizers.Adam(0.01), log_cosh,
                      steps_per_execution=steps_per_execution)
    if accumulate_steps is not None:
        accumulation.accumulate_gradients(model, accumulate_steps)
    history = model.fit(**_train_input(strategy).fit_kwargs(), epochs=EPOCHS, verbose=0)
    return {"loss": np.array(history.history["loss"]), **_result(model)}


def loop(strategy, accumulate_steps: int, steps_per_execution: int = 1, *, steps: int = STEPS,
         backup_for=None, optimizer=None) -> dict:
    """The custom loop up to `steps`, with a backup from `backup_for(model, optimizer)`."""
    from tfmulti.training import loops

    with strategy.scope():
        model = build()
        optimizer = optimizer or keras.optimizers.Adam(0.01)
    step = loops.TrainStep(model, log_cosh, optimizer, strategy, global_batch_size=GLOBAL_BATCH,
                           steps_per_execution=steps_per_execution,
                           accumulate_steps=accumulate_steps)
    backup = backup_for(model, optimizer) if backup_for else None
    result = loops.run(step, lambda s: _train_input(strategy, s), steps=steps, backup=backup,
                       save_every=STEPS_PER_EPOCH // 2)
    return {"losses": np.array(result.losses), "resumed_step": np.array(result.resumed_step),
            "iterations": np.array(optimizer.iterations.numpy()), **_result(model)}


def strategy_of(replicas: int):
    """One device, or MirroredStrategy over `replicas` of the test's virtual CPUs."""
    import tfmulti

    if replicas == 1:
        return tfmulti.get_strategy("one_device")
    return tfmulti.get_strategy("mirrored", devices=[f"CPU:{i}" for i in range(replicas)])


def assert_same_training(got: dict, want: dict, atol: float = 1e-5) -> None:
    """The same trainable weights (`w0`, `w1`, ...) within `atol`."""
    weights = sorted(k for k in want if k.startswith("w"))
    assert weights and sorted(k for k in got if k.startswith("w")) == weights
    for k in weights:
        np.testing.assert_allclose(got[k], want[k], atol=atol, err_msg=k)


def reference() -> dict:
    """Plain Keras on one device, one update per global batch."""
    return fit(tf.distribute.OneDeviceStrategy("CPU:0"), accumulate_steps=None)


def on_two_workers(out_dir, modes: list[str]) -> dict:
    """Runs this script in each of `modes` on one local 2-worker cluster
    (`tests._util.cluster_python_warm`): {mode: the chief's arrays}."""
    from tests._util import cluster_python_warm

    code, output = cluster_python_warm([os.path.abspath(__file__), str(out_dir), *modes],
                                       grace_period=5)
    assert code == 0 and all(output.count(f"{mode} done") == 2 for mode in modes), \
        output[-3000:]
    got = {}
    for mode in modes:
        with np.load(os.path.join(out_dir, f"{mode}.npz")) as arrays:
            got[mode] = dict(arrays)
    return got


def main(out_dir: str, modes: list[str]) -> None:
    import tfmulti
    from tfmulti.cluster import tf_config

    strategy = tfmulti.get_strategy("multi_worker")
    for mode in modes:
        arrays = {"fit": lambda: fit(strategy, ACCUMULATE, steps_per_execution=2),
                  "loop": lambda: loop(strategy, ACCUMULATE, steps_per_execution=2)}[mode]()
        if tf_config.is_chief(tf_config.from_environ()):
            np.savez(os.path.join(out_dir, f"{mode}.npz"), **arrays)
        print(f"{mode} done", flush=True)


if __name__ == "__main__":
    main(sys.argv[1], sys.argv[2:])
