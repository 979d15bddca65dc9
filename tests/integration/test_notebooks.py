"""Executes every notebook in notebooks/ in small mode (TFMULTI_SMALL=1).

The notebooks are stored with the outputs of a full-size run (the readers' copy,
checked by tests/unit/test_notebooks.py); this test executes a copy in memory and
writes it to the test's temporary folder, never over the stored file, and checks
that the run left notebooks/ as it was and removed the tfmulti folders it made in
its TMPDIR (its launches' worker folders, a notebook's example files).

Each notebook runs in a fresh Jupyter kernel (a subprocess), so the virtual
devices configured by conftest.py in this process do not matter: the notebook
configures its own. The kernel is the "python3" kernelspec, which jupyter_client
starts with this process's interpreter (sys.executable), i.e. the same
environment as pytest.
"""

from __future__ import annotations

import contextlib
import os
import re
import sys
from pathlib import Path

import pytest

nbformat = pytest.importorskip("nbformat")
nbclient = pytest.importorskip("nbclient")
from nbclient.exceptions import CellExecutionError, CellTimeoutError  # noqa: E402
from tests._util import file_tree
from tests.unit.test_notebooks import NOTEBOOK_DIR, NOTEBOOKS

KERNEL_NAME = "python3"
CELL_TIMEOUT_S = 300
SMALL_ENV = {"TFMULTI_SMALL": "1"}
_ANSI = re.compile(r"\x1b\[[0-9;]*m")  # colours in IPython tracebacks


@contextlib.contextmanager
def _environ(**values: str):
    """Sets environment variables (inherited by the kernel), restores them after."""
    saved = {key: os.environ.get(key) for key in values}
    os.environ.update(values)
    try:
        yield
    finally:
        for key, old in saved.items():
            if old is None:
                os.environ.pop(key, None)
            else:
                os.environ[key] = old


def _source(nb) -> str:
    return "\n".join(cell.source for cell in nb.cells if cell.cell_type == "code")


def _failed_cell(nb) -> str:
    """'code cell N' for the first code cell with an error output."""
    code_cells = [c for c in nb.cells if c.cell_type == "code"]
    for number, cell in enumerate(code_cells, start=1):
        if any(o.get("output_type") == "error" for o in cell.get("outputs", [])):
            return f"code cell {number}"
    return "a cell"


@pytest.mark.notebook
@pytest.mark.timeout(900)  # whole notebook; each cell has CELL_TIMEOUT_S
@pytest.mark.parametrize("path", NOTEBOOKS, ids=[p.name for p in NOTEBOOKS])
def test_notebook_runs_in_small_mode(path: Path, tmp_path: Path):
    stored = file_tree(NOTEBOOK_DIR)
    nb = nbformat.read(path, as_version=4)
    assert "TFMULTI_SMALL" in _source(nb), (
        f"{path.name} never reads TFMULTI_SMALL; add the small-size switch "
        '(SMALL = os.environ.get("TFMULTI_SMALL") == "1") so the tests run it quickly.'
    )

    client = nbclient.NotebookClient(
        nb,
        kernel_name=KERNEL_NAME,
        timeout=CELL_TIMEOUT_S,
        resources={"metadata": {"path": str(path.parent)}},  # cwd of the kernel
    )
    scratch = tmp_path / "tmp"  # the kernel's TMPDIR (its workers' too)
    scratch.mkdir()
    with _environ(**SMALL_ENV, TMPDIR=str(scratch)):
        try:
            client.execute()
        except CellTimeoutError as e:
            pytest.fail(
                f"{path.name}: a cell ran longer than {CELL_TIMEOUT_S} s:\n{_ANSI.sub('', str(e))}",
                pytrace=False,
            )
        except CellExecutionError as e:
            pytest.fail(
                f"{path.name}: {_failed_cell(nb)} raised an error:\n{_ANSI.sub('', str(e))}",
                pytrace=False,
            )
        finally:
            nbformat.write(nb, tmp_path / path.name)  # the executed copy, to look at
    assert file_tree(NOTEBOOK_DIR) == stored, (
        f"running {path.name} changed notebooks/ (a stored notebook, or a file left there)")
    # What the notebook (or tfmulti for it) made in the temporary folder, it removes.
    left = sorted(p.name for p in scratch.iterdir() if p.name.startswith("tfmulti"))
    assert not left, f"running {path.name} left {left} in its temporary folder"


@pytest.mark.notebook
def test_kernel_runs_this_interpreter(tmp_path):
    """The notebooks must run in the same environment as the tests."""
    nb = nbformat.v4.new_notebook(cells=[nbformat.v4.new_code_cell(
        "import os, sys\nprint(sys.executable)\nprint(sys.prefix)\n"
        "print(os.environ.get('TFMULTI_SMALL'))"
    )])
    with _environ(**SMALL_ENV):
        nbclient.NotebookClient(
            nb, kernel_name=KERNEL_NAME, timeout=60,
            resources={"metadata": {"path": str(tmp_path)}},
        ).execute()
    text = "".join(o.get("text", "") for o in nb.cells[0].outputs).split()
    executable, prefix, small = text
    # Compare prefixes, not resolved paths: a venv's python is a symlink to the
    # base interpreter, so realpath() would match a kernel outside the venv too.
    expected = (os.path.abspath(sys.executable), sys.prefix)
    assert (os.path.abspath(executable), prefix) == expected, (
        f"the {KERNEL_NAME!r} kernel runs {executable} (prefix {prefix}), not this "
        f"interpreter {sys.executable} (prefix {sys.prefix}); install ipykernel in this "
        "environment and remove stray python3 kernelspecs."
    )
    assert small == "1", "TFMULTI_SMALL did not reach the kernel"
