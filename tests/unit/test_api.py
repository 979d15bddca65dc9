"""The public API: a small, pinned set of top-level names, each documented
in docs/reference/api.md (generated from its docstring by mkdocstrings);
everything else is reached through the layers' modules."""

from __future__ import annotations

import ast
import importlib
import inspect
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


API_PAGE = REPO / "docs" / "reference" / "api.md"


def reference_problems(page: str) -> list[str]:
    """What a reference page's mkdocstrings entries (`::: tfmulti.NAME` lines) get
    wrong: a public name without its entry, an entry twice, an entry for an object
    that is not a public name."""
    entries = re.findall(r"^::: ([\w.]+)[ \t]*$", page, flags=re.M)
    wanted = [f"tfmulti.{name}" for name in PUBLIC]
    return ([f"missing: {name}" for name in wanted if name not in entries]
            + [f"twice: {name}" for name in sorted(set(entries)) if entries.count(name) > 1]
            + [f"not public: {name}" for name in entries if name not in wanted])


def test_the_reference_page_has_an_entry_for_every_public_name():
    """One `::: tfmulti.NAME` per public name (the page is generated from their
    docstrings), and none for an object that is not public."""
    assert reference_problems(API_PAGE.read_text()) == []


def test_the_entries_check_finds_missing_repeated_and_private_entries():
    page = "".join(f"::: tfmulti.{name}\n\n" for name in PUBLIC)
    assert reference_problems(page) == []
    assert reference_problems(page.replace("::: tfmulti.train\n", "")) == \
        ["missing: tfmulti.train"]
    assert reference_problems(page + "::: tfmulti.data\n") == ["twice: tfmulti.data"]
    planted = page + "::: tfmulti.runtime.strategy\n    options:\n      members: false\n"
    assert reference_problems(planted) == ["not public: tfmulti.runtime.strategy"]


def module_members(page: str) -> dict[str, list[str]]:
    """`{module: the names of its entry's members option}` for each module entry."""
    found = {}
    entries = re.findall(r"^::: tfmulti\.(\w+)\n((?:[ \t]+\S.*\n)*)", page, flags=re.M)
    for name, options in entries:
        members = re.search(r"^\s+members:\n((?:\s+- \w+\n)+)", options, flags=re.M)
        if members is not None:
            found[name] = re.findall(r"- (\w+)", members.group(1))
    return found


def test_each_modules_entry_renders_its_all():
    """A public module's entry lists its `__all__` as its members (mkdocstrings
    cannot read a computed `__all__`, such as `tfmulti.parallel`'s), so a name
    added to the module is added to the page."""
    listed = module_members(API_PAGE.read_text())
    modules = [n for n in PUBLIC if inspect.ismodule(getattr(tfmulti, n))]
    assert sorted(listed) == modules
    for name in modules:
        assert listed[name] == sorted(getattr(tfmulti, name).__all__), name


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
