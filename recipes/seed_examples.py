"""Seed 003's data-parallel and optimizer examples, corrected, on tfmulti.

    python recipes/seed_examples.py --example=data_parallel --num_virtual_devices=4
    python recipes/seed_examples.py --example=optimizers --num_virtual_devices=4 --epochs=3
    python recipes/seed_examples.py --example=model_parallel --num_virtual_devices=2 --epochs=3

data_parallel. Seed 003 (section 2.1) built four copies of a 784->10 linear
model on one device and gave copy i the columns `data[:, i::4]`: it split the
*features*, so every copy saw all 100 examples but only 196 of the 784 inputs
(a shape error for a 784-input layer, and not data parallelism even if it
ran), with fresh random targets per copy and no gradient averaging. Data
parallelism splits the *batch*: here a MirroredStrategy with 4 replicas gives
each replica 25 of the 100 examples (all 784 features), each replica computes
the gradient of its share of the loss, and an all-reduce sums them, so one
distributed step equals one single-device step on the whole batch. The recipe
prints the per-replica shapes and that difference (~1e-7).

model_parallel. Seed 003 (section 2.2) built two complete copies of a
784-256-10 model on the same device, moved fc1 and fc2 onto that same device
again, and averaged the two copies' losses: no layer ever ran on a second
device, and it trained two models instead of splitting one. Here one model is
split: fc1 (Flatten + Dense 784->256) lives on device 0, fc2 (Dense 256->10)
on device 1; each stage's weights, optimizer slots, forward and backward run
on its device, and 4 micro-batches keep both devices busy (GPipe). The recipe
prints where every variable lives and the test accuracy.

optimizers. Seed 003 (section 2.3) compared nothing: it trained one Adam
model with a mean squared error between (100, 10) outputs and (100,) random
integer "targets" (broadcast to (100, 100)) on random inputs. Here Adam and
SGD train the same model from the same initial weights on the same data order
with a classification loss, and the recipe prints both loss curves and test
accuracies side by side.
"""

from __future__ import annotations

import os
import sys

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import _common  # noqa: E402
from absl import flags  # noqa: E402

_EXAMPLE = flags.DEFINE_enum("example", "data_parallel",
                             ["data_parallel", "model_parallel", "optimizers"],
                             "Which seed example to run.")
_NUM_VIRTUAL_DEVICES = flags.DEFINE_integer(
    "num_virtual_devices", 4, "Logical CPU devices (replicas).", lower_bound=1)
_DATASET = flags.DEFINE_string("dataset", "fashion_mnist", "fashion_mnist or synthetic.")
_DATA_DIR = flags.DEFINE_string("data_dir", None, "TFDS data dir.")
_NUM_EXAMPLES = flags.DEFINE_integer("num_examples", None, "Synthetic data size.", lower_bound=1)
_EPOCHS = flags.DEFINE_integer("epochs", 3, "Epochs (optimizers example).", lower_bound=1)
_GLOBAL_BATCH_SIZE = flags.DEFINE_integer("global_batch_size", 100, "Global batch.",
                                          lower_bound=1)


def data_parallel_step(strategy, images, labels) -> dict:
    """One SGD gradient of a linear model, distributed vs on one device."""
    import keras
    import numpy as np
    import tensorflow as tf

    with strategy.scope():
        model = keras.Sequential([keras.Input((28, 28, 1)), keras.layers.Flatten(),
                                  keras.layers.Dense(10)])
    loss_fn = keras.losses.SparseCategoricalCrossentropy(
        from_logits=True, reduction="sum")
    global_batch = int(images.shape[0])
    per_replica = global_batch // strategy.num_replicas_in_sync

    def replica_fn(x, y):
        with tf.GradientTape() as tape:
            # Each replica: its own slice of the *batch*, scaled by the global batch.
            loss = loss_fn(y, model(x)) / global_batch
        return tape.gradient(loss, model.trainable_variables), loss

    dist = strategy.experimental_distribute_dataset(
        tf.data.Dataset.from_tensor_slices((images, labels)).batch(global_batch))
    x, y = next(iter(dist))
    shapes = [tuple(t.shape) for t in strategy.experimental_local_results(x)]

    @tf.function
    def distributed_step(x, y):
        grads, loss = strategy.run(replica_fn, args=(x, y))
        # The all-reduce: sum the replicas' gradients (each already / global batch).
        return ([strategy.reduce("SUM", g, axis=None) for g in grads],
                strategy.reduce("SUM", loss, axis=None))

    grads, loss = distributed_step(x, y)
    with tf.GradientTape() as tape:
        full_loss = loss_fn(labels, model(images)) / global_batch
    full_grads = tape.gradient(full_loss, model.trainable_variables)
    diff = max(float(np.max(np.abs(a.numpy() - b.numpy()))) for a, b in zip(grads, full_grads))
    return {"replica_batch_shapes": shapes, "per_replica": per_replica,
            "loss": float(loss), "single_device_loss": float(full_loss),
            "max_gradient_difference": diff}


