"""gpu-check: what tfmulti does on this machine's NVIDIA GPUs, in at most 8 minutes.

    python recipes/gpu_check.py --output=runs/gpu_check.json     # or: make gpu-check

Runs `tfmulti env`, MirroredStrategy over every GPU with NCCL and with
hierarchical copy, mixed precision float16 and bfloat16, XLA on one GPU, a
2-stage pipeline over 2 logical GPUs carved from GPU 0, and the equivalence of
mirrored and one-device training (`benchmarks.gpu_check`); writes one JSON
file and prints a table with examples/s and GPU utilization for each. Without
an NVIDIA GPU it fails at once with one line (exit 1).
"""

from __future__ import annotations

import os
import sys

_RECIPES = os.path.dirname(os.path.abspath(__file__))
# A checkout-only script: `benchmarks` sits at the repository root, next to
# `recipes/`, and is not part of the installed package.
sys.path[:0] = [_RECIPES, os.path.dirname(_RECIPES)]
import _common  # noqa: E402  (sets the TF log level before TensorFlow loads)
from absl import flags  # noqa: E402

from benchmarks import gpu_check  # noqa: E402  (no TensorFlow: the checks run it)

_OUTPUT = flags.DEFINE_string("output", "runs/gpu_check.json", "Where to write the JSON.")
_SECONDS = flags.DEFINE_float("seconds", 10.0, "About how long each throughput measurement "
                              "times its steady-state epochs.", lower_bound=1.0)


def main(argv):
    try:
        results = gpu_check.run(_OUTPUT.value, seconds=_SECONDS.value)
    except gpu_check.NoGPUError as e:
        print(f"gpu_check.py: error: {e}", file=sys.stderr)
        return 1
    print(gpu_check.format_results(results))
    print(f"wrote {_OUTPUT.value} ({results['seconds']:.0f} s)")
    failed = [name for name, r in results["checks"].items() if r["status"] != "ok"]
    return 1 if failed else 0


if __name__ == "__main__":
    _common.run(main)
