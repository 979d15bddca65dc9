"""A resumable training run for the fault-tolerance tests (tests/integration/test_backup.py).

    python resumable.py OUT_DIR DISTRIBUTION [--kill STEP:WORKER[:SIGNAL] ...]
                        [--config JSON]

Trains `FIELDS` (synthetic data, SGD, no dropout, 3 epochs x 16 steps, a
backup every 4 steps) with `tfmulti.training.train.train(backup_dir=OUT_DIR/backup)`;
--config overrides TrainConfig fields. The chief saves the final weights and
step count to OUT_DIR/final.npz and the metrics to OUT_DIR/metrics.json.

Each --kill makes worker WORKER send itself SIGNAL at global step STEP, once
(tests/workers/killer.py).
"""

import argparse
import json
import os
import sys

os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")

FIELDS = dict(dataset="synthetic", num_examples=1024, global_batch_size=64, epochs=3,
              optimizer="sgd", learning_rate=0.05, dropout=0.0, seed=0, backup_every_steps=4,
              verbose=2, steps_per_execution=1)  # the tests kill and save at exact steps
"""The run's TrainConfig fields, besides distribution and backup_dir."""


def main():
    import killer  # the workers' directory is sys.path[0]

    parser = argparse.ArgumentParser()
    parser.add_argument("out_dir")
    parser.add_argument("distribution")
    parser.add_argument("--kill", type=killer.kill_spec, action="append", default=[],
                        metavar="STEP:WORKER[:SIGNAL]")
    parser.add_argument("--config", default="{}", help="JSON of TrainConfig fields")
    args = parser.parse_args()

    import keras
    import numpy as np

    from tfmulti.cluster import tf_config
    from tfmulti.config.train_config import TrainConfig
    from tfmulti.training.train import train

    environ = tf_config.from_environ()
    index = int(environ["task"]["index"]) if environ else 0

    class Final(keras.callbacks.Callback):
        def on_train_end(self, logs=None):
            self.model_ref = self.model

    final = Final()
    fields = dict(FIELDS, distribution=args.distribution,
                  backup_dir=os.path.join(args.out_dir, "backup"))
    fields.update(json.loads(args.config))
    kills = killer.callback(args.out_dir, index, args.kill, "resumable")
    metrics = train(TrainConfig(**fields), callbacks=[kills, final])
    model = final.model_ref
    if tf_config.is_chief(environ):
        np.savez(os.path.join(args.out_dir, "final.npz"),
                 iterations=int(model.optimizer.iterations.numpy()),
                 *[np.asarray(w) for w in model.get_weights()])
        with open(os.path.join(args.out_dir, "metrics.json"), "w") as f:
            json.dump(metrics, f)
    return 0


if __name__ == "__main__":
    from tfmulti.utils import deferred_imports

    deferred_imports.install()  # the suite's own program: Keras' optional imports at first use
    sys.exit(main())
