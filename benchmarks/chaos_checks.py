"""What the fault-injection campaign (`benchmarks.chaos`) checks after each
kill: the final model against the reference's, the run's resumes, and that
nothing outside the run's directories changed. Standard library, NumPy and
h5py (no TensorFlow).

    >>> from benchmarks import chaos_checks
    >>> chaos_checks.snapshot_changes({"a": "1 x", "b": "dir"}, {"a": "1 y", "c": "dir"})
    ['added c', 'removed b', 'changed a']
"""

from __future__ import annotations

import dataclasses
import hashlib
import io
import os
import re
import zipfile

__all__ = ["TOLERANCE", "Resumes", "compare_arrays", "compare_metrics", "keras_arrays",
           "plant_neighbours", "read_resumes", "snapshot", "snapshot_changes"]

TOLERANCE = 1e-5
"""The largest difference allowed between a resumed run's values and the reference's."""

# metrics.json fields a resumed run must share with the uninterrupted one.
_COMPARED_METRICS = ("epochs_completed", "steps_per_epoch", "test_loss", "test_accuracy",
                     "train_loss", "train_accuracy")
_SAVED = re.compile(r"^\[worker 0\] tfmulti: (?:preempted: saved a backup|backup) at global "
                    r"step (\d+)\b")
_RESUMED = re.compile(r"^\[worker 0\] tfmulti: resuming from .*: global step (\d+)\b")
_PUBLISHED = re.compile(r"^\[worker 0\] tfmulti: wrote metrics\.json")
_FRESH = re.compile(r"^\[worker 0\] Epoch 1/")
_FINISHED = re.compile(r"^\[worker 0\] tfmulti: this run has finished already")
_ATTEMPT = re.compile(r"^tfmulti launch: (?:host \d+ of \d+ \([^)]*\): )?starting \d+ workers?")


# ----------------------------------------------------------------------------- the model

def keras_arrays(path: str) -> dict:
    """Every array a `.keras` file stores, by its h5 path: the weights, and the
    optimizer's variables (its iteration count first: `optimizer/vars/0`).

    Args:
        path: a file `keras.Model.save` wrote.

    Returns:
        {h5 path: NumPy array}.
    """
    import h5py
    import numpy as np

    with zipfile.ZipFile(path) as archive:
        data = archive.read("model.weights.h5")
    arrays = {}
    with h5py.File(io.BytesIO(data), "r") as f:
        f.visititems(lambda name, obj: arrays.__setitem__(name, np.array(obj))
                     if isinstance(obj, h5py.Dataset) else None)
    return arrays


def compare_arrays(arrays: dict, reference: dict) -> list[str]:
    """What differs between two `keras_arrays` beyond `TOLERANCE`.

    Returns:
        One line per difference (an array in only one, a shape, values); empty
        when equal.
    """
    import numpy as np

    problems = []
    if sorted(arrays) != sorted(reference):
        problems.append(f"arrays {sorted(set(arrays) ^ set(reference))} are in only one model")
    for name in sorted(set(arrays) & set(reference)):
        a, b = np.asarray(arrays[name], np.float64), np.asarray(reference[name], np.float64)
        if a.shape != b.shape:
            problems.append(f"{name}: shape {a.shape} != {b.shape}")
        elif a.size and float(np.max(np.abs(a - b))) > TOLERANCE:
            problems.append(f"{name}: differs by up to {float(np.max(np.abs(a - b))):.3g}")
    return problems


def compare_metrics(metrics: dict, reference: dict) -> list[str]:
    """What differs between two `metrics.json` in the fields a resumed run must
    share with an uninterrupted one (epochs, test and train metrics).

    Example:
        >>> compare_metrics({"test_loss": 0.5, "train_loss": None},
        ...                 {"test_loss": 0.5, "train_loss": 0.25})
        ['metrics.json train_loss None != 0.25']
    """
    problems = []
    for name in _COMPARED_METRICS:
        a, b = metrics.get(name), reference.get(name)
        numbers = all(isinstance(v, (int, float)) and not isinstance(v, bool) for v in (a, b))
        if (abs(a - b) > TOLERANCE) if numbers else a != b:
            problems.append(f"metrics.json {name} {a!r} != {b!r}")
    return problems


# ----------------------------------------------------------------------------- resumes

