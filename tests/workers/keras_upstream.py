"""Keras 3 `fit` under a plain MultiWorkerMirroredStrategy, with a chosen set of
tfmulti's fixes (`tfmulti.runtime.keras_fixes`), to show which upstream bug
each fix covers.

    tfmulti launch --num_workers 2 -- python keras_upstream.py MODE [MODE ...]

Each MODE (in this order; "none" first, before any fix is installed) fits a
fresh model on one shared strategy and prints `MODE: fit ok` or
`MODE: fit failed: ERROR`:

    none    no fix (keras-team/keras#20585: the symbolic build)
    build   the fixes installed (`apply_keras_fixes`), then "logged scalars under
            MultiWorkerMirroredStrategy" undone (tensorflow/tensorflow#72388)
    all     the fixes

The failures are raised while Keras builds its functions, before any
collective runs, so the cluster stays usable for the next mode.
"""

import os
import sys

os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")

import keras  # noqa: E402
import numpy as np  # noqa: E402
import tensorflow as tf  # noqa: E402

from tfmulti.runtime import keras_fixes  # noqa: E402

MODES = ("none", "build", "all")


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
    # "build": undo the logged scalars' fix only; "all": back in place.
    trainer.reduce_per_replica = patched.__wrapped__ if mode == "build" else patched


def fit(strategy) -> None:
    with strategy.scope():
        model = keras.Sequential([keras.Input((4,)), keras.layers.Dense(3)])
        model.compile(optimizer="sgd", metrics=["accuracy"],
                      loss=keras.losses.SparseCategoricalCrossentropy(from_logits=True))
    rng = np.random.default_rng(0)
    ds = tf.data.Dataset.from_tensor_slices(
        (rng.random((32, 4), dtype=np.float32), rng.integers(0, 3, 32))).batch(8)
    options = tf.data.Options()
    options.experimental_distribute.auto_shard_policy = \
        tf.data.experimental.AutoShardPolicy.DATA
    model.fit(ds.with_options(options), epochs=1, verbose=0)


def main(modes: list[str]) -> None:
    unknown = [m for m in modes if m not in MODES]
    if unknown or not modes:
        sys.exit(f"usage: keras_upstream.py MODE [MODE ...], MODE in {list(MODES)}; "
                 f"got {modes}")
    strategy = tf.distribute.MultiWorkerMirroredStrategy()
    for mode in modes:
        set_fixes(mode, strategy)
        try:
            fit(strategy)
        except Exception as e:  # the upstream bugs raise several types
            print(f"{mode}: fit failed: {type(e).__name__}: {e}".replace("\n", " | "),
                  flush=True)
        else:
            print(f"{mode}: fit ok", flush=True)


if __name__ == "__main__":
    main(sys.argv[1:])
