"""Train a model with data parallelism on one host (the seed 000 example, fixed).

The main job (`make demo`): Fashion-MNIST, the seed's MLP, MirroredStrategy
over 4 virtual CPU devices, 5 epochs:

    python recipes/train.py --strategy=mirrored --num_virtual_devices=4 \
        --dataset=fashion_mnist --model=mlp --epochs=5 --global_batch_size=256 \
        --model_dir=/tmp/tfmulti_demo

Multi-worker (MultiWorkerMirroredStrategy, 2 processes on this host):

    tfmulti launch --num_workers 2 -- python recipes/train.py \
        --strategy=multi_worker --global_batch_size=256 --model_dir=/tmp/tfmulti_mw

Pipeline (model) parallelism, 2 stages on 2 virtual CPUs, 4 micro-batches; and
the data x pipeline hybrid, 2 replicas x 2 stages on 4 devices:

    python recipes/train.py --strategy=pipeline --num_virtual_devices=2 \
        --num_stages=2 --num_microbatches=4 --model=cnn
    python recipes/train.py --strategy=hybrid --num_virtual_devices=4 \
        --num_replicas=2 --num_stages=2 --num_microbatches=4 --model=cnn

Mixed precision and XLA (bfloat16 on CPUs; float16 needs a GPU):

    python recipes/train.py --strategy=one_device --mixed_precision=bfloat16 --jit_compile

Fault tolerance: --backup_dir=DIR [--backup_every_steps=N] checkpoints the run;
rerunning the same command resumes at the next step (`tfmulti launch
--max_restarts K` does it for a cluster); SIGTERM saves and exits with code 75.

    python recipes/train.py --strategy=mirrored --num_virtual_devices=2 \
        --backup_dir=/tmp/tfmulti_backup --backup_every_steps=100

Writes <model_dir>/metrics.json, <model_dir>/model.keras and TensorBoard logs
in <model_dir>/logs. Bad flags print one line and exit with code 2, writing
nothing.

What this fixes in seed 000's TensorFlow example:
  * it built the model once outside `strategy.scope()` and again inside; here
    the model and optimizer are built once, inside the scope;
  * it reshaped images to 28x28x1 and fed them to `Dense(input_shape=(784,))`
    (a shape error); here the MLP flattens its input;
  * it trained on raw 0-255 pixels; here pixels are scaled to [0, 1];
  * it fed NumPy arrays with batch 32 (per step, split over replicas); here the
    batch is explicitly global, streamed with tf.data prefetch-to-device;
  * it never evaluated; here the test split is evaluated and saved.
"""

from __future__ import annotations

import os
import sys

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import _common  # noqa: E402  (sets TF log level before TensorFlow loads)
from absl import flags  # noqa: E402

_STRATEGY = flags.DEFINE_enum(
    "strategy", "auto", ["auto", "one_device", "mirrored", "multi_worker", "pipeline", "hybrid"],
    "Distribution strategy; multi_worker runs under `tfmulti launch` or with TF_CONFIG; "
    "pipeline and hybrid place layer stages on devices.")
_NUM_VIRTUAL_DEVICES = flags.DEFINE_integer(
    "num_virtual_devices", 0, "Split the host CPU into this many logical devices (0: no split).",
    lower_bound=0)
_DEVICES = flags.DEFINE_list("devices", None, "Devices to use, e.g. CPU:0,CPU:1 (default: all).")
_CROSS_DEVICE_OPS = flags.DEFINE_enum(
    "cross_device_ops", "auto", ["auto", "nccl", "hierarchical_copy", "reduce_to_one"],
    "Gradient all-reduce implementation for --strategy=mirrored.")
_DATASET = flags.DEFINE_string(
    "dataset", "fashion_mnist", "TFDS name, or synthetic / synthetic_regression.")
_DATA_DIR = flags.DEFINE_string("data_dir", None, "TFDS data dir (default $TFDS_DATA_DIR, else ~/tensorflow_datasets).")
_DOWNLOAD = flags.DEFINE_boolean(
    "download", False, "Allow a TFDS download if the data is not prepared (needs internet).")
_NUM_EXAMPLES = flags.DEFINE_integer("num_examples", None, "Synthetic data: training examples.",
                                     lower_bound=1)
_MODEL = flags.DEFINE_enum("model", "mlp", ["mlp", "regression", "cnn"], "Model builder.")
_DROPOUT = flags.DEFINE_float("dropout", 0.2, "Dropout rate.", lower_bound=0.0, upper_bound=0.99)
_EPOCHS = flags.DEFINE_integer("epochs", 5, "Training epochs.", lower_bound=1)
_STEPS_PER_EPOCH = flags.DEFINE_integer(
    "steps_per_epoch", None, "Steps per epoch (default: one pass over the data).", lower_bound=1)
_GLOBAL_BATCH_SIZE = flags.DEFINE_integer(
    "global_batch_size", 256, "Examples per step over all replicas.", lower_bound=1)
_LEARNING_RATE = flags.DEFINE_float("learning_rate", 1e-3, "Learning rate for --base_batch_size.")
_LR_SCALING = flags.DEFINE_enum("lr_scaling", "none", ["none", "linear", "sqrt"],
                                "Scale the learning rate with global/base batch size.")