def model_parallel(train, batch: int) -> None:
    """fc1 on device 0, fc2 on device 1, trained as one pipelined model."""
    import keras

    from tfmulti import data
    from tfmulti.parallel import PipelineModel

    layers = [keras.layers.Flatten(name="flatten"),
              keras.layers.Dense(256, activation="relu", name="fc1"),
              keras.layers.Dense(10, name="fc2")]
    model = PipelineModel(layers, input_shape=(28, 28, 1), devices=["CPU:0", "CPU:1"],
                          num_microbatches=4, partition=[2, 1], name="seed003")
    model.compile(optimizer="adam", metrics=["accuracy"],
                  loss=keras.losses.SparseCategoricalCrossentropy(from_logits=True))
    import tensorflow as tf

    train_input = data.distribute(train, tf.distribute.get_strategy(), batch, seed=0)
    history = model.fit(**train_input.fit_kwargs(), epochs=_EPOCHS.value, verbose=2)
    for row in model.placement():
        print(f"stage {row['stage']}: {row['layers']} -> variables on "
              f"{row['variable_devices']}")
    print(f"final training accuracy {history.history['accuracy'][-1]:.4f}")


def main(argv):
    import tfmulti
    from tfmulti import data
    from tfmulti.models import builders as models

    tfmulti.configure_virtual_devices(_NUM_VIRTUAL_DEVICES.value)
    batch = _GLOBAL_BATCH_SIZE.value
    if _EXAMPLE.value == "model_parallel":
        strategy = tfmulti.get_strategy("one_device")  # placement is manual
    else:
        strategy = tfmulti.get_strategy("auto")
        data.per_replica_batch_size(batch, strategy.num_replicas_in_sync)  # fail fast
    train = data.load(_DATASET.value, "train", data_dir=_DATA_DIR.value,
                      num_examples=_NUM_EXAMPLES.value)
    if _EXAMPLE.value == "data_parallel":
        images, labels = next(iter(train.batch(batch)))
        result = data_parallel_step(strategy, images, labels)
        for i, shape in enumerate(result["replica_batch_shapes"]):
            print(f"replica {i}: batch {shape}")
        print(f"distributed loss {result['loss']:.6f}, single-device loss "
              f"{result['single_device_loss']:.6f}, max gradient difference "
              f"{result['max_gradient_difference']:.2e}")
        return
    if _EXAMPLE.value == "model_parallel":
        model_parallel(train, batch)
        return
    test = data.load(_DATASET.value, "test", data_dir=_DATA_DIR.value,
                     num_examples=_NUM_EXAMPLES.value and max(_NUM_EXAMPLES.value // 4, 1))
    train_input = data.distribute(train, strategy, batch, seed=0)
    test_input = data.distribute(test, strategy, batch, training=False)
    init = models.build_model("mlp", seed=0).get_weights()
    curves = {}
    for optimizer, rate in (("adam", 1e-3), ("sgd", 0.1)):
        model = models.build_model("mlp", strategy=strategy, seed=0)
        model.set_weights(init)
        models.compile_model(model, task="classification", strategy=strategy,
                             optimizer=optimizer, learning_rate=rate)
        history = model.fit(**train_input.fit_kwargs(), epochs=_EPOCHS.value, verbose=0)
        accuracy = model.evaluate(**test_input.evaluate_kwargs(), return_dict=True,
                                  verbose=0)["accuracy"]
        curves[optimizer] = (history.history["loss"], accuracy)
    print("epoch  " + "  ".join(f"{name:>8}" for name in curves))
    for epoch in range(_EPOCHS.value):
        print(f"{epoch + 1:5d}  " + "  ".join(f"{c[0][epoch]:8.4f}" for c in curves.values()))
    print("test accuracy: " + ", ".join(f"{n}={c[1]:.4f}" for n, c in curves.items()))


if __name__ == "__main__":
    _common.run(main)
