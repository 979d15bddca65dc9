"""The fault-injection campaign (benchmarks.chaos and chaos_checks,
recipes/chaos.py): its checks catch what they must (in-process, no cluster),
and a small campaign (one kill inside the preemption agreement) resumes
exactly. The 30-kill campaign is not part of the tests; BENCHMARKS.md records
it (Reliability)."""

from __future__ import annotations

import json
import os
import random
import signal

import numpy as np
import pytest

from benchmarks import failpoints as _faults
from benchmarks import chaos, chaos_checks

SETUP = chaos.Setup()
WINDOWS = chaos.Windows(progress=(25.0, 2.0, 3.0, 0.5, 0.5), evaluate=6.0, write=0.5)


# ----------------------------------------------------------------------------- plans

@pytest.mark.parametrize("phase", chaos.PHASES)
def test_every_phase_plans_a_kill_armed_where_it_says(phase, tmp_path):
    points = {"save": {"backup.save", "backup.saved"}, "restore": {"backup.restore"},
              "agreement": {"backup.agreement"}, "evaluate": {"train.evaluate"},
              "write": {"train.write", "io.publish", "backup.delete"},
              "exit": {"train.done"}}
    seen = set()
    for seed in range(40):
        trial = chaos.plan_trial(phase, random.Random(seed), SETUP, WINDOWS, str(tmp_path))
        assert trial.signal in ("KILL", "TERM") and trial.worker in (0, 1)
        if phase == "anytime":
            assert not trial.faults
            after, delay = trial.wall
            assert 0 <= delay <= WINDOWS.progress[after]
            seen.add(after)
            continue
        # What the workers get parses back to the same faults.
        assert _faults.parse(_faults.format_faults(list(trial.faults))) == list(trial.faults)
        kill = trial.faults[-1]
        assert kill.point in points[phase] and kill.signal == trial.signal
        assert kill.once and os.path.dirname(kill.once) == str(tmp_path)
        seen.add((kill.point, kill.signal, kill.worker))
        if phase == "restore":  # first a worker dies after a backup, then the restore
            trigger = trial.faults[0]
            assert (trigger.point, trigger.signal) == ("backup.step", "KILL")
            assert SETUP.backup_every_steps < trigger.hit < SETUP.total_steps
        if phase == "agreement":  # first a SIGTERM starts the agreement
            trigger = trial.faults[0]
            assert (trigger.point, trigger.signal) == ("backup.step", "TERM")
            assert 1 <= trigger.hit < SETUP.total_steps - 1
        if kill.point in ("io.publish", "backup.delete"):
            assert kill.worker == 0  # only the chief writes
    if phase == "anytime":  # from the start and after each progress line
        assert seen == set(range(len(WINDOWS.progress)))
    else:  # both signals, both workers (the chief only writes)
        assert {s for _, s, _ in seen} == {"KILL", "TERM"}
        assert {w for _, _, w in seen} == {0, 1}


def test_bad_arguments_fail_before_anything_runs(tmp_path):
    with pytest.raises(ValueError, match="`phase` must be one of"):
        chaos.plan_trial("lunch", random.Random(0), SETUP, WINDOWS, str(tmp_path))
    with pytest.raises(ValueError, match="`kills` must be a positive integer, got 0"):
        chaos.run_campaign(0, str(tmp_path / "out.json"))
    with pytest.raises(ValueError, match=r"`phases` must be a non-empty subset of \['save'"):
        chaos.run_campaign(1, str(tmp_path / "out.json"), phases=("save", "lunch"))
    with pytest.raises(ValueError, match="at least two backups"):
        chaos.Setup(epochs=1, num_examples=256, global_batch_size=64, backup_every_steps=4)
    with pytest.raises(ValueError, match="`grace_period` must be a finite number > 0"):
        chaos.Setup(grace_period=0)
    assert os.listdir(tmp_path) == []


@pytest.mark.slow  # starts the recipe (which stops before TensorFlow)
@pytest.mark.parametrize("flag, message", [
    ("--phases=save,lunch", "--phases must be a non-empty subset of ['save'"),
    ("--kills=0", "flag --kills=0: 0 is not a positive integer"),
    ("--grace_period=-1", "--grace_period must be a finite number > 0, got -1.0"),
])
def test_the_recipe_refuses_bad_flags_in_one_line(tmp_path, flag, message):
    from tests._util import run_recipe

    result = run_recipe("chaos", flag, f"--output={tmp_path / 'out.json'}",
                        f"--workdir={tmp_path / 'work'}", timeout=120)
    assert result.returncode == 2, result.stderr
    assert result.stderr.startswith("chaos.py: error: ") and message in result.stderr
    assert len(result.stderr.strip().splitlines()) == 1, result.stderr
    assert os.listdir(tmp_path) == []  # nothing written, nothing run


