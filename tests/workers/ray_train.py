"""A small run on Ray, as a user's driver script runs it (tests/integration/test_ray.py).

    python ray_train.py OUT_DIR [--kill_at_step N]

Trains `CONFIG` (tiny, synthetic data, a backup every `BACKUP_EVERY` steps) on 2
Ray workers with `tfmulti.ray.train`, on a local Ray it starts and stops;
Ray's storage for the run is OUT_DIR/ray, so the outputs land in
OUT_DIR/ray/run/model. With --kill_at_step, worker 1 sends itself SIGKILL when
it passes global step N (the failpoint `backup.step`, once: OUT_DIR/fired says
it fired), and Ray starts the workers again. Prints the RayRun as one JSON line
last.
"""

import argparse
import dataclasses
import json
import os
import sys

REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
# 2 epochs of 8 steps, a backup every 2: the kill (test_ray.KILL_AT_STEP, step 6)
# resumes from a backup in the middle of the first epoch, and the resumed run
# crosses an epoch end; more steps would only add work to both runs.
EPOCHS, STEPS_PER_EPOCH, GLOBAL_BATCH, BACKUP_EVERY = 2, 8, 64, 2
CONFIG = {"distribution": "multi_worker", "dataset": "synthetic",
          "num_examples": STEPS_PER_EPOCH * GLOBAL_BATCH, "epochs": EPOCHS,
          "global_batch_size": GLOBAL_BATCH, "backup_every_steps": BACKUP_EVERY,
          "steps_per_execution": 1, "verbose": 0, "seed": 0}
FLAGS = [f"--{name}={value}" for name, value in CONFIG.items()]
"""The same run as `recipes/train.py` flags (the uninterrupted reference under `tfmulti launch`)."""


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("out_dir")
    parser.add_argument("--kill_at_step", type=int)
    args = parser.parse_args()
    sys.path.insert(0, REPO)
    from tfmulti import TrainConfig
    from tfmulti.ray import train

    config = TrainConfig(**CONFIG)
    # On a busy machine the two workers import TensorFlow at their own pace: the
    # first waits for the other up to 300 s (60 by default).
    env = {"PYTHONPATH": REPO, "TFMULTI_STARTUP_TIMEOUT": "300"}
    if args.kill_at_step:
        env["TFMULTI_FAULTS"] = (f"benchmarks.failpoints:point=backup.step,worker=1,"
                                 f"hit={args.kill_at_step},signal=KILL,"
                                 f"once={os.path.join(args.out_dir, 'fired')}")
    run = train(config, num_workers=2, max_failures=2, name="run",
                storage_path=os.path.join(args.out_dir, "ray"), worker_env=env)
    print(json.dumps(dataclasses.asdict(run)), flush=True)


if __name__ == "__main__":
    main()
