"""Startup watchdog for a multi-worker process (no TensorFlow import).

    python -m tfmulti.cluster.watchdog PARENT_PID TIMEOUT_S PEERS_JSON TASK

Runs beside a process that is creating a MultiWorkerMirroredStrategy. That
call blocks inside TensorFlow's C++ runtime, holding the GIL, until every peer
has joined (an hour by default), so no Python thread of the process itself can
time it out. If the parent closes our stdin in time, we exit quietly;
otherwise we name the peers it waited for and kill it.
"""

from __future__ import annotations

import json
import os
import select
import signal
import socket
import sys

__all__ = ["main", "reachable"]


def reachable(address: str, timeout_s: float = 1.0) -> bool:
    host, _, port = address.rpartition(":")
    try:
        with socket.create_connection((host, int(port)), timeout=timeout_s):
            return True
    except (OSError, ValueError):
        return False


def main(argv: list[str]) -> int:
    parent, timeout_s, peers, task = int(argv[1]), float(argv[2]), json.loads(argv[3]), argv[4]
    ready, _, _ = select.select([sys.stdin], [], [], timeout_s)
    if ready:  # the parent closed the pipe: the cluster formed, or the parent died
        return 0
    missing = [p for p in peers if not reachable(p)]
    waited_for = missing or peers
    sys.stderr.write(
        f"tfmulti: error: the multi-worker cluster did not form within {timeout_s:g} s; "
        f"task {task} waited for peers {waited_for}"
        f"{' (not reachable)' if missing else ''}. Start every task of the cluster "
        "(TF_CONFIG, SLURM or the cluster resolver's list; e.g. with `tfmulti launch`), "
        "check addresses and firewalls, or raise the startup timeout (`startup_timeout`, "
        "TFMULTI_STARTUP_TIMEOUT, or `tfmulti launch --startup_timeout`). Stopping this "
        "process.\n")
    sys.stderr.flush()
    try:
        os.kill(parent, signal.SIGKILL)  # it cannot run Python code to exit by itself
    except ProcessLookupError:
        pass
    return 1


if __name__ == "__main__":
    sys.exit(main(sys.argv))
