"""Tests of tfmulti.cluster.save_notice: a worker's notice that it saves on SIGTERM,
posted by the preemption watcher of `tfmulti.training.backup` while it trains (what
the launcher does with it: tests/unit/test_supervisor.py, and end to end
tests/integration/test_launch_signals.py)."""

from __future__ import annotations

import os
import signal

from tfmulti.cluster import save_notice


def test_post_and_withdraw_the_file_the_environment_names(tmp_path):
    path = tmp_path / "notice"
    environ = {save_notice.ENV: str(path)}
    assert not save_notice.posted(str(path))
    assert save_notice.post(environ)
    assert save_notice.posted(str(path))
    assert path.read_text() == f"{os.getpid()}\n"
    save_notice.withdraw(environ)
    assert not save_notice.posted(str(path))
    save_notice.withdraw(environ)  # twice: nothing to remove, no error


def test_outside_a_launch_there_is_nothing_to_post(tmp_path):
    assert not save_notice.post({})
    save_notice.withdraw({})
    # An unwritable place is no error: the launcher then kills the worker sooner.
    assert not save_notice.post({save_notice.ENV: str(tmp_path / "missing" / "notice")})


def test_the_preemption_watcher_posts_the_notice_while_installed(tmp_path, monkeypatch):
    from tfmulti.training.backup import _preemption

    path = tmp_path / "notice"
    monkeypatch.setenv(save_notice.ENV, str(path))
    before = signal.getsignal(signal.SIGTERM)
    watcher = _preemption.PreemptionWatcher(task_index=0, num_workers=1,
                                            steps_per_execution=1)
    watcher.install()
    try:
        assert save_notice.posted(str(path))
        assert signal.getsignal(signal.SIGTERM) == watcher._on_sigterm
    finally:
        watcher.uninstall()
    assert not save_notice.posted(str(path))
    assert signal.getsignal(signal.SIGTERM) == before
