"""A resumable training run for the fault-tolerance tests (tests/test_backup.py).

    python resumable.py OUT_DIR DISTRIBUTION [--kill STEP:WORKER[:SIGNAL] ...]
                        [--config JSON]

Trains `FIELDS` (synthetic data, SGD, no dropout, 3 epochs x 16 steps, a
backup every 4 steps) with `tfmulti.training.train(backup_dir=OUT_DIR/backup)`;
--config overrides TrainConfig fields. The chief saves the final weights and
step count to OUT_DIR/final.npz and the metrics to OUT_DIR/metrics.json.

Each --kill makes worker WORKER send itself SIGNAL (KILL, the default, or
TERM) at the first batch end at or past global step STEP, once: a marker
file in OUT_DIR stops a restarted run from doing it again, so one launch
with --max_restarts can be interrupted several times.
"""

import argparse
import json
import os
import signal
import sys

os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")

FIELDS = dict(dataset="synthetic", num_examples=1024, global_batch_size=64, epochs=3,
              optimizer="sgd", learning_rate=0.05, dropout=0.0, seed=0, backup_every_steps=4,
              verbose=2, steps_per_execution=1)  # the tests kill and save at exact steps
"""The run's TrainConfig fields, besides distribution and backup_dir."""


def _kill_spec(text: str) -> tuple[int, int, str]:
    step, worker, *sig = text.split(":")
    return int(step), int(worker), (sig[0] if sig else "KILL").upper()


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("out_dir")
    parser.add_argument("distribution")
    parser.add_argument("--kill", type=_kill_spec, action="append", default=[],
                        metavar="STEP:WORKER[:SIGNAL]")
    parser.add_argument("--config", default="{}", help="JSON of TrainConfig fields")
    args = parser.parse_args()

    import keras
    import numpy as np

    from tfmulti.cluster import tf_config
    from tfmulti.config import TrainConfig
    from tfmulti.training import train

    environ = tf_config.from_environ()
    index = int(environ["task"]["index"]) if environ else 0

    class Killer(keras.callbacks.Callback):
        def on_train_batch_end(self, batch, logs=None):
            step = int(self.model.optimizer.iterations.numpy())
            for kill_step, worker, sig in args.kill:
                marker = os.path.join(args.out_dir, f"killed-{kill_step}-{worker}")
                if step >= kill_step and index == worker and not os.path.exists(marker):
                    open(marker, "w").close()
                    print(f"resumable: worker {index} sends itself SIG{sig} at step {step}",
                          flush=True)
                    os.kill(os.getpid(), getattr(signal, f"SIG{sig}"))
                    return

    class Final(keras.callbacks.Callback):
        def on_train_end(self, logs=None):
            self.model_ref = self.model

    final = Final()
    fields = dict(FIELDS, distribution=args.distribution,
                  backup_dir=os.path.join(args.out_dir, "backup"))
    fields.update(json.loads(args.config))
    metrics = train(TrainConfig(**fields), callbacks=[Killer(), final])
    model = final.model_ref
    if tf_config.is_chief(environ):
        np.savez(os.path.join(args.out_dir, "final.npz"),
                 iterations=int(model.optimizer.iterations.numpy()),
                 *[np.asarray(w) for w in model.get_weights()])
        with open(os.path.join(args.out_dir, "metrics.json"), "w") as f:
            json.dump(metrics, f)
    return 0


if __name__ == "__main__":
    sys.exit(main())
