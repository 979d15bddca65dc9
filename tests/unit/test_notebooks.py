"""The notebooks in notebooks/ as stored: executed, with their outputs.

A reader on the repository's web page or on the docs site (mkdocs-jupyter renders
the stored outputs, it executes nothing) sees only what the file holds, so every
notebook is stored after one full run from the top: every code cell has its
outputs (except cells tagged ``no-output``: definitions and clean-up that print
nothing), the cells ran in order, no cell failed, and a notebook that plots holds
its plots as PNG images. tests/integration/test_notebooks.py executes each one in
small mode; this file only reads the JSON (no kernel, no TensorFlow).

To store a notebook after editing it, run it from the top at full size, e.g.
``.venv/bin/jupyter nbconvert --to notebook --execute --inplace
--ExecutePreprocessor.timeout=1200 notebooks/NAME.ipynb`` (from the repository
root; TFMULTI_SMALL unset).
"""

from __future__ import annotations

import copy
import json
import re

import pytest

from tests._util import REPO

NOTEBOOK_DIR = REPO / "notebooks"
NOTEBOOKS = sorted(NOTEBOOK_DIR.glob("*.ipynb"))

NO_OUTPUT_TAG = "no-output"  # a code cell that prints nothing by design
MAX_NOTEBOOK_BYTES = 600_000  # images as modest PNGs, no progress-bar spam
# A notebook plots when its code draws with matplotlib or a tfmulti plot function.
_PLOTS = re.compile(r"\bplt\.|\bmatplotlib\b|\bschedule\.plot\(|\bplot_step_times\(")
# Machine noise that must not be stored: TensorFlow's C++ log lines (I0000 ...,
# W0000 ..., E0000 ...) and the absolute paths of temporary folders.
# Prose about how the tests run the notebook (test plumbing, not for a reader).
_PLUMBING = re.compile(r"\bthe tests run\b|small-size switch|small mode", re.IGNORECASE)
_NOISE = re.compile(r"^[IWEF]\d{4} \d\d:\d\d:\d\d|/tmp/|/var/folders/", re.MULTILINE)


def _load(path) -> dict:
    with open(path, encoding="utf-8") as f:
        return json.load(f)


def _text(value) -> str:
    return "".join(value) if isinstance(value, list) else str(value)


def _code_cells(nb: dict) -> list[dict]:
    return [cell for cell in nb["cells"] if cell["cell_type"] == "code"]


def _output_texts(output: dict):
    if "text" in output:
        yield _text(output["text"])
    for mime, value in output.get("data", {}).items():
        if mime.startswith("text/"):
            yield _text(value)


def stored_output_problems(nb: dict) -> list[str]:
    """What a stored notebook lacks, one line each (empty when it is complete)."""
    problems = []
    cells = _code_cells(nb)
    counts = [cell.get("execution_count") for cell in cells]
    if counts != list(range(1, len(cells) + 1)):
        problems.append(f"the code cells were not executed once each, in order, from a "
                        f"fresh kernel: execution counts {counts}")
    images = 0
    for number, cell in enumerate(cells, start=1):
        outputs = cell.get("outputs", [])
        tags = cell.get("metadata", {}).get("tags", [])
        if not outputs and NO_OUTPUT_TAG not in tags:
            problems.append(f"code cell {number} has no output (tag it {NO_OUTPUT_TAG!r} "
                            "if it prints nothing by design)")
        for output in outputs:
            if output.get("output_type") == "error":
                problems.append(f"code cell {number} stored an error: "
                                f"{output.get('ename')}: {output.get('evalue')}")
            if "image/png" in output.get("data", {}):
                images += 1
            for text in _output_texts(output):
                noise = _NOISE.search(text)
                if noise:
                    line = text[noise.start():].splitlines()[0]
                    problems.append(f"code cell {number} stored machine noise: {line[:120]!r}")
    source = "\n".join(_text(cell["source"]) for cell in cells)
    if _PLOTS.search(source) and not images:
        problems.append("the notebook plots but stores no image/png output")
    return problems


