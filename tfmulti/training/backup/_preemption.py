"""Preemption: SIGTERM on any worker makes every worker save at one agreed step."""

from __future__ import annotations

import signal
import sys
import threading
import time

from tfmulti.utils.failpoints import failpoint
from tfmulti.cluster import exit_codes, save_notice
from tfmulti.cluster.plan import PREEMPTION_AGREEMENT_S
# Module names of their own, so that a test can fake the coordination service here.
from tfmulti.runtime.roles import coordination_available as _coordination_available
from tfmulti.runtime.roles import coordination_store as _kv

_PREEMPT_KEY = "tfmulti/training/backup/{run}/preempt"
_ACK_KEY = "tfmulti/training/backup/{run}/ack/{index}"
_DONE = "done"


class Preempted(SystemExit):
    """Raised after every worker saved on SIGTERM; exits with `exit_codes.PREEMPTED`."""

    code_on_exit = exit_codes.PREEMPTED

    def __init__(self, message: str):
        super().__init__(self.code_on_exit)
        self.message = message

    def __str__(self) -> str:
        return self.message


class PreemptedUnsaved(Preempted):
    """Raised on SIGTERM when the workers did not agree on a step to save at
    within `PREEMPTION_AGREEMENT_S`: nothing was saved, and the process exits with
    `exit_codes.PREEMPTED_UNSAVED` (a restart resumes from the previous backup)."""

    code_on_exit = exit_codes.PREEMPTED_UNSAVED


class PreemptionWatcher:
    """SIGTERM on any worker -> all workers save at one agreed step boundary.

    The worker that gets the signal publishes `target = its boundary + one
    call of steps` under a coordination-service key and waits until every worker has
    acknowledged it. No worker can pass that boundary before: each step's
    gradient all-reduce needs every worker, and the signalled one only starts
    its next call after the acknowledgements. Each worker watches the key
    from a thread (no per-step cost). Without a cluster the flag is local.
    While installed, it posts the worker's save notice
    (`tfmulti.cluster.save_notice`), so that `tfmulti launch` gives the workers
    its grace period to save when it stops them.
    """

    def __init__(self, task_index: int, num_workers: int, steps_per_execution: int,
                 run: int = 0):
        self.task_index, self.num_workers = task_index, num_workers
        self.steps_per_execution = steps_per_execution
        self.key = _PREEMPT_KEY.format(run=run)
        self.ack_key = lambda index: _ACK_KEY.format(run=run, index=index)
        self.cluster = num_workers > 1 and _coordination_available()
        self.own_signal = False
        self.announced = False
        self.target: int | None = None
        self._event = threading.Event()
        self._previous_handler = None
        self._posted = False
        self._thread: threading.Thread | None = None

    def install(self) -> None:
        if threading.current_thread() is threading.main_thread():
            self._previous_handler = signal.signal(signal.SIGTERM, self._on_sigterm)
            self._posted = save_notice.post()  # the launcher waits for the save
        if self.cluster:
            self._thread = threading.Thread(target=self._watch, daemon=True,
                                            name="tfmulti-preemption-watcher")
            self._thread.start()

    def uninstall(self) -> None:
        if self._posted:
            save_notice.withdraw()
            self._posted = False
        if self._previous_handler is not None:
            signal.signal(signal.SIGTERM, self._previous_handler)
            self._previous_handler = None
        if self._thread is not None:
            try:  # wake the watchers; a worker that already announced wins
                _kv().set_config_key_value(self.key, _DONE)
            except Exception:  # pylint: disable=broad-except  (already set, peer gone)
                pass
            self._thread.join(timeout=5.0)
            self._thread = None

    def _on_sigterm(self, signum, frame) -> None:
        self.own_signal = True
        print(f"tfmulti: worker {self.task_index} got SIGTERM; saving a backup at the next "
              "agreed step, then exiting", file=sys.stderr, flush=True)

    def _watch(self) -> None:
        try:
            value = _kv().get_config_key_value(self.key)
        except Exception:  # pylint: disable=broad-except  (service gone: training fails anyway)
            return
        if value == _DONE:
            return
        self.target = int(value)
        self._event.set()  # before the ack: the announcer resumes only after every ack
        failpoint("backup.agreement")
        try:
            _kv().set_config_key_value(self.ack_key(self.task_index), value)
        except Exception:  # pylint: disable=broad-except
            pass

    def should_save(self, boundary: int) -> bool:
        """Called at the end of each call of steps (global step `boundary`): True when every
        worker saves here and exits."""
        if not self.cluster:
            return self.own_signal
        if self.own_signal and not self.announced:
            self.announced = True
            try:
                _kv().set_config_key_value(self.key, str(boundary + self.steps_per_execution))
            except Exception:  # pylint: disable=broad-except
                # Another worker announced first (its step holds, the watcher
                # thread has it), or training is over ("done"): nothing to add.
                return self._due(boundary)
            failpoint("backup.agreement")
            deadline = time.monotonic() + PREEMPTION_AGREEMENT_S
            for index in range(self.num_workers):
                left_ms = max(1, int((deadline - time.monotonic()) * 1000))
                try:
                    _kv().get_config_key_value(self.ack_key(index), left_ms)
                except Exception as e:  # pylint: disable=broad-except
                    message = (
                        f"worker {self.task_index} got SIGTERM but worker {index} did not "
                        f"acknowledge the save step within {PREEMPTION_AGREEMENT_S:g} s "
                        f"({str(e).strip()[:200]}); nothing was saved: exiting with code "
                        f"{exit_codes.PREEMPTED_UNSAVED}, a restart resumes from the previous "
                        "backup")
                    print(f"tfmulti: {message}", file=sys.stderr, flush=True)
                    raise PreemptedUnsaved(message) from e
        return self._due(boundary)

    def _due(self, boundary: int) -> bool:
        return self._event.is_set() and self.target is not None and boundary >= self.target


