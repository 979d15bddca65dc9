"""Keras imported after tfmulti in a fresh process (tfmulti.utils.deferred_imports):
matplotlib and IPython wait for their first use, where they work as without
tfmulti. (The mechanism, and Keras imported first: tests/unit/test_deferred_imports.py.)"""

from __future__ import annotations

import json

import pytest

from tests._util import run_python

_SCRIPT = """
import json, sys
import tfmulti
from tfmulti.utils import deferred_imports
import keras
loaded = lambda: sorted({"matplotlib", "matplotlib.pyplot", "IPython"} & set(sys.modules))
at_import = loaded()
hooked = deferred_imports.installed()
import numpy as np
from keras.src.saving import file_editor
keras.visualization.plot_image_gallery(np.zeros((2, 8, 8, 3)), value_range=(0, 1),
                                       path=sys.argv[1])
display = file_editor.ipython.display.__name__
print(json.dumps({"at_import": at_import, "after": loaded(), "hooked": hooked,
                  "display": display}))
"""


@pytest.mark.slow
def test_keras_imports_matplotlib_and_ipython_where_first_used(tmp_path):
    figure = tmp_path / "gallery.png"
    result = run_python(["-c", _SCRIPT, str(figure)], timeout=300)
    assert result.returncode == 0, result.stderr[-3000:]
    seen = json.loads(result.stdout.splitlines()[-1])
    assert seen == {"at_import": [], "after": ["IPython", "matplotlib", "matplotlib.pyplot"],
                    "hooked": False, "display": "IPython.display"}, seen
    assert figure.read_bytes().startswith(b"\x89PNG")

