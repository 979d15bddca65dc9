"""The exit codes tfmulti's processes share (no TensorFlow).

A recipe or the `tfmulti` command exits `USAGE` (2) on bad input; a worker
that saved a backup on SIGTERM exits `PREEMPTED` (75, `EX_TEMPFAIL`), which
`tfmulti launch --max_restarts` restarts; one whose training loss turned NaN or
infinite exits `NON_FINITE_LOSS` (65, `EX_DATAERR`), which a restart would only
repeat (`FINAL`). `exit_status` turns a `subprocess` return code into what a
shell would report.
"""

from __future__ import annotations

import signal

__all__ = ["FINAL", "NON_FINITE_LOSS", "PREEMPTED", "PREEMPTED_UNSAVED", "USAGE",
           "describe_end", "describe_exit", "exit_status"]

USAGE = 2
"""Bad flags, arguments or configuration; nothing was started or written."""
PREEMPTED = 75
"""A worker saved a backup on SIGTERM and stopped (EX_TEMPFAIL: try again)."""
PREEMPTED_UNSAVED = 76
"""A worker got SIGTERM but the workers could not agree on a step to save at (a peer
did not acknowledge in time), so it stopped without a new backup: a restart resumes
from the previous one."""
NON_FINITE_LOSS = 65
"""The training loss turned NaN or infinite; the run stopped and published nothing
(EX_DATAERR: the data, or the training it drives, went wrong)."""
FINAL = frozenset({USAGE, NON_FINITE_LOSS})
"""Worker exit codes that `tfmulti launch --max_restarts` does not restart: the same
input would end the same way (a restart resumes from the same backup)."""


def exit_status(returncode: int) -> int:
    """A shell-style exit status: 128 + N for a process killed by signal N."""
    return 128 - returncode if returncode < 0 else returncode


def describe_exit(returncode: int) -> str:
    """A `subprocess` return code in words: "exit code 137 (killed by SIGKILL)"."""
    if returncode < 0:
        try:
            name = signal.Signals(-returncode).name
        except ValueError:
            name = f"signal {-returncode}"
        return f"exit code {exit_status(returncode)} (killed by {name})"
    if returncode == PREEMPTED:
        return f"exit code {returncode} (preempted: saved a backup on SIGTERM)"
    if returncode == PREEMPTED_UNSAVED:
        return (f"exit code {returncode} (preempted: SIGTERM, but no new backup was saved; "
                "a restart resumes from the previous one)")
    if returncode == NON_FINITE_LOSS:
        return f"exit code {returncode} (the training loss was NaN or infinite)"
    return f"exit code {returncode}"


def describe_end(status: int) -> str:
    """How a launch's attempt ended, for a status other than 0, in words that follow "the
    cluster": a preemption says whether a new backup was saved."""
    if status == PREEMPTED:
        return "was preempted (its backup is saved)"
    if status == PREEMPTED_UNSAVED:
        return ("was preempted, but NO NEW BACKUP was saved (the workers did not agree on a "
                "step to save at); a restart resumes from the previous backup, if any")
    if status == NON_FINITE_LOSS:
        return ("stopped: the training loss was NaN or infinite (see above); a restart would "
                "repeat it")
    return f"failed with exit status {status} (see above)"
