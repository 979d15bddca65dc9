"""A resumable training run for the fault-tolerance tests.

    python resumable.py OUT_DIR STRATEGY [--kill_at_step N --signal KILL|TERM
                                         --kill_worker I] [tfmulti.training flags as k=v]

Trains synthetic data with `tfmulti.training.train(backup_dir=OUT_DIR/backup)`;
the chief saves the final weights and step count to OUT_DIR/final.npz. With
--kill_at_step, worker I sends itself the signal at that global step, once
(a marker file in OUT_DIR stops the restarted run from doing it again).
"""

import argparse
import json
import os
import signal
import sys

os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("out_dir")
    parser.add_argument("strategy")
    parser.add_argument("--kill_at_step", type=int, default=0)
    parser.add_argument("--signal", default="KILL")
    parser.add_argument("--kill_worker", type=int, default=0)
    parser.add_argument("--config", default="{}", help="JSON of extra TrainConfig fields")
    args = parser.parse_args()

    import numpy as np
    import keras

    from tfmulti import cluster
    from tfmulti.training import TrainConfig, train

    config = cluster.from_environ()
    index = int(config["task"]["index"]) if config else 0
    marker = os.path.join(args.out_dir, "killed")

    class Killer(keras.callbacks.Callback):
        def __init__(self):
            super().__init__()
            self.epoch = 0

        def on_epoch_begin(self, epoch, logs=None):
            self.epoch = epoch

        def on_train_batch_end(self, batch, logs=None):
            step = int(self.model.optimizer.iterations.numpy())
            if args.kill_at_step and step >= args.kill_at_step and index == args.kill_worker \
                    and not os.path.exists(marker):
                open(marker, "w").close()
                print(f"resumable: worker {index} sends itself SIG{args.signal} at step {step}",
                      flush=True)
                os.kill(os.getpid(), getattr(signal, f"SIG{args.signal}"))

    class Final(keras.callbacks.Callback):
        def on_train_end(self, logs=None):
            self.model_ref = self.model

    final = Final()
    fields = dict(strategy=args.strategy, dataset="synthetic", num_examples=1024,
                  global_batch_size=64, epochs=3, optimizer="sgd", learning_rate=0.05,
                  dropout=0.0, seed=0, backup_dir=os.path.join(args.out_dir, "backup"),
                  backup_every_steps=4, verbose=2,
                  steps_per_execution=1)  # the tests kill and save at exact steps
    fields.update(json.loads(args.config))
    metrics = train(TrainConfig(**fields), callbacks=[Killer(), final])
    model = final.model_ref
    if cluster.is_chief(config):
        np.savez(os.path.join(args.out_dir, "final.npz"),
                 iterations=int(model.optimizer.iterations.numpy()),
                 *[np.asarray(w) for w in model.get_weights()])
        with open(os.path.join(args.out_dir, "metrics.json"), "w") as f:
            json.dump(metrics, f)
    return 0


if __name__ == "__main__":
    sys.exit(main())
