"""The allocator's peak in a step at zero_stage 2, and at stage 3 with each
layer gathering its parameters at its call (tfmulti's) or with each parameter
gathered where it is read and kept until its gradient (all of them held at
once, as the model's gather held them before): an MLP of 6 Dense(512) layers
(1 MiB of float32 kernel each) trained by `fit` on 2 virtual CPUs, Adam.

    TF_CPU_ALLOCATOR_USE_BFC=true python zero_peak.py
        # prints one JSON line: {"parameter_bytes", "layer_bytes", and per run
        # ("2", "3", "3-whole"): {"held": the allocator's bytes before the
        # measured epochs, "peak": its peak in them above "held", "weights": the
        # sum of the trained weights' absolute values}}

(The allocator's counts need TensorFlow's BFC allocator on CPU: oneDNN turns it
on; TF_CPU_ALLOCATOR_USE_BFC does elsewhere. The 2 devices share it.)
"""

import json

import numpy as np

import tfmulti

WIDTH, LAYERS = 512, 6


def measure(stage: int) -> dict:
    import keras
    import tensorflow as tf

    from tfmulti.parallel import zero
    from tfmulti.runtime.strategy import get_strategy

    strategy = get_strategy("mirrored", devices=("CPU:0", "CPU:1"))
    keras.utils.set_random_seed(1)
    with strategy.scope():
        model = keras.Sequential([keras.Input((WIDTH,))]
                                 + [keras.layers.Dense(WIDTH, activation="relu")
                                    for _ in range(LAYERS)] + [keras.layers.Dense(3)])
        model.compile(keras.optimizers.Adam(1e-3),
                      keras.losses.SparseCategoricalCrossentropy(from_logits=True))
    zero.shard_optimizer(model.optimizer, model.trainable_variables, strategy, stage,
                         model=model)
    rng = np.random.default_rng(0)
    x, y = rng.normal(size=(64, WIDTH)).astype("float32"), rng.integers(0, 3, 64)
    model.fit(x, y, batch_size=16, epochs=1, verbose=0)  # (traced: its graphs are held)
    tf.config.experimental.reset_memory_stats("CPU:0")
    held = tf.config.experimental.get_memory_info("CPU:0")["current"]
    model.fit(x, y, batch_size=16, epochs=2, verbose=0)
    peak = tf.config.experimental.get_memory_info("CPU:0")["peak"]
    return {"held": held, "peak": peak - held,
            "weights": float(sum(np.abs(w).sum() for w in model.get_weights()))}


if __name__ == "__main__":
    from tfmulti.parallel import zero

    tfmulti.configure_virtual_devices(2)
    out = {"parameter_bytes": 4 * (LAYERS * (WIDTH + 1) * WIDTH + (WIDTH + 1) * 3),
           "layer_bytes": 4 * (WIDTH + 1) * WIDTH}
    out["2"] = measure(2)
    out["3"] = measure(3)
    # No layer gathers at its call: each parameter is gathered where it is read and
    # kept until its gradient, so the step holds the wholes of all, as before.
    zero._gather_at_call = lambda layer, sharding: None
    out["3-whole"] = measure(3)
    print(json.dumps(out))
