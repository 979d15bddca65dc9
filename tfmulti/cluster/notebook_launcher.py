"""Notebook launcher: run a function defined in Jupyter on N local workers.

The role of Accelerate's `notebook_launcher`, for MultiWorkerMirroredStrategy:
`function` and its arguments are pickled by value (cloudpickle, so functions
defined in the notebook work), run in fresh worker processes started by
`tfmulti.cluster.launch`, and worker 0's return value comes back.
"""

from __future__ import annotations

import os
import pickle
import shutil
import signal
import sys
import tempfile
import types
from typing import Any, Callable, Sequence

from tfmulti.cluster.launcher import launch

__all__ = ["notebook_launcher", "pickle_function"]


_TF_MODULES = ("tensorflow", "keras", "tf_keras")


def _is_tf_object(obj: Any) -> bool:
    if isinstance(obj, (types.ModuleType, type, types.FunctionType, types.BuiltinFunctionType)):
        return False
    return any(getattr(cls, "__module__", "").split(".")[0] in _TF_MODULES
               for cls in type(obj).__mro__)


def _captured_values(function: Callable, args: Sequence) -> list[tuple[str, Any]]:
    """(name, value) of what would be shipped to the workers: args and captured variables."""
    found = [(f"args[{i}]", a) for i, a in enumerate(args)]
    for i, a in enumerate(args):
        if isinstance(a, (list, tuple)):
            found += [(f"args[{i}][{j}]", v) for j, v in enumerate(a)]
        elif isinstance(a, dict):
            found += [(f"args[{i}][{k!r}]", v) for k, v in a.items()]
    code = getattr(function, "__code__", None)
    for name, cell in zip(getattr(code, "co_freevars", ()), function.__closure__ or ()) \
            if code is not None else ():
        try:
            found.append((f"captured variable `{name}`", cell.cell_contents))
        except ValueError:
            pass  # empty cell
    g = getattr(function, "__globals__", {})
    for name in getattr(code, "co_names", ()):
        if name in g:
            found.append((f"global `{name}`", g[name]))
    return found


def pickle_function(function: Callable, args: Sequence = ()) -> bytes:
    """Serializes `function` and `args` by value (cloudpickle) for fresh worker processes.

    Raises:
        ValueError: if they hold TensorFlow/Keras objects or cannot be pickled.
    """
    if not callable(function):
        raise ValueError(f"`function` must be callable, got {type(function).__name__}.")
    if _is_tf_object(function):
        raise ValueError(f"`function` is a TensorFlow object ({type(function).__name__}); "
                         "pass a plain Python function and create tf.functions inside it.")
    for where, value in _captured_values(function, args):
        if _is_tf_object(value):
            raise ValueError(
                f"{where} is a TensorFlow/Keras object ({type(value).__module__}."
                f"{type(value).__name__}); the workers are fresh processes and cannot share "
                "the kernel's TensorFlow objects: create models, tensors, datasets and "
                "strategies inside the function, and pass plain values (numbers, strings, "
                "NumPy arrays).")
    import cloudpickle

    try:
        return cloudpickle.dumps((function, tuple(args)))
    except Exception as e:  # pickling raises many types: TypeError, PicklingError, ...
        raise ValueError(
            f"cannot pickle `function` or `args` for the worker processes "
            f"({type(e).__name__}: {e}); pass only picklable values (numbers, strings, lists, "
            "NumPy arrays) and create TensorFlow objects, locks, files and sockets inside "
            "the function.") from e


def _failure_message(result_dir: str, code: int) -> str:
    tracebacks = []
    for name in sorted(os.listdir(result_dir)):
        if name.startswith("error-") and name.endswith(".txt"):
            with open(os.path.join(result_dir, name), encoding="utf-8") as f:
                tracebacks.append(f"worker {name[6:-4]} failed:\n{f.read()}")
    if not tracebacks:
        return (f"the workers failed with exit status {code} and left no traceback (killed, "
                "or crashed outside Python); see their output above.")
    return "\n".join(tracebacks)


def notebook_launcher(function: Callable, args: Sequence = (), num_workers: int = 2,
                      **launch_options) -> Any:
    """Runs `function(*args)` in `num_workers` fresh worker processes; returns worker 0's value.

    Like Accelerate's `notebook_launcher`, for MultiWorkerMirroredStrategy: each worker gets its
    `TF_CONFIG`, so `function` typically does `strategy = tfmulti.get_strategy("multi_worker")`
    and trains. `function` and `args` are pickled by value (cloudpickle), so functions defined
    in the notebook work. The workers are fresh processes: the kernel's own TensorFlow state
    (devices already initialized, a strategy already created) does not matter, and TensorFlow
    objects cannot be passed in; create them inside `function`. Worker output is streamed
    into the notebook as `[worker I] line`.

    Args:
        function: a picklable callable; imports and TensorFlow objects belong inside it.
        args: positional arguments, plain picklable values.
        num_workers: how many workers; 2 by default.
        **launch_options (Any): `pin_cpus`, `port`, `startup_timeout`, `isolate`, `grace_period`
            (60 s by default), `max_restarts`, `output`, as for `launch`.

    Returns:
        What `function` returned in worker 0 (the chief).

    Raises:
        ValueError: for bad launch options, if `function`/`args` hold TensorFlow objects
            or cannot be pickled, or if the workers cannot be isolated in a private network
            namespace and `isolate=False` was not given (nothing is started).
        RuntimeError: if a worker fails; the message holds its traceback.
        KeyboardInterrupt: if interrupted; the workers are stopped first.
    """
    payload = pickle_function(function, args)
    result_dir = tempfile.mkdtemp(prefix="tfmulti-notebook-")
    try:
        payload_path = os.path.join(result_dir, "function.pkl")
        with open(payload_path, "wb") as f:
            pickle.dump(list(sys.path), f)  # so workers import what the kernel imports
            f.write(payload)
        command = [sys.executable, "-m", "tfmulti.cluster._notebook_worker", payload_path, result_dir]
        code = launch(command, num_workers=num_workers, **launch_options)
        if code == 128 + signal.SIGINT:
            raise KeyboardInterrupt("notebook_launcher: interrupted; the workers are stopped")
        if code != 0:
            raise RuntimeError(_failure_message(result_dir, code))
        try:
            with open(os.path.join(result_dir, "result-0.pkl"), "rb") as f:
                return pickle.load(f)
        except FileNotFoundError:
            raise RuntimeError("worker 0 exited 0 but wrote no result; see its output "
                               "above.") from None
    finally:
        shutil.rmtree(result_dir, ignore_errors=True)
