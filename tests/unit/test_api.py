"""The public API: a small, pinned set of top-level names, each documented
in docs/reference/api.md; everything else is reached through the layers' modules."""

from __future__ import annotations

import ast
import importlib
import re

import tfmulti
from tests._util import REPO

PUBLIC = [
    "PipelineModel", "TrainConfig", "apply_keras_fixes", "backup", "build_model",
    "compile_model", "configure_virtual_devices", "data", "diagnose", "estimate_memory",
    "get_strategy", "launch", "loops", "notebook_launcher", "parallel", "train",
]


def test_the_top_level_names_are_pinned():
    assert [n for n in dir(tfmulti) if not n.startswith("__")] == PUBLIC
    assert "__version__" in dir(tfmulti)


def test_every_public_name_resolves_and_is_documented():
    for name in PUBLIC:
        value = getattr(tfmulti, name)
        assert (value.__doc__ or "").strip(), name


def test_the_reference_page_lists_every_public_name():
    page = (REPO / "docs" / "reference" / "api.md").read_text()
    listed = set(re.findall(r"^##+ `tfmulti\.(\w+)`", page, flags=re.M))
    assert listed == set(PUBLIC)


def test_each_modules_names_line_is_its_all():
    """A module's section on the reference page lists its `__all__`, so a name
    added to the module is added to the page."""
    page = (REPO / "docs" / "reference" / "api.md").read_text()
    sections = re.findall(r"^### `tfmulti\.(\w+)`\n(.*?)(?=^##)", page, flags=re.M | re.S)
    checked = 0
    for name, body in sections:
        line = re.search(r"^Names: (.*)\.$", body, flags=re.M)
        if line is None:
            continue
        listed = re.findall(r"`(\w+)`", line.group(1))
        assert listed == sorted(getattr(tfmulti, name).__all__), name
        checked += 1
    assert checked >= 3


def test_the_changelog_names_this_versions_renames():
    log = (REPO / "CHANGELOG.md").read_text()
    assert f"## {tfmulti.__version__}" in log


def _private_reads(package_root) -> list[str]:
    """Places where a module reads another module's `_private` name
    (`other._name`, or `from pkg.other import _name`); a private module of
    the package may be imported by name."""
    modules = {".".join(p.relative_to(package_root.parent).with_suffix("").parts)
               .removesuffix(".__init__") for p in package_root.rglob("*.py")}
    leaves = {m.rsplit(".", 1)[-1] for m in modules}
    hits = []
    for path in sorted(package_root.rglob("*.py")):
        tree = ast.parse(path.read_text(), str(path))
        aliases = set()
        for node in ast.walk(tree):
            if isinstance(node, ast.Import):
                aliases.update(a.asname or a.name for a in node.names
                               if a.name.startswith("tfmulti"))
            elif isinstance(node, ast.ImportFrom) and (node.module or "").startswith("tfmulti"):
                for a in node.names:
                    if a.name.startswith("_") and not a.name.startswith("__") \
                            and a.name not in leaves:
                        hits.append(f"{path.name}:{node.lineno} import {a.name}")
                    aliases.add(a.asname or a.name)
        for node in ast.walk(tree):
            if (isinstance(node, ast.Attribute) and isinstance(node.value, ast.Name)
                    and node.value.id in aliases and node.attr.startswith("_")
                    and not node.attr.startswith("__") and node.attr not in leaves):
                hits.append(f"{path.relative_to(package_root)}:{node.lineno} "
                            f"{node.value.id}.{node.attr}")
    return hits


def test_no_module_reads_another_modules_private_names():
    assert _private_reads(REPO / "tfmulti") == []


def test_the_private_reads_check_finds_a_planted_one(tmp_path):
    package = tmp_path / "tfmulti"
    package.mkdir()
    (package / "a.py").write_text("def _helper():\n    return 1\n")
    (package / "b.py").write_text("from tfmulti import a\n\nx = a._helper()\n")
    assert _private_reads(package) == ["b.py:3 a._helper"]


def test_every_layer_package_imports():
    for name in ("cli", "cluster", "config", "data", "insight", "memory", "models",
                 "parallel", "runtime", "training", "utils"):
        assert importlib.import_module(f"tfmulti.{name}").__doc__, name
