"""Tables sharded by rows (`shard_embeddings`) on a cluster: the two-tower
model of `tests.tables` trained whole, then with its tables sharded (backing
up, kept, for the test to resume on one device), then sharded again with
worker 1 killed (SIGKILL) in the middle of the second epoch: the launcher
starts both workers again, the finished runs return their published metrics,
and the killed one resumes from its last backup.

    tfmulti launch --num_workers 2 -- python shard_embeddings.py OUT_DIR
        # run folders OUT_DIR/whole, OUT_DIR/sharded (its backup
        # OUT_DIR/sharded_backup), OUT_DIR/killed
"""

import json
import os
import sys

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", ".."))

import tfmulti  # noqa: E402
from tests.tables import clicks, two_tower  # noqa: E402

SETTINGS = {"distribution": "multi_worker", "model": two_tower, "dataset": clicks,
            "global_batch_size": 64, "epochs": 2, "verbose": 0}
"""What every run here shares (4 steps per epoch)."""
KILL_AT, KILLED_BACKUP_EVERY = 7, 2
"""Worker 1 kills itself at step KILL_AT of the killed run, which backs up every
KILLED_BACKUP_EVERY steps: it resumes from step 6, in its second epoch."""

if __name__ == "__main__":
    import killer  # the workers' directory is sys.path[1]

    out = sys.argv[1]
    tfmulti.train(tfmulti.TrainConfig(model_dir=f"{out}/whole", backup_dir=f"{out}/whole_backup",
                                      **SETTINGS))
    tfmulti.train(tfmulti.TrainConfig(
        model_dir=f"{out}/sharded", shard_embeddings=True, backup_dir=f"{out}/sharded_backup",
        keep_backup=True, **SETTINGS))
    index = json.loads(os.environ["TF_CONFIG"])["task"]["index"]
    tfmulti.train(tfmulti.TrainConfig(
        model_dir=f"{out}/killed", shard_embeddings=True, backup_dir=f"{out}/killed_backup",
        backup_every_steps=KILLED_BACKUP_EVERY, steps_per_execution=1, **SETTINGS),
        callbacks=[killer.callback(out, index, [(KILL_AT, 1, "KILL")], "shard_embeddings")])