_BASE_BATCH_SIZE = flags.DEFINE_integer(
    "base_batch_size", 256, "Batch size --learning_rate was tuned for.", lower_bound=1)
_WARMUP_EPOCHS = flags.DEFINE_float("warmup_epochs", 0.0, "Epochs of linear learning-rate warmup up to the (scaled) rate: from "
                                    "--learning_rate when --lr_scaling raises it, else from near 0.",
                                    lower_bound=0.0)
_OPTIMIZER = flags.DEFINE_enum("optimizer", "adam", ["adam", "sgd"], "Optimizer.")
_SEED = flags.DEFINE_integer("seed", 0, "Seed for weights and data order.")
_STEPS_PER_EXECUTION = flags.DEFINE_string(
    "steps_per_execution", "auto", "Training steps per tf.function call (less per-step "
    "overhead): a divisor of the steps per epoch, or auto (the largest one up to 32). Works "
    "with 2+ replicas through tfmulti.keras_fixes.")
_NUM_STAGES = flags.DEFINE_integer("num_stages", 2, "Pipeline stages (pipeline, hybrid).",
                                   lower_bound=1)
_NUM_MICROBATCHES = flags.DEFINE_integer(
    "num_microbatches", 4, "Micro-batches per replica batch (pipeline, hybrid).", lower_bound=1)
_NUM_REPLICAS = flags.DEFINE_integer("num_replicas", 2, "Data-parallel pipelines (hybrid).",
                                     lower_bound=1)
_PARTITION = flags.DEFINE_enum("partition", "params", ["params", "flops", "time"],
                               "How to balance pipeline stages.")
_REMAT = flags.DEFINE_boolean("remat", False, "Recompute stage activations in the backward "
                              "pass (pipeline, hybrid; no dropout).")
_MIXED_PRECISION = flags.DEFINE_enum(
    "mixed_precision", "none", ["none", "bfloat16", "float16"],
    "Compute in 16 bits, keep variables and logits float32; float16 needs a GPU (loss "
    "scaling is automatic), use bfloat16 on CPUs.")
_JIT_COMPILE = flags.DEFINE_boolean(
    "jit_compile", False, "Compile the train step with XLA (not with pipeline or hybrid).")
_BACKUP_DIR = flags.DEFINE_string(
    "backup_dir", None, "Make the run resumable: checkpoints here (every epoch end and every "
    "--backup_every_steps); rerun the same command after a crash or preemption to resume at "
    "the next step. Deleted when the run ends normally (--keep_backup keeps it). Must be "
    "readable by every worker.")
_BACKUP_EVERY_STEPS = flags.DEFINE_integer(
    "backup_every_steps", None, "Also back up every this many global steps (with --backup_dir).",
    lower_bound=1)
_KEEP_BACKUP = flags.DEFINE_boolean("keep_backup", False,
                                    "Keep --backup_dir after the run ends normally.")
_MODEL_DIR = flags.DEFINE_string("model_dir", None, "Where to write metrics, model and logs.")


def main(argv):
    from tfmulti.training import TrainConfig, train

    metrics = train(TrainConfig(
        strategy=_STRATEGY.value,
        num_virtual_devices=_NUM_VIRTUAL_DEVICES.value,
        devices=tuple(_DEVICES.value) if _DEVICES.value else None,
        cross_device_ops=_CROSS_DEVICE_OPS.value,
        dataset=_DATASET.value,
        data_dir=_DATA_DIR.value,
        download=_DOWNLOAD.value,
        num_examples=_NUM_EXAMPLES.value,
        model=_MODEL.value,
        dropout=_DROPOUT.value,
        epochs=_EPOCHS.value,
        steps_per_epoch=_STEPS_PER_EPOCH.value,
        global_batch_size=_GLOBAL_BATCH_SIZE.value,
        learning_rate=_LEARNING_RATE.value,
        lr_scaling=_LR_SCALING.value,
        base_batch_size=_BASE_BATCH_SIZE.value,
        warmup_epochs=_WARMUP_EPOCHS.value,
        optimizer=_OPTIMIZER.value,
        seed=_SEED.value,
        steps_per_execution=_STEPS_PER_EXECUTION.value,
        num_stages=_NUM_STAGES.value,
        num_microbatches=_NUM_MICROBATCHES.value,
        num_replicas=_NUM_REPLICAS.value,
        partition=_PARTITION.value,
        remat=_REMAT.value,
        mixed_precision=_MIXED_PRECISION.value,
        jit_compile=_JIT_COMPILE.value,
        backup_dir=_BACKUP_DIR.value,
        backup_every_steps=_BACKUP_EVERY_STEPS.value,
        keep_backup=_KEEP_BACKUP.value,
        model_dir=_MODEL_DIR.value,
    ))
    summary = ", ".join(
        f"{k}={metrics[k]:.4f}" if isinstance(metrics[k], float) else f"{k}={metrics[k]}"
        for k in ("test_accuracy", "test_loss", "test_mae", "examples_per_second",
                  "num_replicas", "strategy", "epochs_completed") if k in metrics)
    print(f"tfmulti: {summary}")


if __name__ == "__main__":
    _common.run(main)