# ----------------------------------------------------------------------------- checks

def _user_loss(y, p):
    import keras

    return keras.ops.mean((y - p) ** 2)


def test_keras_arrays_hold_the_weights_and_the_optimizer_step_count(tmp_path):
    """The arrays compared, read without TensorFlow from a real .keras file: a
    model of ours after 3 steps, with the iteration count first among the
    optimizer's variables."""
    import keras

    inputs = {"a": keras.Input((3,), name="a"), "b": keras.Input((3,), name="b")}
    hidden = keras.layers.Dense(3)(inputs["a"])
    outputs = keras.layers.Dense(1)(keras.layers.Add()([hidden, inputs["b"]]))
    model = keras.Model(inputs, outputs)
    model.compile(keras.optimizers.Adam(0.01), loss=_user_loss)
    x = {"a": np.ones((12, 3), np.float32), "b": np.zeros((12, 3), np.float32)}
    model.fit(x, np.ones((12, 1), np.float32), batch_size=4, epochs=1, verbose=0)
    model.save(tmp_path / "m.keras")
    arrays = chaos_checks.keras_arrays(str(tmp_path / "m.keras"))
    assert int(arrays["optimizer/vars/0"]) == 3
    kernels = [a for name, a in arrays.items() if name.startswith("layers/")]
    assert sorted(a.shape for a in kernels) == sorted(
        tuple(w.shape) for w in model.get_weights())
    assert chaos_checks.compare_arrays(arrays, arrays) == []


def test_compare_arrays_flags_differences_beyond_the_tolerance():
    reference = {"w": np.zeros((2, 2), np.float32), "optimizer/vars/0": np.array(16)}
    close = {"w": np.full((2, 2), 0.5 * chaos_checks.TOLERANCE, np.float32),
             "optimizer/vars/0": np.array(16)}
    assert chaos_checks.compare_arrays(close, reference) == []
    far = {**close, "w": np.full((2, 2), 3 * chaos_checks.TOLERANCE, np.float32)}
    assert chaos_checks.compare_arrays(far, reference) == ["w: differs by up to 3e-05"]
    twice = {**close, "optimizer/vars/0": np.array(17)}  # one step trained twice
    assert chaos_checks.compare_arrays(twice, reference) == ["optimizer/vars/0: differs by up to 1"]
    assert "only one model" in chaos_checks.compare_arrays({"w": reference["w"]}, reference)[0]
    assert "shape" in chaos_checks.compare_arrays({**close, "w": np.zeros(4)}, reference)[0]


def test_compare_metrics_flags_what_a_resumed_run_lost_or_changed():
    reference = {"epochs_completed": 2, "test_loss": 2.0, "train_loss": 1.5,
                 "examples_per_second": 500.0}
    same = {**reference, "test_loss": 2.0 + 0.5 * chaos_checks.TOLERANCE,
            "examples_per_second": 200.0}  # timings are not compared
    assert chaos_checks.compare_metrics(same, reference) == []
    lost = {**reference, "train_loss": None, "epochs_completed": 3}
    assert chaos_checks.compare_metrics(lost, reference) == [
        "metrics.json epochs_completed 3 != 2", "metrics.json train_loss None != 1.5"]


def test_snapshot_changes_name_what_was_added_removed_or_rewritten(tmp_path):
    (tmp_path / "keep").mkdir()
    (tmp_path / "keep" / "a").write_text("one")
    (tmp_path / "gone").write_text("x")
    (tmp_path / "own").mkdir()
    before = chaos_checks.snapshot(str(tmp_path), exclude=("own",))
    (tmp_path / "keep" / "a").write_text("two")  # same size, other content
    (tmp_path / "gone").unlink()
    (tmp_path / "tfmulti-backup-1").mkdir()  # a leftover
    (tmp_path / "own" / "x").write_text("the run's own: not watched")
    after = chaos_checks.snapshot(str(tmp_path), exclude=("own",))
    changes = chaos_checks.snapshot_changes(before, after)
    assert changes == ["added tfmulti-backup-1", "removed gone", "changed keep/a"]


def _output(*lines: str) -> str:
    return "\n".join(lines)


START = "tfmulti launch: starting 2 workers: localhost:1, localhost:2"
RESTART = "tfmulti launch: restart 1 of 3: starting all 2 workers again"


def _saved(step):
    return f"[worker 0] tfmulti: backup at global step {step} (every 4 steps): /r/tfmulti-ckpt-{step}"


