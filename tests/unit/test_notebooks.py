"""Executes every notebook in notebooks/ in small mode (TFMULTI_SMALL=1).

Each notebook runs in a fresh Jupyter kernel (a subprocess), so the virtual
devices configured by conftest.py in this process do not matter: the notebook
configures its own. The kernel is the "python3" kernelspec, which jupyter_client
starts with this process's interpreter (sys.executable), i.e. the same
environment as pytest.
"""

from __future__ import annotations

from tests._util import REPO


NOTEBOOK_DIR = REPO / "notebooks"
NOTEBOOKS = sorted(NOTEBOOK_DIR.glob("*.ipynb"))


def test_notebooks_found():
    assert NOTEBOOKS, f"no notebooks found in {NOTEBOOK_DIR}"
