"""The fault-injection campaign: a 2-worker training with backups, killed at
random moments of every phase, resumed, and held against an uninterrupted run.

    python recipes/chaos.py --kills=30 --output=runs/chaos/chaos.json

Method. The training is `recipes/train.py` under `tfmulti launch
--num_workers 2 --max_restarts K` (`train_config`: synthetic data, the MLP,
SGD, no dropout, a fixed seed, a backup every few steps; seconds per run).
The reference is one uninterrupted launch of the same command. Each trial
then starts the same run in fresh directories with one kill armed, lets the
launcher restart the cluster (and relaunches it if the launcher gives up,
a bounded number of times) until the run completes, and checks:

* exact: the final `model.keras` holds the reference's arrays (every weight
  and the optimizer's variables) within 1e-5, and the optimizer's iteration
  count is the run's step count: no step trained twice or skipped;
  `metrics.json` has the reference's epochs and test (and train) metrics;
* nothing lost: each restart resumed from the newest backup reported
  complete before the kill (a kill may cost the steps since that backup,
  never a finished backup);
* nothing else touched: next to the run's `backup_dir` and `model_dir` are
  another run's checkpoints and outputs and a file; the workers' TMPDIR is a
  private folder standing in for /tmp. They must be unchanged afterwards,
  the finished run leaves no backup and nothing half-written in `model_dir`.

The kills. A kill is SIGKILL or SIGTERM (chosen at random; SIGTERM takes the
preemption path: every worker saves at an agreed step) to a random worker,
in one of these phases, each trial aiming at the phase with the fewest kills
so far:

    save       at a random save: as it begins plus a random delay (inside
               TensorFlow's write), or once its checkpoint is written
               (before it is recorded, pruned, or the scratch copy removed)
    restore    a worker is first killed at a random step after a backup;
               the restarted run is killed during its restore
    agreement  a worker gets SIGTERM at a random step; the kill comes inside
               the agreement on the step to save at (the signalled worker
               waiting for acknowledgements, or a peer acknowledging)
    evaluate   during the test split's evaluation (a random delay into it)
    write      during the final writes: the chief writing the outputs, each
               rename into `model_dir`, or the removal of the backup
    exit       once the run is complete (outputs written, backup removed), as
               the process is about to exit: the restart must not train again
    anytime    this process signals a worker wherever it is (no failpoint):
               after the launch's start or one of worker 0's progress lines
               (`MILESTONE`), picked at random, by a random part of the time
               to the next one in the reference run (so that a machine
               faster or slower than during the reference still gets it)

The phased kills use the product's failpoints, armed by `benchmarks.failpoints`
(`TFMULTI_FAULTS`); each records where it fired and the last failpoint the
process had passed (`landed`), and a kill counts in the phase it landed in: `training` after a
step, `exit` once the process's run was complete (it waits for a delayed
signal before exiting). A kill that never fires (its point never reached) is
not counted; another trial replaces it.

This process never imports TensorFlow; it reads `model.keras` with h5py.
"""

from __future__ import annotations

import dataclasses
import json
import os
import random
import re
import shutil
import signal
import subprocess
import sys
import tempfile
import threading
import time

from tfmulti.utils import checks
from tfmulti.utils.atomic import write_json_atomic
from benchmarks import _harness, chaos_checks
from benchmarks import failpoints as _faults
from benchmarks.scaling import TRAIN_RECIPE
from tfmulti.cluster import exit_codes
from tfmulti.config.train_config import (DEFAULT_LEARNING_RATE, OPTIMIZERS, ZERO_STAGES,
                                         TrainConfig)

__all__ = ["PHASES", "Setup", "Trial", "Windows", "format_table", "launch_command",
           "plan_trial", "run_campaign", "run_trial", "train_config", "worker_pids"]

PHASES = ("save", "restore", "agreement", "evaluate", "write", "exit", "anytime")
"""The phases kills aim at, in the order ties are broken."""

# The phase a kill landed in, by the last failpoint passed before it.
_PHASE_OF_POINT = {"backup.save": "save", "backup.saved": "save",
                   "backup.restore": "restore", "backup.agreement": "agreement",
                   "train.evaluate": "evaluate", "train.write": "write",
                   "io.publish": "write", "backup.delete": "write",
                   "backup.step": "training", "train.done": "exit"}
