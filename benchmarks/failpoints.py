"""The fault campaign's failpoints: which worker sends itself which signal at
which pass of which of the product's failpoints (pure Python, no TensorFlow).

The product marks the places (`tfmulti.utils.failpoints.failpoint(name)`, a
no-op unless `TFMULTI_FAULTS` arms it); this module names them (`POINTS`),
writes and reads the faults, and fires them. The campaign (`benchmarks.chaos`)
and the tests kill workers at exact moments: during a save, the restore, the
preemption agreement, the evaluation, the final writes. The environment of
the workers gets

    TFMULTI_FAULTS="benchmarks.failpoints:point=backup.save,worker=1,hit=2,signal=KILL,delay=0.05,once=/x/m1"

(`environ_value`; the workers need this checkout on PYTHONPATH), and makes
worker 1 send itself SIGKILL 0.05 s after it passes `backup.save` for the
second time. A worker's rank is its TF_CONFIG task index
(`tfmulti.cluster.tf_config`; 0 without TF_CONFIG). Several faults are
separated by `;`. Fields:

    point   the failpoint (one of `POINTS`); required
    worker  the rank it applies to; default: every worker
    hit     fire at this pass through the point in this process; default 1
    signal  KILL (dies at once), TERM (tfmulti's preemption path), INT, ...;
            default KILL
    delay   seconds from the hit to the signal, sent from a timer thread, so
            that it lands inside what follows the point (the process waits for
            it before exiting: a worker that finished is still killed during
            its peers' work); default 0 (at once)
    once    a file: the fault fires only if the file does not exist, and
            creates it (JSON: point, worker, hit, signal, pid, time, and
            `landed`, the last point this process passed when the signal went
            out), so that a restarted worker does not fire it again, and the
            caller learns that, when and where it fired

SIGKILL ends the process at once. SIGTERM takes the path a scheduler's
preemption takes (tfmulti.training.backup's agreed save, or the default action
outside training). Example:

    >>> from benchmarks import failpoints
    >>> failpoints.parse("point=backup.save,worker=1,hit=2,signal=term")
    [Fault(point='backup.save', worker=1, hit=2, signal='TERM', delay=0.0, once=None)]
"""

from __future__ import annotations

import collections
import dataclasses
import json
import math
import os
import signal
import sys
import threading
import time
from typing import Callable

from tfmulti.cluster import tf_config
from tfmulti.utils.failpoints import ENV

__all__ = ["ENV", "MODULE", "POINTS", "Fault", "arm", "environ_value", "format_faults", "parse"]

MODULE = "benchmarks.failpoints"
"""This module, as `TFMULTI_FAULTS` names it (`environ_value`)."""

POINTS = {
    "backup.step": "a training step ended (the backup's batch-end hook, before the "
                   "preemption check)",
    "backup.save": "a save begins, before the checkpoint is written (every worker)",
    "backup.saved": "a save's checkpoint is written, before the save is finished (the "
                    "chief: before it is recorded and old ones pruned; the others: before "
                    "their scratch copy is removed)",
    "backup.restore": "a restore begins (every worker)",
    "backup.agreement": "inside the preemption agreement (the signalled worker: the step "
                        "announced, before the acknowledgements; the others: the step seen, "
                        "before acknowledging)",
    "backup.delete": "the chief removes the finished backup: before each of its files",
    "train.evaluate": "the test split's evaluation begins (every worker)",
    "train.write": "the evaluation ended, before the outputs are written (every worker; "
                   "the chief writes)",
    "io.publish": "before each staged output is renamed into place",
    "train.done": "the run is complete: outputs written, backup removed (every worker)",
}
"""Every failpoint, by name: where it is."""

_FIELDS = ("point", "worker", "hit", "signal", "delay", "once")


@dataclasses.dataclass(frozen=True)
class Fault:
    """One armed fault: `signal` to worker `worker` (None: any) at pass `hit`
    of `point`, `delay` seconds later, once per `once` file (None: each time
    a process passes the point for the `hit`-th time)."""

    point: str
    worker: int | None = None
    hit: int = 1
    signal: str = "KILL"
    delay: float = 0.0
    once: str | None = None

    def text(self) -> str:
        """The fault as a `TFMULTI_FAULTS` entry (defaults left out)."""
        parts = [f"point={self.point}"]
        if self.worker is not None:
            parts.append(f"worker={self.worker}")
        if self.hit != 1:
            parts.append(f"hit={self.hit}")
        parts.append(f"signal={self.signal}")
        if self.delay:
            parts.append(f"delay={self.delay:g}")
        if self.once:
            parts.append(f"once={self.once}")
        return ",".join(parts)