def _resumed(step):
    return f"[worker 0] tfmulti: resuming from /r/tfmulti-ckpt-{step}: global step {step} = epoch 1"


def test_read_resumes_catches_a_lost_backup_and_a_finished_run_trained_again():
    kept = _output(START, "[worker 0] Epoch 1/2", _saved(4), _saved(8), RESTART, START,
                   _resumed(8), "[worker 0] tfmulti: wrote metrics.json, model.keras")
    assert chaos_checks.read_resumes(kept, 16) == chaos_checks.Resumes([0, 8], [], [])
    lost = _output(START, "[worker 0] Epoch 1/2", _saved(4), _saved(8), START, _resumed(4))
    assert chaos_checks.read_resumes(lost, 16) == chaos_checks.Resumes(
        [0, 4], ["attempt 2 resumed from step 4, but the backup at step 8 was complete"], [])
    afresh = _output(START, "[worker 0] Epoch 1/2", _saved(4), START, "[worker 0] Epoch 1/2")
    assert chaos_checks.read_resumes(afresh, 16).problems == [
        "attempt 2 started afresh, but the backup at step 4 was complete"]
    preempted = _output(START, "[worker 0] Epoch 1/2",
                        "[worker 0] tfmulti: preempted: saved a backup at global step 6 in /r",
                        START, _resumed(4))
    problems = chaos_checks.read_resumes(preempted, 16).problems
    assert "the backup at step 6 was complete" in problems[0]
    # Once the outputs are written, the backup is being removed: a restart from
    # what is left of it (or from nothing) loses nothing but trains again.
    end = _output(START, _saved(16), "[worker 0] tfmulti: wrote metrics.json, ...")
    assert chaos_checks.read_resumes(end + "\n" + _output(START, _resumed(16)), 16) == \
        chaos_checks.Resumes([16], [], [])
    assert chaos_checks.read_resumes(end + "\n" + _output(START, _resumed(12)), 16) == \
        chaos_checks.Resumes([12], [], ["attempt 2 resumed from step 12 after the outputs "
                                        "were written"])
    assert chaos_checks.read_resumes(end + "\n" + _output(START, "[worker 0] Epoch 1/2"), 16) == \
        chaos_checks.Resumes([0], [], ["attempt 2 started afresh after the outputs were written"])
    # What a restart does now: it finds the run finished and trains nothing.
    finished = ("[worker 0] tfmulti: this run has finished already: its outputs are in /m "
                "(metrics.json, model.keras); nothing left to train")
    assert chaos_checks.read_resumes(end + "\n" + _output(START, finished), 16) == \
        chaos_checks.Resumes([16], [], [])


def test_the_table_counts_kills_where_they_landed(capsys):
    records = [{"fired": True, "landed": "save", "signal": "KILL", "exact": True},
               {"fired": True, "landed": "save", "signal": "TERM", "exact": False},
               {"fired": True, "landed": "anytime", "signal": "TERM", "exact": True,
                "retrained": ["attempt 2 started afresh after the outputs were written"]},
               {"fired": False}]
    lines = chaos.format_table(records).splitlines()
    assert lines[1].split() == ["save", "2", "1", "1", "1", "1"]
    assert lines[2].split() == ["anytime", "1", "0", "1", "1", "0"]
    assert lines[3].split() == ["total", "3", "1", "2", "2", "1"]
    assert lines[4].startswith("(1 kill(s) after the outputs were written: the restarted run "
                               "trained again")
    assert lines[5] == "(1 trial(s) whose kill never fired, not counted)"


# ----------------------------------------------------------------------------- a campaign

@pytest.mark.cluster
def test_a_kill_inside_the_preemption_agreement_resumes_exactly(tmp_path, capsys):
    """The campaign in small, of a sharded run (Adam's slots split over the 2
    workers, `zero_stage=1`: the save gathers them, a collective): the reference
    launch, then one trial: a worker gets SIGTERM at a step, and a worker is
    killed inside the agreement that follows; the launcher restarts the cluster,
    the run resumes, and the result equals the reference's, the optimizer's
    slots included (the unsharded campaign: recipes/chaos.py by default)."""
    out, work = tmp_path / "chaos.json", tmp_path / "work"
    # seed 4: worker 0 gets SIGTERM at step 12; worker 1 is SIGKILLed on seeing it
    result = chaos.run_campaign(1, str(out), phases=("agreement",), seed=4, workdir=str(work),
                                setup=chaos.Setup(optimizer="adam", zero_stage=1))
    printed = capsys.readouterr().out
    assert result["complete"] and result["fired"] == 1, printed[-3000:]
    (trial,) = result["trials"]
    assert trial["exact"] and trial["problems"] == [], printed[-3000:]
    assert result["exact"] == 1
    assert [(k["point"], k["signal"]) for k in trial["kills"]] == [
        ("backup.step", "TERM"), ("backup.agreement", "KILL")], trial["kills"]
    assert trial["landed"] == "agreement"
    assert trial["resumed_from"][0] == 0 and trial["resumed_from"][-1] == 8, printed[-3000:]
    assert sum(launch["restarts"] for launch in trial["launches"]) >= 1
    assert json.loads(out.read_text())["exact"] == 1
    row = next(line.split() for line in printed.splitlines() if line.startswith("agreement "))
    assert row == ["agreement", "1", "1", "0", "1", "0"], printed[-2000:]
    assert sorted(os.listdir(work)) == ["reference"]  # the passed trial's folder is removed


