"""A worker's notice to the launcher that it saves on SIGTERM (no TensorFlow).

A MultiWorkerMirroredStrategy worker does not die of SIGTERM: TensorFlow's
coordination service installs a C++ SIGTERM handler in every worker when the
strategy starts (tsl's `SigtermNotifier`, for its own preemption notices), and
that handler only records the signal. So when the launcher stops the workers it
cannot count on SIGTERM to end them; it gives the grace period only to workers
that need it to save, and SIGKILLs the others after `STOP_WITHOUT_SAVE_S`.

A worker says it saves on SIGTERM by holding a file: the launcher names one per
worker in the environment variable `ENV`, and the worker creates it (`post`)
while a SIGTERM handler of its own would save, and removes it (`withdraw`) when
that ends. `tfmulti.training.backup` does so while it trains; a worker script of
your own that saves on SIGTERM (with TensorFlow's `PreemptionCheckpointHandler`,
say) can do the same to get the grace period.
"""

from __future__ import annotations

import os
from typing import Mapping

__all__ = ["ENV", "STOP_WITHOUT_SAVE_S", "post", "posted", "withdraw"]

ENV = "TFMULTI_SAVE_NOTICE"
"""The environment variable that names the file a worker holds while it saves on
SIGTERM (set by `tfmulti launch` for each worker)."""
STOP_WITHOUT_SAVE_S = 5.0
"""Seconds the launcher waits, after SIGTERM, for a worker that holds no notice (and
whose peers hold none) to exit, before it sends SIGKILL."""


def _path(environ: Mapping[str, str] | None) -> str | None:
    return (os.environ if environ is None else environ).get(ENV) or None


def post(environ: Mapping[str, str] | None = None) -> bool:
    """Creates the notice file `ENV` names (in `environ`, by default `os.environ`): this
    process saves on SIGTERM from now on. Returns whether there was one to create (a
    process that `tfmulti launch` did not start has none)."""
    path = _path(environ)
    if path is None:
        return False
    try:
        with open(path, "w", encoding="utf-8") as f:
            f.write(f"{os.getpid()}\n")
    except OSError:
        return False  # the worst case is the old one: a SIGKILL before the save
    return True


def withdraw(environ: Mapping[str, str] | None = None) -> None:
    """Removes the notice file: this process no longer saves on SIGTERM."""
    path = _path(environ)
    if path is not None:
        try:
            os.remove(path)
        except OSError:
            pass


def posted(path: str) -> bool:
    """Whether the worker whose notice file is `path` currently saves on SIGTERM."""
    return os.path.exists(path)
