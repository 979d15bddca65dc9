"""Keras' plotting, notebook and pandas imports, deferred to their first use.

Keras 3 imports `matplotlib.pyplot` (for the image galleries of
`keras.visualization`), `IPython` (for `KerasFileEditor`'s display in a
notebook) and `pandas` (to tell a DataFrame or Series given to `fit`) as it is
imported itself, whenever they are installed: about 1 CPU-second of every
process's start where they are (TensorFlow and Keras together take about 3.8
here; BENCHMARKS.md), paid by each worker, each restart and each notebook
kernel for functions a training run never calls.

`install()` lets those four Keras modules bind a stand-in instead, which
imports the real module where it is first used and puts it in its place: a
program that plots gets the same matplotlib, imported then; one that never
plots never imports it. pandas is only asked whether an array is one of its
DataFrames or Series: the stand-in answers with classes that look for pandas
among the modules loaded (an object of pandas' exists only where the program
imported pandas), so Keras takes a DataFrame as before and
never imports pandas for a NumPy array. Nothing else changes: a module already
imported (by the program, before Keras) is bound as before; a Keras whose
blocks differ from the ones below is left alone (it imports eagerly, as without
tfmulti); `TFMULTI_DEFER_IMPORTS=0` turns this off. The hook leaves
`sys.meta_path` once the four modules are loaded. No TensorFlow.

`import tfmulti` installs nothing: a program that imports tfmulti gets Keras
as Keras ships it (and the Keras fixes when it asks for a strategy). The
processes tfmulti owns call `install()` first, before anything imports Keras:
the `tfmulti` command (`tfmulti.cli.main`; so also the workers of `tfmulti
launch -- tfmulti train ...`), the recipes (`recipes/_common.py`), the notebook
launcher's workers (`tfmulti.cluster._notebook_worker`), the benchmarks'
workers and the test suite's own worker programs. A user's program, under
`tfmulti launch` or not, gets the saving where it calls `install()` itself,
before it imports Keras.
"""

from __future__ import annotations

import contextlib
import importlib
import importlib.abc
import importlib.machinery
import importlib.util
import os
import sys
import threading

__all__ = ["CLASS_TUPLES", "DEFERRED", "OFF_VARIABLE", "install", "installed"]

OFF_VARIABLE = "TFMULTI_DEFER_IMPORTS"
"""`TFMULTI_DEFER_IMPORTS=0` in the environment: Keras imports them eagerly, as it would."""

# Keras module -> (its import block, exactly as Keras writes it; the name it binds; the
# module that name stands for).
DEFERRED = {
    "keras.src.visualization.plot_image_gallery": (
        "try:\n    import matplotlib.pyplot as plt\nexcept ImportError:\n    plt = None\n",
        "plt", "matplotlib.pyplot"),
    "keras.src.visualization.plot_bounding_box_gallery": (
        ("try:\n    from matplotlib import patches  # For legend patches\n"
         "except ImportError:\n    patches = None\n"),
        "patches", "matplotlib.patches"),
    "keras.src.saving.file_editor": (
        "try:\n    import IPython as ipython\nexcept ImportError:\n    ipython = None\n",
        "ipython", "IPython"),
    "keras.src.trainers.data_adapters.array_slicing": (
        "try:\n    import pandas\nexcept ImportError:\n    pandas = None\n",
        "pandas", "pandas"),
}

# Keras module -> (the block that builds a tuple from classes of the deferred module,
# exactly as Keras writes it; the tuple's name; those classes, in its order). With the
# module refused, the block leaves them out; the classes of the stand-in are added.
CLASS_TUPLES = {
    "keras.src.trainers.data_adapters.array_slicing": (
        ("ARRAY_TYPES = (np.ndarray,)\nif pandas:\n"
         "    ARRAY_TYPES = ARRAY_TYPES + (pandas.Series, pandas.DataFrame)\n"),
        "ARRAY_TYPES", ("Series", "DataFrame")),
}


class _LoadedClass(type):
    """The metaclass of a stand-in's classes: `isinstance(x, C)` is
    `isinstance(x, module.C)` where the module is loaded, else False (no object can
    be of a class not loaded), without importing it."""

    def _loaded(cls):
        """The class it stands for, where its module is loaded; else None."""
        return getattr(sys.modules.get(cls.module_name), cls.__name__, None)

    def __instancecheck__(cls, instance) -> bool:
        real = cls._loaded()
        return real is not None and isinstance(instance, real)

    def __subclasscheck__(cls, subclass) -> bool:
        real = cls._loaded()
        return real is not None and issubclass(subclass, real)


