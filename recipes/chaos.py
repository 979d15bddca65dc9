"""The fault-injection campaign: kill a 2-worker training with backups at random
moments of every phase, resume it, and check that nothing was lost.

    python recipes/chaos.py --kills=30 --output=runs/chaos/chaos.json
    python recipes/chaos.py --kills=30 --optimizer=adam --zero_stage=1 \
        --output=runs/chaos/chaos_sharded.json   # a sharded run's backups

Runs `recipes/train.py` under `tfmulti launch --num_workers 2 --max_restarts
K` once uninterrupted (the reference), then once per kill: SIGKILL or SIGTERM
to a random worker during a save, the restore, the preemption agreement, the
evaluation, the final writes, the exit of the finished run, or at a random
time; the launcher restarts the cluster until the run completes. Each kill is
checked: the final weights and optimizer state equal the reference's within
1e-5 (the optimizer's step count too: no step trained twice or skipped),
every restart resumed from the newest complete backup, and nothing outside
the run's directories changed.
Prints one line per trial and a table (kills by phase and signal, resumed
exactly, lost); writes every trial's record to --output. The method:
`benchmarks.chaos`. Exits 1 when a kill was not resumed exactly.
"""

from __future__ import annotations

import os
import signal
import sys

_RECIPES = os.path.dirname(os.path.abspath(__file__))
# A checkout-only script: `benchmarks` sits at the repository root, next to
# `recipes/`, and is not part of the installed package.
sys.path[:0] = [_RECIPES, os.path.dirname(_RECIPES)]
import _common  # noqa: E402  (sets the TF log level before TensorFlow loads)
from absl import flags  # noqa: E402

from benchmarks import chaos  # noqa: E402  (no TensorFlow: the trials run it in workers)
from tfmulti.config.train_config import OPTIMIZERS, ZERO_STAGES

_KILLS = flags.DEFINE_integer("kills", 30, "How many kills to count (trials whose kill never "
                              "fires are replaced).", lower_bound=1)
_PHASES = flags.DEFINE_list("phases", list(chaos.PHASES),
                            f"The phases to aim kills at: any of {', '.join(chaos.PHASES)}.")
_SEED = flags.DEFINE_integer("seed", 0, "Seed of the plan: signals, workers, steps, delays.")
_OUTPUT = flags.DEFINE_string("output", "runs/chaos/chaos.json", "Where to write the JSON.")
_WORKDIR = flags.DEFINE_string("workdir", None, "Where the trials run (default: a new "
                               "temporary folder, removed when every kill resumed exactly).")
_KEEP = flags.DEFINE_bool("keep", False, "Keep every trial's folder (logs, outputs); by "
                          "default only those of the trials that lost something stay.")
_OPTIMIZER = flags.DEFINE_enum("optimizer", chaos.Setup.optimizer, OPTIMIZERS,
                               "The run's optimizer.")
_ZERO_STAGE = flags.DEFINE_enum("zero_stage", str(chaos.Setup.zero_stage),
                                [str(stage) for stage in ZERO_STAGES],
                                "Shard the run's optimizer state over its 2 workers (1 or 2; "
                                "with an optimizer that has slots, --optimizer=adam).")
_GRACE_PERIOD = flags.DEFINE_float("grace_period", chaos.Setup.grace_period,
                                   "The launcher's seconds between SIGTERM and SIGKILL.")


def main(argv):
    # SIGTERM stops the campaign as Ctrl-C does: the launch under way is stopped too.
    signal.signal(signal.SIGTERM, lambda signum, frame: sys.exit(128 + signum))
    try:
        result = chaos.run_campaign(
            _KILLS.value, _OUTPUT.value, phases=tuple(_PHASES.value), seed=_SEED.value,
            setup=chaos.Setup(optimizer=_OPTIMIZER.value, zero_stage=int(_ZERO_STAGE.value),
                              grace_period=_GRACE_PERIOD.value), workdir=_WORKDIR.value,
            keep=_KEEP.value, command=" ".join(["python", "recipes/chaos.py", *sys.argv[1:]]))
    except RuntimeError as e:  # the uninterrupted reference run failed: nothing to compare
        print(f"chaos: error: {e}", file=sys.stderr)
        return 1
    return 0 if result["complete"] and result["exact"] == result["fired"] else 1


if __name__ == "__main__":
    _common.run(main)
