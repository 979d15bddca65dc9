"""Trains every corpus program in turn on a 2-worker cluster, one launch for
all (each start of a cluster costs TensorFlow's import):

    tfmulti launch --num_workers 2 -- python tests/workers/corpus.py OUT_DIR NAME...

Each program's run writes OUT_DIR/NAME (the chief's metrics.json and
model.keras); a program that fails on every worker alike (a refusal before
training, or an error in its first step) is written as OUT_DIR/NAME.refused,
its error's type and message, and the next program runs.
"""

import json
import os
import sys

os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")
sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))))

import tensorflow as tf  # noqa: E402

# Grappler off, as in the pytest processes (tests/conftest.py says why): these
# workers trace every program of the corpus, and the suite's processes that run
# the user's commands (recipes, `tfmulti train` under the launcher, notebooks,
# the docs) keep it on. Measured here (the test module, its plain-Keras
# references included): test_keras_hub's cluster 110 CPU-s with it, 80 without;
# test_corpus' 104 and 95; the same figures.
tf.config.optimizer.set_experimental_options({"disable_meta_optimizer": True})

import tfmulti  # noqa: E402
from tests.corpus import harness  # noqa: E402


def main(out_dir: str, names: list[str]) -> None:
    chief = json.loads(os.environ["TF_CONFIG"])["task"]["index"] == 0
    for name in names:
        folder = os.path.join(out_dir, name)
        config = tfmulti.TrainConfig(distribution="multi_worker", model_dir=folder,
                                     **harness.config_kwargs(name))
        try:
            tfmulti.train(config)
        except (tf.errors.UnavailableError, tf.errors.DeadlineExceededError,
                tf.errors.CancelledError):
            # The cluster itself failed (a worker stopped answering): the next
            # program would wait for it forever; the launch fails now instead.
            print(f"corpus: {name} lost its cluster", flush=True)
            raise
        except Exception as e:  # pylint: disable=broad-except  (reported, then the next one)
            line = f"{type(e).__name__}: {str(e).strip().splitlines()[0] if str(e).strip() else ''}"
            print(f"corpus: {name} refused: {line}", flush=True)
            if chief:
                with open(folder + ".refused", "w") as f:
                    f.write(line)
            continue
        print(f"corpus: {name} trained", flush=True)


if __name__ == "__main__":
    main(sys.argv[1], sys.argv[2:])
