"""Trains a few SGD steps and records per-step losses, final weights and what
evaluate and predict return, for tuple and for dict inputs, on one strategy.

    tfmulti launch --num_workers 2 -- python equivalence.py OUT_DIR
        # MultiWorkerMirroredStrategy, 2 x 1: the chief writes OUT_DIR/tuple.npz
        # and OUT_DIR/dict.npz; every worker prints `total=3.0` (an all-reduce
        # of rank + 1) and `done`
    python equivalence.py OUT_DIR
        # MirroredStrategy over 2 virtual CPUs, the same files
    ... equivalence.py OUT_DIR dict
        # only the dict variant

The test compares the two: `run(strategy, use_dict)` is also called in-process
with a MirroredStrategy over 2 devices (over 4 for 2 hosts x 2 workers,
benchmarks/tests/test_simulated_hosts.py); every worker prints `total=` the sum of rank + 1.
"""

import os
import sys

os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")
if __name__ == "__main__":  # the suite's own program: Keras' optional imports at first use
    from tfmulti.utils import deferred_imports

    deferred_imports.install()

import numpy as np  # noqa: E402

import tfmulti  # noqa: E402
from tfmulti import data
from tfmulti.models import builders as models  # noqa: E402
from tfmulti.cluster import tf_config  # noqa: E402

STEPS, GLOBAL_BATCH, NUM_EXAMPLES = 5, 32, 160
VARIANTS = {"tuple": False, "dict": True}


def build(use_dict: bool):
    import keras

    keras.utils.set_random_seed(0)
    if not use_dict:
        return models.build_model("mlp", dropout=0.0)
    pixels = keras.Input((28, 28, 1), name="pixels")
    scale = keras.Input((1,), name="scale")
    hidden = keras.layers.Dense(64, activation="relu")(keras.layers.Flatten()(pixels))
    logits = keras.layers.Dense(10)(keras.layers.Concatenate()([hidden, scale]))
    return keras.Model({"pixels": pixels, "scale": scale}, logits, name="dict_model")


def run(strategy, use_dict: bool) -> dict:
    """Fits STEPS steps on `strategy`, evaluates and predicts: the arrays to compare."""
    assert strategy.num_replicas_in_sync in (2, 4), strategy.num_replicas_in_sync
    with strategy.scope():
        model = build(use_dict)
    models.compile_model(model, strategy=strategy, optimizer="sgd", learning_rate=0.05,
                         task="classification")
    ds = data.load("synthetic", "train", num_examples=NUM_EXAMPLES)
    if use_dict:
        ds = ds.map(lambda x, y: ({"pixels": x, "scale": 2.0 * x[0, 0]}, y))
    train = data.distribute(ds, strategy, GLOBAL_BATCH, seed=3)
    test = data.distribute(ds, strategy, GLOBAL_BATCH, training=False)
    history = model.fit(train.dataset, steps_per_epoch=1, epochs=STEPS, verbose=0,
                        shuffle=False)
    evaluation = model.evaluate(**test.evaluate_kwargs(), return_dict=True, verbose=0)
    predictions = model.predict(**test.evaluate_kwargs(), verbose=0)
    return dict(losses=np.array(history.history["loss"]),
                eval_loss=np.array(evaluation["loss"]),
                eval_accuracy=np.array(evaluation["accuracy"]),
                num_predictions=np.array(len(predictions)),
                **{f"w{i}": w for i, w in enumerate(model.get_weights())})


def all_reduce_ranks(strategy, rank: int) -> float:
    """The SUM over the workers of rank + 1 (3.0 for 2 workers)."""
    import tensorflow as tf

    value = strategy.run(lambda: tf.constant(float(rank + 1)))
    return float(strategy.reduce(tf.distribute.ReduceOp.SUM, value, axis=None))


def main(out_dir: str, variants=tuple(VARIANTS)) -> None:
    config = tf_config.from_environ()
    if config is None:
        tfmulti.configure_virtual_devices(2)
    strategy = tfmulti.get_strategy("multi_worker" if config else "mirrored")
    if config is not None:
        print(f"total={all_reduce_ranks(strategy, config['task']['index'])}", flush=True)
        # A second call (a second train in one script) gets this strategy back,
        # not a new one that would reset the running server's collectives.
        print(f"same strategy={tfmulti.get_strategy('multi_worker') is strategy}", flush=True)
    for name in variants:
        arrays = run(strategy, VARIANTS[name])
        if tf_config.is_chief(config):
            np.savez(os.path.join(out_dir, f"{name}.npz"), **arrays)
    print("done", flush=True)


if __name__ == "__main__":
    main(sys.argv[1], sys.argv[2:] or tuple(VARIANTS))
