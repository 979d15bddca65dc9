"""Tests of tfmulti.cluster.exit_codes: the exit statuses the launcher, the
supervisor and the workers share. No processes."""

from __future__ import annotations

import signal

from tfmulti.cluster import exit_codes


def test_exit_status():
    assert exit_codes.exit_status(0) == 0
    assert exit_codes.exit_status(3) == 3
    assert exit_codes.exit_status(-signal.SIGKILL) == 137


def test_describe_exit_names_signals_and_preemption():
    # The words of the launcher's "worker I failed with ..." lines.
    assert exit_codes.describe_exit(5) == "exit code 5"
    assert exit_codes.describe_exit(-signal.SIGKILL) == "exit code 137 (killed by SIGKILL)"
    assert exit_codes.describe_exit(exit_codes.PREEMPTED) == (
        "exit code 75 (preempted: saved a backup on SIGTERM)")
    assert exit_codes.describe_exit(exit_codes.PREEMPTED_UNSAVED) == (
        "exit code 76 (preempted: SIGTERM, but no new backup was saved; a restart resumes "
        "from the previous one)")
    assert (exit_codes.USAGE, exit_codes.PREEMPTED, exit_codes.PREEMPTED_UNSAVED) == (2, 75, 76)