class _Deferred:
    """Stands for a module in a Keras module's namespace until first used; then
    imports it and takes its place there."""

    def __init__(self, name: str, owner, attribute: str, classes: tuple[str, ...] = ()):
        self._name, self._owner, self._attribute = name, owner, attribute
        # Classes asked for by type checks alone: answered without the import.
        self._classes = {c: _LoadedClass(c, (), {"module_name": name}) for c in classes}

    def __getattr__(self, attribute: str):
        if attribute in self._classes:
            return self._classes[attribute]
        module = importlib.import_module(self._name)  # the import lock serializes threads
        setattr(self._owner, self._attribute, module)
        return getattr(module, attribute)

    def __repr__(self) -> str:
        return f"<module {self._name!r}, imported where first used (tfmulti)>"


class _Loader(importlib.abc.Loader):
    """Runs a Keras module as its own loader would, with its optional import refused
    (ImportError, which the module catches), then binds the stand-in."""

    def __init__(self, loader, name: str, finder: _Finder):
        self._loader, self._name, self._finder = loader, name, finder

    def __getattr__(self, name: str):  # get_source, get_code...: the module's own loader's
        return getattr(self._loader, name)

    def create_module(self, spec):
        return self._loader.create_module(spec)

    def exec_module(self, module) -> None:
        _, attribute, target = self._finder.table[self._name]
        top = target.partition(".")[0]
        refuse = top not in sys.modules  # already imported: bound as before, at no cost
        with self._finder.refusing(top if refuse else None):
            self._loader.exec_module(module)
        if refuse and getattr(module, attribute, False) is None and self._finder.findable(top):
            _, tuple_name, classes = self._finder.class_tuples.get(self._name, (None, None, ()))
            stand_in = _Deferred(target, module, attribute, classes)
            setattr(module, attribute, stand_in)
            if classes:
                setattr(module, tuple_name, getattr(module, tuple_name)
                        + tuple(getattr(stand_in, name) for name in classes))
        self._finder.done(self._name)


class _Finder(importlib.abc.MetaPathFinder):
    """Hands the modules of `table` (shaped as DEFERRED) to `_Loader`; refuses their
    optional packages while they run."""

    def __init__(self, table: dict = DEFERRED, class_tuples: dict = CLASS_TUPLES):
        self.table, self.class_tuples, self.pending = table, class_tuples, set(table)
        self._thread = threading.local()  # .refused: the packages this thread refuses now

    @contextlib.contextmanager
    def refusing(self, package: str | None):
        """Refuses `package` in this thread meanwhile (nested Keras modules: a list)."""
        refused = self._thread.__dict__.setdefault("refused", [])
        refused.append(package)
        try:
            yield
        finally:
            refused.pop()

    def findable(self, package: str) -> bool:
        """Whether `package` is installed (found, not imported; refusing nothing meanwhile)."""
        saved, self._thread.refused = self._thread.__dict__.get("refused", []), []
        try:
            return importlib.util.find_spec(package) is not None
        finally:
            self._thread.refused = saved

    def find_spec(self, name, path=None, target=None):
        if name.partition(".")[0] in self._thread.__dict__.get("refused", ()):
            raise ImportError(f"{name} is imported where first used (tfmulti)", name=name)
        if name not in self.pending:
            return None
        spec = importlib.machinery.PathFinder.find_spec(name, path)
        if spec is None or not self._block_is_as_expected(spec, name):
            self.done(name)  # imported as without tfmulti
            return None
        spec.loader = _Loader(spec.loader, name, self)
        return spec

    def _block_is_as_expected(self, spec, name: str) -> bool:
        try:
            source = spec.loader.get_source(name)
        except (AttributeError, ImportError, OSError):
            return False
        blocks = [self.table[name][0], *self.class_tuples.get(name, ())[:1]]
        return source is not None and all(block in source for block in blocks)

    def done(self, name: str) -> None:
        self.pending.discard(name)
        if not self.pending and self in sys.meta_path:
            # A new list: an import running in another thread goes on over the old one.
            sys.meta_path = [finder for finder in sys.meta_path if finder is not self]


def installed() -> bool:
    """Whether the hook is waiting for Keras' modules in this process."""
    return any(isinstance(finder, _Finder) for finder in sys.meta_path)


def install() -> None:
    """Defers Keras' plotting, notebook and pandas imports in this process (module
    docstring): what tfmulti's own entry points call before anything imports Keras.

    Does nothing where Keras' modules are loaded already (call it before the first
    `import keras`, `tensorflow.keras` or anything that imports them), where the hook
    is in already, or where `TFMULTI_DEFER_IMPORTS=0`.

    Example:
        >>> from tfmulti.utils import deferred_imports
        >>> deferred_imports.install()  # first: before anything imports Keras
        >>> import keras
    """
    if os.environ.get(OFF_VARIABLE, "1") == "0" or installed():
        return
    if any(name in sys.modules for name in DEFERRED):
        return
    sys.meta_path = [_Finder(), *sys.meta_path]
