"""2-worker Keras training where worker 1 exits with code 3 at step 3.

    tfmulti launch --num_workers 2 -- python die_mid_training.py PID_DIR
"""

import os
import sys

os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")

from tfmulti.utils import deferred_imports  # noqa: E402

deferred_imports.install()  # the suite's own program: Keras' optional imports at first use

import keras  # noqa: E402

import tfmulti  # noqa: E402
from tfmulti import data
from tfmulti.models import builders as models  # noqa: E402
from tfmulti.cluster import tf_config  # noqa: E402

pid_dir = sys.argv[1]
rank = tf_config.from_environ()["task"]["index"]
with open(os.path.join(pid_dir, f"worker-{rank}.pid"), "w") as f:
    f.write(str(os.getpid()))
strategy = tfmulti.get_strategy("multi_worker")
model = models.build_model("mlp", strategy=strategy, seed=0)
models.compile_model(model, task="classification", strategy=strategy)
train = data.distribute(data.load("synthetic", num_examples=4096), strategy, 64, seed=0)


class DieAtStep(keras.callbacks.Callback):
    def on_train_batch_end(self, batch, logs=None):
        if rank == 1 and batch == 3:
            print("worker 1 exits now", flush=True)
            os._exit(3)


model.fit(**train.fit_kwargs(), epochs=50, verbose=0, callbacks=[DieAtStep()])
