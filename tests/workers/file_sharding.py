"""Trains the user's functional model (tests/own_model.py) on a set of TFRecord
files, read through `tfmulti.data.from_files`, and records what it read.

    tfmulti launch --num_workers 2 -- python file_sharding.py FILES_GLOB OUT_DIR
        # MultiWorkerMirroredStrategy: each worker reads only its own files
    python file_sharding.py FILES_GLOB OUT_DIR
        # one device: every file

Every worker writes OUT_DIR/worker{I}.json: the files it opened (its reader
logs each file name it is given), the example ids of its share of one epoch
(taken from the same pipeline fit reads, with the ids kept), and on the chief
the final losses.
"""

import json
import os
import sys

os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")
sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", ".."))
if __name__ == "__main__":  # the suite's own program: Keras' optional imports at first use
    from tfmulti.utils import deferred_imports

    deferred_imports.install()

import numpy as np  # noqa: E402
import keras  # noqa: E402
import tensorflow as tf  # noqa: E402

import tfmulti  # noqa: E402
from tests import own_model  # noqa: E402
from tfmulti import data
from tfmulti.models import builders as models  # noqa: E402

GLOBAL_BATCH, EPOCHS, SEED = 32, 4, 5


def main(pattern: str, out_dir: str) -> None:
    strategy = tfmulti.get_strategy("multi_worker" if os.environ.get("TF_CONFIG")
                                    else "one_device")
    role = tfmulti.runtime.strategy.cluster_role(strategy)
    opened = os.path.join(out_dir, f"opened-{role.worker_index}.txt")

    def log_name(name):
        with open(opened, "a") as f:
            f.write(name.numpy().decode() + "\n")
        return name

    def reader(name):
        name = tf.py_function(log_name, [name], tf.string)
        return tf.data.TFRecordDataset(name)

    files = data.from_files(pattern, own_model.parse_with_id, reader=reader)
    with_ids = data.distribute(files, strategy, GLOBAL_BATCH, seed=SEED)
    ids = []
    iterator = iter(with_ids.dataset)
    for _ in range(with_ids.steps_per_epoch):
        x, _ = next(iterator)
        for part in strategy.experimental_local_results(x["id"]):
            ids.extend(int(i) for i in part.numpy())

    def drop_id(features, label):
        return {"pixels": features["pixels"], "extra": features["extra"]}, label

    train = data.distribute(files, strategy, GLOBAL_BATCH, seed=SEED, map_fn=drop_id,
                            steps_per_epoch=with_ids.steps_per_epoch)
    test = data.distribute(own_model.arrays(512, 9), strategy, GLOBAL_BATCH, training=False)
    keras.utils.set_random_seed(0)
    with strategy.scope():
        model = own_model.build({"pixels": (16,), "extra": (4,)})
    models.compile_model(model, strategy=strategy, optimizer="sgd", learning_rate=0.1,
                         loss=own_model.smooth_loss, metrics=["accuracy"],
                         steps_per_epoch=train.steps_per_epoch)
    history = model.fit(**train.fit_kwargs(), epochs=EPOCHS, verbose=0)
    result = model.evaluate(**test.evaluate_kwargs(), return_dict=True, verbose=0)
    with open(opened) as f:
        names = sorted(set(f.read().split()))
    record = {"worker": role.worker_index, "num_workers": role.num_workers,
              "sharding": train.sharding, "steps_per_epoch": train.steps_per_epoch,
              "opened": names, "epoch_ids": ids,
              "train_loss": [float(v) for v in history.history["loss"]],
              "test_loss": float(result["loss"]), "test_accuracy": float(result["accuracy"]),
              "first_kernel_sum": float(np.sum(model.get_layer("mix").kernel.numpy()))}
    with open(os.path.join(out_dir, f"worker{role.worker_index}.json"), "w") as f:
        json.dump(record, f)
    print("done", flush=True)


if __name__ == "__main__":
    main(sys.argv[1], sys.argv[2])