def format_faults(faults: list[Fault]) -> str:
    """The `TFMULTI_FAULTS` value arming `faults`.

    Example:
        >>> format_faults([Fault("train.evaluate", worker=0, delay=0.5)])
        'point=train.evaluate,worker=0,signal=KILL,delay=0.5'
    """
    return ";".join(f.text() for f in faults)


def _bad(entry: str, what: str) -> ValueError:
    return ValueError(f"{ENV} entry {entry!r}: {what}; write it as "
                      "'point=NAME[,worker=RANK][,hit=N][,signal=KILL|TERM|...][,delay=SECONDS]"
                      "[,once=FILE]', entries separated by ';'.")


def _int_field(entry: str, name: str, text: str, minimum: int) -> int:
    if not (text.isascii() and text.isdigit()) or int(text) < minimum:
        raise _bad(entry, f"`{name}` must be an integer >= {minimum}, got {text!r}")
    return int(text)


def _parse_entry(entry: str) -> Fault:
    fields: dict[str, str] = {}
    for item in entry.split(","):
        name, sep, value = item.partition("=")
        name, value = name.strip(), value.strip()
        if not sep or name not in _FIELDS:
            raise _bad(entry, f"unknown field {item.strip()!r} (fields: {', '.join(_FIELDS)})")
        if name in fields:
            raise _bad(entry, f"`{name}` is given twice")
        fields[name] = value
    if fields.get("point") not in POINTS:
        raise _bad(entry, f"`point` must be one of {', '.join(POINTS)}, got "
                          f"{fields.get('point')!r}")
    sig = fields.get("signal", "KILL").upper().removeprefix("SIG")
    if not hasattr(signal, f"SIG{sig}") or sig.startswith("_"):
        raise _bad(entry, f"`signal` must be a signal name such as KILL or TERM, got "
                          f"{fields['signal']!r}")
    try:
        delay = float(fields.get("delay", "0"))
    except ValueError:
        delay = math.nan
    if not (math.isfinite(delay) and delay >= 0):
        raise _bad(entry, f"`delay` must be a number of seconds >= 0, got {fields['delay']!r}")
    if "once" in fields and not fields["once"]:
        raise _bad(entry, "`once` must be a file path")
    return Fault(point=fields["point"],
                 worker=_int_field(entry, "worker", fields["worker"], 0)
                 if "worker" in fields else None,
                 hit=_int_field(entry, "hit", fields["hit"], 1) if "hit" in fields else 1,
                 signal=sig, delay=delay, once=fields.get("once"))


def parse(text: str) -> list[Fault]:
    """The faults a `TFMULTI_FAULTS` value arms (empty for an empty value).

    Raises:
        ValueError: an entry with an unknown point or field, or a bad value;
            the message names it and shows the format.
    """
    return [_parse_entry(entry.strip()) for entry in text.split(";") if entry.strip()]


def environ_value(faults: list[Fault]) -> str:
    """The `TFMULTI_FAULTS` value arming `faults` in a worker (empty: none)."""
    return f"{MODULE}:{format_faults(faults)}" if faults else ""


def _rank() -> int:
    config = tf_config.from_environ()
    return config["task"]["index"] if config else 0


def arm(spec: str) -> Callable[[str], None]:
    """The function the product's failpoints call in a process armed with
    `spec` (`TFMULTI_FAULTS` without its module part): it counts each point's
    passes and fires the faults of this worker and pass (see the module's
    docstring).

    Raises:
        ValueError: `spec` is malformed (the message names the entry).
    """
    faults = parse(spec)
    rank = _rank()
    lock = threading.Lock()
    hits: collections.Counter = collections.Counter()
    last = [None]  # the last point passed, where a delayed signal lands

    def send(fault: Fault) -> None:
        landed = last[0]
        if fault.once:
            try:
                fd = os.open(fault.once, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o644)
            except FileExistsError:
                return
            with os.fdopen(fd, "w") as f:
                json.dump({"point": fault.point, "worker": rank, "hit": fault.hit,
                           "signal": fault.signal, "delay": fault.delay, "pid": os.getpid(),
                           "time": time.time(), "landed": landed}, f)
        print(f"tfmulti faults: worker {rank} sends itself SIG{fault.signal} at {fault.point} "
              f"(pass {fault.hit}" + (f", +{fault.delay:g} s, after {landed}" if fault.delay
                                       else "") + ")", file=sys.stderr, flush=True)
        os.kill(os.getpid(), getattr(signal, f"SIG{fault.signal}"))

    def fire(name: str) -> None:
        with lock:
            hits[name] += 1
            count = hits[name]
            last[0] = name
        for fault in faults:
            if fault.point == name and fault.hit == count and fault.worker in (None, rank):
                if fault.delay:
                    threading.Timer(fault.delay, send, (fault,)).start()
                else:
                    send(fault)

    return fire
