"""The package's architecture: layers that import downward (the import-linter
contracts in setup.cfg), no import cycles, no TensorFlow below the core."""

from __future__ import annotations

import configparser
import re

import grimp
import pytest

from tests._util import REPO


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


@pytest.mark.parametrize("where", ["tfmulti/__init__.py", "docs/contributing/development.md"])
def test_the_prose_maps_follow_the_contract(where):
    """The layer maps people read list the contract's layers, in its order."""
    layers = [" | ".join(n.strip() for n in layer.split("|")) for layer in _contract_layers()]
    assert _prose_map((REPO / where).read_text()) == layers
