"""A failpoint module that holds a worker mid-run until the test lets it go, so
that a signal from outside (a scheduler's: `scancel --signal=TERM`) lands
while it trains, whatever the machine's speed.

    TFMULTI_FAULTS="tests.workers.hold:step=5,dir=/tmp/x"

makes SLURM task 0 (`SLURM_PROCID`, else TF_CONFIG's index), at its 5th pass
through `backup.step` (the end of a call of training steps), write
/tmp/x/held and wait until /tmp/x/release exists (at most `MAX_HOLD_S`); its
peers wait for it at their next all-reduce. It holds once: where /tmp/x/held
exists (a requeued run of the same job), it does nothing. The workers need this
checkout on PYTHONPATH.
"""

from __future__ import annotations

import os
import time

MAX_HOLD_S = 300.0


def arm(spec: str):
    """The function the product's failpoints call (see the module's docstring)."""
    fields = dict(item.split("=", 1) for item in spec.split(","))
    step, folder = int(fields["step"]), fields["dir"]
    rank = os.environ.get("SLURM_PROCID")
    if rank is None:
        from tfmulti.cluster import tf_config

        config = tf_config.from_environ()
        rank = str(config["task"]["index"] if config else 0)
    held, release = os.path.join(folder, "held"), os.path.join(folder, "release")
    passes = 0

    def fire(name: str) -> None:
        nonlocal passes
        if name != "backup.step" or rank != "0":
            return
        passes += 1
        if passes != step or os.path.exists(held):
            return
        with open(held, "w") as f:
            f.write(str(os.getpid()))
        deadline = time.monotonic() + MAX_HOLD_S
        while not os.path.exists(release) and time.monotonic() < deadline:
            time.sleep(0.05)

    return fire