@pytest.mark.cluster
def test_sigterm_to_the_campaign_stops_its_launch_and_workers(tmp_path):
    """Stopping the campaign (SIGTERM, as Ctrl-C) stops the launch under way: no
    launcher or worker is left behind. Also finds the workers from outside
    their PID namespace (`worker_pids`, what the `anytime` kills use)."""
    import subprocess
    import sys
    import time

    from tests._util import RECIPES

    proc = subprocess.Popen(
        [sys.executable, str(RECIPES / "chaos.py"), "--kills=1", f"--workdir={tmp_path / 'w'}",
         f"--output={tmp_path / 'out.json'}"], stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL, start_new_session=True)
    below = set()  # every process the campaign started, killed if the test fails
    try:
        deadline, pids = time.monotonic() + 120, {}
        while len(pids) < 2:
            assert time.monotonic() < deadline, "the reference launch's workers never started"
            time.sleep(0.2)
            pids = chaos.worker_pids(proc.pid)
        below = _descendants(proc.pid)
        assert sorted(pids) == [0, 1] and set(pids.values()) <= below
        proc.send_signal(signal.SIGTERM)
        assert proc.wait(timeout=60) == 128 + signal.SIGTERM
        deadline = time.monotonic() + 30
        while [pid for pid in below if os.path.exists(f"/proc/{pid}")]:
            assert time.monotonic() < deadline, f"processes {sorted(below)} still running"
            time.sleep(0.2)
        below = set()  # all gone
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait(timeout=30)
        for pid in below:  # only after a failure, while they still run
            try:
                os.kill(pid, signal.SIGKILL)
            except ProcessLookupError:
                pass


def _descendants(pid: int) -> set[int]:
    parents = {}
    for entry in os.listdir("/proc"):
        try:
            with open(f"/proc/{entry}/stat") as f:
                parents[int(entry)] = int(f.read().rpartition(")")[2].split()[1])
        except (OSError, ValueError):
            pass
    found, grew = set(), True
    while grew:
        new = {p for p, parent in parents.items() if parent in found | {pid}} - found
        found |= new
        grew = bool(new)
    return found


@pytest.mark.slow  # starts two small Python processes (no TensorFlow)
def test_an_anytime_kill_lands_after_the_chosen_progress_line(tmp_path):
    """The campaign's own kill: after worker 0's 2nd progress line and 0.3 s, the
    worker (found by its TF_CONFIG below the launch) gets the signal, wherever it
    is; here, in a sleep between its 2nd and 3rd lines."""
    import sys
    import textwrap

    worker = textwrap.dedent('''
        import sys, time
        for i in range(3):
            print(f"[worker 0] tfmulti: line {i}", flush=True)
            time.sleep(2 if i == 1 else 0.1)
        print("never killed", flush=True)
    ''')
    launcher = textwrap.dedent(f'''
        import json, os, subprocess, sys
        env = {{**os.environ, "TF_CONFIG": json.dumps({{"task": {{"index": 0}}}})}}
        child = subprocess.run([sys.executable, "-c", {worker!r}], env=env, timeout=60)
        print("worker exit", child.returncode, flush=True)
    ''')
    launch = chaos._launch([sys.executable, "-c", launcher], dict(os.environ), 60,
                           str(tmp_path / "log"), wall=(2, 0.3, 0, "TERM"))
    lines = [line for _, line in launch.lines]
    assert lines == ["[worker 0] tfmulti: line 0", "[worker 0] tfmulti: line 1",
                     f"worker exit {-signal.SIGTERM}"], lines
    assert launch.wall_kill["signal"] == "TERM" and launch.wall_kill["worker"] == 0
    line_1_at = launch.lines[1][0]
    # The kill's time is recorded rounded to 10 ms (chaos.py), the line's exactly.
    assert 0.3 - 0.005 <= launch.wall_kill["time"] - line_1_at < 1.9
