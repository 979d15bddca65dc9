"""The bad-input campaign: over 100 malformed inputs to tfmulti's entry points,
each of which must end in one line on stderr, exit code 2, writing nothing.

    python recipes/bad_inputs.py --output=runs/bad_inputs/bad_inputs.json

Feeds `recipes/train.py` and the `tfmulti` subcommands `launch`, `diagnose`,
`estimate-memory`, `export` and `env` bad flags, TF_CONFIG values, hook
strings, data functions' data, files, host lists and launch secrets, each in a
fresh temporary folder as its working directory, 2 at a time, each with a
timeout; checks each: exit code 2, one non-empty line on stderr besides
TensorFlow's C++ log lines, no traceback, the folder unchanged. Two controls
(valid inputs made of the same fixtures) must train and exit 0. Prints one
line per input and a table by category; writes every input's record to
--output. The method and what counts: `benchmarks.bad_inputs`. Exits 1 when
an input failed. Run it as root: the inputs about unreadable files run as
`nobody` without capabilities (setpriv).
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

from benchmarks import bad_inputs  # noqa: E402  (no TensorFlow: the inputs run it)

_OUTPUT = flags.DEFINE_string("output", "runs/bad_inputs/bad_inputs.json",
                              "Where to write the JSON.")
_CATEGORIES = flags.DEFINE_list("categories", [], "Run only the inputs of these categories: "
                                f"any of {', '.join(bad_inputs.CATEGORIES)} (default: all).")
_EARLY_ONLY = flags.DEFINE_bool("early_only", False, "Run only the inputs refused before "
                                "TensorFlow starts (seconds each).")
_JOBS = flags.DEFINE_integer("jobs", 2, "Inputs run at once.", lower_bound=1)
_TIMEOUT = flags.DEFINE_float("timeout", 300.0, "Seconds an input may take (those refused "
                              f"before TensorFlow starts: at most {bad_inputs.EARLY_TIMEOUT:g}).")
_WORKDIR = flags.DEFINE_string("workdir", None, "Where the inputs' folders go (default: a new "
                               "temporary folder, removed when every input passed).")
_KEEP = flags.DEFINE_bool("keep", False, "Keep every input's folder; by default only those "
                          "of the inputs that failed stay.")


def main(argv):
    if os.geteuid() != 0:
        raise ValueError("the campaign runs the inputs about unreadable files as `nobody` "
                         "(setpriv): run it as root.")
    # SIGTERM stops the campaign as Ctrl-C does.
    signal.signal(signal.SIGTERM, lambda signum, frame: sys.exit(128 + signum))
    cases = bad_inputs.select(categories=tuple(_CATEGORIES.value), early_only=_EARLY_ONLY.value)
    result = bad_inputs.run_campaign(
        _OUTPUT.value, cases=cases, jobs=_JOBS.value, timeout=_TIMEOUT.value,
        workdir=_WORKDIR.value, keep=_KEEP.value,
        command=" ".join(["python", "recipes/bad_inputs.py", *sys.argv[1:]]))
    return 0 if result["complete"] and not result["failed"] else 1


if __name__ == "__main__":
    _common.run(main)
