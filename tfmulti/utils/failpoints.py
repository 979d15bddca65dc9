"""Failpoints: named places where a fault-injection run may interrupt a worker
(pure Python, no TensorFlow; nothing imported until armed).

Production code marks such a place (during a save, the restore, the
preemption agreement, the evaluation, the final writes) with
`failpoint(name)`. Unarmed, the normal case, that is a no-op: the
`TFMULTI_FAULTS` environment variable is read once, when this module is
imported, and unset or empty it arms nothing.

Armed, `TFMULTI_FAULTS` is `MODULE:SPEC`: at the first failpoint passed, the
process imports MODULE and calls its `arm(SPEC)`, which returns the function
every failpoint then calls with its name (once per pass). The fault campaign
of a checkout (`benchmarks/failpoints.py`, used by `recipes/chaos.py`) is
such a module: it names the points and reads SPEC as which worker sends
itself which signal at which pass of which point. In-process, `install`
sets that function directly (tests).

Example:

    >>> from tfmulti.utils.failpoints import failpoint
    >>> failpoint("backup.save")  # unarmed: nothing happens
"""

from __future__ import annotations

import importlib
import os
import threading
from typing import Callable

__all__ = ["ENV", "failpoint", "install"]

ENV = "TFMULTI_FAULTS"
"""The environment variable that arms failpoints: `MODULE:SPEC`."""

_lock = threading.Lock()


def _load(name: str) -> None:
    """The first failpoint of an armed process: imports the arming module, then
    passes `name` to the function its `arm` returns."""
    global _fire
    with _lock:
        if _fire is _load:
            module, sep, spec = _armed.partition(":")
            if not (sep and module):
                raise ValueError(f"{ENV} must be MODULE:SPEC (a module whose arm(SPEC) "
                                 f"returns the function the failpoints call), got {_armed!r}")
            _fire = importlib.import_module(module).arm(spec)
    _fire(name)


_armed = os.environ.get(ENV, "")  # read once
_fire: Callable[[str], None] | None = _load if _armed else None


def failpoint(name: str) -> None:
    """Marks the failpoint `name`: nothing unless `TFMULTI_FAULTS` armed this
    process (see the module's docstring).

    Raises:
        ValueError: `TFMULTI_FAULTS` is malformed (at the first point passed).
    """
    if _fire is not None:
        _fire(name)


def install(fire: Callable[[str], None] | None) -> Callable[[str], None] | None:
    """Makes every failpoint of this process call `fire(name)` (None: disarms);
    returns what they called before (None: nothing)."""
    global _fire
    with _lock:
        previous, _fire = _fire, fire
    return previous
