"""Process plumbing shared by the launcher, the supervisor and the launchers'
coordination (no TensorFlow): whole-line output from several threads, stop
signals, pipe pumps, and how an attempt of the workers ended."""

from __future__ import annotations

import dataclasses
import os
import signal
import threading
from typing import Callable, TextIO

__all__ = ["ERROR_PREFIX", "NAMESPACE_READY", "NETWORK_ATTACHED", "Outcome", "Output", "PREFIX",
           "SUPERVISOR_ENDED", "StopSignals", "children", "pump"]

PREFIX = "tfmulti launch"
ERROR_PREFIX = f"{PREFIX}: error: "
NAMESPACE_READY = f"{PREFIX}: internal: the namespace is ready\n"
"""What the supervisor's parent prints, inside its namespaces, before it waits for the
launcher to attach the namespace's outbound network (`tfmulti.cluster.outbound`)."""
NETWORK_ATTACHED = "attached\n"
"""The launcher's answer when it did attach it (anything else: the workers run without)."""
SUPERVISOR_ENDED = f"{PREFIX}: internal: the supervisor ends\n"
"""What the supervisor prints last as it returns (a killed one cannot): its exit status
is then the workers' (137 for a worker killed by SIGKILL), not its own death."""
POLL_S = 0.05
READER_JOIN_S = 5.0
REAP_TIMEOUT_S = 5.0


@dataclasses.dataclass(frozen=True)
class Outcome:
    """How one attempt of a host's workers ended."""

    status: int
    """0 when every worker exited 0; else the status of the first that failed, or 128 + N
    for signal N to the launcher."""
    why: str = ""
    """What happened, in words: "worker 3 failed with exit code 137 (killed by SIGKILL)"."""
    signalled: bool = False
    """The launcher got SIGINT or SIGTERM: never restart."""
    by_peer: bool = False
    """The workers were stopped because of another host's (`why` says what)."""

    def to_message(self) -> dict:
        return dataclasses.asdict(self)


class Output:
    """Writes whole lines to a text stream from several threads."""

    def __init__(self, stream: TextIO):
        self._stream = stream
        self._lock = threading.Lock()

    def line(self, text: str) -> None:
        with self._lock:
            try:
                self._stream.write(text if text.endswith("\n") else text + "\n")
                flush = getattr(self._stream, "flush", None)
                if flush:
                    flush()
            except (OSError, ValueError):
                pass  # a closed or broken output must not stop the draining of the pipes

    def say(self, message: str) -> None:
        self.line(f"{PREFIX}: {message}")


class StopSignals:
    """Records SIGINT/SIGTERM while active (only the main thread can install handlers)."""

    def __init__(self):
        self.received: int | None = None
        self.count = 0
        self._old: dict = {}

    def __enter__(self) -> "StopSignals":
        if threading.current_thread() is threading.main_thread():
            for sig in (signal.SIGINT, signal.SIGTERM):
                self._old[sig] = signal.signal(sig, self._handle)
        return self

    def _handle(self, signum, frame) -> None:
        self.count += 1
        if self.received is None:
            self.received = signum

    def __exit__(self, *exc) -> None:
        for sig, handler in self._old.items():
            signal.signal(sig, handler)


def pump(pipe, prefix: str, out: Output, on_line: Callable[[str], bool] | None = None):
    """Copies lines from `pipe` to `out` with `prefix`, in a daemon thread."""

    def run():
        with pipe:
            for raw in iter(pipe.readline, b""):
                text = raw.decode("utf-8", "replace")
                if on_line is None or on_line(text):
                    out.line(prefix + text)

    thread = threading.Thread(target=run, daemon=True, name=f"tfmulti-pump{prefix}")
    thread.start()
    return thread


def children(parent: int) -> list[int]:
    """The processes whose parent is `parent` (from /proc; the PIDs as this process sees
    them)."""
    found = []
    for name in os.listdir("/proc"):
        if not name.isdigit():
            continue
        try:
            with open(f"/proc/{name}/stat", "rb") as f:
                stat = f.read()
        except OSError:
            continue  # exited meanwhile
        if int(stat.rsplit(b")", 1)[1].split()[1]) == parent:
            found.append(int(name))
    return found
