r"""Train a model with data parallelism, pipeline parallelism or both.

The main job (`make demo`): Fashion-MNIST, the MLP, MirroredStrategy
over 4 virtual CPU devices, 5 epochs:

    python recipes/train.py --distribution=mirrored --num_virtual_devices=4 \
        --dataset=fashion_mnist --model=mlp --epochs=5 --global_batch_size=256 \
        --model_dir=/tmp/tfmulti_demo

Multi-worker (MultiWorkerMirroredStrategy, 2 processes on this host):

    tfmulti launch --num_workers 2 -- python recipes/train.py \
        --distribution=multi_worker --global_batch_size=256 --model_dir=/tmp/tfmulti_mw

Pipeline (model) parallelism, 2 stages on 2 virtual CPUs, 4 micro-batches; and
the data x pipeline hybrid, 2 replicas x 2 stages on 4 devices:

    python recipes/train.py --distribution=pipeline --num_virtual_devices=2 \
        --num_stages=2 --num_microbatches=4 --model=cnn
    python recipes/train.py --distribution=hybrid --num_virtual_devices=4 \
        --num_replicas=2 --num_stages=2 --num_microbatches=4 --model=cnn

Mixed precision and XLA (bfloat16 on CPUs; float16 needs a GPU):

    python recipes/train.py --distribution=one_device --mixed_precision=bfloat16 --jit_compile

Fault tolerance: --backup_dir=DIR [--backup_every_steps=N] checkpoints the run;
rerunning the same command resumes at the next step (`tfmulti launch
--max_restarts K` does it for a cluster); SIGTERM saves and exits with code 75.

    python recipes/train.py --distribution=mirrored --num_virtual_devices=2 \
        --backup_dir=/tmp/tfmulti_backup --backup_every_steps=100

Writes <model_dir>/metrics.json, <model_dir>/model.keras and TensorBoard logs
in <model_dir>/logs. Every flag is a field of `tfmulti.config.train_config.TrainConfig`
(`--help` lists them, `--helpfull` adds absl's own), the flags of `tfmulti train`;
`--config FILE` reads their values from a YAML or JSON file (a run's
<model_dir>/.tfmulti-run.json runs it again), flags on the command line override it.
Flags take dashes or underscores (`--global-batch-size 64`); booleans are `--x`,
`--x=false`, `--no_x`, `--no-x` or `--nox`. Bad flags print one line and exit with
code 2, before TensorFlow starts, writing nothing.
"""

from __future__ import annotations

import os
import sys

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import _common  # noqa: E402  (sets the TF log level before TensorFlow loads)

from absl import flags  # noqa: E402

from tfmulti.cluster import tf_config  # noqa: E402  (no TensorFlow)
from tfmulti.config import flags as config_flags  # noqa: E402  (no TensorFlow)

config_flags.define_absl_flags()
flags.adopt_module_key_flags(config_flags)  # --help lists them (--helpfull: absl's too)


def main(argv):
    config = config_flags.config_from_absl()
    config.validate()  # before TensorFlow starts: a bad flag fails at once
    chief = tf_config.process_is_chief(config.distribution, config.cluster_resolver)
    from tfmulti.training import outputs
    from tfmulti.training.train import train

    metrics = train(config)  # every worker has the metrics; the chief's line says them
    print(outputs.summary_line(metrics) if chief else outputs.OTHER_WORKER_LINE)


if __name__ == "__main__":
    _common.run(main)
