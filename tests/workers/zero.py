"""The same run at zero_stage 0, 1 and 2, one after the other in one process
of a cluster (the strategy is the process's one), each backing up (kept, for
the test to resume on one device); stage 3 (which gathers the parameters in
the step, so it takes no accumulation loop: STAGE_3, one update of the same
examples per step) beside a stage-0 run of the same settings; then a one-device run's backups (the
test's) resumed on the 2 workers at stages 0 and 1; then stage 1 again, worker 1
killed (SIGKILL) in the middle of the second epoch: the launcher starts both
workers again, the finished runs return their published metrics, and the
killed one resumes from its last backup.

    tfmulti launch --num_workers 2 -- python zero.py OUT_DIR
        # each stage's run folder: OUT_DIR/stageK (metrics.json, model.keras),
        # its backup OUT_DIR/backupK; OUT_DIR/one_device_backupK resumed into
        # OUT_DIR/resumedK; every worker prints `stage K: BYTES` (its
        # optimizer state's bytes); the killed run's folder OUT_DIR/killed
"""

import json
import os
import sys

import tfmulti

SETTINGS = {"dataset": "synthetic", "num_examples": 256, "global_batch_size": 32,
            "model": "mlp", "accumulate_steps": 2, "verbose": 0}
"""What every run here and its resumption on one device share."""
STAGE_3 = {**SETTINGS, "global_batch_size": 64, "accumulate_steps": 1}
"""Stage 3's settings, and those of the stage-0 run it is compared with ("stage3-0")."""
KILL_AT, KILLED_BACKUP_EVERY = 7, 2
"""The killed run (4 steps per epoch) backs up every KILLED_BACKUP_EVERY steps;
worker 1 kills itself at step KILL_AT, so that the run resumes from step 6, in
the middle of its second epoch."""

if __name__ == "__main__":
    import killer  # the workers' directory is sys.path[0]

    out = sys.argv[1]
    for stage in (0, 1, 2):
        metrics = tfmulti.train(tfmulti.TrainConfig(
            distribution="multi_worker", zero_stage=stage, epochs=2,
            model_dir=f"{out}/stage{stage}", backup_dir=f"{out}/backup{stage}",
            keep_backup=True, **SETTINGS))
        print(f"stage {stage}: {sum(metrics.get('optimizer_state_bytes', {}).values())}",
              flush=True)
    for stage, name in ((0, "stage3-0"), (3, "stage3")):
        metrics = tfmulti.train(tfmulti.TrainConfig(
            distribution="multi_worker", zero_stage=stage, epochs=2, model_dir=f"{out}/{name}",
            backup_dir=f"{out}/{name}_backup", **STAGE_3))
        print(f"{name}: {sum(metrics.get('optimizer_state_bytes', {}).values())}", flush=True)
    for stage in (0, 1):
        tfmulti.train(tfmulti.TrainConfig(
            distribution="multi_worker", zero_stage=stage, epochs=2,
            model_dir=f"{out}/resumed{stage}", backup_dir=f"{out}/one_device_backup{stage}",
            **SETTINGS))
    index = json.loads(os.environ["TF_CONFIG"])["task"]["index"]
    tfmulti.train(tfmulti.TrainConfig(
        distribution="multi_worker", zero_stage=1, epochs=2, model_dir=f"{out}/killed",
        backup_dir=f"{out}/killed_backup", backup_every_steps=KILLED_BACKUP_EVERY,
        steps_per_execution=1, **SETTINGS),
        callbacks=[killer.callback(out, index, [(KILL_AT, 1, "KILL")], "zero")])
