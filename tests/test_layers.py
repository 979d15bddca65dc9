"""The package's architecture: layers that import downward (the import-linter
contracts in setup.cfg), no import cycles, no TensorFlow below the core."""

from __future__ import annotations

import configparser
import os
import re
import shutil
import subprocess
import sys

import grimp
import pytest

from tests._util import REPO

LINT = [sys.executable, "-c", "import sys; from importlinter.cli import lint_imports_command; "
        "sys.exit(lint_imports_command())", "setup.cfg", "--no-cache"]


def _lint(root) -> subprocess.CompletedProcess:
    env = {**os.environ, "PYTHONPATH": str(root)}
    return subprocess.run(LINT, cwd=root, env=env, capture_output=True, text=True, timeout=120)


@pytest.mark.slow
def test_the_layer_contracts_hold():
    result = _lint(REPO)
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-2000:]
    assert "2 kept, 0 broken" in result.stdout


@pytest.mark.slow
@pytest.mark.parametrize("module,planted", [
    ("tfmulti/config/train_config.py", "from tfmulti.models import builders"),  # config -> models
    ("tfmulti/data/catalog.py", "def _late():\n    from tfmulti.insight import timing"),  # lazy
    ("tfmulti/models/builders.py", "from tfmulti.data import catalog"),  # siblings
    ("tfmulti/cluster/plan.py", "import tensorflow"),  # TensorFlow in the launcher
])
def test_a_planted_violation_breaks_a_contract(tmp_path, module, planted):
    """A copy of the package with one upward import (or TensorFlow where it
    must not be) fails the same contracts."""
    shutil.copytree(REPO / "tfmulti", tmp_path / "tfmulti",
                    ignore=shutil.ignore_patterns("__pycache__"))
    shutil.copy(REPO / "setup.cfg", tmp_path / "setup.cfg")
    with open(tmp_path / module, "a") as f:
        f.write(f"\n\n{planted}\n")
    result = _lint(tmp_path)
    assert result.returncode != 0, result.stdout[-3000:]
    assert "BROKEN" in result.stdout and " 0 broken" not in result.stdout, result.stdout[-3000:]


def _cycles(graph, modules) -> list[list[str]]:
    """Strongly connected components with more than one module (Tarjan)."""
    index, low, stack, on_stack, out = {}, {}, [], set(), []

    def visit(v):
        index[v] = low[v] = len(index)
        stack.append(v)
        on_stack.add(v)
        for w in graph.find_modules_directly_imported_by(v):
            if w not in modules:
                continue
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in on_stack:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            component = []
            while True:
                w = stack.pop()
                on_stack.discard(w)
                component.append(w)
                if w == v:
                    break
            if len(component) > 1:
                out.append(sorted(component))

    for module in sorted(modules):
        if module not in index:
            visit(module)
    return out


def test_no_import_cycles():
    """Function-level (lazy) imports count: every import statement is an edge.
    The package roots' lazy re-exports (`tfmulti/__init__.py`) load through
    importlib and are not edges."""
    graph = grimp.build_graph("tfmulti", exclude_type_checking_imports=True)
    modules = {m for m in graph.modules if m.startswith("tfmulti.")}
    assert len(modules) > 25
    assert _cycles(graph, modules) == []


@pytest.mark.slow
def test_tensorflow_stays_unloaded_for_configuration_and_launcher():
    code = ("import sys; import tfmulti.config.train_config, tfmulti.config.flags, "
            "tfmulti.config.user_functions, tfmulti.cluster, tfmulti.cluster.supervisor, "
            "tfmulti.cli, tfmulti.utils.checks, tfmulti.utils.tables, tfmulti.utils.atomic, "
            "tfmulti.utils.failpoints, tfmulti.parallel.partition, tfmulti.parallel.schedule; "
            "print(sorted(m for m in sys.modules if m.split('.')[0] in "
            "('tensorflow', 'keras', 'tf_keras')))")
    result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                            timeout=60, cwd=REPO)
    assert result.returncode == 0, result.stderr
    assert result.stdout.strip() == "[]"


def _contract_layers() -> list[str]:
    """The layers of setup.cfg's contract, top to bottom (siblings as 'a | b')."""
    parser = configparser.ConfigParser()
    parser.read(REPO / "setup.cfg")
    return [line.strip() for line in
            parser["importlinter:contract:layers"]["layers"].strip().splitlines()]


def _names(layers) -> list[str]:
    return [name.strip() for layer in layers for name in layer.split("|")]


def test_the_folders_are_the_contracts_layers():
    """Every layer is a folder of tfmulti/ (the command line, `cli`, a
    module), and every folder a layer."""
    package = REPO / "tfmulti"
    folders = {p.name for p in package.iterdir() if (p / "__init__.py").exists()}
    modules = {p.stem for p in package.glob("*.py") if p.name != "__init__.py"}
    assert folders | modules == set(_names(_contract_layers()))
    assert modules == {"cli"}


def _prose_map(text: str) -> list[str]:
    """The first word of each line of an indented layer map (a block of
    lines `    name   description`), in order."""
    names = []
    for line in text.splitlines():
        match = re.match(r"^    (\w+(?: \| \w+)?)\s{2,}\S", line)
        if match:
            names.append(match.group(1))
    return names


@pytest.mark.parametrize("where", ["tfmulti/__init__.py", "docs/development.md"])
def test_the_prose_maps_follow_the_contract(where):
    """The layer maps people read list the contract's layers, in its order."""
    layers = [" | ".join(n.strip() for n in layer.split("|")) for layer in _contract_layers()]
    assert _prose_map((REPO / where).read_text()) == layers
