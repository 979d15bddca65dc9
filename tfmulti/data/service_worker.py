"""A tf.data service worker process (`tfmulti.data.service.LocalService`
starts it; its cores are set before TensorFlow starts its thread pools):

    python -m tfmulti.data.service_worker --dispatcher=HOST:PORT [--cpus=1,2]
        [--import=MODULE] [--parent=PID]
"""

from __future__ import annotations

import argparse
import ctypes
import importlib
import os
import signal
import sys

HEARTBEAT_MS = 1000
_PR_SET_PDEATHSIG = 1


def main(argv: list[str]) -> int:
    parser = argparse.ArgumentParser(prog="python -m tfmulti.data.service_worker")
    parser.add_argument("--dispatcher", required=True)
    parser.add_argument("--host", default="localhost")
    parser.add_argument("--cpus", default="")
    parser.add_argument("--import", dest="imports", action="append", default=[])
    parser.add_argument("--parent", type=int, default=0,
                        help="end with this process (Linux: the parent-death signal)")
    args = parser.parse_args(argv)
    if args.parent:
        try:
            ctypes.CDLL(None, use_errno=True).prctl(_PR_SET_PDEATHSIG, int(signal.SIGKILL),
                                                    0, 0, 0)
        except (OSError, AttributeError):  # not Linux: the parent stops its workers itself
            pass
        if os.getppid() != args.parent:  # it ended before the signal was set
            return 1
    if args.cpus:  # before TensorFlow sizes its thread pools
        try:
            os.sched_setaffinity(0, {int(c) for c in args.cpus.split(",")})
        except OSError as e:  # outside this container's cpuset: where the parent runs
            print(f"tfmulti: warning: the service worker cannot run on CPUs {args.cpus} "
                  f"({e}); it runs on {sorted(os.sched_getaffinity(0))}", file=sys.stderr)
    import tensorflow as tf  # pylint: disable=import-outside-toplevel

    from tfmulti.data.service import READY  # pylint: disable=import-outside-toplevel

    for name in args.imports:  # the custom ops a dataset uses
        importlib.import_module(name)
    svc = tf.data.experimental.service
    worker = svc.WorkerServer(svc.WorkerConfig(
        dispatcher_address=args.dispatcher, worker_address=f"{args.host}:%port%",
        protocol="grpc", heartbeat_interval_ms=HEARTBEAT_MS))
    print(READY, flush=True)
    worker.join()
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
