"""A 2-task SLURM job step, faked on one host: `tfmulti.training.backup.fit` on a
cluster whose roles come from SLURM's variables alone (no TF_CONFIG).

    tfmulti launch --num_workers 2 -- python slurm_backup.py OUT_DIR
                   [--kill STEP:TASK[:SIGNAL] ...]

The launcher only starts the processes (inside its private network
namespace, where SLURM's ports 8888-8889 are free): each takes its task
number from the launcher's TF_CONFIG, then removes TF_CONFIG and sets what
`srun` sets (SLURM_PROCID, SLURM_STEP_NUM_TASKS=2, SLURM_STEP_NODELIST=
localhost, ...) before TensorFlow starts, and joins with
`tfmulti.get_strategy("multi_worker", cluster_resolver="slurm")`.

It trains `build_model()` (tests/workers/user_model.py: dict inputs, a
residual, a loss of its own) on `dataset_from` with a backup in
OUT_DIR/backup, prints its cluster role, and at the end: the chief writes
OUT_DIR/final-<task>.npz (weights, step count, its predictions on `probe()`);
every task calls `tfmulti.training.export.saved_model(model, OUT_DIR/serving)` (the
chief writes it). Each --kill makes task TASK send itself SIGNAL at global
step STEP, once (tests/workers/killer.py).
"""

import argparse
import json
import os
import sys

os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")

try:  # run as a worker script (its directory is sys.path[0]) or imported by the tests
    import killer
    import user_model
except ImportError:
    from tests.workers import killer, user_model

EPOCHS, STEPS_PER_EPOCH, GLOBAL_BATCH, SAVE_EVERY = 2, 16, 32, 4
NUM_EXAMPLES = STEPS_PER_EPOCH * GLOBAL_BATCH


def probe():
    """Inputs to compare the trained model and its SavedModel on."""
    return user_model.as_inputs(user_model.examples(NUM_EXAMPLES)[0][:20])


def build_model():
    """The user's model, compiled with the user's loss."""
    import keras

    model = user_model.functional_model(seed=7)
    model.compile(keras.optimizers.SGD(0.1), user_model.loss)
    return model


def dataset_from(strategy):
    """`dataset_from(step)` for `backup.fit`: the run's stream on `strategy`."""
    import tensorflow as tf

    from tfmulti import data

    x, y = user_model.examples(NUM_EXAMPLES)
    source = tf.data.Dataset.from_tensor_slices((user_model.as_inputs(x), y))
    return lambda step: data.distribute(source, strategy, GLOBAL_BATCH, seed=0,
                                        skip_steps=step).dataset


def fit(model, strategy, backup_dir: str, callbacks=()):
    from tfmulti.training import backup

    return backup.fit(model, dataset_from(strategy), epochs=EPOCHS,
                      steps_per_epoch=STEPS_PER_EPOCH, backup_dir=backup_dir,
                      save_every_steps=SAVE_EVERY, callbacks=list(callbacks), verbose=2,
                      fingerprint={"global_batch_size": GLOBAL_BATCH, "seed": 0})


def _fake_srun(task: int) -> None:
    os.environ.pop("TF_CONFIG")
    os.environ.update(SLURM_PROCID=str(task), SLURM_LOCALID=str(task), SLURM_NODEID="0",
                      SLURM_NTASKS="2", SLURM_STEP_NUM_TASKS="2", SLURM_JOB_NUM_NODES="1",
                      SLURM_STEP_NODELIST="localhost", SLURM_STEP_TASKS_PER_NODE="2")


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("out_dir")
    parser.add_argument("--kill", type=killer.kill_spec, action="append", default=[],
                        metavar="STEP:TASK[:SIGNAL]")
    args = parser.parse_args()
    task = int(json.loads(os.environ["TF_CONFIG"])["task"]["index"])
    _fake_srun(task)

    import numpy as np

    import tfmulti
    from tfmulti.training import export

    strategy = tfmulti.get_strategy("multi_worker", cluster_resolver="slurm")
    role = tfmulti.runtime.strategy.cluster_role(strategy)
    print(f"slurm_backup: task {task}: chief={role.is_chief} rank={role.worker_index} "
          f"of {role.num_workers}", flush=True)

    with strategy.scope():
        model = build_model()
    kills = killer.callback(args.out_dir, task, args.kill, "slurm_backup")
    result = fit(model, strategy, os.path.join(args.out_dir, "backup"), [kills])
    predictions = model(probe(), training=False).numpy()
    if role.is_chief:
        np.savez(os.path.join(args.out_dir, f"final-{task}.npz"),
                 iterations=int(model.optimizer.iterations.numpy()), predictions=predictions,
                 resumed_step=result.resumed_step,
                 **{f"w{i}": np.asarray(w) for i, w in enumerate(model.get_weights())})
    written = export.saved_model(model, os.path.join(args.out_dir, "serving"))
    print(f"slurm_backup: task {task} exported: {written}", flush=True)
    result.delete_backup()  # after the results: the chief deletes, the other task nothing
    return 0


if __name__ == "__main__":
    from tfmulti.utils import deferred_imports

    deferred_imports.install()  # the suite's own program: Keras' optional imports at first use
    sys.exit(main())
