"""The byte-level transformer over R x S x T devices against the same model
unsplit on one device: forward, gradients, 3 Adam steps; where each
device's variables and optimizer slots live, against the memory estimate.

    python layouts.py R S T
        # configures R*S*T virtual CPUs (at least 4) and prints one JSON line:
        # the figures of `compare(R, S, T)`

tests/unit/test_transformer.py calls `compare` in-process where the 4 devices of
the test process suffice, and runs this script for 2 x 2 x 2.
"""

import json
import os
import sys

os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")

SIZES = dict(seq_len=8, d_model=16, num_heads=4, num_layers=2)
BATCH, MICROBATCHES, LR = 8, 2, 1e-2
# Adam's epsilon: the key projection's bias has a zero gradient up to
# rounding (softmax ignores a shift shared by all keys), which Adam with
# Keras' 1e-7 would divide by itself.
EPSILON = 1e-4


def _tokens(seed):
    import numpy as np

    text = np.random.default_rng(seed).integers(0, 256, (BATCH, SIZES["seq_len"] + 1))
    return text[:, :-1].astype("int32"), text[:, 1:].astype("int32")


def _unsplit_weights(model):
    from tfmulti.parallel.tensor_split import unsplit_transformer

    return unsplit_transformer(model).get_weights()


def _pair(R, S, T):
    """(the R x S x T model, the layer objects it trains, the plain model)."""
    from tfmulti.models import transformer
    from tfmulti.parallel import PipelineModel
    from tfmulti.parallel.tensor_split import split_transformer

    plain = transformer.build_transformer(**SIZES, seed=0)
    source = transformer.build_transformer(**SIZES, seed=0)
    if T > 1:
        source = split_transformer(source, [f"CPU:{i}" for i in range(T)])
    model = PipelineModel(source, devices=[f"CPU:{i}" for i in range(R * S * T)],
                          num_stages=S, num_replicas=R, num_microbatches=MICROBATCHES)
    return model, source, plain


def _compile(model, optimizer):
    import keras

    model.compile(optimizer=optimizer,
                  loss=keras.losses.SparseCategoricalCrossentropy(from_logits=True))


def _max_diff(a_list, b_list) -> float:
    import numpy as np

    assert len(a_list) == len(b_list), (len(a_list), len(b_list))
    return max(float(np.max(np.abs(np.asarray(a) - np.asarray(b))))
               for a, b in zip(a_list, b_list))


def compare(R: int, S: int, T: int) -> dict:
    """Max absolute differences from the plain model, and the placement.

    Returns:
        "forward", "gradients", "adam_losses", "adam_weights" (max |diff|),
        "replicas_equal" (every replica's stages hold replica 0's weights),
        "parameters_by_device" and "estimated_parameters_by_device" (bytes),
        "slots_with_their_variable" (every Adam slot on its variable's device),
        "variable_devices" (the devices holding variables, sorted).
    """
    import keras
    import numpy as np
    import tensorflow as tf

    from tfmulti.utils import sizes
    from tfmulti.memory import estimate as memory

    out = {}
    model, source, plain = _pair(R, S, T)
    x, y = _tokens(0)
    out["forward"] = float(np.max(np.abs(model(x).numpy() - plain(x).numpy())))
    # Gradients of one loss through the whole layout (eager): each replica's
    # weights get their half of the batch's; summed, the plain model's.
    loss_fn = keras.losses.SparseCategoricalCrossentropy(from_logits=True)
    grads = []
    for m, variables in ((plain, [plain.trainable_variables]),
                         (model, [[v for stage in stages for v in stage.trainable_variables]
                                  for stages in model.replicas])):
        with tf.GradientTape() as tape:
            loss = loss_fn(y, m(x, training=True))
        per_replica = tape.gradient(loss, variables)
        grads.append([tf.add_n([tf.convert_to_tensor(g[i]) for g in per_replica])
                      for i in range(len(variables[0]))])
    # Replica 0's stages hold the caller's layer objects: write the summed
    # gradients into them to read them in the plain layout, then restore.
    replica0 = [v for stage in model.replicas[0] for v in stage.trainable_variables]
    saved = [v.numpy() for v in replica0]
    for variable, grad in zip(replica0, grads[1]):
        variable.assign(grad)
    out["gradients"] = _max_diff(_unsplit_weights(source), [g.numpy() for g in grads[0]])
    for variable, value in zip(replica0, saved):
        variable.assign(value)
    # Three Adam steps through the pipeline's training step.
    for m in (model, plain):
        _compile(m, keras.optimizers.Adam(LR, epsilon=EPSILON))
    losses = []
    for step in range(3):
        xs, ys = _tokens(step + 1)
        losses.append((model.train_on_batch(xs, ys), plain.train_on_batch(xs, ys)))
    out["adam_losses"] = max(abs(a - b) for a, b in losses)
    out["adam_weights"] = _max_diff(_unsplit_weights(source), plain.get_weights())
    out["replicas_equal"] = all(
        np.array_equal(a, b) for r in range(1, R) for s in range(S)
        for a, b in zip(model.replicas[0][s].get_weights(), model.replicas[r][s].get_weights()))
    # Placement: bytes per device, against the estimate; slots with their variables.
    by_device = {}
    for v in model.variables:
        if v.trainable:
            device = int(v.value.device.rsplit(":", 1)[1])
            by_device[device] = by_device.get(device, 0) + sizes.variables_bytes([v])
    out["parameters_by_device"] = [by_device.get(d, 0) for d in range(R * S * T)]
    distribution = "hybrid" if R > 1 else "pipeline"
    estimate = memory.estimate_memory(
        "transformer", distribution=distribution, num_stages=S, tensor_parallel=T,
        num_microbatches=MICROBATCHES, global_batch_size=BATCH, dropout=0.0,
        **({"num_replicas": R} if R > 1 else {}), **SIZES)
    out["estimated_parameters_by_device"] = [row["parameters"] for row in estimate["devices"]]
    slots = [s for s in model.optimizer.variables if len(s.shape)]
    out["slots_with_their_variable"] = len(slots) == 2 * len(model.trainable_variables) and all(
        any(s.value.device == v.value.device for s in slots
            if s.path.endswith("/" + v.path.replace("/", "_") + "_momentum"))
        for v in model.trainable_variables)
    out["variable_devices"] = sorted({v.value.device.rsplit("device:", 1)[1]
                                      for v in model.variables})
    return out


if __name__ == "__main__":
    from tfmulti.utils import deferred_imports

    deferred_imports.install()  # the suite's own program: Keras' optional imports at first use
    R, S, T = (int(a) for a in sys.argv[1:4])
    import tfmulti

    tfmulti.configure_virtual_devices(max(4, R * S * T))
    print(json.dumps(compare(R, S, T)), flush=True)