def test_notebooks_found():
    assert NOTEBOOKS, f"no notebooks found in {NOTEBOOK_DIR}"


@pytest.mark.parametrize("path", NOTEBOOKS, ids=[p.name for p in NOTEBOOKS])
def test_notebook_is_stored_with_its_outputs(path):
    problems = stored_output_problems(_load(path))
    assert not problems, (
        f"{path.name} is not stored executed with its outputs:\n  " + "\n  ".join(problems)
        + "\nRun it from the top at full size and store it (see this file's docstring).")


@pytest.mark.parametrize("path", NOTEBOOKS, ids=[p.name for p in NOTEBOOKS])
def test_notebook_size_is_reasonable(path):
    size = path.stat().st_size
    assert size <= MAX_NOTEBOOK_BYTES, (
        f"{path.name} is {size:,} bytes (limit {MAX_NOTEBOOK_BYTES:,}): store smaller "
        "figures (figsize, dpi) and no long progress output (Keras verbose=2 or 0)")


@pytest.mark.parametrize("path", NOTEBOOKS, ids=[p.name for p in NOTEBOOKS])
def test_notebook_opens_for_a_reader(path):
    """The opening cell says what the notebook shows; the prose holds no test plumbing."""
    nb = _load(path)
    first = nb["cells"][0]
    assert first["cell_type"] == "markdown" and _text(first["source"]).startswith("# "), (
        f"{path.name} does not open with a markdown title cell")
    prose = "\n".join(_text(c["source"]) for c in nb["cells"] if c["cell_type"] == "markdown")
    assert "TFMULTI_SMALL" not in prose and not _PLUMBING.search(prose), (
        f"{path.name}'s text talks about the tests' small mode; keep that to a comment in "
        "the code cell that reads TFMULTI_SMALL")


def _clear_outputs(nb: dict) -> dict:
    cleared = copy.deepcopy(nb)
    for cell in _code_cells(cleared):
        cell["outputs"], cell["execution_count"] = [], None
    return cleared


@pytest.mark.parametrize("path", NOTEBOOKS, ids=[p.name for p in NOTEBOOKS])
def test_the_check_fails_on_the_notebook_with_its_outputs_cleared(path):
    problems = stored_output_problems(_clear_outputs(_load(path)))
    assert any("has no output" in p for p in problems), problems
    assert any("execution counts" in p for p in problems), problems


def test_the_check_names_errors_missing_images_noise_and_order():
    def cell(source, outputs, count):
        return {"cell_type": "code", "source": source, "metadata": {},
                "outputs": outputs, "execution_count": count}

    error = {"output_type": "error", "ename": "ValueError", "evalue": "bad", "traceback": []}
    noise = {"output_type": "stream", "name": "stderr",
             "text": "W0000 00:00:1796329394.580152   17382 dataset.cc:997] Input\n"}
    path = {"output_type": "stream", "name": "stdout", "text": "wrote /tmp/tfmulti-x1/a\n"}
    printed = {"output_type": "stream", "name": "stdout", "text": "ok\n"}
    nb = {"cells": [cell("import matplotlib.pyplot as plt", [error], 2),
                    cell("plt.plot([1, 2])", [noise, path], 1),
                    cell("print('ok')", [printed], 3)]}
    problems = "\n".join(stored_output_problems(nb))
    assert "execution counts [2, 1, 3]" in problems
    assert "code cell 1 stored an error: ValueError: bad" in problems
    assert "dataset.cc" in problems and "/tmp/tfmulti-x1" in problems
    assert "stores no image/png" in problems

    tagged = cell("def f():\n    pass", [], 1)
    tagged["metadata"]["tags"] = [NO_OUTPUT_TAG]
    image = {"output_type": "display_data", "data": {"image/png": "iVBOR", "text/plain": "<Figure>"},
             "metadata": {}}
    assert stored_output_problems({"cells": [tagged, cell("plt.show()", [image], 2)]}) == []
