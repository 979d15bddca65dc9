"""Keras' optional imports (matplotlib, IPython, pandas) in fresh processes
(tfmulti.utils.deferred_imports): a program that imports tfmulti gets Keras as
Keras ships it; the processes tfmulti owns (the `tfmulti` command, the recipes,
the notebook launcher's workers) defer them to their first use, where they work
as without tfmulti (a NumPy array given to `fit` imports no pandas; a
DataFrame, made by a program that imported pandas, is taken as one). (The
mechanism, and Keras imported first: tests/unit/test_deferred_imports.py.)"""

from __future__ import annotations

import importlib.util
import json
import pickle

import pytest

from tests._util import RECIPES, run_python
from tfmulti.utils import deferred_imports

_ON = {deferred_imports.OFF_VARIABLE: "1"}  # whatever the suite's environment says
_OPTIONAL = ["IPython", "matplotlib", "matplotlib.patches", "matplotlib.pyplot", "pandas"]

# What `import tfmulti` adds to sys.meta_path; after `import keras`: what Keras binds for
# each optional import, what sys.meta_path holds and which optional modules are loaded
# (argv: the table {module: attribute}; "tfmulti" to import tfmulti first; the modules).
_BINDINGS = """
import importlib, json, sys, types
before = list(sys.meta_path)
if sys.argv[2] == "tfmulti":
    import tfmulti  # noqa: F401
added = [repr(f) for f in sys.meta_path if f not in before]
import keras  # noqa: F401
from keras.src.trainers.data_adapters import array_slicing
bound = {}
for name, attribute in json.loads(sys.argv[1]).items():
    value = getattr(importlib.import_module(name), attribute)
    bound[name] = value.__name__ if isinstance(value, types.ModuleType) else repr(value)
print(json.dumps({
    "added": added,
    "meta_path": [getattr(f, "__module__", type(f).__module__) for f in sys.meta_path],
    "loaded": sorted(set(json.loads(sys.argv[3])) & set(sys.modules)),
    "bound": bound,
    "array_types": [f"{t.__module__}.{t.__qualname__}" for t in array_slicing.ARRAY_TYPES]}))
"""


def _bindings(first: str) -> dict:
    table = {name: attribute for name, (_, attribute, _) in deferred_imports.DEFERRED.items()}
    result = run_python(["-c", _BINDINGS, json.dumps(table), first, json.dumps(_OPTIONAL)],
                        timeout=120)
    assert result.returncode == 0, result.stderr[-3000:]
    return json.loads(result.stdout.splitlines()[-1])


@pytest.mark.slow
def test_import_tfmulti_leaves_keras_as_it_ships():
    with_tfmulti, without = _bindings("tfmulti"), _bindings("keras")
    assert with_tfmulti == without
    assert with_tfmulti["added"] == []
    assert not [m for m in with_tfmulti["meta_path"] if m.startswith("tfmulti")], with_tfmulti
    # Each name Keras binds is the module itself where it is installed, as Keras imports it.
    for name, (_, attribute, target) in deferred_imports.DEFERRED.items():
        installed = importlib.util.find_spec(target.partition(".")[0]) is not None
        assert with_tfmulti["bound"][name] == (target if installed else "None"), name


# The `tfmulti` command's process (`tfmulti env`, which imports Keras), then Keras used.
_COMMAND = """
import json, sys
figure, sys.argv = sys.argv[1], ["tfmulti", "env", "--json"]
from tfmulti.cli import main  # as the `tfmulti` console script runs it
code = main()
from tfmulti.utils import deferred_imports
import keras
loaded = lambda: sorted({"matplotlib", "matplotlib.pyplot", "IPython", "pandas"}
                        & set(sys.modules))
at_import = loaded()
hooked = deferred_imports.installed()
import numpy as np
from keras.src.trainers.data_adapters import array_slicing
model = keras.Sequential([keras.Input((2,)), keras.layers.Dense(1)])
model.compile("sgd", "mse")
model.fit(np.zeros((8, 2)), np.zeros(8), verbose=0)
after_fit = loaded()
import pandas as pd
frame = pd.DataFrame({"a": np.arange(8.0), "b": np.arange(8.0)})
sliced = type(array_slicing.convert_to_sliceable(frame)).__name__
fitted = keras.Sequential([keras.Input((2,)), keras.layers.Dense(1)])
fitted.compile("sgd", "mse")
frame_loss = fitted.fit(frame, pd.Series(np.zeros(8)), verbose=0).history["loss"]
from keras.src.saving import file_editor
keras.visualization.plot_image_gallery(np.zeros((2, 8, 8, 3)), value_range=(0, 1),
                                       path=figure)
display = file_editor.ipython.display.__name__
print(json.dumps({"code": code, "at_import": at_import, "after_fit": after_fit,
                  "after": loaded(), "hooked": hooked, "display": display, "sliced": sliced,
                  "frame_loss": len(frame_loss)}))
"""


@pytest.mark.slow
def test_the_tfmulti_command_imports_them_where_keras_first_uses_them(tmp_path):
    figure = tmp_path / "gallery.png"
    result = run_python(["-c", _COMMAND, str(figure)], timeout=300, env=_ON)
    assert result.returncode == 0, result.stderr[-3000:]
    seen = json.loads(result.stdout.splitlines()[-1])
    assert seen == {"code": 0, "at_import": [], "after_fit": [],
                    "after": ["IPython", "matplotlib", "matplotlib.pyplot", "pandas"],
                    "hooked": False, "display": "IPython.display",
                    "sliced": "PandasDataFrameSliceable", "frame_loss": 1}, seen
    assert figure.read_bytes().startswith(b"\x89PNG")


@pytest.mark.slow
def test_the_notebook_launchers_worker_defers_them(tmp_path):
    import cloudpickle

    def report():  # the notebook's function, run in the worker
        import sys

        import keras  # noqa: F401
        from keras.src.visualization import plot_image_gallery

        return {"loaded": sorted({"IPython", "matplotlib", "pandas"} & set(sys.modules)),
                "plt": type(plot_image_gallery.plt).__name__}

    payload = tmp_path / "payload"
    with open(payload, "wb") as f:
        pickle.dump([], f)
        f.write(cloudpickle.dumps((report, ())))
    results = tmp_path / "results"
    results.mkdir()
    env = {**_ON, "TF_CONFIG": json.dumps({"cluster": {"worker": ["localhost:1"]},
                                           "task": {"type": "worker", "index": 0}})}
    done = run_python(["-m", "tfmulti.cluster._notebook_worker", str(payload), str(results)],
                      timeout=120, env=env)
    assert done.returncode == 0, done.stderr[-2000:]
    assert pickle.loads((results / "result-0.pkl").read_bytes()) == {"loaded": [],
                                                                     "plt": "_Deferred"}


@pytest.mark.slow
def test_the_recipes_install_it_before_tensorflow_loads():
    # recipes/_common.py, which every recipe imports first (no TensorFlow: a cheap process).
    code = ("import sys; from tfmulti.utils import deferred_imports; import _common; "
            "print(deferred_imports.installed(), 'keras' in sys.modules)")
    result = run_python(["-c", code], timeout=60, cwd=RECIPES, env=_ON)
    assert result.returncode == 0, result.stderr[-2000:]
    assert result.stdout.split() == ["True", "False"]
    off = run_python(["-c", code], timeout=60, cwd=RECIPES,
                     env={deferred_imports.OFF_VARIABLE: "0"})
    assert off.stdout.split() == ["False", "False"], off.stderr[-2000:]
