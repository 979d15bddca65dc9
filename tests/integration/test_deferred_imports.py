"""Keras imported after tfmulti in a fresh process (tfmulti.utils.deferred_imports):
matplotlib, IPython and pandas wait for their first use, where they work as
without tfmulti (a NumPy array given to `fit` imports no pandas; a DataFrame,
made by a program that imported pandas, is taken as one). (The mechanism, and Keras imported first: tests/unit/test_deferred_imports.py.)"""

from __future__ import annotations

import json

import pytest

from tests._util import run_python

_SCRIPT = """
import json, sys
import tfmulti
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
                                       path=sys.argv[1])
display = file_editor.ipython.display.__name__
print(json.dumps({"at_import": at_import, "after_fit": after_fit, "after": loaded(),
                  "hooked": hooked, "display": display, "sliced": sliced,
                  "frame_loss": len(frame_loss)}))
"""


@pytest.mark.slow
def test_keras_imports_matplotlib_ipython_and_pandas_where_first_used(tmp_path):
    figure = tmp_path / "gallery.png"
    result = run_python(["-c", _SCRIPT, str(figure)], timeout=300)
    assert result.returncode == 0, result.stderr[-3000:]
    seen = json.loads(result.stdout.splitlines()[-1])
    assert seen == {"at_import": [], "after_fit": [],
                    "after": ["IPython", "matplotlib", "matplotlib.pyplot", "pandas"],
                    "hooked": False, "display": "IPython.display",
                    "sliced": "PandasDataFrameSliceable", "frame_loss": 1}, seen
    assert figure.read_bytes().startswith(b"\x89PNG")