_OUTPUTS = ("metrics.json", "model.keras", "logs", ".tfmulti-run.json")
MILESTONE = re.compile(r"^\[worker 0\] (?:tfmulti: |Epoch \d)")
"""Worker 0's progress lines: the same sequence in every run until a kill (its
strategy, each epoch, each backup, the outputs written, its summary)."""


@dataclasses.dataclass(frozen=True)
class Setup:
    """The training every trial runs, and how hard the campaign tries.

    Attributes:
        epochs, num_examples, global_batch_size, backup_every_steps: the run
            (`train_config`); the defaults train 2 x 8 steps.
        optimizer, zero_stage: the run's optimizer (by name) and its sharding
            over the 2 workers (`zero_stage` 1 or 2: each holds half of the
            optimizer's slots; give an optimizer with slots, "adam").
        max_restarts: the launcher's restarts per launch (`--max_restarts`).
        max_launches: launches per trial before it counts as lost.
        grace_period: the launcher's seconds between SIGTERM and SIGKILL.
        launch_timeout: seconds one launch may take.
    """

    epochs: int = 2
    num_examples: int = 512
    global_batch_size: int = 64
    backup_every_steps: int = 4
    optimizer: str = "sgd"
    zero_stage: int = 0
    max_restarts: int = 3
    max_launches: int = 3
    grace_period: float = 10.0
    launch_timeout: float = 900.0

    def __post_init__(self):
        for name in ("epochs", "num_examples", "global_batch_size", "backup_every_steps",
                     "max_restarts", "max_launches"):
            checks.positive_int(name, getattr(self, name))
        checks.one_of("optimizer", self.optimizer, OPTIMIZERS)
        checks.one_of("zero_stage", self.zero_stage, ZERO_STAGES)
        checks.positive_number("grace_period", self.grace_period)
        checks.positive_number("launch_timeout", self.launch_timeout)
        if self.num_examples // self.global_batch_size * self.epochs \
                < 2 * self.backup_every_steps:
            raise ValueError(
                f"the run must hold at least two backups: {self.epochs} epochs x "
                f"{self.num_examples // self.global_batch_size} steps is fewer than 2 x "
                f"`backup_every_steps` ({self.backup_every_steps}); train more steps.")

    @property
    def total_steps(self) -> int:
        return self.epochs * (self.num_examples // self.global_batch_size)

    @property
    def saves(self) -> int:
        """The saves of an uninterrupted run (every `backup_every_steps`)."""
        return self.total_steps // self.backup_every_steps


# The TrainConfig fields of the command line, in its order.
_FLAG_FIELDS = ("distribution", "dataset", "model", "num_examples", "epochs",
                "global_batch_size", "optimizer", "learning_rate", "dropout", "seed",
                "steps_per_execution", "backup_every_steps", "zero_stage", "verbose",
                "backup_dir", "model_dir")


def train_config(setup: Setup, backup_dir: str, model_dir: str) -> TrainConfig:
    """The run every trial trains: 2 workers, deterministic (dropout off, a fixed
    seed), one step per call, so that a kill at any step resumes exactly."""
    config = TrainConfig(distribution="multi_worker", dataset="synthetic", model="mlp",
                         num_examples=setup.num_examples, epochs=setup.epochs,
                         global_batch_size=setup.global_batch_size,
                         optimizer=setup.optimizer,
                         learning_rate=0.05 if setup.optimizer == "sgd" else DEFAULT_LEARNING_RATE,
                         dropout=0.0, seed=0, steps_per_execution=1,
                         backup_every_steps=setup.backup_every_steps,
                         zero_stage=setup.zero_stage, verbose=2,
                         backup_dir=backup_dir, model_dir=model_dir)
    config.validate()
    return config


def launch_command(setup: Setup, backup_dir: str, model_dir: str) -> list[str]:
    """`tfmulti launch --num_workers 2 --max_restarts K` of `recipes/train.py`."""
    config = train_config(setup, backup_dir, model_dir)
    return [sys.executable, "-m", "tfmulti.cli", "launch", "--num_workers=2",
            f"--max_restarts={setup.max_restarts}", f"--grace_period={setup.grace_period:g}",
            "--", sys.executable, TRAIN_RECIPE,
            *(f"--{name}={getattr(config, name)}" for name in _FLAG_FIELDS)]


# ----------------------------------------------------------------------------- trials

@dataclasses.dataclass(frozen=True)
class Trial:
    """One kill: `signal` to worker `worker`, aimed at `phase`. `faults` are the
    failpoints armed (a trigger first where the phase needs one); `wall`, for
    `anytime`, when this process signals the worker itself: (`after`, `delay`),
    `delay` seconds after worker 0 printed its `after`-th progress line
    (`MILESTONE`; 0: the launch's start)."""

    phase: str
    signal: str
    worker: int
    faults: tuple[_faults.Fault, ...] = ()
    wall: tuple[int, float] | None = None

    def describe(self) -> str:
        if self.wall is not None:
            after, delay = self.wall
            return (f"SIG{self.signal} to worker {self.worker} {delay:.1f} s after "
                    + (f"worker 0's progress line {after}" if after else "the launch"))
        return _faults.format_faults(
            [dataclasses.replace(f, once=None) for f in self.faults])


@dataclasses.dataclass(frozen=True)
class Windows:
    """Seconds the random delays span, measured on the reference run."""

    progress: tuple[float, ...]  # from the launch to worker 0's first progress line, and
    # from each to the next (the last: to the end of the launch)
    evaluate: float  # from the last backup to the end of the evaluation
    write: float  # from there to the outputs written
    save: float = 0.25
    restore: float = 0.25


def plan_trial(phase: str, rng: random.Random, setup: Setup, windows: Windows,
               markers: str) -> Trial:
    """A random kill in `phase` (see the module's docstring); the fault markers
    (`once` files) go into the folder `markers`.

    Raises:
        ValueError: an unknown phase.
    """
    checks.one_of("phase", phase, PHASES)
    sig = rng.choice(("KILL", "TERM"))
    worker = rng.randrange(2)
    total, every = setup.total_steps, setup.backup_every_steps

    def fault(point, worker=worker, hit=1, signal=sig, delay=0.0, name="kill"):
        return _faults.Fault(point, worker=worker, hit=hit, signal=signal,
                             delay=round(delay, 3), once=os.path.join(markers, name))

    if phase == "anytime":
        after = rng.randrange(len(windows.progress))
        return Trial(phase, sig, worker,
                     wall=(after, round(rng.uniform(0, windows.progress[after]), 2)))
    if phase == "save":
        hit = rng.randint(1, setup.saves)
        kill = (fault("backup.save", hit=hit, delay=rng.uniform(0, windows.save))
                if rng.random() < 0.5 else fault("backup.saved", hit=hit))
        return Trial(phase, sig, worker, (kill,))
    if phase == "restore":
        trigger = fault("backup.step", worker=rng.randrange(2), signal="KILL", name="trigger",
                        hit=rng.randint(every + 1, total - 1))
        return Trial(phase, sig, worker,
                     (trigger, fault("backup.restore", delay=rng.uniform(0, windows.restore))))
    if phase == "agreement":
        trigger = fault("backup.step", worker=rng.randrange(2), signal="TERM", name="trigger",
                        hit=rng.randint(1, total - 2))
        return Trial(phase, sig, worker, (trigger, fault("backup.agreement")))
    if phase == "evaluate":
        return Trial(phase, sig, worker, (fault(
            "train.evaluate", delay=rng.uniform(0, 0.8 * windows.evaluate)),))
    if phase == "exit":
        return Trial(phase, sig, worker, (fault("train.done", delay=rng.uniform(0, 0.5)),))
    # write: the chief's writes, each rename, the backup's removal; or worker 1
    # stopping while the chief writes (the launcher then stops the chief)
    kind = rng.choice(("train.write", "io.publish", "backup.delete"))
    if kind == "train.write":
        kill = fault(kind, delay=rng.uniform(0, windows.write))
    else:
        worker = 0
        kill = fault(kind, worker=0, hit=rng.randint(1, 2))  # 2 outputs; 2 checkpoints kept
    return Trial(phase, sig, worker, (kill,))


# ----------------------------------------------------------------------------- running

def _children() -> dict[int, list[int]]:
    children: dict[int, list[int]] = {}
    for entry in os.listdir("/proc"):
        if entry.isdigit():
            try:
                with open(f"/proc/{entry}/stat") as f:
                    ppid = int(f.read().rpartition(")")[2].split()[1])
            except (OSError, ValueError, IndexError):
                continue
            children.setdefault(ppid, []).append(int(entry))
    return children


def worker_pids(launcher_pid: int) -> dict[int, int]:
    """The worker processes of the launch whose launcher is `launcher_pid`.

    Returns:
        {rank (TF_CONFIG's task index): pid as this process sees it (the
        launcher may run them in a PID namespace of their own)}.
    """
    children, found, stack = _children(), {}, [launcher_pid]
    while stack:
        for child in children.get(stack.pop(), []):
            stack.append(child)
            try:
                with open(f"/proc/{child}/environ", "rb") as f:
                    environ = f.read().split(b"\0")
            except OSError:
                continue
            for item in environ:
                if item.startswith(b"TF_CONFIG="):
                    try:
                        found[int(json.loads(item[10:])["task"]["index"])] = child
                    except (ValueError, KeyError, TypeError):
                        pass
    return found


@dataclasses.dataclass
class _Launch:
    """One launch of a trial: its exit status, its output (each line with its
    second), its seconds, and the wall-clock kill sent during it, if any."""

    status: int
    lines: list
    seconds: float
    wall_kill: dict | None

    @property
    def output(self) -> str:
        return "\n".join(line for _, line in self.lines)


def _launch(command: list[str], env: dict, timeout: float, log_path: str,
            wall: tuple[int, float, int, str] | None = None) -> _Launch:
    """Runs one launch, its output also to `log_path`. `wall`: (after, delay,
    worker, signal): this process signals the worker `delay` seconds after worker
    0's `after`-th progress line (0: the start)."""
    start = time.monotonic()
    lines: list[tuple[float, str]] = []
    progress = [0]
    reached = threading.Event()
    if wall is None or wall[0] == 0:
        reached.set()
    proc = subprocess.Popen(command, env=env, stdin=subprocess.DEVNULL, stdout=subprocess.PIPE,
                            stderr=subprocess.STDOUT, text=True, errors="backslashreplace",
                            start_new_session=True)

    def read():
        for line in proc.stdout:
            lines.append((time.monotonic() - start, line.rstrip("\n")))
            if MILESTONE.match(line):
                progress[0] += 1
                if wall is not None and progress[0] >= wall[0]:
                    reached.set()

    reader = threading.Thread(target=read, daemon=True)
    reader.start()
    sent = None
    try:
        if wall is not None:
            while not reached.wait(0.1) and proc.poll() is None \
                    and time.monotonic() - start < timeout:
                pass
            if reached.is_set():
                sent = _signal_later(proc, start, *wall[1:])
        proc.wait(timeout=max(1.0, timeout - (time.monotonic() - start)))
    except subprocess.TimeoutExpired:
        lines.append((time.monotonic() - start, f"chaos: the launch took over {timeout:g} s; "
                                                 "stopping it"))
        proc.send_signal(signal.SIGTERM)  # the launcher stops its workers
        try:
            proc.wait(timeout=120)
        except subprocess.TimeoutExpired:
            pass
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()
        reader.join(timeout=30)
    with open(log_path, "w") as f:
        f.write("".join(f"{t:8.2f} {line}\n" for t, line in lines))
    return _Launch(exit_codes.exit_status(proc.returncode), lines,
                   time.monotonic() - start, sent)


def _signal_later(proc: subprocess.Popen, start: float, delay: float, worker: int,
                  sig: str) -> dict | None:
    """Signals the launch's worker `worker` in `delay` seconds, unless the launch
    ended by then; returns what was sent."""
    try:
        proc.wait(timeout=delay)
        return None
    except subprocess.TimeoutExpired:
        pass
    pid = worker_pids(proc.pid).get(worker)
    try:
        if pid is not None:
            os.kill(pid, getattr(signal, f"SIG{sig}"))
            return {"worker": worker, "signal": sig, "pid": pid,
                    "time": round(time.monotonic() - start, 2), "landed": "anytime"}
    except ProcessLookupError:
        pass  # between the lookup and the signal
    return None


def _worker_env(tmp: str, faults: str) -> dict:
    env = {**os.environ, "TMPDIR": tmp, "TF_CPP_MIN_LOG_LEVEL": "2"}
    env["PYTHONPATH"] = _harness.REPO_ROOT + (os.pathsep + env["PYTHONPATH"]
                                              if env.get("PYTHONPATH") else "")
    env.pop(_faults.ENV, None)
    if faults:
        env[_faults.ENV] = faults
    return env


def _fired(trial: Trial | None, launches: list[_Launch]) -> dict:
    """The kills that fired (from the faults' `once` files and the wall-clock
    kill), and whether, where and how the trial's own kill landed."""
    kills = []
    for fault in (trial.faults if trial else ()):
        try:
            with open(fault.once) as f:
                kills.append(json.load(f))
        except (OSError, ValueError):
            pass  # never fired
    kills += [launch.wall_kill for launch in launches if launch.wall_kill]
    if trial is None:
        return {"kills": kills, "fired": True}
    own = [k for k in kills if trial.wall is not None or k["point"] == trial.faults[-1].point]
    if not own:
        return {"kills": kills, "fired": False}
    landed = own[-1]["landed"]
    return {"kills": kills, "fired": True, "signal": own[-1]["signal"],
            "worker": own[-1]["worker"], "landed": _PHASE_OF_POINT.get(landed, landed)}


def _check(setup: Setup, model_dir: str, backup_dir: str, launches: list[_Launch],
           reference: dict | None) -> tuple[list[str], dict]:
    """The problems of a trial's run once its launches ended (see the module's
    docstring), and what it ended with (arrays, metrics, resumes)."""
    problems, found = [], {}
    status = launches[-1].status
    if status != 0:
        problems.append(f"the run did not complete in {len(launches)} launches (last exit "
                        f"status {status})")
    complete = all(os.path.exists(os.path.join(model_dir, n))
                   for n in ("metrics.json", "model.keras"))
    if status == 0 and not complete:
        problems.append("the launch succeeded but metrics.json or model.keras is missing")
    if complete:
        found["arrays"] = chaos_checks.keras_arrays(os.path.join(model_dir, "model.keras"))
        with open(os.path.join(model_dir, "metrics.json")) as f:
            found["metrics"] = json.load(f)
        found["iterations"] = int(found["arrays"].get("optimizer/vars/0", -1))
        if found["iterations"] != setup.total_steps:
            problems.append(f"the optimizer ran {found['iterations']} steps, not "
                            f"{setup.total_steps}")
        if reference is not None:
            problems += chaos_checks.compare_arrays(found["arrays"], reference["arrays"])
            problems += chaos_checks.compare_metrics(found["metrics"], reference["metrics"])
    resumes = chaos_checks.read_resumes("\n".join(launch.output for launch in launches),
                                        setup.total_steps)
    found["resumed_from"], found["retrained"] = resumes.steps, resumes.retrained
    problems += resumes.problems
    if status == 0:
        if os.path.exists(backup_dir):
            problems.append(f"the backup is still there after a clean end: "
                            f"{sorted(os.listdir(backup_dir))}")
        left = sorted(set(os.listdir(model_dir)) - set(_OUTPUTS)) \
            if os.path.isdir(model_dir) else []
        if left:
            problems.append(f"model_dir holds leftovers: {left}")
    return problems, found


def run_trial(trial: Trial | None, setup: Setup, folder: str,
              reference: dict | None = None) -> dict:
    """Runs one trial in `folder`: the run with `trial`'s kill armed, launched
    again until it completes (at most `setup.max_launches` times), then checked.

    Args:
        trial: the kill; None: the uninterrupted reference.
        setup: the run and the launcher's settings.
        folder: a new folder for the trial (the run's directories, its workers'
            TMPDIR, the faults' markers, one log per launch).
        reference: the reference's record (its `arrays` and `metrics`); None:
            nothing to compare with.

    Returns:
        The trial's record: its plan, the kills that fired and where they landed,
        the launches, where each attempt resumed, the problems found, and
        `exact` (no problem).
    """
    run_dir, tmp = os.path.join(folder, "run"), os.path.join(folder, "tmp")
    backup_dir, model_dir = os.path.join(run_dir, "backup"), os.path.join(run_dir, "model")
    for path in (run_dir, tmp, os.path.join(folder, "faults")):
        os.makedirs(path, exist_ok=True)
    chaos_checks.plant_neighbours(run_dir)
    watched = {"next to the run": (run_dir, ("backup", "model")), "the workers' TMPDIR": (tmp, ())}
    before = {key: chaos_checks.snapshot(path, skip) for key, (path, skip) in watched.items()}
    command = launch_command(setup, backup_dir, model_dir)
    env = _worker_env(tmp, _faults.environ_value(list(trial.faults)) if trial else "")
    start = time.monotonic()
    launches: list[_Launch] = []
    while len(launches) < setup.max_launches and (not launches or launches[-1].status != 0):
        wall = ((*trial.wall, trial.worker, trial.signal)
                if trial is not None and trial.wall is not None and not launches else None)
        launches.append(_launch(command, env, setup.launch_timeout,
                                os.path.join(folder, f"launch-{len(launches) + 1}.log"), wall))
    problems, found = _check(setup, model_dir, backup_dir, launches, reference)
    problems += [f"{key} {change}" for key, (path, skip) in watched.items()
                 for change in chaos_checks.snapshot_changes(
                     before[key], chaos_checks.snapshot(path, skip))]
    return {"phase": trial.phase if trial else "reference", "folder": folder,
            "plan": trial.describe() if trial else "", **_fired(trial, launches),
            "launches": [{"exit_status": launch.status, "seconds": round(launch.seconds, 1),
                          "restarts": launch.output.count("tfmulti launch: restart ")}
                         for launch in launches],
            "seconds": round(time.monotonic() - start, 1), **found,
            "timeline": [launch.lines for launch in launches],
            "problems": problems, "exact": not problems}


def _windows(record: dict, setup: Setup) -> Windows:
    """The reference run's timings (its one launch's output lines)."""
    lines = record["timeline"][0]
    total = record["launches"][0]["seconds"]
    marks = [0.0] + [t for t, line in lines if MILESTONE.match(line)] + [total]

    def first(pattern):
        return next((t for t, line in lines if re.search(pattern, line)), None)

    last_backup = first(rf"^\[worker 0\] tfmulti: backup at global step {setup.total_steps}\b")
    # Worker 1 says it is done once `train` returned: the chief starts writing.
    evaluated = first(r"^\[worker 1\] tfmulti: done\b")
    written = first(r"^\[worker 0\] tfmulti: wrote metrics\.json")
    if None in (last_backup, evaluated, written):
        raise RuntimeError(f"the reference run's output lacks the lines that time its phases; "
                           f"see {record['folder']}")
    return Windows(progress=tuple(b - a for a, b in zip(marks, marks[1:])),
                   evaluate=max(0.5, evaluated - last_backup), write=max(0.2, written - evaluated))


def _counts(records: list[dict]) -> dict:
    rows: dict[str, dict] = {}
    for r in records:
        if not r.get("fired"):
            continue
        row = rows.setdefault(r["landed"], {"kills": 0, "KILL": 0, "TERM": 0, "exact": 0,
                                             "lost": 0})
        row["kills"] += 1
        row[r["signal"]] = row.get(r["signal"], 0) + 1
        row["exact" if r["exact"] else "lost"] += 1
    return rows


def format_table(records: list[dict]) -> str:
    """The campaign's table: kills by the phase they landed in and signal,
    resumed exactly, lost; then the trials whose kill never fired.

    Example:
        >>> print(format_table([{"fired": True, "landed": "save", "signal": "KILL",
        ...                      "exact": True}]))
        phase      kills  SIGKILL  SIGTERM  resumed exactly  lost
        save           1        1        0                1     0
        total          1        1        0                1     0
    """
    rows = _counts(records)
    known = (*PHASES, "training")
    order = [p for p in known if p in rows] + sorted(p for p in rows if p not in known)
    lines = [f"{'phase':<10} {'kills':>5}  {'SIGKILL':>7}  {'SIGTERM':>7}  "
             f"{'resumed exactly':>15}  {'lost':>4}"]
    total = {"kills": 0, "KILL": 0, "TERM": 0, "exact": 0, "lost": 0}
    for phase in order:
        row = rows[phase]
        for key in total:
            total[key] += row.get(key, 0)
        lines.append(f"{phase:<10} {row['kills']:>5}  {row.get('KILL', 0):>7}  "
                     f"{row.get('TERM', 0):>7}  {row['exact']:>15}  {row['lost']:>4}")
    lines.append(f"{'total':<10} {total['kills']:>5}  {total['KILL']:>7}  {total['TERM']:>7}  "
                 f"{total['exact']:>15}  {total['lost']:>4}")
    retrained = sum(1 for r in records if r.get("fired") and r.get("retrained"))
    if retrained:
        lines.append(f"({retrained} kill(s) after the outputs were written: the restarted run "
                     "trained again; nothing lost, the work done twice)")
    missed = sum(1 for r in records if not r.get("fired"))
    if missed:
        lines.append(f"({missed} trial(s) whose kill never fired, not counted)")
    return "\n".join(lines)


def _next_phase(records: list[dict], phases: tuple[str, ...]) -> str:
    counts = _counts(records)
    return min(phases, key=lambda p: (counts.get(p, {}).get("kills", 0), phases.index(p)))


def _summary(record: dict) -> dict:
    """A trial's record for the JSON file (without the arrays and raw lines)."""
    return {k: v for k, v in record.items() if k not in ("arrays", "timeline")}


def run_campaign(kills: int, output: str, *, phases: tuple[str, ...] = PHASES, seed: int = 0,
                 setup: Setup | None = None, workdir: str | None = None,
                 keep: bool = False, command: str | None = None) -> dict:
    """Runs the reference, then trials until `kills` kills have fired (at most
    3 x `kills` trials); prints each trial's result and the table; writes
    `output` (JSON) after every trial.

    Args:
        kills: how many kills to count.
        output: the JSON file (every trial: its plan, kills, launches, checks).
        phases: the phases to aim at (a subset of `PHASES`).
        seed: the random seed of the plan (signals, workers, steps, delays).
        setup: the training and the launcher's settings; default `Setup()`.
        workdir: where the trials' directories go (default: a new temporary
            folder); a trial's folder is removed once it passed, unless `keep`.
        keep: keep every trial's folder (logs, outputs).
        command: the command line, recorded in the JSON.

    Returns:
        The record written to `output`; `complete` is true when `kills` kills fired,
        `exact` how many of them resumed exactly.

    Raises:
        ValueError: bad arguments.
        RuntimeError: the reference run failed.
    """
    checks.positive_int("kills", kills)
    if not phases or any(p not in PHASES for p in phases):
        raise ValueError(f"`phases` must be a non-empty subset of {list(PHASES)}, got "
                         f"{list(phases)!r}.")
    setup = setup or Setup()
    own_workdir = workdir is None
    workdir = workdir or tempfile.mkdtemp(prefix="tfmulti-chaos-")
    os.makedirs(workdir, exist_ok=True)
    rng = random.Random(seed)
    started = time.monotonic()
    result = {"command": command, "kills": kills, "phases": list(phases), "seed": seed,
              "setup": dataclasses.asdict(setup), "workdir": workdir, "complete": False}
    print(f"chaos: reference run (uninterrupted) in {workdir}", flush=True)
    reference = run_trial(None, setup, os.path.join(workdir, "reference"), None)
    if not reference["exact"]:
        raise RuntimeError(f"the reference run failed ({'; '.join(reference['problems'])}); "
                           f"see {os.path.join(workdir, 'reference')}")
    windows = _windows(reference, setup)
    result["reference"] = {**_summary(reference), "windows": dataclasses.asdict(windows)}
    print(f"chaos: reference: {reference['seconds']:.0f} s, {setup.total_steps} steps",
          flush=True)
    records: list[dict] = []
    fired = 0
    for n in range(1, 3 * kills + 1):
        if fired >= kills:
            break
        phase = _next_phase(records, phases)
        folder = os.path.join(workdir, f"trial-{n:02d}-{phase}")
        trial = plan_trial(phase, rng, setup, windows, os.path.join(folder, "faults"))
        record = run_trial(trial, setup, folder, reference)
        records.append(record)
        fired += record["fired"]
        status = ("not fired" if not record["fired"] else "exact" if record["exact"]
                  else "LOST: " + "; ".join(record["problems"]))
        print(f"chaos: trial {n} ({phase} -> {record.get('landed', '-')}), "
              f"{trial.describe()}: {status} [{record['seconds']:.0f} s, "
              f"{len(record['launches'])} launch(es), resumed from {record['resumed_from']}]",
              flush=True)
        if (record["exact"] or not record["fired"]) and not keep:
            shutil.rmtree(folder, ignore_errors=True)
        result.update(trials=[_summary(r) for r in records], fired=fired,
                      exact=sum(1 for r in records if r["fired"] and r["exact"]),
                      seconds=round(time.monotonic() - started, 1))
        write_json_atomic(output, result)
    result["complete"] = fired >= kills
    result["table"] = format_table(records)
    write_json_atomic(output, result)
    print(result["table"], flush=True)
    print(f"chaos: {result['exact']} of {fired} kills resumed exactly, "
          f"{fired - result['exact']} lost; {result['seconds'] / 60:.1f} min; {output}",
          flush=True)
    if own_workdir and not keep and result["exact"] == fired:
        shutil.rmtree(workdir, ignore_errors=True)
    return result
