"""`--kill STEP:WORKER[:SIGNAL]` for the test workers: the worker numbered
WORKER sends itself SIGNAL (KILL, the default, or TERM) at the first batch
end at or past global step STEP, once: a marker file in OUT_DIR stops a
restarted run from doing it again, so one launch with --max_restarts can be
interrupted several times."""

import os
import signal


def kill_spec(text: str) -> tuple[int, int, str]:
    """argparse `type` for STEP:WORKER[:SIGNAL]."""
    step, worker, *sig = text.split(":")
    return int(step), int(worker), (sig[0] if sig else "KILL").upper()


def callback(out_dir: str, index: int, kills, name: str):
    """A Keras callback doing `kills` for worker `index`; says so as `name: ...`."""
    import keras

    class Killer(keras.callbacks.Callback):
        def on_train_batch_end(self, batch, logs=None):
            step = int(self.model.optimizer.iterations.numpy())
            for kill_step, worker, sig in kills:
                marker = os.path.join(out_dir, f"killed-{kill_step}-{worker}")
                if step >= kill_step and index == worker and not os.path.exists(marker):
                    open(marker, "w").close()
                    print(f"{name}: worker {index} sends itself SIG{sig} at step {step}",
                          flush=True)
                    os.kill(os.getpid(), getattr(signal, f"SIG{sig}"))
                    return

    return Killer()
