"""The user's own functions behind `--model=package.module:function` and
`--dataset=package.module:function`: found, checked and called (no TensorFlow
here; what they return is checked by the callers).

A hook is named `package.module:function`; the module is imported from
`sys.path`, where the current directory is added after the standard library
(`import_user_module`): a user's module there is found, but a file there named
like a standard module (`configparser.py`) never replaces it. Resolving a hook
imports and runs code, as `python -m` does: `--model=os:abort` calls
`os.abort`. A function takes whichever of the keyword arguments tfmulti offers it names
(`call`), so `def build(input_shape, num_classes):` and `def build():` both
work.

Example:
    >>> from tfmulti.config import user_functions as hooks
    >>> fn = hooks.resolve("json:dumps", "model")
    >>> hooks.call(lambda seed, dropout=0.1: (seed, dropout), {"seed": 3, "extra": 1}, "model")
    (3, 0.1)
"""

from __future__ import annotations

import importlib
import inspect
import os
import re
import sys
import types
from typing import Callable

__all__ = ["call", "check_takes", "has_default", "import_user_module", "parameters",
           "resolve"]


def resolve(value, what: str) -> Callable:
    """The function `value` names: itself if callable, else the `function` of
    `package.module:function`.

    Args:
        value: a callable or "package.module:function".
        what: the option it came from ("model", "dataset"), for messages.

    Raises:
        ValueError: the module cannot be imported (not found, or its import
            failed), has no such attribute, or the attribute is not callable.
    """
    if callable(value) and not isinstance(value, str):
        return value
    module_name, _, attr = str(value).partition(":")
    cwd = os.getcwd()
    try:
        module = import_user_module(module_name)
    except ModuleNotFoundError as e:
        if e.name and (module_name == e.name or module_name.startswith(e.name + ".")):
            raise ValueError(
                f"`{what}` {value!r}: no module named {module_name!r} in the current directory "
                f"({cwd}) or on sys.path; run from the folder that holds "
                f"{module_name.replace('.', '/')}.py, or add its folder to PYTHONPATH.") from None
        raise ValueError(f"`{what}` {value!r}: importing {module_name!r} failed: {e}.") from e
    except Exception as e:  # pylint: disable=broad-except  (the user's module raised)
        raise ValueError(f"`{what}` {value!r}: importing {module_name!r} raised "
                         f"{type(e).__name__}: {e}") from e
    if not hasattr(module, attr):
        public = sorted(n for n, v in vars(module).items()
                        if callable(v) and not n.startswith("_")
                        and getattr(v, "__module__", None) == module.__name__)
        raise ValueError(
            f"`{what}` {value!r}: module {module_name!r} ({getattr(module, '__file__', '?')}) "
            f"has no {attr!r}; its functions: {public or 'none'}.")
    fn = getattr(module, attr)
    if not callable(fn):
        raise ValueError(f"`{what}` {value!r} names an object of type {type(fn).__name__}, "
                         f"not a function; name a function that returns the {what}.")
    return fn


def _is_standard_library(entry: str, stdlib: str) -> bool:
    """Whether the `sys.path` entry `entry` holds the standard library (its
    folder, lib-dynload, its zip), not a site folder inside it."""
    path = os.path.realpath(entry or os.curdir)
    parts = path.split(os.sep)
    if "site-packages" in parts or "dist-packages" in parts:
        return False
    if path == stdlib or path.startswith(stdlib + os.sep):
        return True
    return (os.path.dirname(path) == os.path.dirname(stdlib)
            and re.fullmatch(r"python\d+\.zip", os.path.basename(path)) is not None)


def import_user_module(name: str) -> types.ModuleType:
    """Imports the module `name` of a hook, finding it in the current directory too.

    The current directory goes on `sys.path` right after the standard
    library's entries (unless it is there already, or `""` is), never ahead
    of them: a file there named like a standard module (`configparser.py`)
    never shadows it, during this import or later in the process, while the
    user's own modules there (and their sibling modules) are found. Importing
    runs the module's code.

    Raises:
        whatever the import raises (ImportError, or the module's own error).
    """
    cwd = os.getcwd()
    if cwd not in sys.path and "" not in sys.path:
        stdlib = os.path.realpath(os.path.dirname(os.__file__))
        after = [i + 1 for i, entry in enumerate(sys.path)
                 if isinstance(entry, str) and _is_standard_library(entry, stdlib)]
        sys.path.insert(max(after, default=len(sys.path)), cwd)
    return importlib.import_module(name)


def parameters(fn: Callable) -> set[str] | None:
    """The keyword arguments `fn` takes by name; None when it takes `**kwargs`
    (any) or its signature cannot be read."""
    try:
        params = inspect.signature(fn).parameters.values()
    except (TypeError, ValueError):
        return set()
    if any(p.kind is p.VAR_KEYWORD for p in params):
        return None
    return {p.name for p in params if p.kind in (p.POSITIONAL_OR_KEYWORD, p.KEYWORD_ONLY)}


def has_default(fn: Callable, name: str) -> bool:
    """Whether `fn` takes the keyword argument `name` with a default of its
    own (which tfmulti leaves in place rather than pass a value it does not know)."""
    try:
        parameter = inspect.signature(fn).parameters.get(name)
    except (TypeError, ValueError):
        return False
    return parameter is not None and parameter.default is not parameter.empty \
        and parameter.kind in (parameter.POSITIONAL_OR_KEYWORD, parameter.KEYWORD_ONLY)


def check_takes(fn: Callable, positional: tuple[str, ...], what: str) -> None:
    """Checks that `fn` can be called with the positional arguments
    `positional` (e.g. a loss with `("y_true", "y_pred")`), before anything
    calls it inside a traced training step, where a mismatch is a traceback.

    Raises:
        ValueError: naming the function, its signature and what it must take.
    """
    try:
        signature = inspect.signature(fn)
    except (TypeError, ValueError):
        return  # a builtin without a readable signature: let the call decide
    try:
        signature.bind(*positional)
    except TypeError:
        name = getattr(fn, "__qualname__", None) or type(fn).__name__
        raise ValueError(f"`{what}` {name}{signature} must take {len(positional)} arguments "
                         f"({', '.join(positional)}); define it as "
                         f"def {getattr(fn, '__name__', what)}({', '.join(positional)}).") from None


def call(fn: Callable, offered: dict, what: str):
    """Calls `fn` with the arguments of `offered` that it takes (all of them if
    it takes `**kwargs`).

    Raises:
        ValueError: `fn` requires an argument that is not offered.
    """
    try:
        signature = inspect.signature(fn)
    except (TypeError, ValueError):  # a builtin or C function: call it bare
        return fn()
    params = signature.parameters.values()
    if any(p.kind is p.VAR_KEYWORD for p in params):
        return fn(**offered)
    kwargs = {p.name: offered[p.name] for p in params
              if p.name in offered and p.kind in (p.POSITIONAL_OR_KEYWORD, p.KEYWORD_ONLY)}
    missing = [p.name for p in params if p.default is p.empty and p.name not in kwargs
               and p.kind not in (p.VAR_POSITIONAL, p.VAR_KEYWORD)]
    if missing:
        name = getattr(fn, "__qualname__", repr(fn))
        raise ValueError(f"the {what} function {name} requires {missing}, which tfmulti does "
                         f"not provide; it may take any of {sorted(offered)}, or give the "
                         f"others defaults.")
    return fn(**kwargs)
