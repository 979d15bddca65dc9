"""Trains a few SGD steps and saves per-step losses and final weights.

    python equivalence.py OUT.npz [--dict]           # MirroredStrategy, 2 virtual CPUs
    tfmulti launch --num_workers 2 -- python equivalence.py OUT.npz [--dict]
                                                     # MultiWorkerMirroredStrategy, 2 x 1

Also runs evaluate and predict, and records what they return.
"""

import os
import sys

os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")

import numpy as np  # noqa: E402

import tfmulti  # noqa: E402
from tfmulti import cluster, data, models  # noqa: E402

STEPS, GLOBAL_BATCH, NUM_EXAMPLES = 5, 32, 160


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


def main(out: str, use_dict: bool) -> None:
    multi = cluster.from_environ() is not None
    if not multi:
        tfmulti.configure_virtual_devices(2)
    strategy = tfmulti.get_strategy("multi_worker" if multi else "mirrored")
    assert strategy.num_replicas_in_sync == 2, strategy.num_replicas_in_sync
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
    if cluster.is_chief(cluster.from_environ()):
        np.savez(out, losses=np.array(history.history["loss"]),
                 eval_loss=evaluation["loss"], eval_accuracy=evaluation["accuracy"],
                 num_predictions=len(predictions),
                 **{f"w{i}": w for i, w in enumerate(model.get_weights())})
    print("done", flush=True)


if __name__ == "__main__":
    main(sys.argv[1], "--dict" in sys.argv[2:])
