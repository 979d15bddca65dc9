"""Saves tfmulti backups in a loop until killed (the crash-during-save test).

    python save_loop.py BACKUP_DIR

Every variable of a ~32 MB model is filled with the step number before each
save of that step, so a restored checkpoint is consistent exactly when all of
its values equal its step. Continues from the newest valid checkpoint; prints
`ready` once its first save is complete (the kills come after it, whatever
the load on the machine).
"""

import os
import sys

os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")


def model():
    import keras

    m = keras.Sequential([keras.Input((2048,)), keras.layers.Dense(4096)])
    m.compile("sgd", "mse")
    return m


def main(backup_dir):
    from tfmulti.training import backup

    m = model()
    saver = backup.Backup(backup_dir, m, keep=2, chief=True, task_index=0)
    step = backup.latest_valid(backup_dir).step
    first = step + 1
    while True:
        step += 1
        for v in m.variables:
            v.assign(v.numpy() * 0 + step)
        saver.save(step)
        if step == first:
            print("ready", flush=True)


if __name__ == "__main__":
    from tfmulti.utils import deferred_imports

    deferred_imports.install()  # the suite's own program: Keras' optional imports at first use
    main(sys.argv[1])
