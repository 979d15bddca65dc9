"""One worker of `tfmulti.cluster.notebook_launcher` (internal):

    python -m tfmulti.cluster._notebook_worker PAYLOAD RESULT_DIR

PAYLOAD holds the kernel's sys.path (pickle) followed by (function, args) (cloudpickle).
Worker 0 writes its pickled return value to RESULT_DIR/result-0.pkl; a worker whose function
raises writes the traceback to RESULT_DIR/error-RANK.txt and exits 1.
"""

from __future__ import annotations

import json
import os
import pickle
import sys
import traceback

from tfmulti.utils import deferred_imports

__all__ = ["main"]


def _rank() -> int:
    return int(json.loads(os.environ["TF_CONFIG"])["task"]["index"])


def _write(result_dir: str, name: str, data: bytes) -> None:
    tmp = os.path.join(result_dir, f".{name}.tmp")
    with open(tmp, "wb") as f:
        f.write(data)
    os.replace(tmp, os.path.join(result_dir, name))


def _fail(result_dir: str, rank: int, text: str) -> int:
    sys.stderr.write(text)
    sys.stderr.flush()
    _write(result_dir, f"error-{rank}.txt", text.encode("utf-8", "backslashreplace"))
    return 1


def main(argv: list[str]) -> int:
    if len(argv) != 2:
        print("usage: python -m tfmulti.cluster._notebook_worker PAYLOAD RESULT_DIR", file=sys.stderr)
        return 2
    payload_path, result_dir = argv
    rank = _rank()
    try:
        with open(payload_path, "rb") as f:
            kernel_path = pickle.load(f)
            # The kernel's order: its own entries (e.g. a local checkout put
            # first with sys.path.insert(0, ...)) before site-packages.
            sys.path[:0] = [p for p in kernel_path if p not in sys.path]
            function, args = pickle.load(f)
        value = function(*args)
    except Exception:
        return _fail(result_dir, rank, traceback.format_exc())
    if rank == 0:
        import cloudpickle

        try:
            data = cloudpickle.dumps(value)
        except Exception as e:
            return _fail(result_dir, rank, (
                f"ValueError: the function's return value cannot be pickled "
                f"({type(e).__name__}: {e}); return plain Python values (numbers, strings, "
                "dicts, NumPy arrays), e.g. `history.history` instead of a model or tensor.\n"))
        _write(result_dir, "result-0.pkl", data)
    return 0


if __name__ == "__main__":
    # The worker's process is tfmulti's own: Keras' optional imports wait for their first
    # use (tfmulti.utils.deferred_imports), installed before the function imports Keras.
    deferred_imports.install()
    sys.exit(main(sys.argv[1:]))
