"""What every recipe shares: flag parsing that turns bad input into one line
and exit code 2 (library errors restated in flag names), quieter
TensorFlow start-up logs and Keras' optional imports deferred (a recipe is
tfmulti's own program: each imports this module before anything imports Keras)."""

from __future__ import annotations

import os
import sys

from tfmulti.utils import deferred_imports, quiet  # (no TensorFlow)

quiet.install()  # TensorFlow's C++ start-up lines dropped, TF_CPP_MIN_LOG_LEVEL=2
deferred_imports.install()  # Keras' plotting, notebook and pandas imports at first use

from absl import app, flags, logging  # noqa: E402

from tfmulti.config import flags as config_flags  # noqa: E402  (no TensorFlow)
from tfmulti.cluster.exit_codes import USAGE  # noqa: E402


def usage_error(message: str) -> None:
    """Prints `<program>: error: <message>` and exits with code 2."""
    prog = os.path.basename(sys.argv[0] or "recipe")
    print(f"{prog}: error: {message}", file=sys.stderr)
    sys.exit(USAGE)


def parse_flags(argv: list[str]) -> list[str]:
    """absl flag parsing with a one-line error and exit code 2 (absl exits 1)."""
    try:  # the flag style of every tool: --num-workers, --no_x / --no-x as absl's --nox
        rest = flags.FLAGS(config_flags.absl_argv(argv))
    except flags.Error as e:
        usage_error(f"{e} (see --helpfull)")
    if not flags.FLAGS["verbosity"].present:
        logging.set_verbosity(logging.WARNING)  # TF's INFO chatter hides progress
    return rest


def run(main) -> None:
    """`app.run(main)`, with user errors (ValueError, and OSError such as a
    missing file, a full disk or no permission) as one line in flag names and
    exit code 2."""

    def guarded(argv):
        if len(argv) > 1:
            usage_error(f"unexpected arguments {argv[1:]}; every option is a --flag.")
        try:
            return main(argv)
        except (ValueError, OSError) as e:
            usage_error(config_flags.flag_message(str(e), extra_names=flags.FLAGS))

    app.run(guarded, flags_parser=parse_flags)