@dataclasses.dataclass(frozen=True)
class Resumes:
    """Where each attempt of a trial's run resumed, read from its output.

    Attributes:
        steps: the step each attempt resumed from (0: a fresh start; the run's
            last step for an attempt that found the run finished), for the
            attempts that got as far as choosing one.
        problems: finished backups lost: an attempt that resumed from an older
            backup than the newest one reported complete before it, while the
            run's outputs were not yet written.
        retrained: attempts that trained again after the outputs were written
            (killed after the end, the backup already removed): nothing is lost,
            the work is done twice.
    """

    steps: list[int]
    problems: list[str]
    retrained: list[str]


def read_resumes(output: str, total_steps: int) -> Resumes:
    """Where the attempts of a trial resumed, from its launches' output.

    Args:
        output: everything the launches printed, in order.
        total_steps: the run's global steps.

    Returns:
        A `Resumes`.
    """
    resumes = Resumes([], [], [])
    saved, published, attempt, chose = 0, False, 0, False

    def chosen(step: int, what: str) -> None:
        resumes.steps.append(step)
        if published and step < total_steps:
            resumes.retrained.append(f"attempt {attempt} {what} after the outputs were "
                                     "written")
        elif step < saved and not published:
            resumes.problems.append(f"attempt {attempt} {what}, but the backup at step "
                                    f"{saved} was complete")

    for line in output.splitlines():
        if _ATTEMPT.match(line):
            attempt += 1
            chose = False
        elif (match := _SAVED.match(line)):
            saved = max(saved, int(match.group(1)))
        elif (match := _RESUMED.match(line)):
            chose = True
            chosen(int(match.group(1)), f"resumed from step {match.group(1)}")
        elif _FINISHED.match(line) and not chose:  # a restart once the outputs were written
            chose = True
            chosen(total_steps, "found the run finished")
        elif _PUBLISHED.match(line):
            published = True
        elif _FRESH.match(line) and attempt and not chose:
            chose = True
            chosen(0, "started afresh")
    return resumes


# ----------------------------------------------------------------------------- the rest

def plant_neighbours(run_dir: str) -> None:
    """Puts another run's files next to a run's directories: checkpoints with
    TensorFlow's default names, outputs, and a file whose name starts like the
    backup directory's. The run must leave them as they are."""
    files = {"other-run/backup/ckpt-4.index": b"not ours",
             "other-run/backup/ckpt-4.data-00000-of-00001": b"not ours either",
             "other-run/backup/checkpoint": b'model_checkpoint_path: "ckpt-4"\n',
             "other-run/model/metrics.json": b'{"test_accuracy": 0.5}\n',
             "backup-notes.txt": b"the user's notes\n"}
    for rel, content in files.items():
        path = os.path.join(run_dir, rel)
        os.makedirs(os.path.dirname(path), exist_ok=True)
        with open(path, "wb") as f:
            f.write(content)


def snapshot(root: str, exclude: tuple[str, ...] = ()) -> dict:
    """Every file and folder under `root`, except the top-level entries named in
    `exclude`, with its size and content hash (files) or `dir`.

    Returns:
        {path relative to `root`: signature}.
    """
    found = {}
    for folder, dirs, files in os.walk(root):
        rel = os.path.relpath(folder, root)
        dirs[:] = sorted(d for d in dirs
                         if os.path.normpath(os.path.join(rel, d)) not in exclude)
        for d in dirs:
            found[os.path.normpath(os.path.join(rel, d))] = "dir"
        for name in files:
            path = os.path.join(folder, name)
            try:
                with open(path, "rb") as f:
                    signature = f"{os.fstat(f.fileno()).st_size} " \
                                f"{hashlib.sha256(f.read()).hexdigest()[:16]}"
            except OSError as e:
                signature = f"unreadable ({e.strerror})"
            found[os.path.normpath(os.path.join(rel, name))] = signature
    return found


def snapshot_changes(before: dict, after: dict) -> list[str]:
    """The paths added, removed or changed between two `snapshot`s."""
    return ([f"added {p}" for p in sorted(set(after) - set(before))]
            + [f"removed {p}" for p in sorted(set(before) - set(after))]
            + [f"changed {p}" for p in sorted(set(before) & set(after))
               if before[p] != after[p]])
