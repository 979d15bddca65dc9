"""Keras 3 `fit` under a plain MultiWorkerMirroredStrategy, with a chosen set of
tfmulti's fixes, to show which upstream bug each fix covers.

    tfmulti launch --num_workers 2 -- python keras_upstream.py none|build|all
"""

import os
import sys

os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")

import keras  # noqa: E402
import numpy as np  # noqa: E402
import tensorflow as tf  # noqa: E402

from tfmulti import keras_fixes  # noqa: E402

mode = sys.argv[1]
if mode != "none":
    keras_fixes.apply_multi_worker_fixes()
    if mode == "build":  # undo fix 3 only
        from keras.src.backend.tensorflow import trainer

        trainer.reduce_per_replica = trainer.reduce_per_replica.__wrapped__
strategy = tf.distribute.MultiWorkerMirroredStrategy()
with strategy.scope():
    model = keras.Sequential([keras.Input((4,)), keras.layers.Dense(3)])
    model.compile(optimizer="sgd", metrics=["accuracy"],
                  loss=keras.losses.SparseCategoricalCrossentropy(from_logits=True))
rng = np.random.default_rng(0)
ds = tf.data.Dataset.from_tensor_slices(
    (rng.random((32, 4), dtype=np.float32), rng.integers(0, 3, 32))).batch(8)
options = tf.data.Options()
options.experimental_distribute.auto_shard_policy = tf.data.experimental.AutoShardPolicy.DATA
model.fit(ds.with_options(options), epochs=1, verbose=0)
print("fit ok", flush=True)
